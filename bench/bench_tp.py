"""Tensor parallelism on one host: the medium preset at TP=1 (1 rank), TP=2 and PP=2 (2 ranks).

    python bench/bench_tp.py [--seqs 128,512] [--reps 3] [--batch 1] [--json OUT]

Drives the real CLI: for each configuration and sequence length it writes a job TOML to a
temp dir and launches ``mpiexec -n N python -m rlx_mpi run JOB --json STATS`` ``--reps``
times, round-robin over the configurations so a burst of load on the shared machine hits all
of them, and keeps the best ``total_forward_ms`` (rank 0's wall time from the start of the
forward to the logits). Each launch does one forward, so it is a cold forward: the first
touch of every activation buffer is inside the timing, as it is for a user of the CLI.

  tp1   1 rank, every layer, BLAS threads = all usable cores
  tp2   2 ranks, one stage, tp = 2: half of each layer's heads and MLP columns per rank,
        two all-reduces per layer, vocab-sharded LM head + all-gather
  pp2   2 ranks, two stages, tp = 1 (policy balanced), batch 1 and one microbatch: the
        stages run one after the other, so this measures the cost of the split, not overlap

The library pins each rank's BLAS threads to usable cores / ranks on the host (threadpoolctl);
the bench asks ``rlx_mpi probe`` what that gives and prints it. The checkpoint (~0.9 GB) is
created from the preset at --ckpt if missing (a few seconds), outside any timing.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from _cli import default_mpiexec, ensure_checkpoint, probe_cpus, run_job, summarize, write_job
from _machine import add_common_args, fmt_table, header, loadavg, machine, pct, save_json

CONFIGS = {  # name: (ranks, tp)
    "tp1": (1, 1),
    "tp2": (2, 2),
    "pp2": (2, 1),
}


def _mb(n: float) -> str:
    return f"{n / 1e6:.0f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seqs", default="128,512", help="comma-separated sequence lengths (default 128,512)")
    ap.add_argument("--batch", type=int, default=1, help="sequences per forward (default 1)")
    ap.add_argument("--reps", type=int, default=3, help="launches per configuration; the best is kept (default 3)")
    ap.add_argument("--preset", default="medium", help="random preset (default medium)")
    ap.add_argument("--ckpt", default=None, help="checkpoint path (default /tmp/rlx_bench_<preset>.h5)")
    ap.add_argument("--mpiexec", default=default_mpiexec(), help="launcher (default: the one next to this python)")
    add_common_args(ap, quiet_wait_s=30.0)
    args = ap.parse_args()
    seqs = [int(s) for s in args.seqs.split(",")]
    ckpt = Path(args.ckpt or f"/tmp/rlx_bench_{args.preset}.h5")

    info = machine()
    created = ensure_checkpoint(ckpt, args.preset)
    threads = {name: probe_cpus(n, mpiexec=args.mpiexec) for name, (n, _) in CONFIGS.items()}
    print(header(f"bench_tp: {args.preset} preset, batch {args.batch}, TP=1 vs TP=2 vs PP=2 on one host, via the CLI",
                 info, f"checkpoint {ckpt} ({'created now' if created else 'existing'}); best of {args.reps} "
                 f"launches each, round-robin; one cold forward per launch; each launch waits up to "
                 f"{args.quiet_wait:g} s for the CPUs to be < {100 * args.quiet:.0f}% busy"))
    print("# BLAS threads per rank (picked by the library): "
          + ", ".join(f"{k} {v}" for k, v in threads.items()))

    results = {}
    with tempfile.TemporaryDirectory(prefix="rlx_bench_tp_") as tmp:
        folder = Path(tmp)
        for seq in seqs:
            jobs = {name: write_job(folder, f"{name}_s{seq}", checkpoint=ckpt, preset=args.preset, batch=args.batch,
                                    seq=seq, tp=tp) for name, (_, tp) in CONFIGS.items()}
            runs: dict[str, list[dict]] = {name: [] for name in CONFIGS}
            for rep in range(args.reps):
                for name, (n, _) in CONFIGS.items():
                    runs[name].append(run_job(n, jobs[name], folder / "stats.json", mpiexec=args.mpiexec,
                                              quiet=args.quiet, quiet_wait_s=args.quiet_wait))
                print(f"# seq {seq}: rep {rep + 1}/{args.reps}: " + ", ".join(
                      f"{name} {rs[-1]['total_forward_ms']:.0f} ms (CPU {pct(rs[-1]['busy_before'])} busy before)"
                      for name, rs in runs.items()), flush=True)
            results[seq] = {name: summarize(rs, ("forward_ms", "weight_bytes", "peak_rss_bytes")) for name, rs in runs.items()}

    for seq, res in results.items():
        base = res["tp1"]["best_ms"]
        rows = []
        for name, r in res.items():
            rows.append([name, str(CONFIGS[name][0]), " ".join(r["layers"]), ",".join(map(str, threads[name])),
                         f"{r['best_ms']:.0f}", f"{r['median_ms']:.0f}", f"{r['tokens'] / r['best_ms'] * 1e3:.0f}",
                         f"{base / r['best_ms']:.2f}", " ".join(f"{x:.0f}" for x in r["forward_ms"]),
                         " ".join(_mb(x) for x in r["weight_bytes"]), " ".join(_mb(x) for x in r["peak_rss_bytes"])])
        print(f"\n## seq {seq}, batch {args.batch} ({res['tp1']['tokens']} tokens)")
        print(fmt_table(["config", "ranks", "layers", "blas_thr", "best_ms", "median_ms", "tok/s", "speedup",
                         "fwd_ms/rank", "weights_MB/rank", "peak_rss_MB/rank"], rows))
    print("\n## ratios (best of each; > 1 means faster than 1 rank)")
    print(fmt_table(["seq", "TP2 vs TP1", "PP2 vs 1 rank", "TP2 vs PP2", "TP2 weights/rank vs TP1"],
                    [[str(seq), f"{res['tp1']['best_ms'] / res['tp2']['best_ms']:.2f}",
                      f"{res['tp1']['best_ms'] / res['pp2']['best_ms']:.2f}",
                      f"{res['pp2']['best_ms'] / res['tp2']['best_ms']:.2f}",
                      f"{max(res['tp2']['weight_bytes']) / res['tp1']['weight_bytes'][0]:.2f}"]
                     for seq, res in results.items()]))
    print(f"# load average at the end: {loadavg()}")
    save_json(args.json, {"bench": "tp", "machine": info, "preset": args.preset, "batch": args.batch,
                          "reps": args.reps, "blas_threads": threads, "results": results})


if __name__ == "__main__":
    main()
