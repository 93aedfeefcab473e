"""Qwen3-MoE-style decode (many small experts, top-8, softmax without renormalising) against a
dense model with the same active parameters, at batch 1 and at batch 8.

Issue 31's figure: time per decode step of the MoE model over that of a dense model whose MLP
is as wide as the top-k experts together (same FLOPs a token; at batch 1 the same weight bytes
read), target <= 1.3 at batch 1. At batch 8 the rows route to different experts, so a step
reads up to 8 x top-k experts' weights where the dense model reads its one MLP: the ratio says
what that costs. Both are random checkpoints of the one decoder, shaped like Qwen3-30B-A3B
scaled down (default: hidden 1024, 4 layers, 16 heads / 4 kv of 64 with per-head q/k norms,
64 experts of width 192 top-8 vs one MLP of width 1536); decode steps are interleaved so host
load hits both alike; the best of --reps is kept.

    OMP_NUM_THREADS=1 NUMBA_NUM_THREADS=1 python bench/bench_moe_qwen3.py [--batch 1,8] [--tokens 32] [--reps 5]
            [--precision f32|bf16|int8] [--hidden 1024 --layers 4 --experts 64 --top-k 8 --expert-width 192]
"""

from __future__ import annotations

import argparse
import dataclasses
import tempfile
import time
from pathlib import Path

import numpy as np


def main() -> None:
    from rlx_mpi.checkpoint import H5ParamSource
    from rlx_mpi.families import get_family
    from rlx_mpi.families.decoder.arch import Arch
    from rlx_mpi.kv_cache import KvSpec

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", default="1,8", help="comma-separated decode batch sizes (default 1,8)")
    ap.add_argument("--tokens", type=int, default=32, help="decode steps timed per rep (default 32)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--precision", default="f32", choices=["f32", "bf16", "f16", "int8"])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--expert-width", type=int, default=192)
    args = ap.parse_args()
    h = args.hidden
    moe = Arch(vocab_size=8192, hidden_size=h, intermediate_size=args.expert_width, num_hidden_layers=args.layers,
               num_attention_heads=h // 64, num_key_value_heads=max(1, h // 256), head_dim=64, qk_norm=True,
               max_position_embeddings=1024, num_experts=args.experts, experts_per_token=args.top_k,
               norm_topk_prob=False).validate("bench")
    dense = dataclasses.replace(moe, intermediate_size=args.top_k * args.expert_width, num_experts=0,
                                experts_per_token=0).validate("bench")
    family = get_family("qwen3_moe")
    stages = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, cfg in (("moe", moe), ("dense", dense)):
            path = Path(tmp) / f"{name}.h5"
            family.init_random(path, cfg, seed=0)
            with H5ParamSource(path) as src:
                stages[name] = family.build_stage(cfg, src, range(cfg.num_hidden_layers), True, True,
                                                  precision=args.precision)
    print(f"# moe: {family.describe(moe)}\n# dense: {family.describe(dense)}\n# {args.precision} weights, "
          f"best of {args.reps} interleaved reps of {args.tokens} decode steps")
    prompt = 16
    rng = np.random.default_rng(0)
    for batch in (int(b) for b in args.batch.split(",")):
        ids = rng.integers(0, moe.vocab_size, (batch, prompt))
        slots = np.arange(batch)
        best = {name: float("inf") for name in stages}
        for _ in range(args.reps):
            for name, stage in stages.items():  # interleaved
                stage.reset(batch, prompt + args.tokens, KvSpec("full"))
                logits = stage.prefill(ids, slots, np.full(batch, prompt))
                tokens, t0 = logits.argmax(-1), time.perf_counter()
                for pos in range(prompt, prompt + args.tokens):
                    tokens = stage.decode(tokens[:, None], slots, np.full(batch, pos)).argmax(-1)
                best[name] = min(best[name], (time.perf_counter() - t0) / args.tokens)
        print(f"batch {batch}: moe {best['moe'] * 1e3:.3f} ms/step, dense {best['dense'] * 1e3:.3f} ms/step, "
              f"moe / dense {best['moe'] / best['dense']:.2f}" + (" (target <= 1.3)" if batch == 1 else ""))


if __name__ == "__main__":
    main()
