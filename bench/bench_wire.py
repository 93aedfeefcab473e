"""Wire codecs: bf16 and f16 pack + unpack throughput vs `np.copyto` of the same float32 array.

    python bench/bench_wire.py [--sizes 1 4 16 64] [--trials 9] [--json bench/results/wire.json]

ratio = copyto time / (pack time + unpack time), i.e. the throughput of packing then unpacking
(in float32 bytes per second) divided by that of copyto. 1.0 means a pack-and-unpack round
costs one memcpy of the float32 block; the issue's target for bf16 is >= 0.8. Every kernel is
single-threaded (the rank's other cores belong to its BLAS threads). numpy's own float16 cast
(`np.copyto` with casting) is shown beside ours for context.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
from _machine import add_common_args, fmt_table, header, machine, pct, save_json, wait_quiet

from rlx_mpi.comm import wire


def _time(fn, inner: int) -> float:
    t0 = time.perf_counter()
    for _ in range(inner):
        fn()
    return (time.perf_counter() - t0) / inner


def measure(mib: int, trials: int) -> dict:
    n = mib * (1 << 20) // 4
    x = np.random.default_rng(0).standard_normal(n).astype(np.float32)
    y = np.empty_like(x)
    bf16, f16 = wire.get_codec("bf16"), wire.get_codec("f16")
    wb, wh = bf16.wire_buffer(x.shape), f16.wire_buffer(x.shape)
    wn = np.empty(n, np.float16)
    ops = {
        "copyto": lambda: np.copyto(y, x),
        "bf16_pack": lambda: bf16.pack(x, wb),
        "bf16_unpack": lambda: bf16.unpack(wb, y),
        "f16_pack": lambda: f16.pack(x, wh),
        "f16_unpack": lambda: f16.unpack(wh, y),
        "numpy_f16_pack": lambda: np.copyto(wn, x, casting="same_kind"),
        "numpy_f16_unpack": lambda: np.copyto(y, wn),
    }
    for fn in ops.values():  # warm: first touch of every page, kernels loaded
        fn()
    inner = max(1, 64 // mib)  # >= 64 MiB of traffic per timing, so a timer tick is noise
    times = {k: [] for k in ops}
    for _ in range(trials):  # interleaved: a burst of load hits every variant alike
        for k, fn in ops.items():
            times[k].append(_time(fn, inner))
    best = {k: min(v) for k, v in times.items()}

    def ratios(prefix: str) -> tuple[float, float]:
        per_trial = [times["copyto"][i] / (times[f"{prefix}_pack"][i] + times[f"{prefix}_unpack"][i]) for i in range(trials)]
        return best["copyto"] / (best[f"{prefix}_pack"] + best[f"{prefix}_unpack"]), statistics.median(per_trial)

    out = {"mib": mib, "elements": n, "inner": inner, "best_ms": {k: v * 1e3 for k, v in best.items()},
           "median_ms": {k: statistics.median(v) * 1e3 for k, v in times.items()}}
    for prefix in ("bf16", "f16", "numpy_f16"):
        out[f"{prefix}_ratio_best"], out[f"{prefix}_ratio_median"] = ratios(prefix)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=int, nargs="+", default=[1, 4, 16, 64], help="float32 block sizes in MiB")
    ap.add_argument("--trials", type=int, default=9, help="interleaved trials per size (default 9)")
    add_common_args(ap, quiet_wait_s=20.0)
    args = ap.parse_args()
    info = machine()
    wire.warm_up()
    print(header("bench_wire: pack + unpack vs np.copyto, 1 thread", info,
                 "ratio = t(copyto) / (t(pack) + t(unpack)); best of interleaved trials (median of per-trial ratios)"))
    rows, results = [], []
    for mib in args.sizes:
        busy = wait_quiet(args.quiet, args.quiet_wait) if args.quiet_wait > 0 else None
        r = measure(mib, args.trials)
        r["busy_before"] = busy
        results.append(r)
        b = r["best_ms"]
        rows.append([f"{mib}", f"{b['copyto']:.3f}", f"{b['bf16_pack']:.3f}", f"{b['bf16_unpack']:.3f}",
                     f"{r['bf16_ratio_best']:.2f} ({r['bf16_ratio_median']:.2f})",
                     f"{b['f16_pack']:.3f}", f"{b['f16_unpack']:.3f}", f"{r['f16_ratio_best']:.2f} ({r['f16_ratio_median']:.2f})",
                     f"{r['numpy_f16_ratio_best']:.2f}", pct(busy)])
    print(fmt_table(["MiB", "copyto_ms", "bf16_pack", "bf16_unpack", "bf16_ratio", "f16_pack", "f16_unpack",
                     "f16_ratio", "numpy_f16", "busy"], rows))
    print("target: bf16_ratio >= 0.8 " + ("met at every size" if all(r["bf16_ratio_best"] >= 0.8 for r in results)
                                         else "MISSED at " + ", ".join(f"{r['mib']} MiB" for r in results if r["bf16_ratio_best"] < 0.8)))
    info["loadavg_end"] = __import__("_machine").loadavg()
    save_json(args.json, {"machine": info, "trials": args.trials, "results": results})


if __name__ == "__main__":
    main()
