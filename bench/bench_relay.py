"""Relay of hidden-state-sized messages through the executor vs raw mpi4py Send/Recv.

    mpiexec -n 2 python bench/bench_relay.py [--min-mb 1] [--max-mb 64] [--trials 5] [--wire f32] [--json OUT]

Rank 0 and rank 1 bounce a float32 array back and forth. "ours" is the real hot path: each
rank runs `Executor.run` on a four-action schedule (post receive, compute, post send, wait
send, wait receive), so every hop goes through the schedule interpreter, the buffer pool, the
codec (f32: the output array itself, no copy), `Link.isend/irecv` and `faults.wait`; the
compute callback only hands back a preallocated output. "raw" is `comm.Send` / `comm.Recv` of
the same bytes. One-way time = round trip / 2; variants interleaved, best trial kept.
``raw/ours`` >= 0.95 is the target (1.0 = no overhead).
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from mpi4py import MPI

from _machine import add_common_args, fmt_table, header, loadavg, machine, pct, quiet_gate, save_json
from rlx_mpi.comm import transport
from rlx_mpi.comm.executor import Executor, wire_codec_by_name
from rlx_mpi.lifecycle.faults import RankContext
from rlx_mpi.comm.schedule import COMPUTE, POST_RECV, POST_SEND, WAIT_RECV, WAIT_SEND, Action


def relay_schedule(rank: int) -> list[Action]:
    """One round trip: rank 0 sends then receives; rank 1 receives then sends back."""
    peer = 1 - rank
    if rank == 0:
        return [Action(0, POST_RECV, 0, 0, peer), Action(0, COMPUTE, 0, 1), Action(0, POST_SEND, 0, 0, peer),
                Action(0, WAIT_SEND, 0, 0, peer), Action(0, WAIT_RECV, 0, 0, peer)]
    return [Action(1, POST_RECV, 0, 0, peer), Action(1, WAIT_RECV, 0, 0, peer), Action(1, COMPUTE, 0, 0),
            Action(1, POST_SEND, 0, 0, peer), Action(1, WAIT_SEND, 0, 0, peer)]


def _ours(comm, ex: Executor, out: np.ndarray, iters: int) -> float:
    actions = relay_schedule(comm.rank)
    spec = (out.shape, np.float32)
    comm.Barrier()
    t0 = time.perf_counter()
    for i in range(iters):
        ex.run(actions, lambda m, x: out, lambda a: spec, tag_base=i % 1000)
    return time.perf_counter() - t0


def _raw(comm, buf: np.ndarray, iters: int) -> float:
    peer = 1 - comm.rank
    comm.Barrier()
    t0 = time.perf_counter()
    for i in range(iters):
        tag = i % 1000
        if comm.rank == 0:
            comm.Send(buf, dest=peer, tag=tag)
            comm.Recv(buf, source=peer, tag=tag)
        else:
            comm.Recv(buf, source=peer, tag=tag)
            comm.Send(buf, dest=peer, tag=tag)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--min-mb", type=int, default=1, help="smallest message in MiB (default 1)")
    ap.add_argument("--max-mb", type=int, default=64, help="largest message in MiB (default 64)")
    ap.add_argument("--trials", type=int, default=5, help="interleaved trials per size; the best is kept (default 5)")
    ap.add_argument("--budget-mb", type=float, default=512.0, help="MiB per trial and variant (default 512)")
    ap.add_argument("--wire", default="f32", help="codec between the output and the wire (default f32)")
    add_common_args(ap, quiet_wait_s=20.0)
    args = ap.parse_args()

    comm = MPI.COMM_WORLD.Dup()
    if comm.size != 2:
        if comm.rank == 0:
            print("bench_relay: run with exactly 2 ranks: mpiexec -n 2 python bench/bench_relay.py")
        raise SystemExit(2)
    info = machine() if comm.rank == 0 else None
    ctx = RankContext(rank=comm.rank, size=comm.size)
    link = transport.Link(comm, ctx, timeout_s=120.0)
    ex = Executor(link, ctx, rank_of=lambda s: s, codec=wire_codec_by_name(args.wire), record=False)
    if comm.rank == 0:
        print(header(f"bench_relay: executor ({args.wire} wire) vs raw Send/Recv ping-pong, one-way = round trip / 2",
                     info, f"best of {args.trials} interleaved trials per size"))
    rows, results = [], []
    n = args.min_mb
    while n <= args.max_mb:
        nbytes = n * 2**20
        busy = quiet_gate(comm, args.quiet, args.quiet_wait)
        out = np.ones(nbytes // 4, dtype=np.float32)
        buf = np.ones_like(out)
        iters = int(max(3, args.budget_mb // n))
        _ours(comm, ex, out, 2)
        _raw(comm, buf, 2)
        best = {"ours": float("inf"), "raw": float("inf")}
        for _ in range(args.trials):
            best["ours"] = min(best["ours"], _ours(comm, ex, out, iters) / iters / 2)
            best["raw"] = min(best["raw"], _raw(comm, buf, iters) / iters / 2)
        if comm.rank == 0:
            ratio = best["raw"] / best["ours"]
            results.append({"bytes": nbytes, "iters": iters, "busy_before": busy, "ours_s": best["ours"],
                            "raw_s": best["raw"], "raw_over_ours": ratio})
            rows.append([f"{n} MiB", f"{best['ours'] * 1e6:.0f}", f"{best['raw'] * 1e6:.0f}",
                         f"{nbytes / best['ours'] / 1e9:.2f}", f"{nbytes / best['raw'] / 1e9:.2f}", f"{ratio:.3f}",
                         pct(busy)])
            print(f"# {n} MiB: {iters} round trips x {args.trials} trials", flush=True)
        n *= 2
    if comm.rank == 0:
        print(fmt_table(["size", "ours_us", "raw_us", "ours_GB/s", "raw_GB/s", "raw/ours", "busy_before"], rows))
        worst = min(r["raw_over_ours"] for r in results)
        print(f"# worst raw/ours {worst:.3f} (target >= 0.95); load average at the end: {loadavg()}")
        save_json(args.json, {"bench": "relay", "machine": info, "wire": args.wire, "trials": args.trials,
                              "results": results, "worst_raw_over_ours": worst})


if __name__ == "__main__":
    main()
