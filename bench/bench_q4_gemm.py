"""q4 prefill products in one process: kernels/q4gemm.py against the paths it replaced.

    OMP_NUM_THREADS=1 NUMBA_NUM_THREADS=1 python bench/bench_q4_gemm.py --rows 16,32,64,128,512 --threads 1
    OMP_NUM_THREADS=2 NUMBA_NUM_THREADS=2 python bench/bench_q4_gemm.py --rows 128,512 --threads 2

A layer's four products of the medium preset (q|k|v 2048 x 1024, o 1024 x 1024, gate|up 5632 x
1024, down 1024 x 2816; ``--shapes`` for others), random weights quantized by
`kernels.quantize_q4`, for each row count: the q4 GEMM (``gemm_q4``), decode's fused matvec (what a
q4 product of up to `matvec_rows` rows ran before), dequantize + BLAS (above it) and the float32
product of the same rows (``float_product``: the f32 path every Linear takes, row-invariant). Rounds interleave the
four, the minimum of each is kept, and the report is each one's time over the GEMM's (> 1: the
GEMM is faster), so a loaded host still gives usable ratios. Prints one JSON line per row count.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

MEDIUM = "2048x1024,1024x1024,5632x1024,1024x2816"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="16,32,64,128,512")
    ap.add_argument("--shapes", default=MEDIUM, help="comma list of NxK (output rows x input columns)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    from threadpoolctl import threadpool_limits

    threadpool_limits(args.threads)
    from rlx_mpi import kernels

    if not kernels.Q4_GEMM:
        raise SystemExit("bench_q4_gemm: this CPU (or NUMBA_CPU_NAME) has no AVX-512 VNNI: the q4 GEMM is not used here")
    kernels.set_threads(args.threads)
    rng = np.random.default_rng(0)
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    weights = []
    for n, k in shapes:
        w = (rng.standard_normal((n, k)) * 0.02).astype(np.float32)
        weights.append((w, *kernels.quantize_q4(w)))
    for m in (int(v) for v in args.rows.split(",")):
        xs = [rng.standard_normal((m, k)).astype(np.float32) for _, k in shapes]

        def f32():
            for (w, _, _), x in zip(weights, xs):
                kernels.float_product(x, w)

        paths = {
            "gemm_q4": lambda: [kernels.gemm_q4(x, c, sm) for (_, c, sm), x in zip(weights, xs)],
            "fused_matvec": lambda: [kernels.fused_matvec(x, c, "q4", sm, np.empty((m, c.shape[0]), np.float32))
                                     for (_, c, sm), x in zip(weights, xs)],
            "dequant_blas": lambda: [kernels.dequant_matmul(x, c, "q4", sm, fused=False)
                                     for (_, c, sm), x in zip(weights, xs)],
            "f32": f32,
        }
        best = dict.fromkeys(paths, float("inf"))
        for fn in paths.values():
            fn()  # compile / warm
        for _ in range(args.rounds):
            for name, fn in paths.items():
                t = time.perf_counter()
                fn()
                best[name] = min(best[name], time.perf_counter() - t)
        flops = sum(2.0 * m * n * k for n, k in shapes)
        print(json.dumps({"rows": m, "threads": args.threads, "ms": {k: round(v * 1e3, 3) for k, v in best.items()},
                          "gemm_q4_gflops": round(flops / best["gemm_q4"] / 1e9, 1),
                          "over_gemm_q4": {k: round(v / best["gemm_q4"], 3) for k, v in best.items()}}), flush=True)


if __name__ == "__main__":
    main()
