"""numba kernels vs the numpy they replace, and their share of a whole forward (same run).

    python bench/bench_kernels.py [--seq 512] [--preset small]
"""

from __future__ import annotations

import argparse
import platform
import time

import numpy as np

from rlx_mpi import kernels
from rlx_mpi.checkpoint import H5ParamSource
from rlx_mpi.llama import PRESETS, LlamaStage, model
from rlx_mpi.llama.init import init_random


def best_ms(fn, reps: int = 7) -> float:
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times) * 1e3


def numpy_softmax(scores):
    t = scores.shape[-1]
    x = scores + np.triu(np.full((t, t), -np.inf, dtype=np.float32), k=1)
    x = np.exp(x - x.max(-1, keepdims=True))
    return x / x.sum(-1, keepdims=True)


def numpy_rms(x, w, eps):
    return w * (x / np.sqrt(np.mean(np.square(x), -1, keepdims=True) + np.float32(eps)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--preset", default="small")
    ap.add_argument("--ckpt", default="/tmp/rlx_bench_small.h5")
    args = ap.parse_args()
    cfg = PRESETS[args.preset]
    rng = np.random.default_rng(0)
    scores = rng.standard_normal((1, cfg.num_attention_heads, args.seq, args.seq), dtype=np.float32)
    x = rng.standard_normal((1, args.seq, cfg.hidden_size), dtype=np.float32)
    w = rng.standard_normal(cfg.hidden_size, dtype=np.float32)
    kernels.warm_up()
    print(f"machine: {platform.machine()}, {platform.processor() or '?'}; numpy {np.__version__}; "
          f"preset {args.preset}, seq {args.seq}")
    soft_np = best_ms(lambda: numpy_softmax(scores))
    soft_nb = best_ms(lambda: kernels.causal_softmax_(scores.copy()))
    rms_np = best_ms(lambda: numpy_rms(x, w, 1e-6))
    rms_nb = best_ms(lambda: kernels.rms_norm(x, w, 1e-6))
    print(f"causal softmax: numpy {soft_np:.2f} ms, numba {soft_nb:.2f} ms (incl. a copy): {soft_np / soft_nb:.2f}x")
    print(f"rms_norm:       numpy {rms_np:.3f} ms, numba {rms_nb:.3f} ms: {rms_np / rms_nb:.2f}x")

    init_random(args.ckpt, cfg, seed=0)
    ids = rng.integers(0, cfg.vocab_size, (1, args.seq))
    with H5ParamSource(args.ckpt) as src:
        stage = LlamaStage(cfg, src, range(cfg.num_hidden_layers), True, True)
    with_kernels = best_ms(lambda: stage.forward(ids), reps=3)
    saved = (model.kernels.causal_softmax_, model.kernels.rms_norm)
    model.kernels.causal_softmax_ = numpy_softmax
    model.kernels.rms_norm = numpy_rms
    try:
        plain = best_ms(lambda: stage.forward(ids), reps=3)
    finally:
        model.kernels.causal_softmax_, model.kernels.rms_norm = saved
    print(f"whole forward:  numpy-only {plain:.1f} ms, with numba kernels {with_kernels:.1f} ms: "
          f"{plain / with_kernels:.2f}x")


if __name__ == "__main__":
    main()
