"""Resident low-precision weights: decode and prefill speed, peak RSS, and the kernels' paths.

    python bench/bench_precision.py [--threads 1,2] [--trials 5] [--torch-python PY] [--json OUT]

Four parts, all ratios taken in this run:

1. **forward** (medium preset, one process, BLAS and numba pinned to t threads): one
   ``LlamaStage`` per precision (f32, bf16, f16, int8), built from the same f32 checkpoint, timed
   interleaved on decode-like inputs (batch 1 and 8 of one token: every projection sees 1 or 8
   rows, the fused dequantise-matvec path, and every weight is read once per forward) and on a
   prefill (batch 1 x seq 128: the tiled dequantise + BLAS path). tokens/s per precision over our
   f32's. With ``--torch-python`` (or ``RLX_TORCH_PYTHON``) a venv with torch and transformers
   times ``LlamaForCausalLM`` (f32, eager, ``use_cache=False``, same shape, same threads) in a
   subprocess, so our f32 is also shown against transformers f32.
2. **rss**: a fresh subprocess per precision builds the whole medium model from the f32
   checkpoint (and, for bf16, also from a bf16 checkpoint) and does one decode forward;
   its ``ru_maxrss`` over the f32 process's.
3. **kernel paths**: for 1..32 activation rows, the fused matvec kernel vs the tiled path, on a
   set of 2816 x 1024 matrices larger than the caches (so the crossover ``kernels.matvec_rows`` is
   measured, not guessed), and at 64 rows the tiled path vs a plain numba dequantising GEMM.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from _machine import add_common_args, fmt_table, header, machine, save_json, wait_quiet

PRECISIONS = ("f32", "bf16", "f16", "int8")
CKPT = Path("/tmp/rlx_bench_medium.h5")
CKPT_BF16 = Path("/tmp/rlx_bench_medium_bf16.h5")


def pin(threads: int) -> None:
    import numba
    from threadpoolctl import threadpool_limits

    threadpool_limits(threads)
    numba.set_num_threads(threads)


def build(precision: str, ckpt: Path):
    from rlx_mpi.model.checkpoint import H5ParamSource
    from rlx_mpi.families.llama import PRESETS
    from rlx_mpi.families.decoder.stage import DecoderStage as LlamaStage
    from rlx_mpi.families.decoder.arch import expected_shapes

    cfg = PRESETS["medium"]
    with H5ParamSource(ckpt, expected_shapes(cfg)) as src:
        return LlamaStage(cfg, src, range(cfg.num_hidden_layers), True, True, precision=precision)


CASES = {"decode b1": (1, 1), "decode b8": (8, 1), "prefill 1x128": (1, 128)}


def time_forward(stage, ids, reps: int = 1) -> float:
    t0 = time.perf_counter()
    for _ in range(reps):
        stage.forward(ids)
    return (time.perf_counter() - t0) / reps


def bench_forward(threads: int, trials: int, args) -> dict:
    pin(threads)
    stages = {p: build(p, CKPT) for p in PRECISIONS}
    rng = np.random.default_rng(0)
    out = {}
    for case, (B, T) in CASES.items():
        wait_quiet(args.quiet, args.quiet_wait)
        ids = rng.integers(0, 16384, (B, T))
        reps = 4 if T == 1 else 1
        times = {p: [] for p in PRECISIONS}
        for p in PRECISIONS:
            time_forward(stages[p], ids)  # warm
        for _ in range(trials):  # interleaved: a burst of load hits every precision alike
            for p in PRECISIONS:
                times[p].append(time_forward(stages[p], ids, reps))
        best = {p: min(v) for p, v in times.items()}
        out[case] = {"tokens": B * T, "best_s": best, "median_s": {p: statistics.median(v) for p, v in times.items()},
                     "speedup_vs_f32": {p: best["f32"] / best[p] for p in PRECISIONS}}
    return out


_HF_CHILD = r"""
import json, sys, time, torch
from transformers import LlamaConfig, LlamaForCausalLM
cfg, threads, trials, cases = json.loads(sys.argv[1])
torch.set_num_threads(threads)
kw = dict(vocab_size=cfg["vocab_size"], hidden_size=cfg["hidden_size"], intermediate_size=cfg["intermediate_size"],
          num_hidden_layers=cfg["num_hidden_layers"], num_attention_heads=cfg["num_attention_heads"],
          num_key_value_heads=cfg["num_key_value_heads"], max_position_embeddings=cfg["max_position_embeddings"],
          tie_word_embeddings=False)
