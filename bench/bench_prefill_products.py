"""Prefill's float products alone (issue 36, kernels/matvec.py's panel note): this checkout's
`kernels.matmul_float` against the code before the invariance kernels, at the medium preset's four
products (q|k|v 1024 -> 2048, o 1024 -> 1024, gate|up 1024 -> 5632, down 2816 -> 1024), in process.

    git archive e304325 rlx_mpi | tar -x -C OLD && mv OLD/rlx_mpi OLD/rlx_mpi_old
    python bench/bench_prefill_products.py --old OLD [--rows 128 512] [--precisions f32 bf16] [--threads 1 2]

"old" is what the old `Linear` ran for that many rows: f32 its broadcast GEMM (`gemm_f32`) up to
F32_GEMM_ROWS on AVX-512, OpenBLAS above; bf16 / f16 dequantized tiles through OpenBLAS
(`dequant_matmul`). Each round times one product of each of ``--copies`` copies of the weight (so
they come from memory, as in a prefill, where every matrix is used once); rounds alternate which
side goes first; the table is the best round of each, in GFLOP/s, and old / new time (> 1: this
checkout is faster). The results must be the same to float32 rounding (checked). ``--quick``: one
small shape, 2 rounds (a smoke run).
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

SHAPES = ((1024, 2048), (1024, 1024), (1024, 5632), (2816, 1024))  # (K, N): medium's products


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--old", required=True, help="directory holding the package rlx_mpi_old")
    ap.add_argument("--rows", nargs="+", type=int, default=[128, 512])
    ap.add_argument("--precisions", nargs="+", default=["f32", "bf16"], choices=["f32", "bf16", "f16"])
    ap.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--copies", type=int, default=4)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    from threadpoolctl import threadpool_limits

    sys.path.insert(0, args.old)
    import rlx_mpi_old.kernels as old_k
    from rlx_mpi import kernels as new_k

    shapes = ((256, 96),) if args.quick else SHAPES
    rounds = 2 if args.quick else args.rounds
    rng = np.random.default_rng(0)
    print(f"{'precision':9s} {'threads':7s} {'rows':>5s} {'K -> N':>12s} {'old GF/s':>9s} {'new GF/s':>9s} {'old/new':>8s}")
    for precision in args.precisions:
        for threads in args.threads:
            threadpool_limits(threads)
            old_k.set_threads(threads)
            new_k.set_threads(threads)
            for rows in args.rows:
                for k, n in shapes:
                    ws = []
                    for _ in range(args.copies):
                        w = rng.standard_normal((n, k)).astype(np.float32)
                        if precision == "bf16":
                            w = new_k.to_bf16(w)
                        elif precision == "f16":
                            w = w.astype(np.float16).view(np.uint16)
                        ws.append(new_k.aligned(w))
                    x = new_k.aligned(rng.standard_normal((rows, k)).astype(np.float32))

                    def old(w):
                        if precision != "f32":
                            return old_k.dequant_matmul(x, w, precision, fused=False)
                        if old_k.F32_GEMM and rows <= old_k.F32_GEMM_ROWS:
                            return old_k.gemm_f32(x, w)
                        return x @ w.T

                    def new(w):
                        return new_k.matmul_float(x, new_k.kernel_weight(precision, w))

                    a, b = old(ws[0]), new(ws[0])
                    scale = float(np.abs(a).max()) or 1.0
                    assert np.abs(a - b).max() <= 0.05 * scale, "the two sides disagree"
                    best = {"old": float("inf"), "new": float("inf")}
                    for r in range(rounds):
                        for name, f in ((("old", old), ("new", new)) if r % 2 == 0 else (("new", new), ("old", old))):
                            t0 = time.perf_counter()
                            for w in ws:
                                f(w)
                            best[name] = min(best[name], (time.perf_counter() - t0) / len(ws))
                    gf = 2 * rows * k * n / 1e9
                    print(f"{precision:9s} {threads:<7d} {rows:5d} {f'{k} -> {n}':>12s} {gf / best['old']:9.1f} "
                          f"{gf / best['new']:9.1f} {best['old'] / best['new']:8.3f}", flush=True)


if __name__ == "__main__":
    main()
