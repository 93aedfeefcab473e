"""Logits with a bf16 / f16 wire against the f32 wire, on a preset, through the CLI.

    python bench/bench_wire_error.py [--preset small] [--ranks 3] [--batch 4] [--seq 64] [--json OUT]

Runs the same ids through ``--ranks`` pipeline stages (``ranks - 1`` hops) with each wire
format and reports ``max|logits - logits_f32| / max|logits_f32|`` beside the documented bound
`executor.wire_error_bound` (4 x the codec's per-element bound per hop), the gain per hop
(error / (hops x per-element bound)) and the bytes sent per stage.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import h5py
import numpy as np

from _cli import default_mpiexec, ensure_checkpoint, write_job
from _machine import fmt_table, header, machine, save_json


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="small")
    ap.add_argument("--ranks", type=int, default=3)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--microbatches", type=int, default=2)
    ap.add_argument("--mpiexec", default=default_mpiexec())
    ap.add_argument("--json")
    args = ap.parse_args()
    from rlx_mpi.comm.executor import wire_error_bound
    from rlx_mpi.comm.wire import get_codec

    ckpt = Path(f"/tmp/rlx_bench_{args.preset}.h5")
    ensure_checkpoint(ckpt, args.preset)
    info = machine()
    print(header(f"bench_wire_error: {args.preset}, {args.ranks} stages, batch {args.batch} x seq {args.seq}", info))
    logits, sent = {}, {}
    with tempfile.TemporaryDirectory(prefix="rlx_bench_we_") as tmp:
        folder = Path(tmp)
        for w in ("f32", "bf16", "f16"):
            job = write_job(folder, w, checkpoint=ckpt, preset=args.preset, batch=args.batch, seq=args.seq,
                            microbatches=args.microbatches, wire=w)
            out, stats = folder / f"{w}.h5", folder / f"{w}.json"
            subprocess.run([args.mpiexec, "-n", str(args.ranks), sys.executable, "-m", "rlx_mpi", "run", str(job),
                            "--out", str(out), "--json", str(stats)], check=True, capture_output=True, timeout=900)
            with h5py.File(out, "r") as f:
                logits[w] = f["logits"][()]
            sent[w] = [t["bytes_sent"] for t in sorted(json.loads(stats.read_text())["timings"], key=lambda t: t["rank"])]
    hops = args.ranks - 1
    ref = logits["f32"]
    rows, results = [], {}
    for w in ("bf16", "f16"):
        codec = get_codec(w)
        err = float(np.abs(logits[w] - ref).max() / np.abs(ref).max())
        bound = wire_error_bound(codec, hops)
        gain = err / (hops * codec.rel_error)
        results[w] = {"rel_error": err, "bound": bound, "gain_per_hop": gain, "bytes_sent": sent[w],
                      "bytes_vs_f32": sum(sent[w]) / sum(sent["f32"])}
        rows.append([w, f"{err:.2e}", f"{bound:.2e}", f"{gain:.2f}", f"{results[w]['bytes_vs_f32']:.2f}",
                     "yes" if err <= bound else "NO"])
    print(fmt_table(["wire", "max_err/max|logit|", "bound", "gain/hop", "bytes_vs_f32", "within"], rows))
    save_json(args.json, {"bench": "wire_error", "machine": info, "preset": args.preset, "ranks": args.ranks,
                          "batch": args.batch, "seq": args.seq, "results": results})


if __name__ == "__main__":
    main()
