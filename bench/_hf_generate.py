"""The transformers side of bench_generate.py; run with the torch venv's Python.

    PY bench/_hf_generate.py build --preset small --hf-dir DIR [--vocab V] [--dims JSON]
    PY bench/_hf_generate.py time --hf-dir DIR --threads 2 --prompt-len 64 --new 17 --batches 1,8 --trials 3

``build`` saves a random ``LlamaForCausalLM`` of the preset's shape (bench_hf.build_hf). ``time``
prints JSON: for each batch, the wall seconds of ``generate(do_sample=False, use_cache=True)``
with ``max_new_tokens`` = --new and = 1 (min_new_tokens the same, no end-of-sequence), eager
attention, float32, ``torch.set_num_threads``, the same seeded prompts as ours; each trial
interleaves the two lengths; the medians are reported.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_hf
sys.path.insert(1, str(Path(__file__).resolve().parent.parent))  # this checkout's rlx_mpi (presets)


def prompts(batch: int, length: int, vocab: int, seed: int = 0) -> np.ndarray:
    """The prompt ids bench_generate.py writes too (same seed, same draw)."""
    return np.random.default_rng(seed).integers(0, vocab, (8, length))[:batch]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=["build", "time"])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--hf-dir", required=True)
    ap.add_argument("--vocab", type=int, help="build: vocabulary size (default: the preset's)")
    ap.add_argument("--dims", help="build: the preset's fields as JSON (then rlx_mpi, which needs numba, is not imported)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new", type=int, default=17)
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--trials", type=int, default=3)
    args = ap.parse_args()
    if args.what == "build":
        from bench_hf import build_hf

        build_hf(Path(args.hf_dir), args.preset, seed=0, vocab=args.vocab,
                 dims=json.loads(args.dims) if args.dims else None)
        return
    import torch
    from transformers import LlamaForCausalLM

    torch.set_num_threads(args.threads)
    model = LlamaForCausalLM.from_pretrained(args.hf_dir, attn_implementation="eager", dtype=torch.float32).eval()
    out = {"threads": args.threads, "torch": torch.__version__, "batches": {}}
    for b in (int(x) for x in args.batches.split(",")):
        ids = torch.from_numpy(prompts(b, args.prompt_len, model.config.vocab_size))
        mask = torch.ones_like(ids)

        def run(n: int) -> float:
            t0 = time.perf_counter()
            with torch.inference_mode():
                model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=n, min_new_tokens=n,
                               use_cache=True, pad_token_id=0, eos_token_id=None)
            return time.perf_counter() - t0

        run(2)  # warm-up
        walls = {1: [], args.new: []}
        for _ in range(args.trials):
            for n in walls:
                walls[n].append(run(n))
        out["batches"][b] = {"wall_1": statistics.median(walls[1]), "wall_n": statistics.median(walls[args.new])}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
