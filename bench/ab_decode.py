"""In-process A/B of decode: this checkout's decoder against an older copy of the package.

    git archive REF rlx_mpi | tar -x -C OLD && mv OLD/rlx_mpi OLD/rlx_mpi_old
    rlx-mpi init-model --preset medium M.h5
    python bench/ab_decode.py M.h5 --old OLD --precision f32 --threads 1 [--batch 8]

Both stages are built in one process from the same checkpoint; each round times ``--steps``
decode steps of ``--batch`` sequences (default 1, after a 32-token prefill) on each side, alternating which goes
first, and the report is the median per-token time of each and their ratio (> 1: this checkout
is faster). With ``--prefill-only`` each round times ``--steps`` prefills of the ``--prompt``
tokens instead (ms per prefill). The logits of both are compared (the change must not alter results). Meant for
decisions on a loaded host: ratios, not figures.
"""

from __future__ import annotations

import argparse
import importlib
import json
import statistics
import sys
import time

import numpy as np


def build(pkg: str, path: str, preset: str, precision: str, threads: int, max_seq: int, batch: int):
    fam = importlib.import_module(f"{pkg}.families")
    stage_mod = importlib.import_module(f"{pkg}.families.decoder.stage")
    ck = importlib.import_module(f"{pkg}.checkpoint")
    kvm = importlib.import_module(f"{pkg}.kv_cache")
    kern = importlib.import_module(f"{pkg}.kernels")
    kern.set_threads(threads)
    if preset == "file":  # the checkpoint's own family and config
        family, config_json = ck.read_header(path)
        cfg = fam.get_family(family).load_config(config_json, path)
    else:
        cfg = fam.get_family("llama").presets[preset]
    with ck.H5ParamSource(path) as src:
        stage = stage_mod.DecoderStage(cfg, src, range(cfg.num_hidden_layers), True, True, precision=precision)
    stage.reset(batch, max_seq, kvm.KvSpec("full"))
    return stage, cfg


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("checkpoint")
    ap.add_argument("--old", required=True, help="directory holding the package rlx_mpi_old")
    ap.add_argument("--preset", default="medium", help="a llama preset of the checkpoint, or \"file\": its own config")
    ap.add_argument("--precision", default="f32")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--batch", type=int, default=1, help="sequences decoded together (default 1)")
    ap.add_argument("--prefill-only", action="store_true", help="time prefills of --prompt tokens, not decode steps")
    args = ap.parse_args()
    from threadpoolctl import threadpool_limits

    threadpool_limits(args.threads)
    sys.path.insert(0, args.old)
    stages = {}
    for name, pkg in (("old", "rlx_mpi_old"), ("new", "rlx_mpi")):
        stages[name], cfg = build(pkg, args.checkpoint, args.preset, args.precision, args.threads,
                                  args.prompt + args.steps + 1, args.batch)
    b = args.batch
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, (b, args.prompt))
    slots, lengths = np.arange(b), np.full(b, args.prompt)
    first = {n: s.prefill(ids, slots, lengths) for n, s in stages.items()}
    tokens = np.random.default_rng(1).integers(0, cfg.vocab_size, (args.steps, b, 1))

    def run(s):
        out = []
        for i, t in enumerate(tokens):
            out.append(s.prefill(ids, slots, lengths) if args.prefill_only else
                       s.decode(t, slots, np.full(b, args.prompt + i)))
        return out

    logits = {n: run(s) for n, s in stages.items()}  # warm, and the results to compare
    diff = max(float(np.abs(a - b).max()) for a, b in zip(logits["old"], logits["new"]))
    diff = max(diff, float(np.abs(first["old"] - first["new"]).max()))
    times = {"old": [], "new": []}
    for r in range(args.rounds):
        for n in (("old", "new") if r % 2 == 0 else ("new", "old")):
            t0 = time.perf_counter()
            run(stages[n])
            times[n].append((time.perf_counter() - t0) / args.steps * 1e3)
    med = {n: statistics.median(v) for n, v in times.items()}
    print(json.dumps({"prefill_only": args.prefill_only, "prompt": args.prompt, "precision": args.precision, "threads": args.threads, "batch": b, "ms_per_step": med,
                      "ratio_old_over_new": med["old"] / med["new"], "max_abs_logit_diff": diff,
                      "rounds": times}))


if __name__ == "__main__":
    main()
