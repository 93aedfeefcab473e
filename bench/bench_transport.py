"""Ping-pong of hidden-state-sized messages: our `transport.Link` vs raw mpi4py vs a memcpy.

    mpiexec -n 2 python bench/bench_transport.py [--min-kb 4] [--max-mb 64] [--trials 5] [--json OUT]

For each size (powers of 4 from --min-kb to --max-mb; 2 MB is one medium-preset hidden state
at seq 512) rank 0 and rank 1 bounce one float32 buffer back and forth with:

  ours     `transport.Link.send/recv`: Isend/Irecv finished by `faults.wait` (Test polling
           with sched_yield, then sleeps that back off to 5 ms) and a byte-count check;
  raw      `comm.Send` / `comm.Recv` on the same numpy buffer;
  raw-nb   `comm.Isend` / `comm.Irecv` + `Wait` (ours without the deadline polling);

and rank 0 times `np.copyto` of the same bytes (rank 1 sleeps meanwhile). One-way time is
half a round trip. Variants are interleaved within each trial and the best trial is kept, so
the load of a shared machine hits all of them alike. Ratios > 1 mean ours is slower.

A second table is the pipeline's usual case: rank 0 (a stage) is already waiting for its
input when rank 1 sends it --late-ms later (busy-waiting first, like a stage still
computing). It reports the time from rank 1's send call until rank 0 has the data, median of
--late-reps; a receiver that has waited past `faults.wait`'s spin phase is asleep when the
message comes. (Ranks on one host share CLOCK_MONOTONIC, which perf_counter reads.)
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from mpi4py import MPI

from _machine import add_common_args, fmt_table, header, loadavg, machine, pct, quiet_gate, save_json
from rlx_mpi.comm import transport
from rlx_mpi.lifecycle.faults import RankContext

VARIANTS = ("ours", "raw", "raw-nb")


def _sizes(min_kb: int, max_mb: int) -> list[int]:
    sizes, n = [], min_kb * 1024
    while n <= max_mb * 2**20:
        sizes.append(n)
        n *= 4
    return sizes


def _iters(nbytes: int, budget_bytes: float) -> int:
    """Round trips per trial: many for small messages (µs each), a few for 64 MB."""
    return int(max(3, min(2000, budget_bytes // nbytes)))


def _ping_pong(kind: str, comm, link: transport.Link, buf: np.ndarray, iters: int) -> float:
    """``iters`` round trips between ranks 0 and 1; returns rank 0's elapsed seconds."""
    peer, me = 1 - comm.rank, comm.rank
    comm.Barrier()
    t0 = time.perf_counter()
    for i in range(iters):
        tag = i % 1000
        for step in ((0, 1) if me == 0 else (1, 0)):
            if step == 0:  # send
                if kind == "ours":
                    link.send(buf, peer, tag, "the bench buffer")
                elif kind == "raw":
                    comm.Send(buf, dest=peer, tag=tag)
                else:
                    comm.Isend(buf, dest=peer, tag=tag).Wait()
            else:  # receive
                if kind == "ours":
                    link.recv(buf, peer, tag, "the bench buffer")
                elif kind == "raw":
                    comm.Recv(buf, source=peer, tag=tag)
                else:
                    comm.Irecv(buf, source=peer, tag=tag).Wait()
    return time.perf_counter() - t0


def _memcpy(comm, dst: np.ndarray, src: np.ndarray, iters: int) -> float | None:
    """Rank 0 copies ``iters`` times while rank 1 sleeps in a polled barrier (no spinning core)."""
    comm.Barrier()
    elapsed = None
    if comm.rank == 0:
        t0 = time.perf_counter()
        for _ in range(iters):
            np.copyto(dst, src)
        elapsed = time.perf_counter() - t0
    request = comm.Ibarrier()
    while not request.Test():
        time.sleep(0.0005)
    return elapsed


