"""Every float32 bit pattern (2**32) through the bf16 and f16 pack kernels, against numpy.

    python bench/check_wire_exhaustive.py

bf16: round to nearest even computed in numpy uint64 arithmetic on the bits; f16: numpy's
``astype(np.float16)`` (itself round to nearest even); NaN inputs must give NaN. Not a timing:
a one-off correctness sweep too long for the test suite (~5 CPU-minutes, 1.5 GB of RAM; 30
minutes wall on a loaded 2-core host). Prints the mismatch counts; exit 1 if any.
"""

from __future__ import annotations

import sys
import warnings

import numpy as np

from rlx_mpi.comm import wire


def main() -> int:
    warnings.simplefilter("ignore")  # the f16 overflow casts
    bf, f16 = wire.get_codec("bf16"), wire.get_codec("f16")
    bad_bf = bad_h = 0
    step = 1 << 26
    for lo in range(0, 1 << 32, step):
        u = np.arange(lo, lo + step, dtype=np.uint64).astype(np.uint32)
        x = u.view(np.float32)
        nan = np.isnan(x)
        want = ((u.astype(np.uint64) + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
        got = bf.pack(x)
        back = bf.unpack(got[nan], np.empty(int(nan.sum()), np.float32))
        bad_bf += int(np.sum(got[~nan] != want[~nan])) + int(np.sum(~np.isnan(back)))
        h = f16.pack(x)
        ref = x.astype(np.float16)
        bad_h += int(np.sum(h.view(np.uint16)[~nan] != ref.view(np.uint16)[~nan])) + int(np.sum(~np.isnan(h[nan])))
    print(f"all 2**32 float32 patterns: bf16 mismatches {bad_bf}, f16 mismatches {bad_h}")
    return 1 if bad_bf or bad_h else 0


if __name__ == "__main__":
    sys.exit(main())
