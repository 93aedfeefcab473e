"""The cost of the TP lockstep check (issue 36) against a decode step, in one run.

The check (`drivers.decode_ring.lockstep_fold`'s note) adds, per step of stage 0, one blake2b fold
of the step's header and tokens, and widens the stop all-reduce the first stage's TP ranks
already make every step from one int32 to three int64. This bench measures, on one host:

* ``step_ms``: a decode step of ``generate`` at TP 2 (the median gap between a row's tokens,
  from ``--json``), on the ``--preset`` model with ``--batch`` rows;
* ``fold_us``: the fold of a header and tokens of that batch (in this process, best of 5);
* ``allreduce_extra_us``: the MAX all-reduce of int64[3] minus that of int32[1] over 2 ranks
  (``mpiexec -n 2``, best of 5 x 2000);

and prints ``cost_pct = 100 x (fold + extra) / step`` (the issue asks < 1 %) as JSON.

    python bench/bench_lockstep.py --preset small --batch 8            # on a quiet host
    python bench/bench_lockstep.py --preset tiny --batch 2 --tokens 4  # smoke
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
import timeit
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from _cli import default_mpiexec, ensure_checkpoint  # noqa: E402


def _allreduce_us(n: int, reps: int = 2000) -> dict:
    """(under mpiexec -n 2) best microseconds per MAX all-reduce of int32[1] and int64[3]."""
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    out = {}
    for name, buf in (("int32x1", np.zeros(1, np.int32)), ("int64x3", np.zeros(3, np.int64))):
        best = float("inf")
        for _ in range(n):
            comm.Barrier()
            t0 = time.perf_counter()
            for _ in range(reps):
                comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.MAX)
            best = min(best, (time.perf_counter() - t0) / reps * 1e6)
        out[name] = best
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=32, help="new tokens per prompt")
    ap.add_argument("--allreduce", action="store_true", help=argparse.SUPPRESS)  # the mpiexec child
    args = ap.parse_args()
    if args.allreduce:
        res = _allreduce_us(5)
        from mpi4py import MPI

        if MPI.COMM_WORLD.rank == 0:
            print(json.dumps(res))
        return
    from rlx_mpi.drivers.decode_ring import lockstep_fold

    header = np.arange(8 + 8 * args.batch, dtype=np.int64)  # about `Scheduler.header_size`
    tokens = np.arange(args.batch, dtype=np.int64)
    fold_us = min(timeit.repeat(lambda: lockstep_fold(12345, header, tokens), number=10000, repeat=5)) / 10000 * 1e6
    mpiexec = default_mpiexec()
    ar = json.loads(subprocess.run([mpiexec, "-n", "2", sys.executable, __file__, "--allreduce"], check=True,
                                   capture_output=True, text=True).stdout.strip().splitlines()[-1])
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        ckpt = Path(f"/tmp/rlx_bench_{args.preset}.h5")
        ensure_checkpoint(ckpt, args.preset)
        (d / "job.toml").write_text(f'[model]\ncheckpoint = "{ckpt}"\n[run]\ntimeout_s = 600.0\n'
                                    f'[placement]\ntp = 2\nreplicas = 1\nreserve_ram_gb = 0.0\n')
        (d / "p.jsonl").write_text("".join(json.dumps({"id": f"p{i}", "tokens": [1 + i, 2, 3, 4]}) + "\n"
                                           for i in range(args.batch)))
        subprocess.run([mpiexec, "-n", "2", sys.executable, "-m", "rlx_mpi", "generate", str(d / "job.toml"),
                        "--prompts", str(d / "p.jsonl"), "--out", str(d / "c.jsonl"), "--batch", str(args.batch),
                        "--max-new-tokens", str(args.tokens), "--json", str(d / "s.json")], check=True,
                       capture_output=True)
        step_ms = json.loads((d / "s.json").read_text())["token_gap_ms"]["median"]
    extra_us = max(0.0, ar["int64x3"] - ar["int32x1"])
    print(json.dumps({"preset": args.preset, "batch": args.batch, "step_ms": step_ms, "fold_us": round(fold_us, 2),
                      "allreduce_us": ar, "allreduce_extra_us": round(extra_us, 2),
                      "cost_pct": round(100 * (fold_us + extra_us) / 1e3 / step_ms, 4)}, indent=1))


if __name__ == "__main__":
    main()
