"""Our single-process forward vs Hugging Face transformers on the same converted model.

    /work/torchvenv/bin/python bench/bench_hf.py [--seqs 128,512] [--threads 1,2] [--trials 5] [--json OUT]

(The torch venv needs rlx_mpi and its deps: ``pip install numpy h5py numba mpi4py
threadpoolctl`` and ``pip install --no-deps -e .``; no MPI library is needed, nothing here
uses MPI.)

It builds a ``LlamaForCausalLM`` with the shape of our ``small`` preset (8 layers, hidden 512,
8 heads / 4 kv heads, vocab 4096; untied head), fills it like ``rlx_mpi.llama.init`` does
(linear weights N(0, 1/fan_in), embedding N(0, 1), norms 1 + 0.1 N(0, 1), so logits are O(1)
and the difference below means something), ``save_pretrained``s it to --hf-dir, converts it
with ``rlx_mpi.llama.convert.convert_hf`` and builds our ``LlamaStage`` over all layers.

Then, for each thread count and sequence length (batch 1, the same random ids), it times
transformers (float32, eager attention, ``use_cache=False``, ``torch.inference_mode``,
``torch.set_num_threads(t)``) and ours (threadpoolctl limited to t BLAS threads; our numba
kernels are single-threaded), interleaved, best of --trials after a warm-up, and prints
ours/HF (< 1: ours is faster) and the largest absolute logits difference.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np

from _machine import add_common_args, fmt_table, header, loadavg, machine, save_json, wait_quiet


def build_hf(hf_dir: Path, preset: str, seed: int):
    """A transformers Llama of ``preset``'s shape with O(1) random weights, saved to ``hf_dir``."""
    import torch
    import transformers
    from transformers import LlamaConfig, LlamaForCausalLM

    from rlx_mpi.llama import PRESETS

    p = PRESETS[preset]
    kw = dict(vocab_size=p.vocab_size, hidden_size=p.hidden_size, intermediate_size=p.intermediate_size,
              num_hidden_layers=p.num_hidden_layers, num_attention_heads=p.num_attention_heads,
              num_key_value_heads=p.num_key_value_heads, max_position_embeddings=p.max_position_embeddings,
              rms_norm_eps=p.rms_norm_eps, tie_word_embeddings=False, attention_bias=False, mlp_bias=False)
    if int(transformers.__version__.split(".")[0]) >= 5:
        kw["rope_parameters"] = {"rope_type": "default", "rope_theta": p.rope_theta}
    else:
        kw["rope_theta"] = p.rope_theta
    torch.manual_seed(seed)
    model = LlamaForCausalLM._from_config(LlamaConfig(**kw), attn_implementation="eager", dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.ndim == 1:  # RMSNorm weights
                param.copy_(1.0 + 0.1 * torch.randn_like(param))
            elif "embed_tokens" in name:
                param.copy_(torch.randn_like(param))
            else:
                param.copy_(torch.randn_like(param) * param.shape[1] ** -0.5)
    model.eval()
    model.save_pretrained(hf_dir, safe_serialization=True)
    return model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="small", help="shape of the model (default small)")
    ap.add_argument("--seqs", default="128,512", help="comma-separated sequence lengths (default 128,512)")
    ap.add_argument("--threads", default="1,2", help="comma-separated thread counts (default 1,2)")
    ap.add_argument("--trials", type=int, default=5, help="timed forwards per variant, interleaved; best kept (default 5)")
    ap.add_argument("--hf-dir", default="/tmp/rlx_bench_hf_small", help="where to save_pretrained the model")
    ap.add_argument("--ckpt", default="/tmp/rlx_bench_hf_small.h5", help="where to write the converted checkpoint")
    add_common_args(ap, quiet_wait_s=30.0)
    args = ap.parse_args()
    seqs = [int(s) for s in args.seqs.split(",")]
    threads = [int(t) for t in args.threads.split(",")]

    import torch
    import transformers  # noqa: F401 (version in the header)
    from threadpoolctl import threadpool_limits

    from rlx_mpi.checkpoint import H5ParamSource
    from rlx_mpi.llama import LlamaStage
    from rlx_mpi.llama.convert import convert_hf

    transformers.utils.logging.disable_progress_bar()
    info = machine()
    hf_dir, ckpt = Path(args.hf_dir), Path(args.ckpt)
    hf_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    model = build_hf(hf_dir, args.preset, seed=0)
    cfg = convert_hf(hf_dir, ckpt)
    with H5ParamSource(ckpt) as src:
        stage = LlamaStage(cfg, src, range(cfg.num_hidden_layers), True, True)
    setup_s = time.perf_counter() - t0
    print(header(f"bench_hf: transformers vs rlx_mpi LlamaStage, one process, {args.preset}-preset shape, batch 1",
                 info, f"model built, saved ({hf_dir}), converted ({ckpt}) and loaded in {setup_s:.1f} s; "
                 f"best of {args.trials} interleaved forwards after a warm-up; HF: eager attention, use_cache=False"))

    rng = np.random.default_rng(1234)
    rows, results = [], []
    for t in threads:
        for seq in seqs:
            ids = rng.integers(0, cfg.vocab_size, (1, seq), dtype=np.int64)
            ids_t = torch.from_numpy(ids)

            def hf():
                torch.set_num_threads(t)
                with torch.inference_mode():
                    return model(input_ids=ids_t, use_cache=False).logits

            def ours():
                with threadpool_limits(limits=t):
                    return stage.forward(ids)

            busy = wait_quiet(args.quiet, args.quiet_wait) if args.quiet_wait > 0 else None
            diff = float(np.abs(ours() - hf().numpy()).max())  # also the warm-up of both
            scale = float(np.abs(hf().numpy()).max())
            times = {"hf": [], "ours": []}
            for _ in range(args.trials):
                for name, fn in (("hf", hf), ("ours", ours)):
                    time.sleep(0.05)  # let the other library's spinning worker threads go idle
                    start = time.perf_counter()
                    fn()
                    times[name].append(time.perf_counter() - start)
            best = {k: min(v) * 1e3 for k, v in times.items()}
            med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
            results.append({"threads": t, "seq": seq, "best_ms": best, "median_ms": med,
                            "ours_over_hf": best["ours"] / best["hf"], "max_abs_diff": diff, "max_abs_logit": scale,
                            "busy_before": busy})
            rows.append([str(t), str(seq), f"{best['hf']:.1f}", f"{best['ours']:.1f}", f"{med['hf']:.1f}",
                         f"{med['ours']:.1f}", f"{best['ours'] / best['hf']:.2f}", f"{diff:.1e}", f"{scale:.1f}"])
            print(f"# threads {t}, seq {seq} done (CPU {'?' if busy is None else f'{100 * busy:.0f}%'} busy "
                  "before it)", flush=True)
    print(fmt_table(["threads", "seq", "hf_best_ms", "ours_best_ms", "hf_med_ms", "ours_med_ms", "ours/hf",
                     "max_abs_diff", "max_abs_logit"], rows))
    print(f"# load average at the end: {loadavg()}")
    save_json(args.json, {"bench": "hf", "machine": info, "preset": args.preset, "trials": args.trials,
                          "model_config": json.loads(cfg.to_json()), "results": results})


if __name__ == "__main__":
    main()
