"""The host's float32 FMA peak and how much of it prefill's float32 products reach (issue 41).

    python bench/bench_fma_peak.py [--threads 1 2] [--rows 128 512] [--rounds 5] [--json OUT]

Peak: a numba function whose body is CHAINS independent chains of ``acc = fma(acc, m, c)`` on
vectors of the kernels' width (16 float32 lanes where `kernels.isa` says avx512, else 8),
written as LLVM IR (``llvm.fma``), so its speed is the FMA units' throughput, not their latency
(4 cycles on current x86 cores: 12 chains keep 2 pipes busy with room to spare). The script
checks its assembly holds the expected ``vfmadd`` on zmm (ymm) registers before timing it, runs
it on each thread count (Python threads, the function nogil), and reports 2 x lanes x FMAs / s.

Products: `kernels.matmul_float` (what a prefill's float32 `Linear` calls past F32_MATVEC_ROWS
rows, kernels/matvec.py) on the medium preset's four products (the shapes of
bench_prefill_products.py), ``--copies`` copies of each weight so they come from memory as in a
prefill, best of ``--rounds``; GFLOP/s = 2 rows K N / s, and that over the peak at the same
thread count. ``--quick``: one small shape, 2 rounds (a smoke run).

Note: the CPU-time columns. On a host shared with other jobs a thread waits for its core, and
wall-time rates fall with the load (2 threads on a 2-core VM with another job running: the
peak no higher than 1 thread's). Beside each wall-time rate the script prints the rate over the
process's CPU time per thread (flops x threads / CPU seconds: what the threads did while they
ran). The team's workers (`_common.run_parts`) wait on a futex, not spinning, so their CPU time
is their work. Both are printed; only ratios within a run mean anything (bench/README.md).
"""

from __future__ import annotations

import argparse
import re
import threading
import time

import numpy as np

from _machine import add_common_args, fmt_table, header, machine, pct, save_json, wait_quiet

SHAPES = ((1024, 2048), (1024, 1024), (1024, 5632), (2816, 1024))  # (K, N): medium's q|k|v, o, gate|up, down
CHAINS = 12  # independent accumulators: > latency (4) x pipes (2), 12 of 32 (16) vector registers
UNROLL = 4  # FMAs per chain per loop trip (the loop's own add and branch then cost ~1 in 50 instructions)


def _peak_kernel(lanes: int):
    """A nogil numba function ``f(trips, m, c) -> float32`` running trips x UNROLL x CHAINS
    vector FMAs of ``lanes`` float32, and the assembly it compiled to."""
    import numba
    from llvmlite import ir
    from numba import types
    from numba.core import cgutils
    from numba.extending import intrinsic

    @intrinsic
    def chains(typingctx, trips, m, c):
        sig = types.float32(types.int64, types.float32, types.float32)

        def codegen(context, builder, signature, args):
            f = ir.FloatType()
            vt = ir.VectorType(f, lanes)
            fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vt, [vt, vt, vt]), f"llvm.fma.v{lanes}f32")

            def splat(v):
                u = builder.insert_element(ir.Constant(vt, ir.Undefined), v, ir.Constant(ir.IntType(32), 0))
                return builder.shuffle_vector(u, u, ir.Constant(ir.VectorType(ir.IntType(32), lanes), [0] * lanes))

            mv, cv = splat(args[1]), splat(args[2])
            accs = [cgutils.alloca_once_value(builder, builder.fadd(cv, ir.Constant(vt, [float(i)] * lanes)))
                    for i in range(CHAINS)]
            with cgutils.for_range(builder, args[0]):
                vals = [builder.load(a) for a in accs]
                for _ in range(UNROLL):
                    vals = [builder.call(fma, [v, mv, cv]) for v in vals]
                for a, v in zip(accs, vals):
                    builder.store(v, a)
            total = builder.load(accs[0])
            for a in accs[1:]:
                total = builder.fadd(total, builder.load(a))
            return builder.extract_element(total, ir.Constant(ir.IntType(32), 0))

        return sig, codegen

    @numba.njit(types.float32(types.int64, types.float32, types.float32), nogil=True)
    def peak(trips, m, c):
        return chains(trips, m, c)

    return peak, peak.inspect_asm(peak.signatures[0])


def check_asm(asm: str, lanes: int) -> int:
    """The count of packed-single FMAs on the expected registers in the loop; ValueError if
    fewer than one loop trip's worth (the compiler did not keep the chains as vectors)."""
    reg = "zmm" if lanes == 16 else "ymm"
    n = len(re.findall(rf"vfmadd\d{{3}}ps\s+[^\n]*%{reg}", asm))
    if n < CHAINS * UNROLL:
        raise ValueError(f"expected >= {CHAINS * UNROLL} vfmadd...ps on {reg} registers, found {n}")
    return n


