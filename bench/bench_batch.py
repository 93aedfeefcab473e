"""OpenAI batch files (#34) against our own prompt lines, ratios taken in one run.

    python bench/bench_batch.py [--preset medium] [--prompts 32] [--max-new-tokens 32] [--reps 3]
                                [--ranks 2] [--json bench/results/batch.json]

Method. Every figure is a real CLI launch (``mpiexec -n RANKS rlx-mpi generate ... --json``)
whose rate is new tokens over the job's own drive time (``wall_s``, start-up excluded);
``--ignore-eos`` makes every row the same length in both formats. Launches are interleaved,
``--reps`` rounds after one warm-up round, medians kept.

1. per-row settings: the same prompts (random word ids, 16-128 tokens) as our lines with the
   job's sampling (temperature 0.8, top-p 0.95, seed 1) against OpenAI ``/v1/completions``
   requests that each carry those settings, plus two stop strings that never match (so every
   step decodes each row's tail on stage 0). Goal >= 0.97: per-row sampling (a Python loop
   over the rows on the last stage) and stop strings are cheap next to a decode step.
2. n = 4: a quarter of the prompts as requests with ``n: 4`` against each of those prompts four
   times in our format (each sample is a row of its own: sharing the prefill is #33's). Goal
   >= 0.97.

A word-level tokenizer (token i is "w<i>") is written beside the random checkpoint, so the
OpenAI format has its tokenizer. Take the figures on a quiet host.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

SETTINGS = {"temperature": 0.8, "top_p": 0.95, "seed": 1}


def _tokenizer(ckpt: Path, vocab: int) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"<unk>": 0, **{f"w{i}": i for i in range(1, vocab)}}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(ckpt.with_name(f"{ckpt.stem}.tokenizer.json")))


def _files(folder: Path, n: int, vocab: int, seed: int, max_new: int) -> dict[str, Path]:
    import numpy as np

    rng = np.random.default_rng(seed)
    prompts = [rng.integers(1, vocab, int(rng.integers(16, 129))).tolist() for _ in range(n)]
    files = {k: folder / f"{k}.jsonl" for k in ("ours", "openai", "ours_x4", "openai_n4")}

    def request(i: int, p: list[int], **extra) -> str:
        return json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions",
                           "body": {"model": "bench", "prompt": p, "max_tokens": max_new, **SETTINGS, **extra}})

    files["ours"].write_text("".join(json.dumps({"id": f"p{i}", "tokens": p}) + "\n" for i, p in enumerate(prompts)))
    files["openai"].write_text("".join(request(i, p, stop=["w0 w0 w0", "<never>"]) + "\n"
                                       for i, p in enumerate(prompts)))
    quarter = prompts[:max(1, n // 4)]
    files["ours_x4"].write_text("".join(json.dumps({"id": f"p{i}.{j}", "tokens": p}) + "\n"
                                        for i, p in enumerate(quarter) for j in range(4)))
    files["openai_n4"].write_text("".join(request(i, p, n=4) + "\n" for i, p in enumerate(quarter)))
    return files


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="medium")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", metavar="OUT", default=str(HERE / "results" / "batch.json"))
    args = ap.parse_args()

    from _cli import default_mpiexec, ensure_checkpoint
    from _machine import header, loadavg, machine, save_json
    from rlx_mpi.families.llama import PRESETS

    info, mpiexec = machine(), default_mpiexec()
    rows: dict[str, list[float]] = {k: [] for k in ("ours", "openai", "ours_x4", "openai_n4")}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        ckpt = tmp / f"{args.preset}.h5"
        ensure_checkpoint(ckpt, args.preset)
        vocab = PRESETS[args.preset].vocab_size
        _tokenizer(ckpt, vocab)
        files = _files(tmp, args.prompts, vocab, args.seed, args.max_new_tokens)
        job = tmp / "job.toml"
        job.write_text(f'[model]\ncheckpoint = "{ckpt}"\npreset = "{args.preset}"\n[run]\ntimeout_s = 600.0\n'
                       'startup_timeout_s = 900.0\n[placement]\nreserve_ram_gb = 0.5\n')
        common = ["--max-new-tokens", str(args.max_new_tokens), "--batch", str(args.batch), "--ignore-eos",
                  "--temperature", str(SETTINGS["temperature"]), "--top-p", str(SETTINGS["top_p"]),
                  "--seed", str(SETTINGS["seed"])]

        def rate(kind: str) -> float:
            out, stats = tmp / f"{kind}.{time.monotonic_ns()}.jsonl", tmp / f"{kind}.{time.monotonic_ns()}.json"
            cmd = [mpiexec, "-n", str(args.ranks), sys.executable, "-m", "rlx_mpi", "generate", str(job),
                   "--prompts", str(files[kind]), "--out", str(out), "--json", str(stats), *common]
            p = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp, timeout=7200,
                               env={**os.environ, "OMP_NUM_THREADS": "1"})
            if p.returncode != 0:
                raise RuntimeError(f"`{' '.join(cmd)}` exited {p.returncode}:\n{p.stderr[-3000:]}")
            doc = json.loads(stats.read_text())
            return doc["new_tokens"] / doc["wall_s"]

        for rep in range(args.reps + 1):  # round 0 warms the caches (numba, page cache) and is not kept
            got = {k: rate(k) for k in rows}
            if rep:
                for k, v in got.items():
                    rows[k].append(v)
            print(f"round {rep}{'' if rep else ' (warm-up)'}: " + ", ".join(f"{k} {v:.1f}" for k, v in got.items())
                  + " tokens/s", flush=True)
    med = {k: statistics.median(v) for k, v in rows.items()}
    ratios = {"openai_over_ours": med["openai"] / med["ours"], "n4_over_4_lines": med["openai_n4"] / med["ours_x4"]}
    print(header("OpenAI batch requests vs our prompt lines, one run", info))
    print(f"preset {args.preset}, {args.ranks} ranks, {args.prompts} prompts (16-128 tokens), max_new_tokens "
          f"{args.max_new_tokens} (--ignore-eos), batch {args.batch}, {args.reps} rounds (medians)")
    for k, v in ratios.items():
        print(f"{k:20s} {v:6.3f}   (goal >= 0.97)")
    print(f"load average at the end {loadavg()}")
    save_json(args.json, {"machine": info, "args": vars(args), "tokens_per_s": rows, "medians": med, "ratios": ratios,
                          "loadavg_end": loadavg()})


if __name__ == "__main__":
    main()