model = LlamaForCausalLM._from_config(LlamaConfig(**kw), attn_implementation="eager", dtype=torch.float32).eval()
out = {}
with torch.inference_mode():
    for case, (B, T) in cases.items():
        ids = torch.randint(0, cfg["vocab_size"], (B, T))
        reps = 4 if T == 1 else 1
        model(ids, use_cache=False)
        ts = []
        for _ in range(trials):
            t0 = time.perf_counter()
            for _ in range(reps):
                model(ids, use_cache=False)
            ts.append((time.perf_counter() - t0) / reps)
        out[case] = min(ts)
print(json.dumps({"torch": torch.__version__, "best_s": out}))
"""


def bench_hf(python: str, threads: int, trials: int) -> dict:
    from dataclasses import asdict

    from rlx_mpi.families.llama import PRESETS

    arg = json.dumps([asdict(PRESETS["medium"]), threads, trials, CASES])
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    proc = subprocess.run([python, "-c", _HF_CHILD, arg], capture_output=True, text=True, timeout=1800, env=env)
    if proc.returncode:
        raise RuntimeError(f"transformers child failed:\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _vm_hwm() -> int:
    """Peak RSS of this process image. Not ru_maxrss: Linux carries that over fork + exec, so a
    child of this (2 GB) bench would report the parent's peak."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def rss_child(precision: str, ckpt: str) -> None:
    pin(1)
    stage = build(precision, Path(ckpt))
    stage.forward(np.zeros((1, 1), np.int64))
    print(json.dumps({"peak_rss": _vm_hwm(), "weight_bytes": stage.weight_bytes}))


def bench_rss() -> dict:
    out = {}
    for label, precision, ckpt in [("f32", "f32", CKPT), ("bf16", "bf16", CKPT), ("bf16 (bf16 file)", "bf16", CKPT_BF16),
                                   ("f16", "f16", CKPT), ("int8", "int8", CKPT)]:
        proc = subprocess.run([sys.executable, __file__, "--rss-child", precision, str(ckpt)], capture_output=True,
                              text=True, timeout=900)
        if proc.returncode:
            raise RuntimeError(proc.stderr[-2000:])
        out[label] = json.loads(proc.stdout.strip().splitlines()[-1])
    base = out["f32"]["peak_rss"]
    for v in out.values():
        v["rss_vs_f32"] = v["peak_rss"] / base
    return out


