"""Pipeline parallelism on one host: 1 vs 2 vs 4 ranks, 1 vs 4 microbatches, via the CLI.

    python bench/bench_pipeline.py [--preset small] [--batch 4] [--seq 256] [--reps 3] [--json OUT]

For each rank count (tp = 1, so ranks = stages, policy balanced) and microbatch count, it
writes a job TOML to a temp dir and launches ``mpiexec -n N python -m rlx_mpi run JOB --json
STATS`` ``--reps`` times, round-robin over the configurations, keeping the best
``total_forward_ms`` (rank 0's wall time from the start of the forward to the logits on rank
0). Tokens/s are compared with one rank and one microbatch in the same run.

What to expect on a 2-core host: one rank already uses both cores (2 BLAS threads), so two
stages can at best match it, minus the pipeline bubble (with m microbatches over s stages only
m / (m + s - 1) of the time is overlapped) and the hand-offs. 4 ranks on 2 cores are
OVERSUBSCRIBED: their ratios measure scheduling and hand-off overhead, not speed-up.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from _cli import default_mpiexec, ensure_checkpoint, probe_cpus, run_job, summarize, write_job
from _machine import add_common_args, fmt_table, header, loadavg, machine, pct, save_json


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="small", help="random preset (default small)")
    ap.add_argument("--ckpt", default=None, help="checkpoint path (default /tmp/rlx_bench_<preset>.h5)")
    ap.add_argument("--ranks", default="1,2,4", help="comma-separated rank counts (default 1,2,4)")
    ap.add_argument("--microbatches", default="1,4", help="comma-separated microbatch counts (default 1,4)")
    ap.add_argument("--batch", type=int, default=4, help="sequences per forward (default 4)")
    ap.add_argument("--seq", type=int, default=256, help="tokens per sequence (default 256)")
    ap.add_argument("--reps", type=int, default=3, help="launches per configuration; the best is kept (default 3)")
    ap.add_argument("--mpiexec", default=default_mpiexec(), help="launcher (default: the one next to this python)")
    add_common_args(ap, quiet_wait_s=30.0)
    args = ap.parse_args()
    rank_counts = [int(x) for x in args.ranks.split(",")]
    mbs = [int(x) for x in args.microbatches.split(",")]
    ckpt = Path(args.ckpt or f"/tmp/rlx_bench_{args.preset}.h5")

    info = machine()
    cores = info["usable_cores"] or info["cores"]
    created = ensure_checkpoint(ckpt, args.preset)
    threads = {n: probe_cpus(n, mpiexec=args.mpiexec) for n in rank_counts}
    print(header(f"bench_pipeline: {args.preset} preset, batch {args.batch} x seq {args.seq}, pipeline stages "
                 f"{rank_counts} x microbatches {mbs}, via the CLI", info,
                 f"checkpoint {ckpt} ({'created now' if created else 'existing'}); best of {args.reps} launches "
                 f"each, round-robin; one cold forward per launch; each launch waits up to {args.quiet_wait:g} s "
                 f"for the CPUs to be < {100 * args.quiet:.0f}% busy"))
    print("# BLAS threads per rank (picked by the library): " + ", ".join(f"{n} ranks {v}" for n, v in threads.items()))
    over = [n for n in rank_counts if n > cores]
    if over:
        print(f"# NOTE: {over} ranks on {cores} cores are OVERSUBSCRIBED: those ratios are about overhead, not speed-up")

    configs = [(n, m) for n in rank_counts for m in mbs]
    runs: dict[tuple[int, int], list[dict]] = {c: [] for c in configs}
    with tempfile.TemporaryDirectory(prefix="rlx_bench_pp_") as tmp:
        folder = Path(tmp)
        jobs = {(n, m): write_job(folder, f"pp{n}_mb{m}", checkpoint=ckpt, preset=args.preset, batch=args.batch,
                                  seq=args.seq, microbatches=m) for n, m in configs}
        for rep in range(args.reps):
            for n, m in configs:
                runs[(n, m)].append(run_job(n, jobs[(n, m)], folder / "stats.json", mpiexec=args.mpiexec,
                                            quiet=args.quiet, quiet_wait_s=args.quiet_wait))
            print(f"# rep {rep + 1}/{args.reps}: " + ", ".join(
                  f"{n}x{m} {rs[-1]['total_forward_ms']:.0f} ms ({pct(rs[-1]['busy_before'])})"
                  for (n, m), rs in runs.items()) + " (ranks x microbatches, CPU busy before launch)", flush=True)
    res = {c: summarize(rs, ("forward_ms", "recv_wait_ms", "send_ms", "peak_rss_bytes")) for c, rs in runs.items()}

    base = res[configs[0]]
    rows = []
    for (n, m), r in res.items():
        same_mb = res.get((rank_counts[0], m))
        rows.append([str(n) + (" (over)" if n > cores else ""), str(m), " ".join(r["layers"]),
                     ",".join(map(str, threads[n])), f"{r['best_ms']:.0f}", f"{r['median_ms']:.0f}",
                     f"{r['tokens'] / r['best_ms'] * 1e3:.0f}", f"{base['best_ms'] / r['best_ms']:.2f}",
                     f"{same_mb['best_ms'] / r['best_ms']:.2f}" if same_mb else "-",
                     " ".join(f"{x:.0f}" for x in r["forward_ms"]), " ".join(f"{x:.0f}" for x in r["recv_wait_ms"]),
                     " ".join(f"{x:.1f}" for x in r["send_ms"])])
    print(f"\n## {args.preset}, batch {args.batch} x seq {args.seq} = {base['tokens']} tokens "
          f"(vs_1rank: tokens/s over {rank_counts[0]} rank(s) with {mbs[0]} microbatch(es); vs_same_mb: over "
          f"{rank_counts[0]} rank(s) with the same microbatches)")
    print(fmt_table(["ranks", "mb", "layers", "blas_thr", "best_ms", "median_ms", "tok/s", "vs_1rank", "vs_same_mb",
                     "fwd_ms/rank", "recv_wait_ms/rank", "send_ms/rank"], rows))
    print(f"# load average at the end: {loadavg()}")
    save_json(args.json, {"bench": "pipeline", "machine": info, "preset": args.preset, "batch": args.batch,
                          "seq": args.seq, "reps": args.reps, "blas_threads": {str(k): v for k, v in threads.items()},
                          "results": [{"ranks": n, "microbatches": m, **r} for (n, m), r in res.items()]})


if __name__ == "__main__":
    main()
