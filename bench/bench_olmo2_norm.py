"""OLMo 2's whole-projection q/k RMSNorm under tensor parallelism: all-reduce the sums of squares
(what `decoder.model.projection_norm_` does) vs every rank computing the whole q and k projection.

    mpiexec -n 2 python bench/bench_olmo2_norm.py [--hidden 4096 --heads 32 --kv-heads 32 --head-dim 128]
            [--tokens 1,8,128] [--precision f32] [--trials 7] [--json OUT]

Per layer and TP rank, for T tokens (1: a decode step; 128: a prefill chunk):

  allreduce  q|k of this rank's heads (q_dim/tp + kv_dim/tp rows), each token's local sums of
             squares (T x 2 floats) all-reduced over the TP group with the deadline that TP
             uses (`rlx_mpi.all_reduce`, timeout_s), then the slice scaled: the shipped path;
  replicate  q|k of EVERY head (q_dim + kv_dim rows: tp x the product, and tp x those weights
             held per rank), normalised locally, this rank's slice kept; no collective.

The time per layer is the slowest rank's trial time / iterations, best of --trials interleaved
trials; the ratio replicate / allreduce > 1 means the all-reduce is the cheaper choice. Both
give the same numbers (checked at start). Defaults: OLMo-2-7B (hidden 4096, 32 heads, 32 kv
heads of 128). Take figures only on a quiet host (the gate waits for one).
"""

from __future__ import annotations

import argparse
import time
from types import SimpleNamespace

import numpy as np
from mpi4py import MPI

from _machine import add_common_args, fmt_table, header, loadavg, machine, quiet_gate, save_json
from rlx_mpi import ReduceKind, all_reduce
from rlx_mpi.model.checkpoint import part_bounds
from rlx_mpi.lifecycle.faults import RankContext
from rlx_mpi.families.decoder.model import projection_norm_, rms_norm
from rlx_mpi.families.decoder.weights import make_linear


def _replicate(x, full, qd, kd, wq, wk, eps, qs, ks):
    qk = full(x)  # (T, q_dim + kv_dim): every head
    q = rms_norm(np.ascontiguousarray(qk[:, :qd]), wq, eps)
    k = rms_norm(np.ascontiguousarray(qk[:, qd:qd + kd]), wk, eps)
    return np.concatenate([q[:, qs[0]:qs[1]], k[:, ks[0]:ks[1]]], axis=1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=32)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--tokens", default="1,8,128", help="comma-separated tokens per call (default 1,8,128)")
    ap.add_argument("--precision", default="f32", choices=["f32", "bf16", "f16", "int8"])
    ap.add_argument("--trials", type=int, default=7)
    ap.add_argument("--iters", type=int, default=0, help="calls per trial (default: about 0.2 s of work)")
    add_common_args(ap, quiet_wait_s=20.0)
    args = ap.parse_args()

    comm = MPI.COMM_WORLD.Dup()
    tp, r = comm.size, comm.rank
    ctx = RankContext(rank=r, size=tp)
    C, hs, eps = args.hidden, args.head_dim, 1e-6
    qd, kd = args.heads * hs, args.kv_heads * hs
    if args.heads % tp or args.kv_heads % tp:
        raise SystemExit(f"--heads and --kv-heads must be multiples of the {tp} ranks")
    rng = np.random.default_rng(0)  # the same full weights on every rank
    w_full = (rng.standard_normal((qd + kd, C), dtype=np.float32) * C ** -0.5)
    wq, wk = 1 + 0.1 * rng.standard_normal(qd, dtype=np.float32), 1 + 0.1 * rng.standard_normal(kd, dtype=np.float32)
    qs, ks = part_bounds(qd, r, tp), part_bounds(kd, r, tp)
    local = np.concatenate([w_full[qs[0]:qs[1]], w_full[qd + ks[0]:qd + ks[1]]])
    # what projection_norm_ reads of a layer (both variants leave v alone, so it has none here)
    w = SimpleNamespace(q_dim=qs[1] - qs[0], kv_dim=ks[1] - ks[0], q_proj_norm=wq[qs[0]:qs[1]],
                        k_proj_norm=wk[ks[0]:ks[1]], norm_group=tp)
    part, full = make_linear(local, args.precision), make_linear(w_full, args.precision)

    def reduce(sums):
        return all_reduce(sums, ReduceKind.SUM, comm=comm, timeout_s=60.0, ctx=ctx)

    def run_allreduce(x):
        return projection_norm_(part(x), w, eps, reduce)  # (T, q_local | k_local)

    def run_replicate(x):
        return _replicate(x, full, qd, kd, wq, wk, eps, qs, ks)

    info = machine() if r == 0 else None
    if r == 0:
        print(header(f"bench_olmo2_norm: whole-projection q/k norm under TP {tp}", info,
                     f"hidden {C}, {args.heads} heads / {args.kv_heads} kv of {hs}, {args.precision} weights; "
                     f"best of {args.trials} interleaved trials"))
    x0 = rng.standard_normal((4, C), dtype=np.float32)
    a, b = run_allreduce(x0), run_replicate(x0)
    err = float(np.abs(a - b).max())
    if r == 0:
        print(f"# allreduce vs replicate: max |diff| {err:.2e} (the same numbers)")
    rows, results = [], []
    for T in (int(t) for t in args.tokens.split(",")):
        x = rng.standard_normal((T, C), dtype=np.float32)
        iters = args.iters or max(3, int(2e8 / (2 * T * (qd + kd) * C)))
        best = {"allreduce": float("inf"), "replicate": float("inf")}
        busy = quiet_gate(comm, args.quiet, args.quiet_wait)
        for _ in range(args.trials):
            for name, fn in (("allreduce", run_allreduce), ("replicate", run_replicate)):
                comm.Barrier()
                t0 = time.perf_counter()
                for _ in range(iters):
                    fn(x)
                dt = comm.allreduce(time.perf_counter() - t0, op=MPI.MAX) / iters
                best[name] = min(best[name], dt)
        if r == 0:
            ratio = best["replicate"] / best["allreduce"]
            results.append({"tokens": T, "iters": iters, "busy_before": busy,
                            "us": {k: v * 1e6 for k, v in best.items()}, "replicate_over_allreduce": ratio})
            rows.append([str(T), f"{best['allreduce'] * 1e6:.1f}", f"{best['replicate'] * 1e6:.1f}", f"{ratio:.2f}"])
    if r == 0:
        print(fmt_table(["tokens", "allreduce_us", "replicate_us", "replicate/allreduce"], rows))
        extra = 4 * (qd + kd) * C * (tp - 1) / tp / 2**20
        print(f"# replicate also holds {extra:.1f} MiB more q/k weights per rank and layer (f32 bytes)")
        print(f"# load average at the end: {loadavg()}")
        save_json(args.json, {"bench": "olmo2_norm", "ranks": tp, "machine": info, "results": results,
                              "max_abs_diff": err})
    comm.Free()


if __name__ == "__main__":
    main()
