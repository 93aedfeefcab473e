"""The overlapped pipeline against its GPipe bound and against one rank with all the cores.

    python bench/bench_overlap.py [--preset medium] [--batch 16] [--seq 128] [--microbatches 8]
                                  [--wires f32] [--reps 3] [--json OUT]

Three configurations, launched round-robin ``--reps`` times each; every launch starts up once
and times ``--forwards`` warm forwards after a cold one (bench/_drive.py: `Cluster.drive`, the
CLI's forward); best and median over all warm forwards are kept:

  1r1t   one rank pinned to one core (``taskset -c 0``: the library then pins 1 BLAS thread), M = 1
  1r2t   one rank on both cores (2 BLAS threads), M = 1
  2r     two pipeline stages, 1 BLAS thread each, M microbatches, for each ``--wires`` format

and reports, from the same run:

  bound      = tokens/s(2r) / (2M/(M+1) x tokens/s(1r1t)): the fraction of GPipe's ideal
               (equal stages, free communication) reached; target >= 0.95
  vs_2thread = tokens/s(2r) / tokens/s(1r2t); target >= 0.95
  sched_eff  = (1 - measured bubble) / (1 - ideal bubble) within the 2-rank run itself: the
               schedule against GPipe on its own compute times, so it does not depend on the
               load during the other launches (the two ratios above do, on a shared host)

Each rank's measured busy fraction and the bubble beside the ideal (p-1)/(M+p-1) come from the
CLI's stats. Absolute times are for context: the host is shared.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from _cli import default_mpiexec, ensure_checkpoint, run_warm, write_job
from _machine import add_common_args, fmt_table, header, loadavg, machine, pct, save_json, wait_quiet


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="medium")
    ap.add_argument("--ckpt", default=None, help="checkpoint (default /tmp/rlx_bench_<preset>.h5)")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--wires", default="f32", help="comma-separated wire formats for the 2-rank runs (default f32)")
    ap.add_argument("--reps", type=int, default=2, help="launches per configuration (default 2)")
    ap.add_argument("--forwards", type=int, default=3, help="warm forwards per launch (default 3)")
    ap.add_argument("--mpiexec", default=default_mpiexec())
    add_common_args(ap, quiet_wait_s=30.0)
    args = ap.parse_args()
    M, wires = args.microbatches, args.wires.split(",")
    ckpt = Path(args.ckpt or f"/tmp/rlx_bench_{args.preset}.h5")
    info = machine()
    created = ensure_checkpoint(ckpt, args.preset)
    print(header(f"bench_overlap: {args.preset}, batch {args.batch} x seq {args.seq}; 2 stages x M={M} vs 1 rank",
                 info, f"checkpoint {ckpt} ({'created now' if created else 'existing'}); {args.reps} launches each, "
                 f"round-robin; {args.forwards} warm forwards per launch after a cold one"))
    with tempfile.TemporaryDirectory(prefix="rlx_bench_ov_") as tmp:
        folder = Path(tmp)
        common = dict(checkpoint=ckpt, preset=args.preset, batch=args.batch, seq=args.seq)
        cases = {"1r1t": (1, write_job(folder, "one", **common), ["taskset", "-c", "0"]),
                 "1r2t": (1, write_job(folder, "one2", **common), None)}
        for w in wires:
            cases[f"2r_{w}"] = (2, write_job(folder, f"two_{w}", microbatches=M, wire=w, **common), None)
        runs: dict[str, list[dict]] = {k: [] for k in cases}
        for rep in range(args.reps):
            for name, (n, job, prefix) in cases.items():
                busy = wait_quiet(args.quiet, args.quiet_wait) if args.quiet_wait > 0 else None
                got = run_warm(n, job, folder / "runs.json", mpiexec=args.mpiexec, reps=args.forwards, prefix=prefix)
                runs[name] += [{**r, "busy_before": busy} for r in got if not r["cold"]]
            print(f"# launch {rep + 1}: " + ", ".join(f"{k} {min(r['total_forward_ms'] for r in v[-args.forwards:]):.0f} ms "
                                                     f"({pct(v[-1]['busy_before'])} busy before)"
                                                     for k, v in runs.items()), flush=True)

    def tps(name: str, how=min) -> float:
        ms = how(r["total_forward_ms"] for r in runs[name])
        return runs[name][0]["tokens"] / ms * 1e3

    factor = 2 * M / (M + 1)
    rows, results = [], {}
    for name in cases:
        best = min(runs[name], key=lambda r: r["total_forward_ms"])
        res = {"best_tokens_per_s": tps(name), "median_tokens_per_s": tps(name, statistics.median),
               "all_ms": [r["total_forward_ms"] for r in runs[name]], "bubble": best.get("bubble"),
               "ideal_bubble": best.get("ideal_bubble"),
               "busy": [t["forward_ms"] / best["span_ms"] for t in best["timings"]] if best.get("span_ms") else None,
               "forward_ms": [t["forward_ms"] for t in best["timings"]],
               "recv_wait_ms": [t["recv_wait_ms"] for t in best["timings"]],
               "send_ms": [t["send_ms"] for t in best["timings"]],
               "pack_ms": [t.get("pack_ms", 0.0) for t in best["timings"]]}
        if name.startswith("2r"):
            res["sched_eff"] = (1 - res["bubble"]) / (1 - res["ideal_bubble"])
            for how, key in ((min, "best"), (statistics.median, "median")):
                res[f"{key}_vs_bound"] = tps(name, how) / (factor * tps("1r1t", how))
                res[f"{key}_vs_2thread"] = tps(name, how) / tps("1r2t", how)
        results[name] = res
        rows.append([name, f"{res['best_tokens_per_s']:.1f}", f"{res['median_tokens_per_s']:.1f}",
                     f"{res.get('best_vs_bound', float('nan')):.3f}", f"{res.get('median_vs_bound', float('nan')):.3f}",
                     f"{res.get('best_vs_2thread', float('nan')):.3f}",
                     f"{res.get('median_vs_2thread', float('nan')):.3f}",
                     " ".join(f"{100 * b:.0f}%" for b in res["busy"] or []),
                     f"{100 * res['bubble']:.1f}%/{100 * res['ideal_bubble']:.1f}%" if res["bubble"] is not None else "-",
                     f"{res['sched_eff']:.3f}" if "sched_eff" in res else "-",
                     " ".join(f"{x:.0f}" for x in res["forward_ms"]), " ".join(f"{x:.0f}" for x in res["recv_wait_ms"]),
                     " ".join(f"{x:.0f}" for x in res["send_ms"])])
    print(f"\n## GPipe bound factor 2M/(M+1) = {factor:.3f} for M = {M}")
    print(fmt_table(["case", "best_tok/s", "med_tok/s", "vs_bound", "med_vs_bound", "vs_2thr", "med_vs_2thr",
                     "busy/rank", "bubble/ideal", "sched_eff", "fwd_ms/rank", "recv_wait_ms", "send_wait_ms"], rows))
    print(f"# load average at the end: {loadavg()}")
    save_json(args.json, {"bench": "overlap", "machine": info, "preset": args.preset, "batch": args.batch,
                          "seq": args.seq, "microbatches": M, "reps": args.reps, "forwards": args.forwards, "bound_factor": factor,
                          "results": results})


if __name__ == "__main__":
    main()
