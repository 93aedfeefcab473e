"""A new group joining a decoding pipeline: the stall it causes, whole prompts against chunked prefill.

    python bench/bench_join.py [--preset medium | --checkpoint M.h5] [--chunks 0,32,64] [--trials 3]
                               [--prompts 16] [--prompt-len 128] [--new 32] [--batch 2] [--groups 4]
                               [--json bench/results/join.json]

Method. ``mpiexec -n 2 python -m rlx_mpi generate`` (2 stages of one core each) over ``--prompts``
prompts of ``--prompt-len`` tokens in ``--groups`` groups of ``--batch``: the groups start one step
apart, so when one finishes its prompts and takes new ones the others are still decoding, and
its prefill runs on the same stages. Each ``--prefill-chunk`` value is launched in turn, trials
interleaved, medians kept. From ``generate --json``: new tokens over the loop's wall time, and
the time between a row's consecutive tokens as stage 0 receives them (median, 99th percentile,
largest: a whole-prompt prefill shows as a largest gap of about its own duration). Issue 16 asks
for "no stall when a new group joins".
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from _cli import default_mpiexec, ensure_checkpoint
from _machine import add_common_args, fmt_table, header, machine, save_json, wait_quiet
from bench_generate import write_prompts


def run(mpiexec: str, job: Path, prompts: Path, folder: Path, chunk: int, args) -> dict:
    out, stats = folder / "out.jsonl", folder / "stats.json"
    for p in (out, stats):
        p.unlink(missing_ok=True)
    cmd = [mpiexec, "-n", "2", sys.executable, "-m", "rlx_mpi", "generate", str(job), "--prompts", str(prompts),
           "--out", str(out), "--json", str(stats), "--max-new-tokens", str(args.new), "--batch", str(args.batch),
           "--groups", str(args.groups), "--prefill-chunk", str(chunk)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
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
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--groups", type=int, default=4)
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--mpiexec", default=default_mpiexec())
    add_common_args(ap, quiet_wait_s=120)
    args = ap.parse_args()
    chunks = [int(c) for c in args.chunks.split(",")]
    info = machine()
    print(header("A group joining a 2-stage decode: whole prompts against chunked prefill", info))
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        ckpt = Path(args.checkpoint) if args.checkpoint else folder / f"{args.preset}.h5"
        if not args.checkpoint:
            ensure_checkpoint(ckpt, args.preset)
        from rlx_mpi.checkpoint import read_header
        from rlx_mpi.families import get_family

        family, text = read_header(ckpt)
        vocab = get_family(family).load_config(text, str(ckpt)).vocab_size
        prompts = write_prompts(folder / "p.jsonl", args.prompts, args.prompt_len, vocab)
        job = folder / "job.toml"
        job.write_text(f'[model]\ncheckpoint = "{ckpt}"\n[run]\ntimeout_s = 600.0\n[placement]\nreserve_ram_gb = 0.0\n')
        trials: dict[int, list[dict]] = {c: [] for c in chunks}
        for t in range(args.trials):
            for c in chunks:
                wait_quiet(args.quiet, args.quiet_wait)
                trials[c].append(run(args.mpiexec, job, prompts, folder, c, args))
            print(f"  trial {t + 1}/{args.trials} done", flush=True)
    keys = ["tokens_per_s", "gap_median_ms", "gap_p99_ms", "gap_max_ms", "prefill_steps"]
    med = {c: {k: statistics.median(r[k] for r in trials[c]) for k in keys} for c in chunks}
    rows = [[str(c) if c else "0 (whole)", f"{m['tokens_per_s']:.1f}", f"{m['gap_median_ms']:.0f}",
             f"{m['gap_p99_ms']:.0f}", f"{m['gap_max_ms']:.0f}", f"{m['prefill_steps']:.0f}"] for c, m in med.items()]
    print(f"2 stages x 1 thread, {args.prompts} prompts of {args.prompt_len} tokens, {args.new} new, "
          f"{args.groups} groups of {args.batch} (medians of {args.trials})")
    print(fmt_table(["prefill_chunk", "tokens/s", "gap median ms", "gap p99 ms", "gap max ms", "prefill steps"], rows))
    save_json(args.json, {"machine": info, "args": vars(args), "medians": {str(c): m for c, m in med.items()},
                          "trials": {str(c): r for c, r in trials.items()}})


if __name__ == "__main__":
    main()
