"""Our single-process forward vs Hugging Face transformers on the same converted model.

    /work/torchvenv/bin/python bench/bench_hf.py [--seqs 128,512] [--threads 1,2] [--trials 5] [--json OUT]
    /work/torchvenv/bin/python bench/bench_hf.py --preset medium --shapes 1x512,16x128,8x512 --trials 3

(The torch venv needs rlx_mpi and its deps: ``pip install numpy h5py numba mpi4py
threadpoolctl`` and ``pip install --no-deps -e .``; no MPI library is needed, nothing here
uses MPI.)

It builds a ``LlamaForCausalLM`` with the shape of our ``small`` preset (8 layers, hidden 512,
8 heads / 4 kv heads, vocab 4096; untied head), fills it like ``rlx_mpi.families.llama (init_random)`` does
(linear weights N(0, 1/fan_in), embedding N(0, 1), norms 1 + 0.1 N(0, 1), so logits are O(1)
and the difference below means something), ``save_pretrained``s it to --hf-dir, converts it
with ``rlx_mpi.families.convert_hf`` and builds our ``LlamaStage`` over all layers.

Then, for each thread count and shape (batch x seq; --seqs alone means batch 1; the same
random ids for both), it times transformers (float32, eager attention, ``use_cache=False``,
``torch.inference_mode``, ``torch.set_num_threads(t)``) and ours (threadpoolctl limited to t
BLAS threads, and our numba kernels to t threads), interleaved, best of --trials after a warm-up, and prints
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


def build_hf(hf_dir: Path, preset: str, seed: int, vocab: int | None = None, dims: dict | None = None):
    """A transformers Llama of ``preset``'s shape (``vocab`` tokens if given) with O(1) random
    weights, saved to ``hf_dir``. ``dims`` (the preset's fields as a dict) spares importing
    rlx_mpi, whose kernels need numba, in a torch-only Python."""
    import torch
    import transformers
    from transformers import LlamaConfig, LlamaForCausalLM

    if dims is None:
        from dataclasses import asdict

        from rlx_mpi.families.llama import PRESETS

        dims = asdict(PRESETS[preset])
    keys = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "max_position_embeddings", "rms_norm_eps")
    kw = {k: dims[k] for k in keys}
    kw.update(tie_word_embeddings=False, attention_bias=False, mlp_bias=False)
    if vocab:
        kw["vocab_size"] = vocab
    rope_theta = dims["rope_theta"]
    if int(transformers.__version__.split(".")[0]) >= 5:
        kw["rope_parameters"] = {"rope_type": "default", "rope_theta": rope_theta}
    else:
        kw["rope_theta"] = rope_theta
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


def flat_gemm_patch():
    """Patch model.attention/mlp so every projection is one (B*T, C) @ W.T GEMM, as the Linear
    objects of issue 10 section 1 do (numpy runs (B, T, C) @ W.T as B GEMMs). Returns an undo."""
    from rlx_mpi import kernels
    from rlx_mpi.families.decoder import model

    saved = (model.attention, model.mlp)

    def attention(x, w, head_dim, cos, sin, reduce=model._identity):
        B, T, C = x.shape
        x2 = x.reshape(B * T, C)
        nh, nkv = w.q_proj.shape[0] // head_dim, w.k_proj.shape[0] // head_dim
        q = (x2 @ w.q_proj.T).reshape(B, T, nh, head_dim).transpose(0, 2, 1, 3)
        k = (x2 @ w.k_proj.T).reshape(B, T, nkv, head_dim).transpose(0, 2, 1, 3)
        v = (x2 @ w.v_proj.T).reshape(B, T, nkv, head_dim).transpose(0, 2, 1, 3)
        q, k = model.apply_rope(q, cos, sin), model.apply_rope(k, cos, sin)
        y = kernels.attend(q, k, v).reshape(B * T, nh * head_dim)
        return reduce((y @ w.o_proj.T).reshape(B, T, C))

    def mlp(x, w, reduce=model._identity):
        B, T, C = x.shape
        x2 = x.reshape(B * T, C)
        silu = kernels.silu_mul_(x2 @ w.gate_proj.T, x2 @ w.up_proj.T)
        return reduce((silu @ w.down_proj.T).reshape(B, T, C))

    model.attention, model.mlp = attention, mlp

    def undo():
        model.attention, model.mlp = saved
    return undo


def gemm_ms_hf(fn) -> tuple[float, float]:
    """(GEMM ms, whole ms) of one transformers forward, by torch.profiler's self CPU time."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    ops = {e.key: e.self_cpu_time_total / 1e3 for e in prof.key_averages()}
    return sum(ops.get(k, 0.0) for k in ("aten::mm", "aten::addmm")), sum(ops.values())


def gemm_ms_ours(fn) -> tuple[float, float]:
    """(GEMM ms, whole ms) of one of our forwards: time inside every Linear call (the projections
    and the head; attention's score GEMMs count as attention, as torch's bmm does above)."""
    from rlx_mpi.families.decoder import weights

    spent, call = [0.0], weights.Linear.__call__

    def timed(self, x):
        t0 = time.perf_counter()
        try:
            return call(self, x)
        finally:
            spent[0] += time.perf_counter() - t0

    weights.Linear.__call__ = timed
    try:
        t0 = time.perf_counter()
        fn()
        whole = time.perf_counter() - t0
    finally:
        weights.Linear.__call__ = call
    return spent[0] * 1e3, whole * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="small", help="shape of the model (default small)")
    ap.add_argument("--seqs", default="128,512", help="comma-separated sequence lengths (default 128,512)")
    ap.add_argument("--shapes", default=None,
                    help="comma-separated BATCHxSEQ shapes, e.g. 1x512,16x128,8x512 (overrides --seqs)")
    ap.add_argument("--threads", default="1,2", help="comma-separated thread counts (default 1,2)")
    ap.add_argument("--trials", type=int, default=5, help="timed forwards per variant, interleaved; best kept (default 5)")
    ap.add_argument("--hf-dir", default=None, help="where to save_pretrained the model (/tmp/rlx_bench_hf_PRESET)")
    ap.add_argument("--ckpt", default=None, help="where to write the converted checkpoint (/tmp/rlx_bench_hf_PRESET.h5)")
    ap.add_argument("--flat-gemm", action="store_true",
                    help="also time ours with every projection as one (B*T, C) GEMM (see flat_gemm_patch)")
    ap.add_argument("--gemm-share", action="store_true",
                    help="also profile one forward of each: time in the projection GEMMs (torch.profiler's "
                    "aten::mm for HF, our Linear calls for ours), their GF/s, and the floor that time sets: "
                    "our GEMM ms / HF's whole forward is the best ours/hf could be if nothing else took time")
    add_common_args(ap, quiet_wait_s=30.0)
    args = ap.parse_args()
    if args.shapes:
        shapes = [tuple(int(n) for n in s.split("x")) for s in args.shapes.split(",")]
    else:
        shapes = [(1, int(s)) for s in args.seqs.split(",")]
    threads = [int(t) for t in args.threads.split(",")]

    import torch
    import transformers  # noqa: F401 (version in the header)
    from threadpoolctl import threadpool_limits

    from rlx_mpi import kernels
    from rlx_mpi.model.checkpoint import H5ParamSource
    from rlx_mpi.families.decoder.stage import DecoderStage as LlamaStage
    from rlx_mpi.families import convert_hf

    transformers.utils.logging.disable_progress_bar()
    info = machine()
    hf_dir = Path(args.hf_dir or f"/tmp/rlx_bench_hf_{args.preset}")
    ckpt = Path(args.ckpt or f"/tmp/rlx_bench_hf_{args.preset}.h5")
    hf_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    model = build_hf(hf_dir, args.preset, seed=0)
    cfg = convert_hf(hf_dir, ckpt)
    with H5ParamSource(ckpt) as src:
        stage = LlamaStage(cfg, src, range(cfg.num_hidden_layers), True, True)
    C = cfg.hidden_size  # weights a token multiplies by in one layer (q, k, v, o, gate, up, down)
    layer_params = C * (cfg.q_dim + 2 * cfg.kv_dim) + cfg.q_dim * C + 3 * C * cfg.intermediate_size
    setup_s = time.perf_counter() - t0
    print(header(f"bench_hf: transformers vs rlx_mpi LlamaStage, one process, {args.preset}-preset shape",
                 info, f"model built, saved ({hf_dir}), converted ({ckpt}) and loaded in {setup_s:.1f} s; "
                 f"best of {args.trials} interleaved forwards after a warm-up; HF: eager attention, use_cache=False"))

    rng = np.random.default_rng(1234)
    rows, results, pending = [], [], []
    for t in threads:
        for batch, seq in shapes:
            ids = rng.integers(0, cfg.vocab_size, (batch, seq), dtype=np.int64)
            ids_t = torch.from_numpy(ids)

            def hf(t=t, ids_t=ids_t):  # (bound now: --gemm-share calls these after the loops)
                torch.set_num_threads(t)
                with torch.inference_mode():
                    return model(input_ids=ids_t, use_cache=False).logits

            def ours(t=t, ids=ids):
                getattr(kernels, "set_threads", lambda n: None)(t)  # (absent before blocked attention)
                with threadpool_limits(limits=t):
                    return stage.forward(ids)

            def ours_flat():
                undo = flat_gemm_patch()
                try:
                    return ours()
                finally:
                    undo()

            busy = wait_quiet(args.quiet, args.quiet_wait) if args.quiet_wait > 0 else None
            diff = float(np.abs(ours() - hf().numpy()).max())  # also the warm-up of both
            scale = float(np.abs(hf().numpy()).max())
            variants = [("hf", hf), ("ours", ours)] + ([("ours_flat", ours_flat)] if args.flat_gemm else [])
            flat_diff = float(np.abs(ours_flat() - hf().numpy()).max()) if args.flat_gemm else None
            times = {name: [] for name, _ in variants}
            for _ in range(args.trials):
                for name, fn in variants:
                    time.sleep(0.05)  # let the other library's spinning worker threads go idle
                    start = time.perf_counter()
                    fn()
                    times[name].append(time.perf_counter() - start)
            best = {k: min(v) * 1e3 for k, v in times.items()}
            med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
            results.append({"threads": t, "batch": batch, "seq": seq, "best_ms": best, "median_ms": med,
                            "ours_over_hf": best["ours"] / best["hf"], "max_abs_diff": diff, "max_abs_logit": scale,
                            "ours_flat_over_hf": best["ours_flat"] / best["hf"] if args.flat_gemm else None,
                            "flat_max_abs_diff": flat_diff,
                            "busy_before": busy})
            rows.append([str(t), f"{batch}x{seq}", f"{best['hf']:.1f}", f"{best['ours']:.1f}", f"{med['hf']:.1f}",
                         f"{med['ours']:.1f}", f"{best['ours'] / best['hf']:.2f}", f"{diff:.1e}", f"{scale:.1f}"]
                        + ([f"{best['ours_flat']:.1f}", f"{best['ours_flat'] / best['hf']:.2f}"] if args.flat_gemm else []))
            if args.gemm_share:  # profiled after every timing: torch.profiler was seen to slow later forwards
                pending.append((len(results) - 1, batch, seq, hf, ours))
            flat = f", flat/hf {best['ours_flat'] / best['hf']:.2f}" if args.flat_gemm else ""
            print(f"# threads {t}, shape {batch}x{seq}: ours/hf {best['ours'] / best['hf']:.2f}{flat} (best ms: "
                  + ", ".join(f"{k} {v:.0f}" for k, v in best.items())
                  + f"; CPU {'?' if busy is None else f'{100 * busy:.0f}%'} busy before it)", flush=True)
            save_json(args.json, {"bench": "hf", "machine": info, "preset": args.preset, "trials": args.trials,
                                  "partial": True, "results": results})  # a killed run keeps its cases
    for i, batch, seq, hf, ours in pending:
        best = results[i]["best_ms"]
        flops = 2 * batch * seq * (cfg.num_hidden_layers * layer_params + cfg.hidden_size * cfg.vocab_size)
        (hg, hw), (og, ow) = gemm_ms_hf(hf), gemm_ms_ours(ours)
        share = {"hf_gemm_ms": hg, "hf_whole_ms": hw, "ours_gemm_ms": og, "ours_whole_ms": ow,
                 "hf_gemm_gflops": flops / hg / 1e6, "ours_gemm_gflops": flops / og / 1e6,
                 "floor_ours_gemm_over_hf_best": og / best["hf"]}
        results[i]["gemm_share"] = share
        print(f"# threads {results[i]['threads']}, shape {batch}x{seq}, GEMMs: hf {hg:.0f} of {hw:.0f} ms "
              f"({share['hf_gemm_gflops']:.1f} GF/s), ours {og:.0f} of {ow:.0f} ms ({share['ours_gemm_gflops']:.1f} "
              f"GF/s); ours' GEMMs alone are {share['floor_ours_gemm_over_hf_best']:.2f} of HF's best forward", flush=True)
    print(fmt_table(["threads", "BxT", "hf_best_ms", "ours_best_ms", "hf_med_ms", "ours_med_ms", "ours/hf",
                     "max_abs_diff", "max_abs_logit"] + (["flat_best_ms", "flat/hf"] if args.flat_gemm else []), rows))
    print(f"# load average at the end: {loadavg()}")
    save_json(args.json, {"bench": "hf", "machine": info, "preset": args.preset, "trials": args.trials,
                          "model_config": json.loads(cfg.to_json()), "results": results})


if __name__ == "__main__":
    main()
