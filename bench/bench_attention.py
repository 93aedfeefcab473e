"""Attention alone (kernels/attention.py, the block note): this checkout's prefill (`attend`) and
decode (`attend_cache`) against an older copy of the package, in one process, alternating rounds,
the minimum of each; per thread count a fresh process.

    git archive REF rlx_mpi | tar -x -C OLD && mv OLD/rlx_mpi OLD/rlx_mpi_old
    python bench/bench_attention.py --old OLD [--tokens 128 512] [--threads 1 2] [--rounds 9]

Shapes: the medium preset's heads (16 query heads over 8 kv heads of 64), one prompt of --tokens
(prefill: causal over itself; decode: one query per head over a cache of --tokens keys, batch 1
and 8). A whole forward is num_hidden_layers (16 for medium) times a call. Prints each call's
time (ms) and old / new (> 1: this checkout is faster) and the largest difference of the outputs.
--quick: 2 rounds at 32 tokens (a smoke run).
"""

from __future__ import annotations

import argparse
import importlib
import os
import subprocess
import sys
import time

import numpy as np

NH, NKV, HS = 16, 8, 64  # the medium preset's attention (rlx_mpi/families/llama.py)


def cases(tokens: list[int]):
    rng = np.random.default_rng(0)
    for t in tokens:
        q = rng.standard_normal((1, NH, t, HS)).astype(np.float32)
        k = rng.standard_normal((1, NKV, t, HS)).astype(np.float32)
        v = rng.standard_normal((1, NKV, t, HS)).astype(np.float32)
        yield f"prefill {t}", (lambda kern, q=q, k=k, v=v: kern.attend(q, k, v))
        for b in (1, 8):
            qd = rng.standard_normal((b, NH, 1, HS)).astype(np.float32)
            ck = rng.standard_normal((b, NKV, t, HS)).astype(np.float32)
            cv = rng.standard_normal((b, NKV, t, HS)).astype(np.float32)
            pos = np.full(b, t - 1)
            yield f"decode {t} x{b}", (lambda kern, qd=qd, ck=ck, cv=cv, pos=pos, b=b:
                                       kern.attend_cache(qd, ck, cv, np.arange(b), pos))


def run_one(args) -> None:
    from threadpoolctl import threadpool_limits

    threads = args.threads[0]
    threadpool_limits(threads)
    sys.path.insert(0, args.old)
    kerns = {name: importlib.import_module(f"{pkg}.kernels") for name, pkg in (("old", "rlx_mpi_old"),
                                                                             ("new", "rlx_mpi"))}
    for kern in kerns.values():
        kern.set_threads(threads)
    for name, fn in cases(args.tokens):
        outs = {n: fn(k) for n, k in kerns.items()}  # warm (compiles), and the outputs to compare
        best = {n: float("inf") for n in kerns}
        for _ in range(args.rounds):
            for n, k in kerns.items():
                t0 = time.perf_counter()
                fn(k)
                best[n] = min(best[n], time.perf_counter() - t0)
        diff = float(np.abs(outs["old"] - outs["new"]).max())
        print(f"{threads:<7d} {name:16s} {best['old'] * 1e3:9.3f} {best['new'] * 1e3:9.3f} "
              f"{best['old'] / best['new']:8.2f} {diff:10.2e}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--old", required=True, help="directory holding the package rlx_mpi_old")
    ap.add_argument("--tokens", nargs="+", type=int, default=[128, 512])
    ap.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # (one thread count, this process)
    args = ap.parse_args()
    if args.quick:
        args.tokens, args.rounds = [32], 2
    if args.one:
        run_one(args)
        return
    print(f"{'threads':7s} {'case':16s} {'old ms':>9s} {'new ms':>9s} {'old/new':>8s} {'max |dy|':>10s}", flush=True)
    for threads in args.threads:
        env = dict(os.environ, OMP_NUM_THREADS=str(threads), OPENBLAS_NUM_THREADS=str(threads),
                   NUMBA_NUM_THREADS=str(threads))
        cmd = [sys.executable, __file__, "--one", "--old", args.old, "--threads", str(threads),
               "--rounds", str(args.rounds), "--tokens", *map(str, args.tokens)]
        proc = subprocess.run(cmd, env=env)
        if proc.returncode:
            sys.exit(proc.returncode)


if __name__ == "__main__":
    main()
