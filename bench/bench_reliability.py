"""What the reliability guards cost, as ratios taken in the same run.

    mpiexec -n 2 python bench/bench_reliability.py [--seq 512] [--preset small] [--json OUT]

1. the NaN/Inf check of a stage's output (`faults.check_finite`) vs the forward that made it
   (the whole small model as one stage: the check then scans the logits, the largest output);
2. one agreed start-up step (`faults.agree`: the step run in a bounded thread, every rank's
   verdict sent to rank 0, its decision broadcast) vs the bare `comm.Allreduce` of a flag
   that the agreement needed before, and vs the forward.
Times are the best of several interleaved trials; only the ratios are meant to be read.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from mpi4py import MPI

from _machine import add_common_args, header, machine, quiet_gate, save_json
from rlx_mpi.model.checkpoint import H5ParamSource
from rlx_mpi.lifecycle.faults import RankContext, agree, check_finite
from rlx_mpi.families.llama import PRESETS
from rlx_mpi.families.decoder.stage import DecoderStage as LlamaStage
from rlx_mpi.families.llama import FAMILY as _LLAMA
init_random = _LLAMA.init_random


def best_s(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--preset", default="small")
    ap.add_argument("--ckpt", default="/tmp/rlx_bench_small.h5")
    ap.add_argument("--trials", type=int, default=3)
    add_common_args(ap, quiet_wait_s=30.0)
    args = ap.parse_args()
    comm = MPI.COMM_WORLD
    ctx = RankContext(rank=comm.rank, size=comm.size)
    cfg = PRESETS[args.preset]
    info = machine()
    if comm.rank == 0:
        print(header(f"bench_reliability: {args.preset} preset, seq {args.seq}, {comm.size} ranks", info))
        init_random(args.ckpt, cfg, seed=0)
    comm.Barrier()
    with H5ParamSource(args.ckpt) as src:
        stage = LlamaStage(cfg, src, range(cfg.num_hidden_layers), True, True)
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, (1, args.seq))
    out = stage.forward(ids)
    flag = np.zeros(1, np.int32)
    rows = []
    for trial in range(args.trials):
        busy = quiet_gate(comm, args.quiet, args.quiet_wait)
        forward = best_s(lambda: stage.forward(ids), 2)
        check = best_s(lambda: check_finite(out, "the logits", ctx), 20)
        comm.Barrier()
        agreed = best_s(lambda: agree(comm, ctx, 60.0, lambda: None, "a bench step"), 50)
        comm.Barrier()
        allreduce = best_s(lambda: comm.Allreduce(MPI.IN_PLACE, flag, op=MPI.MIN), 50)
        rows.append({"trial": trial, "busy_before": busy, "forward_ms": forward * 1e3, "check_finite_ms": check * 1e3,
                     "agree_us": agreed * 1e6, "allreduce_us": allreduce * 1e6,
                     "check_vs_forward": check / forward, "agree_vs_allreduce": agreed / allreduce,
                     "agree_vs_forward": agreed / forward})
    if comm.rank != 0:
        return
    med = {k: float(np.median([r[k] for r in rows])) for k in rows[0] if k not in ("trial", "busy_before")}
    print(f"logits {out.nbytes / 1e6:.1f} MB; medians of {args.trials} trials:")
    print(f"  check_finite {med['check_finite_ms']:.2f} ms vs forward {med['forward_ms']:.1f} ms: "
          f"{100 * med['check_vs_forward']:.3f}% of the forward")
    print(f"  agree {med['agree_us']:.0f} us vs a bare Allreduce {med['allreduce_us']:.0f} us: "
          f"{med['agree_vs_allreduce']:.1f}x; {100 * med['agree_vs_forward']:.4f}% of one forward")
    save_json(args.json, {"machine": info, "args": vars(args), "trials": rows, "median": med})


if __name__ == "__main__":
    main()
