"""MoE decode against a dense model with the same active parameters, at batch 1 and batch 8.

Issue 31's target: time per decode step of a MoE model <= 1.3 x that of a dense model whose MLP
is as wide as the experts a token uses together (top-k, plus DeepSeek's shared experts: the
same FLOPs and weight bytes read per token at batch 1). Both are random checkpoints of the one
decoder with the same attention (Mixtral's GQA, DeepSeek's latent attention, GPT-OSS's sinks and
windows, Qwen3-MoE's q/k norms); decode steps are interleaved so host load hits both alike and
the best of ``--reps`` is kept. At batch 8 the rows pick different experts: a MoE step reads
each expert some row chose once (`kernels.experts`: rows grouped by expert), between k and
min(E, 8 k) experts, where the dense step reads its one MLP, so the batch-8 ratio is bounded by
about (attention + distinct experts' bytes) / (attention + k experts' bytes); the script prints
the distinct experts a step touched (mean over steps and layers) and that bound beside the ratio.

    OMP_NUM_THREADS=1 NUMBA_NUM_THREADS=1 python bench/bench_moe.py [--kind mixtral|deepseek|gpt_oss|qwen3]
        [--batch 1 8] [--tokens 64] [--reps 5] [--scale 1.0] [--precision f32|bf16|int8|q4]

Every chosen expert runs in one call (`kernels.experts_decode`); to see what the routing and the
experts cost apart from the rest of the step, profile a stage (a MoE layer's `model.mlp`).

``--scale`` multiplies the widths (0.25 for a smoke run; 4 makes the weights larger than a
server's L3, so both models read DRAM: at 1 the dense model's 100 MB may stay in a large L3
while the MoE's 300 MB cannot, which measures the cache, not the code).

Note: until 2026-12-03 the dense peer here had the width of *one* expert (``dense_intermediate_size``
only applies to a MoE model's dense layers), so the figures taken with it (Mixtral 1.73x, DeepSeek
3.40x, GPT-OSS 1.88x at batch 1, --scale 4) compared k experts against one: not comparable.
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
        return max(32, int(n * scale) // 32 * 32)  # whole q4 groups

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
    elif kind == "qwen3":  # Qwen3-30B-A3B's shape scaled: 64 small experts, top-8, softmax not renormalised
        moe = Arch(**{**base, "num_attention_heads": 16}, head_dim=64, qk_norm=True, intermediate_size=w(192),
                   num_experts=64, experts_per_token=8, norm_topk_prob=False)
    else:
        raise SystemExit(f"--kind {kind!r}: expected mixtral, deepseek, gpt_oss or qwen3")
    active = moe.experts_per_token * moe.intermediate_size + moe.shared_intermediate_size
    # the dense peer's one MLP is as wide as the experts a token uses: its `intermediate_size`
    # (`dense_intermediate_size` is a MoE model's dense layers' width: a dense model ignores it)
    dense = dataclasses.replace(moe, num_experts=0, experts_per_token=0, shared_intermediate_size=0,
                                intermediate_size=active, routing="softmax", router_bias=False,
                                expert_bias=False, n_group=1, topk_group=1, routed_scaling_factor=1.0,
                                norm_topk_prob=True)
    family = {"mixtral": "mixtral", "deepseek": "deepseek_v3", "gpt_oss": "gpt_oss", "qwen3": "qwen3_moe"}[kind]
    return family, moe.validate("bench"), dense.validate("bench")


def _count_experts() -> dict[int, list[int]]:
    """Wrap the MoE layers' routing to record, by the number of rows routed, how many distinct
    experts each call chose (a decode step of B rows routes B rows per MoE layer)."""
    from rlx_mpi.families.decoder import moe as moe_mod

    seen, route = {}, moe_mod.route

    def counting(x, *a, **k):
        index, weight = route(x, *a, **k)
        seen.setdefault(len(x), []).append(len(np.unique(index)))
        return index, weight

    moe_mod.route = counting
    return seen


def _bytes_read(stages: dict, touched: float) -> float:
    """Weight bytes a decode step reads, MoE over dense: every weight but the routed experts, plus
    ``touched`` experts a MoE layer (the dense step reads all its weights once, whatever the batch)."""
    from rlx_mpi.families.decoder.weights import Experts

    moe = stages["moe"]
    layers = [b.mlp for b in moe.blocks if isinstance(b.mlp, Experts)]
    experts = sum(sum(e.nbytes for e in m.experts) for m in layers)
    one = experts / sum(len(m.experts) for m in layers)

    def read(stage) -> int:  # a step reads one row of the embedding (unless it is the tied head)
        return stage.weight_bytes - (stage.embed_tokens.nbytes if stage.head is not stage.embed_tokens else 0)

    return (read(moe) - experts + touched * one * len(layers)) / read(stages["dense"])


def main() -> None:
    from rlx_mpi.model.checkpoint import H5ParamSource
    from rlx_mpi.families import get_family
    from rlx_mpi.model.kv_cache import KvSpec

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kind", default="mixtral", choices=["mixtral", "deepseek", "gpt_oss", "qwen3"])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--scale", type=float, default=1.0)
    ap.add_argument("--precision", default="f32", choices=["f32", "bf16", "f16", "int8", "q4"])
    args = ap.parse_args()
    name, moe, dense = models(args.kind, args.scale)
    family = get_family(name)
    stages = {}
    with tempfile.TemporaryDirectory() as tmp:
        for label, cfg in (("moe", moe), ("dense", dense)):
            path = Path(tmp) / f"{label}.h5"
            family.init_random(path, cfg, seed=0)
            with H5ParamSource(path) as src:
                stages[label] = family.build_stage(cfg, src, range(cfg.num_hidden_layers), True, True,
                                                   precision=args.precision)
    print(f"# {args.kind}: {family.describe(moe)}\n# dense peer: {family.describe(dense)}\n"
          f"# {args.precision} weights, best of {args.reps} interleaved reps of {args.tokens} decode steps")
    k, E = moe.experts_per_token, moe.num_experts
    seen = _count_experts()
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
            print(f"batch {B}: {label:5s} {t * 1e3:8.3f} ms/step")
        ratio = best["moe"] / best["dense"]
        if B == 1:
            print(f"batch {B}: moe / dense {ratio:.2f} (target <= 1.3)")
        else:
            touched = float(np.mean(seen.get(B, [np.nan])))
            print(f"batch {B}: moe / dense {ratio:.2f}; distinct routed experts a layer touched {touched:.1f} "
                  f"(of {E}; k = {k}, B x k = {B * k}; random routing expects {E * (1 - (1 - k / E) ** B):.1f}); "
                  f"weight bytes a step reads, moe / dense: {_bytes_read(stages, touched) :.2f} (the bound where DRAM limits)")


if __name__ == "__main__":
    main()
