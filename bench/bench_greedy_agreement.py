"""Greedy tokens at bf16 / f16 / int8 resident weights vs f32, over a set of prompts.

    python bench/bench_greedy_agreement.py [--preset small] [--prompts 32] [--new 32] [--json OUT]

Runs ``rlx-mpi generate`` (one rank, greedy, full KV cache) on the same random checkpoint and
prompts once per ``[run] precision`` and reports, against f32: the share of prompts whose new
tokens are identical, the mean length of the common prefix of new tokens (as a share of
``--new``), and the share of all new-token positions that agree. A random-weights model has
flat logits, so greedy choices are more fragile here than on a trained model: read these as
a lower bound on the agreement.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from _cli import default_mpiexec, ensure_checkpoint
from _machine import machine

PRECISIONS = ("f32", "bf16", "f16", "int8")


def generate(mpiexec: str, folder: Path, ckpt: Path, prompts: Path, precision: str, new: int) -> dict[str, list[int]]:
    job = folder / f"{precision}.toml"
    job.write_text(f'[model]\ncheckpoint = "{ckpt}"\n\n[run]\nprecision = "{precision}"\nkv_cache = "full"\n'
                   f'timeout_s = 600.0\n\n[placement]\nreserve_ram_gb = 0.0\n')
    out = folder / f"{precision}.jsonl"
    cmd = [mpiexec, "-n", "1", sys.executable, "-m", "rlx_mpi", "generate", str(job), "--prompts", str(prompts),
           "--out", str(out), "--max-new-tokens", str(new)]  # no tokenizer: no end-of-sequence id
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if p.returncode != 0:
        sys.exit(f"bench_greedy_agreement: {precision} failed ({p.returncode}):\n{p.stderr[-2000:]}")
    return {row["id"]: row["tokens"] for row in map(json.loads, out.read_text().splitlines())}


def agreement(ref: dict[str, list[int]], got: dict[str, list[int]], new: int) -> dict:
    same, prefix, positions = 0, [], []
    for pid, want in ref.items():
        have = got[pid]
        same += have == want
        k = next((i for i, (a, b) in enumerate(zip(want, have)) if a != b), min(len(want), len(have)))
        prefix.append(k / new)
        positions.append(np.mean([a == b for a, b in zip(want, have)]))
    return {"identical": same / len(ref), "common_prefix": float(np.mean(prefix)),
            "positions_equal": float(np.mean(positions))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    mpiexec = default_mpiexec()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        ckpt = folder / f"{args.preset}.h5"
        ensure_checkpoint(ckpt, args.preset)
        from rlx_mpi.families.llama import PRESETS

        vocab = PRESETS[args.preset].vocab_size
        rng = np.random.default_rng(args.seed)
        prompts = folder / "prompts.jsonl"
        prompts.write_text("".join(json.dumps({"id": f"p{i}", "tokens": rng.integers(0, vocab, rng.integers(4, 33)).tolist()})
                                   + "\n" for i in range(args.prompts)))
        tokens = {p: generate(mpiexec, folder, ckpt, prompts, p, args.new) for p in PRECISIONS}
    rows = {p: agreement(tokens["f32"], tokens[p], args.new) for p in PRECISIONS[1:]}
    print(f"# greedy agreement with f32, {args.preset} preset, {args.prompts} prompts x {args.new} new tokens")
    print(f"{'precision':>9}  {'identical':>9}  {'common_prefix':>13}  {'positions_equal':>15}")
    for p, r in rows.items():
        print(f"{p:>9}  {r['identical']:9.2f}  {r['common_prefix']:13.2f}  {r['positions_equal']:15.2f}")
    if args.json:
        args.json.write_text(json.dumps({"bench": "greedy_agreement", "machine": machine(), "preset": args.preset,
                                         "prompts": args.prompts, "new": args.new, "results": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
