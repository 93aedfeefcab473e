"""Data-parallel replicas (#35) against their peers, ratios taken in one run.

    python bench/bench_replicas.py [--preset medium] [--prompts 64] [--max-new-tokens 32] [--reps 3]
                                   [--today DIR] [--json bench/results/replicas.json]

Method. Every figure is a real CLI launch (``generate``/``score`` with ``--json``) whose rate is
new (or scored) tokens over the job's own drive time (``wall_s``: from the barrier before the
work to the last row written, start-up excluded); launches of the configurations compared are
interleaved, ``--reps`` rounds, and medians kept.

1. generate, 2 replicas vs 2 independent jobs: one ``mpiexec -n 2`` job with ``replicas = 2``,
   its ranks pinned to cores 0 and 1 (MPMD ``taskset`` per rank), against the two halves of the
   prompt file (``--shard 1/2`` and ``--shard 2/2``) run as two one-rank jobs side by side, one
   pinned to each core. Their rate is both jobs' tokens over the longer drive. Goal >= 0.95.
2. score, 2 replicas vs 1: the same 2-replica pinning against one one-rank job on core 0 over
   the whole file (score is compute-bound: goal >= 1.8).
3. generate, 1 replica vs today's code: the same one-rank job under this checkout and under
   ``--today DIR``, a source tree of the code before replicas (``git worktree add /tmp/today
   <commit>``; run with this Python and ``PYTHONPATH=DIR``); goal overhead <= 2 %. Without
   ``--today`` this row is skipped (a job of one replica runs no work-sharing code: no counter,
   no messages; the row checks that claim).

Take the figures on a quiet 2-core host; the prompts are random ids (``--seed``), lengths 16-128.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


def _job(folder: Path, name: str, ckpt: Path, preset: str, replicas: int | None) -> Path:
    """A job file; ``replicas`` None leaves the key out (the code before replicas refuses it)."""
    path = folder / f"{name}.toml"
    path.write_text(f'[model]\ncheckpoint = "{ckpt}"\npreset = "{preset}"\n[run]\ntimeout_s = 600.0\n'
                    f'startup_timeout_s = 900.0\n[placement]\nreserve_ram_gb = 0.5\n'
                    + (f"replicas = {replicas}\n" if replicas is not None else ""))
    return path


def _prompts(path: Path, n: int, vocab: int, seed: int, score: bool) -> Path:
    import numpy as np

    rng = np.random.default_rng(seed)
    with open(path, "w") as f:
        for i in range(n):
            length = int(rng.integers(16, 129))
            f.write(json.dumps({"id": f"{'s' if score else 'p'}{i}", "tokens": rng.integers(0, vocab, length).tolist()})
                    + "\n")
    return path


def _cmd(python: str, mpiexec: str, cores: list[int], args: list[str]) -> list[str]:
    """One job, rank i pinned to cores[i] (MPMD: one taskset per rank)."""
    cmd = [mpiexec]
    for i, core in enumerate(cores):
        cmd += ([":"] if i else []) + ["-n", "1", "taskset", "-c", str(core), python, "-m", "rlx_mpi", *args]
    return cmd


def _start(cmd: list[str], cwd: Path, src: str | None = None) -> subprocess.Popen:
    """``cwd`` outside any checkout: ``python -m`` puts the working folder first on the path."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if src:  # another source tree's rlx_mpi first on the path (mpiexec passes the environment on)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH")) if p)
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=cwd)


def _finish(p: subprocess.Popen, stats: Path) -> dict:
    out, err = p.communicate(timeout=7200)
    if p.returncode != 0:
        raise RuntimeError(f"`{' '.join(p.args)}` exited {p.returncode}:\n{err[-3000:]}")
    return json.loads(stats.read_text())


