"""``score``'s tokens/s against ``run``'s on the same batch shape, in one process tree.

    python bench/bench_score.py [--preset small] [--ranks 2] [--batch 8] [--seq 128] [--microbatches 4]
                                [--reps 5] [--json bench/results/score.json]

Method. One ``mpiexec -n R`` launch of this file (``--worker``) starts the cluster once
(`Cluster.start` with a `ScoreDriver`: probe, plan, build), then alternates, ``--reps`` times
after one untimed warm-up of each, a ``run`` forward (`Cluster.drive`: the GPipe forward of
``batch x seq`` ids cut into ``microbatches``, logits of every position back to rank 0) and
``score``'s rounds over the same ids as ``batch`` lines (``--batch`` = rows per microbatch x
seq tokens, so the same ``microbatches`` microbatches of the same shape in one round; the
last stage gathers the log-probs and only they go to rank 0). Both timings run from the
barrier before the forward to rank 0 holding the result; the journal is not involved (no
file writes), so this is the pipeline's rate. Ratio = median score tokens/s / median run
tokens/s; the brief asks for >= 0.9.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


def worker(args) -> None:
    import numpy as np

    from rlx_mpi.cluster.start import Cluster
    from rlx_mpi.drivers.run import drive
    from rlx_mpi.drivers.score import ScoreDriver, ScoreOptions, plan_rounds

    class Flags:
        prompts, out, json, batch = "-", "-", None, None

    driver = ScoreDriver(Flags())
    B, T, M = args.batch, args.seq, args.microbatches
    budget = (B // M) * T

    def load(cx):  # the same lines on every rank, no prompt file, no journal
        cx.prepare()
        ids = np.random.default_rng(0).integers(0, cx.dims.vocab_size, (B, T))
        driver.ids = ids
        driver.doc = {"pending": [[i, f"r{i}", ids[i].tolist(), 1] for i in range(B)], "total": B}
        driver.rounds = plan_rounds([T] * B, budget, M)
        assert len(driver.rounds) == 1 and len(driver.rounds[0]) == M, driver.rounds
        return B, T

    driver.configure = lambda cx: setattr(driver, "opts", ScoreOptions(Path("-"), Path("-"), budget))
    driver.outputs = lambda cx: ([], {})
    driver.load = load
    cx = Cluster.start(args.job, driver)
    runs, scores = [], []
    for i in range(args.reps + 1):
        r = drive(cx, driver.ids)
        s = cx.run(driver)
        if cx.is_root and i > 0:
            runs.append(r.tokens_per_s)
            scores.append(s.run.tokens_per_s)
    if cx.is_root:
        Path(args.worker).write_text(json.dumps({"run": runs, "score": scores}))
    cx.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", metavar="OUT", default=str(HERE / "results" / "score.json"))
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--job", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)

    from _cli import default_mpiexec, ensure_checkpoint, write_job
    from _machine import header, loadavg, machine, save_json

    info = machine()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        ckpt = tmp / f"{args.preset}.h5"
        ensure_checkpoint(ckpt, args.preset)
        job = write_job(tmp, "score", checkpoint=ckpt, preset=args.preset, batch=args.batch, seq=args.seq,
                        microbatches=args.microbatches, timeout_s=600.0)
        out = tmp / "times.json"
        cmd = [default_mpiexec(), "-n", str(args.ranks), sys.executable, __file__, "--worker", str(out), "--job",
               str(job), "--batch", str(args.batch), "--seq", str(args.seq), "--microbatches",
               str(args.microbatches), "--reps", str(args.reps)]
        subprocess.run(cmd, check=True, env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
        times = json.loads(out.read_text())
    run, score = statistics.median(times["run"]), statistics.median(times["score"])
    ratio = score / run
    print(header("score vs run tokens/s, same batch shape, one process tree", info))
    print(f"preset {args.preset}, {args.ranks} ranks, batch {args.batch} x seq {args.seq}, "
          f"{args.microbatches} microbatches, {args.reps} reps (medians)")
    print(f"run   {run:10.1f} tokens/s   {['%.0f' % x for x in times['run']]}")
    print(f"score {score:10.1f} tokens/s   {['%.0f' % x for x in times['score']]}")
    print(f"ratio score/run {ratio:.3f} (goal >= 0.9); load average at the end {loadavg()}")
    save_json(args.json, {"machine": info, "preset": args.preset, "ranks": args.ranks, "batch": args.batch,
                          "seq": args.seq, "microbatches": args.microbatches, "reps": args.reps,
                          "run_tokens_per_s": times["run"], "score_tokens_per_s": times["score"],
                          "run_median": run, "score_median": score, "ratio": ratio, "loadavg_end": loadavg(),
                          "note": "taken under load on a shared 2-core host: a rough figure"})


if __name__ == "__main__":
    main()
