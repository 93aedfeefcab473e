"""MoE decode against a dense model with the same active parameters, at batch 1 and batch 8.

Issue 15's target: time per token of a MoE model <= 1.3 x that of a dense model whose MLP is
as wide as the experts a token uses together (top-k, plus DeepSeek's shared experts: the same
FLOPs and weight bytes read per token at batch 1). Both are random checkpoints of the one
decoder with the same attention (Mixtral's GQA, DeepSeek's latent attention, GPT-OSS's sinks and
windows); decode steps are interleaved so host load hits both alike. At batch 8 the rows pick
different experts, so a MoE step reads up to 8 x k experts where the dense one reads one MLP:
the ratio there shows what routing costs a batch (issue 31).

    OMP_NUM_THREADS=1 NUMBA_NUM_THREADS=1 python bench/bench_moe.py [--kind mixtral|deepseek|gpt_oss]
        [--batch 1 8] [--tokens 64] [--reps 5] [--scale 1.0]

``--scale`` multiplies the widths (0.25 for a smoke run). Mixtral measured only under heavy load
(2 cores shared by five jobs, load average 8-10): 1.05x to 1.77x across runs, 1.23x typical;
DeepSeek and GPT-OSS not measured yet: not README figures, take them on a quiet host.
"""

from __future__ import annotations

import argparse
import dataclasses
import tempfile
import time
from pathlib import Path

import numpy as np


def models(kind: str, scale: float):
    """(family name, MoE Arch, dense Arch of the same active parameters)."""
    from rlx_mpi.families.decoder.arch import Arch

    def w(n: int) -> int:
        return max(8, int(n * scale) // 8 * 8)

    base = dict(vocab_size=4096, hidden_size=w(512), num_hidden_layers=4, num_attention_heads=8,
                num_key_value_heads=4, max_position_embeddings=1024)
    if kind == "mixtral":
        moe = Arch(**base, intermediate_size=w(1376), num_experts=8, experts_per_token=2)
    elif kind == "deepseek":  # MLA; 16 experts in 4 groups (2 compete), top-4, one shared expert
        moe = Arch(**{**base, "num_key_value_heads": 8}, head_dim=32, intermediate_size=w(344), kv_lora_rank=w(128),
                   q_lora_rank=w(192), qk_nope_head_dim=32, v_head_dim=32, rope_interleave=True, num_experts=16,
                   experts_per_token=4, routing="sigmoid", router_bias=True, n_group=4, topk_group=2,
                   routed_scaling_factor=2.5, shared_intermediate_size=w(344))
    elif kind == "gpt_oss":  # sinks, biases, sliding/full layers, clamped SwiGLU, top-2 of 8 with biases
        moe = Arch(**base, head_dim=64, intermediate_size=w(1376), qkv_bias=True, o_bias=True, attention_sinks=True,
                   layer_windows=(128, 0, 128, 0), activation="silu_clamped", num_experts=8, experts_per_token=2,
                   routing="topk_softmax", router_bias=True, expert_bias=True)
    else:
        raise SystemExit(f"--kind {kind!r}: expected mixtral, deepseek or gpt_oss")
    active = moe.experts_per_token * moe.intermediate_size + moe.shared_intermediate_size
    dense = dataclasses.replace(moe, num_experts=0, experts_per_token=0, shared_intermediate_size=0,
                                dense_intermediate_size=active, routing="softmax", router_bias=False,
                                expert_bias=False, n_group=1, topk_group=1, routed_scaling_factor=1.0)
    family = {"mixtral": "mixtral", "deepseek": "deepseek_v3", "gpt_oss": "gpt_oss"}[kind]
    return family, moe.validate("bench"), dense.validate("bench")


def main() -> None:
    from rlx_mpi.checkpoint import H5ParamSource
    from rlx_mpi.families import get_family
    from rlx_mpi.kv_cache import KvSpec

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kind", default="mixtral", choices=["mixtral", "deepseek", "gpt_oss"])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--scale", type=float, default=1.0)
    args = ap.parse_args()
    name, moe, dense = models(args.kind, args.scale)
    family = get_family(name)
    stages = {}
    with tempfile.TemporaryDirectory() as tmp:
        for label, cfg in (("moe", moe), ("dense", dense)):
            path = Path(tmp) / f"{label}.h5"
            family.init_random(path, cfg, seed=0)
            with H5ParamSource(path) as src:
                stages[label] = family.build_stage(cfg, src, range(cfg.num_hidden_layers), True, True)
    print(f"{args.kind}: {family.describe(moe)}; dense peer MLP width {dense.mlp_width(0)}")
    for B in args.batch:
        best = {label: float("inf") for label in stages}
        rows, prompt = np.arange(B), np.arange(16 * B).reshape(B, 16) % moe.vocab_size
        for _ in range(args.reps):
            for label, stage in stages.items():  # interleaved
                stage.reset(B, 16 + args.tokens, KvSpec("full"))
                tokens = stage.prefill(prompt, rows, np.full(B, 16)).argmax(-1)
                t0 = time.perf_counter()
                for pos in range(16, 16 + args.tokens):
                    tokens = stage.decode(tokens[:, None], rows, np.full(B, pos)).argmax(-1)
                best[label] = min(best[label], (time.perf_counter() - t0) / args.tokens)
        for label, t in best.items():
            print(f"batch {B}: {label:5s} {t * 1e3:8.3f} ms/step (best of {args.reps})")
        print(f"batch {B}: moe / dense {best['moe'] / best['dense']:.2f}" + (" (target <= 1.3)" if B == 1 else ""))


if __name__ == "__main__":
    main()