def _rate(*docs: dict, score: bool = False) -> float:
    tokens = sum(d["scored_tokens"] if score else d["new_tokens"] for d in docs)
    wall = max((d["total_forward_ms"] / 1e3 if score else d["wall_s"]) for d in docs)
    return tokens / wall


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="medium")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--batch", type=int, default=8, help="generate's sequences per group")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--today", metavar="DIR", help="a source tree of rlx_mpi before replicas, for row 3")
    ap.add_argument("--json", metavar="OUT", default=str(HERE / "results" / "replicas.json"))
    args = ap.parse_args()

    from _cli import default_mpiexec, ensure_checkpoint
    from _machine import header, loadavg, machine, save_json
    from rlx_mpi.families.llama import PRESETS

    info, mpiexec, py = machine(), default_mpiexec(), sys.executable
    rows: dict[str, list[float]] = {k: [] for k in ("gen_replicas", "gen_halves", "score_replicas", "score_one",
                                                    "gen_one", "gen_today")}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        ckpt = tmp / f"{args.preset}.h5"
        ensure_checkpoint(ckpt, args.preset)
        vocab = PRESETS[args.preset].vocab_size
        prompts = _prompts(tmp / "p.jsonl", args.prompts, vocab, args.seed, score=False)
        lines = _prompts(tmp / "s.jsonl", args.prompts, vocab, args.seed + 1, score=True)
        one, two = _job(tmp, "one", ckpt, args.preset, 1), _job(tmp, "two", ckpt, args.preset, 2)
        # the code before replicas reads only the Arch keys it knew: its own copy of the same preset
        # (the same init seed), made by that code on first use
        today = _job(tmp, "today", tmp / f"today-{args.preset}.h5", args.preset, None)
        gen = ["--max-new-tokens", str(args.max_new_tokens), "--batch", str(args.batch)]

        def go(name: str, tree: str | None, cores: list[int], job: Path, command: str, src: Path, *extra: str):
            out, stats = tmp / f"{name}.{time.monotonic_ns()}.jsonl", tmp / f"{name}.{time.monotonic_ns()}.json"
            argv = [command, str(job), "--prompts", str(src), "--out", str(out), "--json", str(stats), *extra]
            return _start(_cmd(py, mpiexec, cores, argv), tmp, tree), stats

        for rep in range(args.reps + 1):  # round 0 warms the caches (numba, page cache) and is not kept
            keep = rep > 0
            p, s = go("gr", None, [0, 1], two, "generate", prompts, *gen)
            r = _rate(_finish(p, s))
            (a, sa), (b, sb) = (go("gh1", None, [0], one, "generate", prompts, *gen, "--shard", "1/2"),
                                go("gh2", None, [1], one, "generate", prompts, *gen, "--shard", "2/2"))
            h = _rate(_finish(a, sa), _finish(b, sb))
            p, s = go("sr", None, [0, 1], two, "score", lines)
            sr = _rate(_finish(p, s), score=True)
            p, s = go("s1", None, [0], one, "score", lines)
            s1 = _rate(_finish(p, s), score=True)
            p, s = go("g1", None, [0], one, "generate", prompts, *gen)
            g1 = _rate(_finish(p, s))
            gt = None
            if args.today:
                p, s = go("gt", args.today, [0], today, "generate", prompts, *gen)
                gt = _rate(_finish(p, s))
            if keep:
                for k, v in (("gen_replicas", r), ("gen_halves", h), ("score_replicas", sr), ("score_one", s1),
                             ("gen_one", g1), ("gen_today", gt)):
                    if v is not None:
                        rows[k].append(v)
            print(f"round {rep}{'' if keep else ' (warm-up)'}: generate 2 replicas {r:.1f} vs halves {h:.1f}; "
                  f"score 2 replicas {sr:.1f} vs 1 {s1:.1f}; generate 1 replica {g1:.1f}"
                  + (f" vs today {gt:.1f}" if gt else "") + " tokens/s", flush=True)
    med = {k: statistics.median(v) for k, v in rows.items() if v}
    ratios = {"generate_2_replicas_over_halves": med["gen_replicas"] / med["gen_halves"],
              "score_2_replicas_over_1": med["score_replicas"] / med["score_one"]}
    if "gen_today" in med:
        ratios["generate_1_replica_over_today"] = med["gen_one"] / med["gen_today"]
    print(header("data-parallel replicas vs their peers, one run", info))
    print(f"preset {args.preset}, {args.prompts} prompts (16-128 tokens), max_new_tokens {args.max_new_tokens}, "
          f"batch {args.batch}, {args.reps} rounds (medians, tokens/s over each job's drive time)")
    goals = {"generate_2_replicas_over_halves": ">= 0.95", "score_2_replicas_over_1": ">= 1.8",
             "generate_1_replica_over_today": ">= 0.98"}
    for k, v in ratios.items():
        print(f"{k:34s} {v:6.3f}   (goal {goals[k]})")
    print(f"load average at the end {loadavg()}")
    save_json(args.json, {"machine": info, "args": vars(args), "tokens_per_s": rows, "medians": med, "ratios": ratios,
                          "loadavg_end": loadavg()})


if __name__ == "__main__":
    main()
