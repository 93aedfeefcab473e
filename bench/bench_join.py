"""A new group joining a decoding pipeline: the stall it causes, whole prompts against chunked prefill.

    python bench/bench_join.py [--preset medium | --checkpoint M.h5] [--chunks 0,32,64] [--trials 3]
                               [--prompts 16] [--prompt-len 128 | LO:HI] [--new 32] [--batch 2] [--groups 4]
                               [--old DIR] [--json bench/results/join.json]

Method. ``mpiexec -n 2 python -m rlx_mpi generate`` (2 stages of one core each) over ``--prompts``
prompts of ``--prompt-len`` tokens in ``--groups`` groups of ``--batch``: the groups start one step
apart, so when one finishes its prompts and takes new ones the others are still decoding, and
its prefill runs on the same stages. Each ``--prefill-chunk`` value is launched in turn, trials
interleaved, medians kept. From ``generate --json``: new tokens over the loop's wall time, and
the time between a row's consecutive tokens as stage 0 receives them (median, 99th percentile,
largest: a whole-prompt prefill shows as a largest gap of about its own duration). Issue 16 asks
for "no stall when a new group joins". ``--prompt-len LO:HI`` draws each prompt's length
(seeded): rows of a group then end at different steps and new rows join decoding ones (MIXED
steps). ``--eos-frac F`` makes that fraction of the vocabulary end-of-sequence ids (a
``generation_config.json`` beside a link to the checkpoint): rows of a random model then end
after a geometric number of tokens, as real rows end at their EOS, and new prompts join rows
still decoding. ``--old DIR`` also runs every chunk value with the rlx_mpi package found in DIR (e.g.
``git archive OLD rlx_mpi | tar -x -C DIR``), interleaved, for an A/B in one run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from _cli import default_mpiexec, ensure_checkpoint
from _machine import add_common_args, fmt_table, header, machine, save_json, wait_quiet
from bench_generate import write_prompts


def run(mpiexec: str, job: Path, prompts: Path, folder: Path, chunk: int, args, pythonpath: str | None = None) -> dict:
    out, stats = folder / "out.jsonl", folder / "stats.json"
    for p in (out, stats):
        p.unlink(missing_ok=True)
    cmd = [mpiexec, "-n", str(args.ranks), sys.executable, "-m", "rlx_mpi", "generate", str(job), "--prompts", str(prompts),
           "--out", str(out), "--json", str(stats), "--max-new-tokens", str(args.new), "--batch", str(args.batch),
           "--groups", str(args.groups), "--prefill-chunk", str(chunk)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [pythonpath, os.environ.get("PYTHONPATH")])))
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, env=env, cwd=folder)  # (not the repo: -m puts the cwd first)
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
    doc = json.loads(stats.read_text())
    return {"tokens_per_s": doc["new_tokens"] / doc["wall_s"], "prefill_steps": doc["prefill_steps"],
            **{f"gap_{k}_ms": v for k, v in doc["token_gap_ms"].items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="medium", help="llama preset of a random checkpoint made once (default medium)")
    ap.add_argument("--checkpoint", help="an existing checkpoint instead of the preset's")
    ap.add_argument("--chunks", default="0,32,64", help="--prefill-chunk values to compare (0: whole prompts)")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--prompt-len", default="128", help="tokens per prompt, or LO:HI for lengths drawn in [LO, HI]")
    ap.add_argument("--eos-frac", type=float, default=0.0, help="fraction of the vocab that ends a row (0: none)")
    ap.add_argument("--old", help="a folder holding an older rlx_mpi package, run beside the current one (A/B)")
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--ranks", type=int, default=2, help="ranks (= stages, one thread each unless 1: then all cores)")
    ap.add_argument("--groups", type=int, default=4)
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--mpiexec", default=default_mpiexec())
    add_common_args(ap, quiet_wait_s=120)
    args = ap.parse_args()
    chunks = [int(c) for c in args.chunks.split(",")]
    lo, _, hi = args.prompt_len.partition(":")
    lo, hi = int(lo), int(hi or lo)
    variants = [(str(c) if c else "0 (whole)", c, None) for c in chunks]
    if args.old:
        variants += [(f"{label}, old", c, str(Path(args.old).resolve())) for label, c, _ in variants if c]  # (0: one path)
    info = machine()
    print(header("A group joining a 2-stage decode: whole prompts against chunked prefill", info))
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        ckpt = Path(args.checkpoint) if args.checkpoint else folder / f"{args.preset}.h5"
        if not args.checkpoint:
            ensure_checkpoint(ckpt, args.preset)
        from rlx_mpi.model.checkpoint import read_header
        from rlx_mpi.families import get_family

        family, text = read_header(ckpt)
        vocab = get_family(family).load_config(text, str(ckpt)).vocab_size
        if args.eos_frac > 0:  # a link to the checkpoint with its own generation_config.json
            link = folder / "eos" / ckpt.name
            link.parent.mkdir()
            link.symlink_to(ckpt.resolve())
            eos = np.random.default_rng(2).choice(vocab, max(1, int(args.eos_frac * vocab)), replace=False)
            (link.parent / "generation_config.json").write_text(json.dumps({"eos_token_id": sorted(map(int, eos))}))
            ckpt = link
        prompts = write_prompts(folder / "p.jsonl", args.prompts, hi, vocab)
        if lo < hi:  # each prompt cut to its own length
            rng = np.random.default_rng(1)
            rows = [json.loads(line) for line in prompts.read_text().splitlines()]
            prompts.write_text("".join(json.dumps({**r, "tokens": r["tokens"][:int(rng.integers(lo, hi + 1))]}) + "\n"
                                       for r in rows))
        job = folder / "job.toml"
        job.write_text(f'[model]\ncheckpoint = "{ckpt}"\n[run]\ntimeout_s = 600.0\n[placement]\nreserve_ram_gb = 0.0\n')
        trials: dict[str, list[dict]] = {label: [] for label, _, _ in variants}
        for t in range(args.trials):
            for label, c, path in variants:
                wait_quiet(args.quiet, args.quiet_wait)
                trials[label].append(run(args.mpiexec, job, prompts, folder, c, args, path))
            print(f"  trial {t + 1}/{args.trials} done", flush=True)
    keys = ["tokens_per_s", "gap_median_ms", "gap_p99_ms", "gap_max_ms", "prefill_steps"]
    med = {label: {k: statistics.median(r[k] for r in trials[label]) for k in keys} for label in trials}
    rows = [[label, f"{m['tokens_per_s']:.1f}", f"{m['gap_median_ms']:.0f}",
             f"{m['gap_p99_ms']:.0f}", f"{m['gap_max_ms']:.0f}", f"{m['prefill_steps']:.0f}"] for label, m in med.items()]
    print(f"{args.ranks} rank(s), {args.prompts} prompts of {args.prompt_len} tokens, {args.new} new, "
          f"{args.groups} groups of {args.batch} (medians of {args.trials})")
    print(fmt_table(["prefill_chunk", "tokens/s", "gap median ms", "gap p99 ms", "gap max ms", "prefill steps"], rows))
    save_json(args.json, {"machine": info, "args": vars(args), "medians": med, "trials": trials})


if __name__ == "__main__":
    main()
