"""The price of row invariance (issue 36, docs/invariance.md): this checkout against the code before
it, in process, at bench_llamacpp.py's shapes (decode at batch 1, 8 prompts decoding together, a
prefill of 128 tokens), per precision and thread count. Each case is one `ab_decode.py` run
(alternating rounds, medians); the table is old / new time (< 1: invariance costs that much).

    git archive e304325 rlx_mpi | tar -x -C OLD && mv OLD/rlx_mpi OLD/rlx_mpi_old
    rlx-mpi init-model --preset medium M.h5
    python bench/bench_invariance.py M.h5 --old OLD [--precisions f32 bf16 int8 q4] [--threads 1 2]
        [--prefills 128 512]

(e304325: main before the invariance kernels.) --preset, --rounds and --steps pass through;
``--quick`` runs batch 1 only with 2 rounds (a smoke run on a tiny checkpoint: --preset tiny).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

CASES = (("decode, batch 1", ["--batch", "1"]), ("decode, 8 prompts", ["--batch", "8"]))


def _prefill(tokens: int) -> tuple[str, list[str]]:
    return f"prefill {tokens}", ["--prefill-only", "--prompt", str(tokens), "--steps", "4" if tokens <= 128 else "2"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("checkpoint")
    ap.add_argument("--old", required=True, help="directory holding the package rlx_mpi_old")
    ap.add_argument("--preset", default="medium")
    ap.add_argument("--precisions", nargs="+", default=["f32", "bf16", "int8", "q4"])
    ap.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--prefills", nargs="+", type=int, default=[128, 512],
                    help="prefill lengths (tokens) to time (default bench_llamacpp's pp128 and pp512)")
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    ab = Path(__file__).with_name("ab_decode.py")
    cases = CASES[:1] if args.quick else CASES + tuple(_prefill(t) for t in args.prefills)
    rounds = 2 if args.quick else args.rounds
    print(f"{'precision':9s} {'threads':7s} {'case':18s} {'old ms':>9s} {'new ms':>9s} {'old/new':>8s} {'max |dlogit|':>12s}")
    for precision in args.precisions:
        for threads in args.threads:
            for name, extra in cases:
                cmd = [sys.executable, str(ab), args.checkpoint, "--old", args.old, "--preset", args.preset,
                       "--precision", precision, "--threads", str(threads), "--rounds", str(rounds),
                       "--steps", str(args.steps), *extra]
                proc = subprocess.run(cmd, capture_output=True, text=True)
                if proc.returncode:
                    print(f"{precision:9s} {threads:<7d} {name:18s} failed: {proc.stderr.strip().splitlines()[-1:]}")
                    continue
                r = json.loads(proc.stdout.strip().splitlines()[-1])
                ms = r["ms_per_step"]
                print(f"{precision:9s} {threads:<7d} {name:18s} {ms['old']:9.2f} {ms['new']:9.2f} "
                      f"{r['ratio_old_over_new']:8.3f} {r['max_abs_logit_diff']:12.2e}", flush=True)


if __name__ == "__main__":
    main()