def _busy(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def _late(kind: str, comm, link: transport.Link, buf: np.ndarray, delay_s: float, reps: int) -> float:
    """Median seconds from rank 1's (late) send call until both ranks are done."""
    lats = []
    for i in range(reps):
        comm.Barrier()
        if comm.rank == 1:
            _busy(delay_s)
        t0 = time.perf_counter()
        if comm.rank == 0:
            if kind == "ours":
                link.recv(buf, 1, i, "the bench buffer")
            elif kind == "raw":
                comm.Recv(buf, source=1, tag=i)
            else:
                comm.Irecv(buf, source=1, tag=i).Wait()
        else:
            if kind == "ours":
                link.send(buf, 0, i, "the bench buffer")
            elif kind == "raw":
                comm.Send(buf, dest=0, tag=i)
            else:
                comm.Isend(buf, dest=0, tag=i).Wait()
        t1 = time.perf_counter()
        start = comm.bcast(t0, root=1)
        lats.append(comm.allreduce(t1, op=MPI.MAX) - start)
    return float(np.median(lats))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--min-kb", type=int, default=4, help="smallest message in KiB (default 4)")
    ap.add_argument("--max-mb", type=int, default=64, help="largest message in MiB (default 64)")
    ap.add_argument("--trials", type=int, default=5, help="interleaved trials per size; the best is kept (default 5)")
    ap.add_argument("--budget-mb", type=float, default=256.0,
                    help="bytes per trial and variant, in MiB: sets the round trips per size (default 256)")
    ap.add_argument("--late-ms", default="0,10", help="comma-separated delays of the sender, ms (default 0,10)")
    ap.add_argument("--late-kb", default="4,2048", help="comma-separated sizes for the late table, KiB (default 4,2048)")
    ap.add_argument("--late-reps", type=int, default=9, help="messages per late case; the median is kept (default 9)")
    add_common_args(ap, quiet_wait_s=20.0)
    args = ap.parse_args()

    comm = MPI.COMM_WORLD.Dup()
    if comm.size != 2:
        if comm.rank == 0:
            print(f"bench_transport: run with exactly 2 ranks (got {comm.size}): "
                  "mpiexec -n 2 python bench/bench_transport.py")
        raise SystemExit(2)
    info = machine() if comm.rank == 0 else None
    ctx = RankContext(rank=comm.rank, size=comm.size)
    link = transport.Link(comm, ctx, timeout_s=120.0)
    if comm.rank == 0:
        print(header("bench_transport: ping-pong rank 0 <-> rank 1, one-way time = round trip / 2", info,
                     f"{comm.size} ranks on one host; best of {args.trials} interleaved trials per size"))

    rows, results = [], []
    for nbytes in _sizes(args.min_kb, args.max_mb):
        busy = quiet_gate(comm, args.quiet, args.quiet_wait)
        buf = np.ones(nbytes // 4, dtype=np.float32)
        dst = np.empty_like(buf)
        iters = _iters(nbytes, args.budget_mb * 2**20)
        warm = max(1, iters // 10)
        for kind in VARIANTS:  # warm-up: page faults, MPI's first-use buffers, pipelining set-up
            _ping_pong(kind, comm, link, buf, warm)
        _memcpy(comm, dst, buf, warm)
        best = {k: float("inf") for k in (*VARIANTS, "memcpy")}
        for _ in range(args.trials):
            for kind in VARIANTS:
                best[kind] = min(best[kind], _ping_pong(kind, comm, link, buf, iters) / iters / 2)
            t = _memcpy(comm, dst, buf, iters)
            if t is not None:
                best["memcpy"] = min(best["memcpy"], t / iters)
        if comm.rank:
            continue
        us = {k: v * 1e6 for k, v in best.items()}
        gbs = {k: nbytes / v / 1e9 for k, v in best.items()}
        results.append({"bytes": nbytes, "iters": iters, "busy_before": busy, "one_way_us": us, "gb_per_s": gbs,
                        "ours_over_raw": best["ours"] / best["raw"], "ours_over_raw_nb": best["ours"] / best["raw-nb"],
                        "ours_over_memcpy": best["ours"] / best["memcpy"]})
        r = results[-1]
        size = f"{nbytes // 2**20} MB" if nbytes >= 2**20 else f"{nbytes // 1024} KB"
        rows.append([size, f"{us['ours']:.1f}", f"{us['raw']:.1f}", f"{us['raw-nb']:.1f}",
                     f"{r['ours_over_raw']:.2f}", f"{r['ours_over_raw_nb']:.2f}", f"{gbs['ours']:.2f}",
                     f"{gbs['raw']:.2f}", f"{gbs['memcpy']:.2f}", f"{r['ours_over_memcpy']:.2f}"])
        print(f"# {size}: {iters} round trips x {args.trials} trials (CPU {pct(busy)} busy before)", flush=True)

    if comm.rank == 0:
        print(fmt_table(["size", "ours_us", "raw_us", "raw_nb_us", "ours/raw", "ours/raw_nb", "ours_GB/s",
                         "raw_GB/s", "memcpy_GB/s", "ours/memcpy"], rows))

    late_rows, late_results = [], []
    quiet_gate(comm, args.quiet, args.quiet_wait)
    for kb in (int(x) for x in args.late_kb.split(",")):
        buf = np.ones(kb * 256, dtype=np.float32)
        for ms in (float(x) for x in args.late_ms.split(",")):
            lat = {kind: _late(kind, comm, link, buf, ms / 1e3, args.late_reps) * 1e6 for kind in VARIANTS}
            late_results.append({"bytes": kb * 1024, "late_ms": ms, "us": lat})
            late_rows.append([f"{kb} KB", f"{ms:g}", f"{lat['ours']:.0f}", f"{lat['raw']:.0f}", f"{lat['raw-nb']:.0f}",
                              f"{lat['ours'] / lat['raw']:.1f}"])
    if comm.rank == 0:
        print(f"\n## rank 0 waits, rank 1 sends late: time from the send call until rank 0 has the data "
              f"(median of {args.late_reps})")
        print(fmt_table(["size", "late_ms", "ours_us", "raw_us", "raw_nb_us", "ours/raw"], late_rows))
        print(f"# load average at the end: {loadavg()}")
        save_json(args.json, {"bench": "transport", "machine": info, "trials": args.trials, "results": results,
                              "late": late_results})
    comm.Free()


if __name__ == "__main__":
    main()
