"""Defaults that use the pipeline (issue #34): 8 prompts on 2 stages with the default batch 8.

    python bench/bench_default_split.py [--preset small] [--new 17] [--prompt-len 64] [--trials 3]
                                        [--json bench/results/default_split.json]

Before, ``mpiexec -n 2 rlx-mpi generate`` on 8 prompts with ``batch = 8`` filled one group of 8
and left the second stage's group empty: the two stages took turns (0.54x one rank with two
threads, where ``--batch 4`` gave 0.74x). Now the batch is cut so that every stage has a group
(`scheduler.split_batch`). Cases, all on the same seeded prompts, timed as bench_generate.py
does (decode tokens/s from the N-token and 1-token walls of ``--json``, medians of the trials):

  1 rank x 2 threads, batch 8                 the peer the issue names
  2 ranks, --batch 8 --groups 0 (the default)  split now: 2 groups of 4
  2 ranks, --batch 8 --groups 1                the old default's schedule: one group of 8
  2 ranks, --batch 4 --groups 2                the hand-tuned layout the issue measured

Expected on a quiet 2-core host: "default / 1 rank" near "batch 4 x 2 groups / 1 rank" (~0.74x)
and above "one group / 1 rank" (~0.54x). Rows are the same in every case (checked here too).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

from _cli import default_mpiexec, ensure_checkpoint
from _machine import add_common_args, loadavg, save_json, wait_quiet
from bench_generate import run_generate, write_prompts

CASES = [("1 rank x 2 threads, batch 8", 1, 8, 1),
         ("2 ranks, default (--batch 8 --groups 0)", 2, 8, 0),
         ("2 ranks, one group (--batch 8 --groups 1)", 2, 8, 1),
         ("2 ranks, --batch 4 --groups 2", 2, 4, 2)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--new", type=int, default=17, help="new tokens per prompt in the long run (default 17)")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--mpiexec", default=default_mpiexec())
    add_common_args(ap, 120.0)
    args = ap.parse_args()
    from rlx_mpi.families.llama import PRESETS

    cfg = PRESETS[args.preset]
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        ckpt = folder / f"{args.preset}.h5"
        ensure_checkpoint(ckpt, args.preset)
        job = folder / "job.toml"
        job.write_text(f'[model]\ncheckpoint = "{ckpt}"\n[run]\ntimeout_s = 600.0\n[placement]\nreserve_ram_gb = 0.0\n')
        prompts = write_prompts(folder / "p.jsonl", args.prompts, args.prompt_len, cfg.vocab_size)
        walls = {label: {1: [], args.new: []} for label, *_ in CASES}
        rows = {}
        for trial in range(args.trials):
            for label, ranks, batch, groups in CASES:
                for n in (1, args.new):
                    wait_quiet(args.quiet, args.quiet_wait)
                    out = folder / "out.jsonl"
                    walls[label][n].append(run_generate(ranks, job, prompts, out, folder / "stats.json", n, batch,
                                                        groups, args.mpiexec, []))
                    if n == args.new:
                        rows[label] = [{k: v for k, v in json.loads(ln).items() if k != "ms"}
                                       for ln in out.read_text().splitlines()]
            print(f"trial {trial + 1}/{args.trials} done (load {loadavg()})", file=sys.stderr, flush=True)
    same = all(r == rows[CASES[0][0]] for r in rows.values())
    tok_s = {}
    for label, *_ in CASES:
        w1, wn = statistics.median(walls[label][1]), statistics.median(walls[label][args.new])
        tok_s[label] = args.prompts * (args.new - 1) / max(wn - w1, 1e-9)
    peer = tok_s[CASES[0][0]]
    doc = {"preset": args.preset, "prompts": args.prompts, "new": args.new, "prompt_len": args.prompt_len,
           "walls": walls, "decode_tok_s": tok_s, "same_rows": same,
           "ratios": {f"{label} / {CASES[0][0]}, decode": tok_s[label] / peer for label, *_ in CASES[1:]}}
    for k, v in doc["ratios"].items():
        print(f"{v:5.2f}x  {k}")
    print(f"rows identical in every case: {same}")
    if args.json:
        save_json(args.json, doc)
    if not same:
        raise SystemExit("the rows differ between cases")


if __name__ == "__main__":
    main()