def time_peak(peak, lanes: int, threads: int, seconds: float) -> tuple[float, float]:
    """GFLOP/s of `peak` on ``threads`` Python threads at once (each ``seconds``-ish): over the
    wall time, and over the process's CPU time per thread (the CPU-time note)."""
    trips = max(1000, int(seconds * 4e9 / (UNROLL * CHAINS)))  # ~1 vector FMA a cycle at ~4 GHz
    start = threading.Barrier(threads + 1)
    sink = []

    def run():
        start.wait()
        sink.append(peak(trips, np.float32(0.999), np.float32(1e-3)))

    workers = [threading.Thread(target=run) for _ in range(threads)]
    for t in workers:
        t.start()
    start.wait()
    t0, c0 = time.perf_counter(), time.process_time()
    for t in workers:
        t.join()
    dt, dc = time.perf_counter() - t0, time.process_time() - c0
    gflop = threads * trips * UNROLL * CHAINS * lanes * 2 / 1e9
    return gflop / dt, gflop * threads / dc


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    ap.add_argument("--rows", nargs="+", type=int, default=[128, 512])
    ap.add_argument("--rounds", type=int, default=5, help="timed rounds of each case, best kept")
    ap.add_argument("--copies", type=int, default=4, help="copies of each weight (they come from memory)")
    ap.add_argument("--peak-seconds", type=float, default=0.3, help="length of one peak trial")
    ap.add_argument("--quick", action="store_true", help="one small shape, 2 rounds")
    add_common_args(ap, quiet_wait_s=30.0)
    args = ap.parse_args()
    from rlx_mpi import kernels
    from rlx_mpi.kernels import isa

    rounds = 2 if args.quick else args.rounds
    shapes = ((256, 96),) if args.quick else SHAPES
    rec = isa.detect()
    lanes = 16 if rec.used == "avx512" else 8
    peak, asm = _peak_kernel(lanes)
    fmas = check_asm(asm, lanes)
    info = machine()
    print(header("bench_fma_peak: float32 FMA peak and prefill's f32 products (matmul_float) against it", info,
                 f"arithmetic {rec.describe()}; peak kernel {CHAINS} chains x {lanes} lanes, {fmas} vfmadd in its asm; "
                 f"best of {rounds}"))
    kernels.warm_up()
    out = {"machine": info, "isa": rec.__dict__, "lanes": lanes, "chains": CHAINS, "peak": {}, "products": []}
    for threads in args.threads:
        busy = wait_quiet(args.quiet, args.quiet_wait) if args.quiet_wait > 0 else None
        time_peak(peak, lanes, threads, 0.05)  # (warm: clocks up)
        trials = [time_peak(peak, lanes, threads, args.peak_seconds) for _ in range(rounds)]
        wall, cpu = max(t[0] for t in trials), max(t[1] for t in trials)
        out["peak"][threads] = {"gflops": wall, "gflops_cpu": cpu, "busy_before": busy}
        print(f"# peak, {threads} thread(s): {wall:.1f} GFLOP/s wall, {cpu:.1f} over CPU time "
              f"(host busy before: {pct(busy)})", flush=True)
    rng = np.random.default_rng(0)
    rows_out = []
    for threads in args.threads:
        kernels.set_threads(threads)
        pk = out["peak"][threads]
        for rows in args.rows:
            for k, n in shapes:
                busy = wait_quiet(args.quiet, args.quiet_wait) if args.quiet_wait > 0 else None
                ws = [kernels.aligned(rng.standard_normal((n, k)).astype(np.float32)) for _ in range(args.copies)]
                x = kernels.aligned(rng.standard_normal((rows, k)).astype(np.float32))
                kernels.matmul_float(x, ws[0])  # (warm)
                wall = cpu = float("inf")
                for _ in range(rounds):
                    t0, c0 = time.perf_counter(), time.process_time()
                    for w in ws:
                        kernels.matmul_float(x, w)
                    wall = min(wall, (time.perf_counter() - t0) / len(ws))
                    cpu = min(cpu, (time.process_time() - c0) / len(ws))
                gflop = 2 * rows * k * n / 1e9
                gf, gfc = gflop / wall, gflop * threads / cpu
                out["products"].append({"threads": threads, "rows": rows, "k": k, "n": n, "gflops": gf,
                                        "fraction_of_peak": gf / pk["gflops"], "gflops_cpu": gfc,
                                        "fraction_of_peak_cpu": gfc / pk["gflops_cpu"], "busy_before": busy})
                rows_out.append([str(threads), str(rows), f"{k} -> {n}", f"{gf:.1f}", f"{pk['gflops']:.1f}",
                                 f"{gf / pk['gflops']:.2f}", f"{gfc:.1f}", f"{pk['gflops_cpu']:.1f}",
                                 f"{gfc / pk['gflops_cpu']:.2f}", pct(busy)])
    print(fmt_table(["threads", "rows", "K -> N", "GFLOP/s", "peak", "fraction", "cpu GFLOP/s", "cpu peak",
                     "cpu fraction", "busy before"], rows_out))
    save_json(args.json, out)


if __name__ == "__main__":
    main()
