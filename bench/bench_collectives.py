"""`rlx_mpi.all_reduce` (with and without a deadline) vs raw `comm.Allreduce`, same buffers.

    mpiexec -n 2 python bench/bench_collectives.py [--min-kb 1] [--max-mb 16] [--trials 5] [--json OUT]
    mpiexec -n 4 python bench/bench_collectives.py      # 4 ranks oversubscribe a 2-core host

For each float32 buffer size (powers of 4 from 1 KiB to 16 MiB; a medium-preset TP partial
sum at seq 512 is 2 MiB), every rank runs, interleaved within each trial:

  deadline  `all_reduce(buf, ReduceKind.SUM, comm=c, timeout_s=60)`: Iallreduce finished by
            `faults.wait` (Test polling with sched_yield, then backing-off sleeps) -- the path
            tensor parallelism uses;
  blocking  `all_reduce(buf, ReduceKind.SUM, comm=c)`: argument checks + blocking Allreduce;
  raw       `c.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)`.

Each trial is a barrier and then ``iters`` back-to-back reductions; the time per reduction is
the slowest rank's trial time / iters, best of the trials. Buffers hold zeros so repeated
in-place sums stay finite (the cost of a float add does not depend on the value).

A second table times one reduction when the last rank arrives --late-ms after the others (it
busy-waits, like a rank still computing): the time from the late rank's call until every rank
has the result, median of --late-reps. Tensor-parallel ranks are rarely in lockstep, and a
rank that has waited past `faults.wait`'s spin phase is asleep when its partner arrives. (The
clocks of ranks on one host are comparable: perf_counter is CLOCK_MONOTONIC.)
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from mpi4py import MPI

from _machine import add_common_args, fmt_table, header, loadavg, machine, pct, quiet_gate, save_json
from rlx_mpi import ReduceKind, all_reduce
from rlx_mpi.lifecycle.faults import RankContext

VARIANTS = ("deadline", "blocking", "raw")


def _sizes(min_kb: int, max_mb: int) -> list[int]:
    sizes, n = [], min_kb * 1024
    while n <= max_mb * 2**20:
        sizes.append(n)
        n *= 4
    return sizes


def _trial(kind: str, comm, buf: np.ndarray, iters: int, ctx: RankContext) -> float:
    comm.Barrier()
    t0 = time.perf_counter()
    if kind == "deadline":
        for _ in range(iters):
            all_reduce(buf, ReduceKind.SUM, comm=comm, timeout_s=60.0, ctx=ctx)
    elif kind == "blocking":
        for _ in range(iters):
            all_reduce(buf, ReduceKind.SUM, comm=comm)
    else:
        for _ in range(iters):
            comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
    elapsed = np.array([time.perf_counter() - t0])
    comm.Allreduce(MPI.IN_PLACE, elapsed, op=MPI.MAX)  # the group is as slow as its slowest rank
    return float(elapsed[0])


def _busy(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def _late(kind: str, comm, buf: np.ndarray, delay_s: float, reps: int, ctx: RankContext) -> float:
    """Median seconds from the late rank's call until the last rank has the sum."""
    late = comm.size - 1
    lats = []
    for _ in range(reps):
        comm.Barrier()
        if comm.rank == late:
            _busy(delay_s)
        t0 = time.perf_counter()
        if kind == "deadline":
            all_reduce(buf, ReduceKind.SUM, comm=comm, timeout_s=60.0, ctx=ctx)
        elif kind == "blocking":
            all_reduce(buf, ReduceKind.SUM, comm=comm)
        else:
            comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
        t1 = time.perf_counter()
        start = comm.bcast(t0, root=late)
        lats.append(comm.allreduce(t1, op=MPI.MAX) - start)
    return float(np.median(lats))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--min-kb", type=int, default=1, help="smallest buffer in KiB (default 1)")
    ap.add_argument("--max-mb", type=int, default=16, help="largest buffer in MiB (default 16)")
    ap.add_argument("--trials", type=int, default=5, help="interleaved trials per size; the best is kept (default 5)")
    ap.add_argument("--budget-mb", type=float, default=128.0,
                    help="bytes reduced per trial and variant, in MiB: sets the reductions per size (default 128)")
    ap.add_argument("--late-ms", default="0,10", help="comma-separated late arrivals of the last rank, ms (default 0,10)")
    ap.add_argument("--late-kb", default="4,2048", help="comma-separated buffer sizes for the late table, KiB (default 4,2048)")
    ap.add_argument("--late-reps", type=int, default=9, help="reductions per late case; the median is kept (default 9)")
    add_common_args(ap, quiet_wait_s=20.0)
    args = ap.parse_args()

    comm = MPI.COMM_WORLD.Dup()
    ctx = RankContext(rank=comm.rank, size=comm.size)
    root = comm.rank == 0
    info = machine() if root else None
    if root:
        cores = info["usable_cores"] or info["cores"]
        note = (f"{comm.size} ranks on {cores} cores: OVERSUBSCRIBED, ratios show polling/scheduling overhead, "
                "not network cost" if comm.size > cores else f"{comm.size} ranks on {cores} cores")
        print(header(f"bench_collectives: in-place float32 SUM all-reduce over {comm.size} ranks", info,
                     f"{note}; best of {args.trials} interleaved trials per size"))

    rows, results = [], []
    for nbytes in _sizes(args.min_kb, args.max_mb):
        busy = quiet_gate(comm, args.quiet, args.quiet_wait)
        buf = np.zeros(nbytes // 4, dtype=np.float32)
        iters = int(max(3, min(2000, args.budget_mb * 2**20 // nbytes)))
        for kind in VARIANTS:  # warm-up
            _trial(kind, comm, buf, max(1, iters // 10), ctx)
        best = {k: float("inf") for k in VARIANTS}
        for _ in range(args.trials):
            for kind in VARIANTS:
                best[kind] = min(best[kind], _trial(kind, comm, buf, iters, ctx) / iters)
        if not root:
            continue
        us = {k: v * 1e6 for k, v in best.items()}
        results.append({"bytes": nbytes, "iters": iters, "busy_before": busy, "us": us,
                        "deadline_over_raw": best["deadline"] / best["raw"],
                        "blocking_over_raw": best["blocking"] / best["raw"]})
        size = f"{nbytes // 2**20} MB" if nbytes >= 2**20 else f"{nbytes // 1024} KB"
        # algorithm bandwidth: bytes of the buffer / time (what a caller sees)
        rows.append([size, f"{us['deadline']:.1f}", f"{us['blocking']:.1f}", f"{us['raw']:.1f}",
                     f"{results[-1]['deadline_over_raw']:.2f}", f"{results[-1]['blocking_over_raw']:.2f}",
                     f"{nbytes / best['raw'] / 1e9:.2f}"])
        print(f"# {size}: {iters} reductions x {args.trials} trials (CPU {pct(busy)} busy before)", flush=True)

    if root:
        print(fmt_table(["size", "deadline_us", "blocking_us", "raw_us", "deadline/raw", "blocking/raw",
                         "raw_GB/s"], rows))

    late_rows, late_results = [], []
    quiet_gate(comm, args.quiet, args.quiet_wait)
    for kb in (int(x) for x in args.late_kb.split(",")):
        buf = np.zeros(kb * 256, dtype=np.float32)
        for ms in (float(x) for x in args.late_ms.split(",")):
            lat = {kind: _late(kind, comm, buf, ms / 1e3, args.late_reps, ctx) * 1e6 for kind in VARIANTS}
            late_results.append({"bytes": kb * 1024, "late_ms": ms, "us": lat})
            late_rows.append([f"{kb} KB", f"{ms:g}", f"{lat['deadline']:.0f}", f"{lat['blocking']:.0f}",
                              f"{lat['raw']:.0f}", f"{lat['deadline'] / lat['raw']:.1f}"])
    if root:
        print(f"\n## rank {comm.size - 1} arrives late: time from its call until every rank has the sum "
              f"(median of {args.late_reps})")
        print(fmt_table(["size", "late_ms", "deadline_us", "blocking_us", "raw_us", "deadline/raw"], late_rows))
        print(f"# load average at the end: {loadavg()}")
        save_json(args.json, {"bench": "collectives", "ranks": comm.size, "machine": info, "trials": args.trials,
                              "results": results, "late": late_results})
    comm.Free()


if __name__ == "__main__":
    main()
