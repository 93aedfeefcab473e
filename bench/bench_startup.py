"""Start-up to first forward: the tiny job on 4 ranks, launched again with warm caches.

    python bench/bench_startup.py [--ranks 4] [--launches 5] [--json OUT]

Launches ``mpiexec -n 4 python -m rlx_mpi run jobs/tiny.toml --trace T`` once to warm numba's
cache and the page cache (reported, not counted), then ``--launches`` more. For each launch:
the wall time of the whole command (mpiexec start to exit, an upper bound: it includes the
forward, ~10 ms here, and teardown) and, from rank 0's trace, the start-up phases on its clock
(``start`` = interpreter, imports, MPI init and the job file up to `cmd_run`; then load inputs,
probe, plan, build) and where the forward began relative to the process's own start
(/proc/self/stat starttime is only 10 ms resolution, so the wall time is the number to read).
Target: median wall < 3 s. 4 ranks on 2 cores are oversubscribed: imports contend.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _cli import default_mpiexec
from _machine import add_common_args, fmt_table, header, loadavg, machine, pct, save_json, wait_quiet

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--launches", type=int, default=5)
    ap.add_argument("--job", default=str(ROOT / "jobs" / "tiny.toml"))
    ap.add_argument("--mpiexec", default=default_mpiexec())
    add_common_args(ap, quiet_wait_s=20.0)
    args = ap.parse_args()
    info = machine()
    print(header(f"bench_startup: {Path(args.job).name} on {args.ranks} ranks, launch to exit and start-up phases",
                 info, f"1 warming launch, then {args.launches}"))
    rows, results = [], []
    with tempfile.TemporaryDirectory(prefix="rlx_bench_su_") as tmp:
        for i in range(args.launches + 1):
            busy = wait_quiet(args.quiet, args.quiet_wait) if args.quiet_wait > 0 else None
            trace = Path(tmp) / f"t{i}.json"
            cmd = [args.mpiexec, "-n", str(args.ranks), sys.executable, "-m", "rlx_mpi", "run", args.job,
                   "--trace", str(trace)]
            t0 = time.perf_counter()
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
            wall = time.perf_counter() - t0
            if proc.returncode != 0:
                raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stderr[-2000:]}")
            doc = json.loads(trace.read_text())
            ev = [e for e in doc["traceEvents"] if e.get("ph") == "X" and e["pid"] == 0]
            phases = {e["name"]: e["dur"] / 1e3 for e in ev if e["cat"] == "startup"}
            first = min(e["ts"] for e in ev if e["cat"] != "startup")
            begin = min(e["ts"] for e in ev if e["cat"] == "startup")
            r = {"launch": i, "warming": i == 0, "wall_s": wall, "phases_ms": phases,
                 "startup_to_forward_ms": (first - begin) / 1e3, "busy_before": busy}
            results.append(r)
            rows.append([str(i) + (" (warm-up)" if i == 0 else ""), f"{wall:.2f}", f"{r['startup_to_forward_ms']:.0f}",
                         *(f"{phases.get(k, 0):.0f}" for k in ("start", "load inputs", "probe", "plan", "build")),
                         pct(busy)])
    print(fmt_table(["launch", "wall_s", "cmd_run_to_fwd_ms", "start_ms", "inputs_ms", "probe_ms", "plan_ms",
                     "build_ms", "busy_before"], rows))
    walls = [r["wall_s"] for r in results if not r["warming"]]
    med = statistics.median(walls)
    print(f"# median wall {med:.2f} s, best {min(walls):.2f} s (target < 3 s); load average at the end: {loadavg()}")
    save_json(args.json, {"bench": "startup", "machine": info, "ranks": args.ranks, "job": args.job,
                          "results": results, "median_wall_s": med, "best_wall_s": min(walls)})


if __name__ == "__main__":
    main()