def bench_paths(threads: int) -> dict:
    """Fused matvec vs tiled dequantise + BLAS by rows; tiled vs a naive numba GEMM at 64 rows."""
    import numba

    from rlx_mpi import kernels

    pin(threads)
    rng = np.random.default_rng(0)
    N, K, M = 2816, 1024, 24  # 24 x 5.8 MB of bf16: past the last-level cache
    mats = [kernels.to_bf16(rng.standard_normal((N, K), dtype=np.float32)) for _ in range(M)]

    def run(fn, x):
        ts = []
        for _ in range(3):
            t0 = time.perf_counter()
            for w in mats:
                fn(x, w)
            ts.append(time.perf_counter() - t0)
        return min(ts) / M

    def fused(x, w):
        out = np.empty((x.shape[0], N), np.float32)
        kernels._matvec_float(x, w, out, min(N, 4 * numba.get_num_threads()))

    def tiled(x, w):
        kernels.dequant_matmul(x, w, "bf16", fused=False)

    @numba.njit(parallel=True, fastmath={"reassoc", "contract"})
    def numba_gemm(x, w, out):
        for n in numba.prange(w.shape[0]):
            wv = (w[n].astype(np.uint32) << np.uint32(16)).view(np.float32)
            for r in range(x.shape[0]):
                acc = np.float32(0.0)
                for k in range(x.shape[1]):
                    acc += x[r, k] * wv[k]
                out[r, n] = acc

    rows = {}
    for R in (1, 2, 4, 8, 16, 32):
        x = rng.standard_normal((R, K), dtype=np.float32)
        f, t = run(fused, x), run(tiled, x)
        rows[R] = {"fused_ms": f * 1e3, "tiled_ms": t * 1e3, "tiled_over_fused": t / f}
    x = rng.standard_normal((64, K), dtype=np.float32)
    numba_gemm(x, mats[0], np.empty((64, N), np.float32))
    g = run(lambda x, w: numba_gemm(x, w, np.empty((64, N), np.float32)), x)
    t = run(tiled, x)
    return {"rows": rows, "gemm64": {"tiled_ms": t * 1e3, "numba_gemm_ms": g * 1e3, "numba_over_tiled": g / t}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", default="1,2", help="comma-separated thread counts (default 1,2)")
    ap.add_argument("--trials", type=int, default=5, help="interleaved timed forwards per precision (default 5)")
    ap.add_argument("--torch-python", default=os.environ.get("RLX_TORCH_PYTHON"),
                    help="python of a venv with torch + transformers (default $RLX_TORCH_PYTHON; none: skip)")
    ap.add_argument("--skip", default="", help="comma list of parts to skip: forward, rss, paths")
    ap.add_argument("--rss-child", nargs=2, metavar=("PRECISION", "CKPT"), help=argparse.SUPPRESS)
    add_common_args(ap, quiet_wait_s=20.0)
    args = ap.parse_args()
    if args.rss_child:
        return rss_child(*args.rss_child)
    skip = set(filter(None, args.skip.split(",")))
    info = machine()
    print(header("bench_precision: resident bf16 / f16 / int8 weights vs f32 (medium preset)", info))
    from rlx_mpi.families.llama import PRESETS
    from rlx_mpi.families.llama import FAMILY as _LLAMA
    init_random = _LLAMA.init_random

    for path, dtype in ((CKPT, "float32"), (CKPT_BF16, "bfloat16")):
        if not path.exists():
            init_random(path, PRESETS["medium"], seed=0, dtype=dtype)
    doc = {"machine": info, "forward": {}, "hf": {}, "rss": None, "paths": {}}
    threads = [int(t) for t in args.threads.split(",")]
    if "forward" not in skip:
        for t in threads:
            doc["forward"][t] = bench_forward(t, args.trials, args)
            if args.torch_python:
                doc["hf"][t] = bench_hf(args.torch_python, t, args.trials)
            rows = []
            for case, r in doc["forward"][t].items():
                tok = r["tokens"]
                hf = doc["hf"].get(t, {}).get("best_s", {}).get(case)
                rows.append([case, f"{tok / r['best_s']['f32']:.1f}"]
                            + [f"{r['speedup_vs_f32'][p]:.2f}x" for p in PRECISIONS[1:]]
                            + ([f"{hf / r['best_s']['f32']:.2f}x", f"{hf / r['best_s']['bf16']:.2f}x"] if hf else []))
            head = ["case", "f32 tok/s"] + [f"{p}/f32" for p in PRECISIONS[1:]]
            head += ["f32 vs HF f32", "bf16 vs HF f32"] if t in doc["hf"] else []
            print(f"\n## forward, {t} thread(s): tokens/s over our f32's (> 1: faster), best of {args.trials}")
            print(fmt_table(head, rows))
    if "rss" not in skip:
        doc["rss"] = bench_rss()
        print("\n## peak RSS of a fresh process that builds the whole model and does one decode forward")
        print(fmt_table(["precision", "peak_rss_MB", "weights_MB", "rss/f32"],
                        [[k, f"{v['peak_rss'] / 1e6:.0f}", f"{v['weight_bytes'] / 1e6:.0f}", f"{v['rss_vs_f32']:.2f}"]
                         for k, v in doc["rss"].items()]))
    if "paths" not in skip:
        for t in threads:
            doc["paths"][t] = p = bench_paths(t)
            print(f"\n## bf16 kernel paths, {t} thread(s), 2816 x 1024 matrices past the cache: tiled / fused time")
            print(fmt_table(["rows", "fused_ms", "tiled_ms", "tiled/fused"],
                            [[str(R), f"{v['fused_ms']:.3f}", f"{v['tiled_ms']:.3f}", f"{v['tiled_over_fused']:.2f}"]
                             for R, v in p["rows"].items()]))
            g = p["gemm64"]
            print(f"64 rows: tiled {g['tiled_ms']:.3f} ms, numba GEMM {g['numba_gemm_ms']:.3f} ms "
                  f"({g['numba_over_tiled']:.1f}x the tiled time)")
    save_json(args.json, doc)


if __name__ == "__main__":
    main()
