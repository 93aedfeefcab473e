"""Shared prompt prefixes computed once (issue 33): ``generate`` and ``score`` with the prefix
cache against ``--no-prefix-cache``, and llama.cpp's shared-prompt mode, in one run.

    python bench/bench_prefix.py [--quick] [--checkpoint /tmp/llamacpp/models/medium.h5 | --preset medium]
                                 [--prompts 128] [--prefix 1024] [--question 32] [--new 16] [--batch 8]
                                 [--layouts 1,2,tp2] [--cases shared,random,score] [--trials 3]
                                 [--random-prompts N] [--random-layouts 1] [--score-questions 32]
                                 [--score-context 600] [--score-layouts 1,2,tp2]
                                 [--llamacpp /tmp/llamacpp/build/bin] [--gguf /tmp/llamacpp/models/medium-f32.gguf]
                                 [--json bench/results/prefix_DATE.json]

``--quick`` (~10 min on a quiet 2-core host with the medium preset): 16 shared-prefix prompts on
the three layouts (the ratio grows with the prompts: 16 gives its lower end, every prompt after
the first prefills 32 positions of 1,056), the random case on 1 rank with 8 prompts (the cost of
the cache is per prompt: hashing and lookups, no more with more prompts), the score case on 1 rank
with 8 questions (32 lines), one trial each, llama.cpp's -pps with 16 sequences. Each case and
layout stays selectable alone (``--cases score --score-layouts 2``).

Method. ``--prompts`` prompts, each one shared ``--prefix``-token prefix and its own
``--question``-token tail (case ``shared``), or ``--prefix + --question`` random tokens each
(case ``random``: nothing to reuse, what the cache costs), ``--new`` new tokens each
(``--ignore-eos``), ``--batch`` rows per group, greedy. Each layout (``1``: one rank; ``2``: two
stages of one core each; ``tp2``: one stage of two TP ranks) runs with the cache and with
``--no-prefix-cache``, trials interleaved, the best kept; the whole-job tokens/s is new tokens
over the loop's wall (``generate --json``: start-up excluded) and the rows of the two runs must
be identical (tokens), or the bench fails. Targets (issue 33): shared >= 5x on 1 rank, >= 4x on
2 stages and TP 2; random >= 0.97x (``--random-prompts``, ``--random-layouts``). Case ``score``
(a few-shot evaluation): ``--score-questions`` questions, each four lines {"context": the shared
``--score-context``-token context + the question's 24 tokens, "continuation": one of four 8-token
answers}, ``score`` with and without the cache (``--score-layouts``); its whole-job tokens/s is the
lines' tokens over the scoring loop's wall (``score --json``), and the log-probs of the two runs
must be within 1e-6 (the bench reports whether they are bitwise equal). Target: >= 4x. With ``--llamacpp DIR`` (default the lead's build when it
exists) and ``--gguf`` the same model's f32 GGUF, ``llama-batched-bench -pps`` (the prompt
computed once and its cache shared by the sequences) runs the shared case's shape (``--prompts``
sequences, a ``--prefix + --question`` prompt, ``--new`` tokens; its prompt is one for all, so
it reuses more than we can) on as many cores as the 1-rank run.

Case ``mixed`` (the block cache, issue 33; not in the default ``--cases``): ``--mixed-prompts``
random prompts of ``--mixed-lengths`` tokens (uniform, default 32-2048), ``--new`` new tokens each,
under a KV budget of ``--mixed-rows`` full-length rows (default 8): the slot cache
(``--no-prefix-cache --batch 8``: 8 max-length slots) against the block cache in the same memory
(``--kv-rows`` 8 less the prefix pool's 2, ``--batch --mixed-batch``, default 64), on
``--mixed-layouts``. Reported: rows decoding at once (``generate --json``'s ``rows_at_once``),
tokens/s, each run's KV bytes; rows must be identical. Targets: >= 2x the rows at once, >= 1.5x
the tokens/s. E.g. ``python bench/bench_prefix.py --cases mixed --mixed-prompts 64``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from _cli import default_mpiexec, ensure_checkpoint
from _machine import add_common_args, fmt_table, header, machine, save_json, wait_quiet

LAYOUTS = {"1": (1, 1), "2": (2, 1), "tp2": (2, 2)}  # name -> (ranks, tp)
_LLAMA_BIN = Path("/tmp/llamacpp/build/bin")
_MEDIUM = Path("/tmp/llamacpp/models/medium.h5")


def write_prompts(path: Path, case: str, n: int, prefix: int, question: int, vocab: int) -> Path:
    rng = np.random.default_rng(0)
    shared = rng.integers(0, vocab, prefix).tolist()
    with path.open("w") as f:
        for i in range(n):
            head = shared if case == "shared" else rng.integers(0, vocab, prefix).tolist()
            f.write(json.dumps({"id": f"{case}{i}", "tokens": head + rng.integers(0, vocab, question).tolist()}) + "\n")
    return path


def write_score_lines(path: Path, questions: int, context: int, vocab: int) -> Path:
    """A few-shot evaluation: one shared context, then per question four lines, each the question
    and one candidate answer (only the answer is scored)."""
    rng = np.random.default_rng(1)
    shared = rng.integers(0, vocab, context).tolist()
    with path.open("w") as f:
        for q in range(questions):
            ctx = shared + rng.integers(0, vocab, 24).tolist()
            for a in range(4):
                f.write(json.dumps({"id": f"q{q}a{a}", "context": ctx,
                                    "continuation": rng.integers(0, vocab, 8).tolist()}) + "\n")
    return path


def _launch(mpiexec: str, command: str, job: Path, inputs: Path, folder: Path, ranks: int, cache: bool, threads: int,
            *flags: str) -> tuple[dict, list[dict]]:
    """One ``rlx-mpi COMMAND`` run with or without the cache: its --json and its output rows."""
    out, stats = folder / "out.jsonl", folder / "stats.json"
    for p in (out, stats, folder / "out.jsonl.meta.json"):
        p.unlink(missing_ok=True)
    cmd = [mpiexec, "-n", str(ranks), sys.executable, "-m", "rlx_mpi", command, str(job), "--prompts", str(inputs),
           "--out", str(out), "--json", str(stats), *flags, *([] if cache else ["--no-prefix-cache"])]
    env = dict(os.environ, OMP_NUM_THREADS="1" if ranks > 1 else str(threads),
               NUMBA_NUM_THREADS="1" if ranks > 1 else str(threads))
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=7200, env=env, cwd=folder)
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
    return json.loads(stats.read_text()), [json.loads(line) for line in out.read_text().splitlines() if line]


def run_score(mpiexec: str, job: Path, lines: Path, folder: Path, ranks: int, cache: bool, args) -> dict:
    """Whole-job tokens/s of ``score``: the lines' tokens over the scoring loop's wall."""
    doc, rows = _launch(mpiexec, "score", job, lines, folder, ranks, cache, args.threads)
    wall = doc["total_forward_ms"] / 1e3
    return {"tokens_per_s": doc["tokens"] / wall, "wall_s": wall, "prefix_hits": doc.get("prefix_hits"),
            "rows": [r["logprobs"] for r in rows]}


def run(mpiexec: str, job: Path, prompts: Path, folder: Path, ranks: int, cache: bool, args,
        extra: tuple = ()) -> dict:
    """Whole-job tokens/s of ``generate``: new tokens over the loop's wall (``extra`` flags after
    the others: a later --batch wins)."""
    doc, rows = _launch(mpiexec, "generate", job, prompts, folder, ranks, cache, args.threads, "--max-new-tokens",
                        str(args.new), "--batch", str(args.batch), "--ignore-eos", *map(str, extra))
    return {"tokens_per_s": doc["new_tokens"] / doc["wall_s"], "wall_s": doc["wall_s"],
            "prefix_hits": doc.get("prefix_hits"), "rows": [r["tokens"] for r in rows],
            "rows_at_once": doc.get("rows_at_once"), "kv_bytes": sum(r.get("kv_bytes") or 0 for r in doc["rows"])}


def write_mixed(path: Path, n: int, lengths: tuple[int, int], vocab: int) -> Path:
    rng = np.random.default_rng(1)
    with path.open("w") as f:
        for i in range(n):
            f.write(json.dumps({"id": f"m{i}", "tokens": rng.integers(0, vocab, int(rng.integers(lengths[0], lengths[1] + 1)))
                                .tolist()}) + "\n")
    return path


def mixed(args, job: Path, prompts: Path, folder: Path, ranks: int) -> dict:
    """Case ``mixed``: the slot cache (--no-prefix-cache, --mixed-rows slots) against the block cache
    in the same memory (--kv-rows: --mixed-rows less the prefix pool's 2; --mixed-batch rows a step)."""
    from rlx_mpi.engine.block_pool import PREFIX_POOL_ROWS

    def one(paged: bool) -> dict:
        extra = ("--batch", args.mixed_batch, "--kv-rows", max(1, args.mixed_rows - PREFIX_POOL_ROWS)) if paged \
            else ("--batch", args.mixed_rows)
        return run(args.mpiexec, job, prompts, folder, ranks, paged, args, extra)

    best = best_pair(one, args.trials, args)
    if best[True]["rows"] != best[False]["rows"]:
        raise SystemExit("mixed: rows differ between the block cache and the slot cache")
    on, off = best[True], best[False]
    return {"cache_tokens_per_s": on["tokens_per_s"], "off_tokens_per_s": off["tokens_per_s"],
            "ratio": on["tokens_per_s"] / off["tokens_per_s"], "rows_at_once": [on["rows_at_once"], off["rows_at_once"]],
            "kv_bytes": [on["kv_bytes"], off["kv_bytes"]], "prefix_hits": None}


def write_job(folder: Path, name: str, ckpt: Path, tp: int = 1) -> Path:
    job = folder / f"job_{name}.toml"
    job.write_text(f'[model]\ncheckpoint = "{ckpt}"\n[run]\ntimeout_s = 3600.0\nstartup_timeout_s = 3600.0\n'
                   f'[placement]\nreserve_ram_gb = 0.0\ntp = {tp}\n')
    return job


def best_pair(fn, trials: int, args) -> dict[bool, dict]:
    """The best run of ``trials`` with the cache and without, interleaved."""
    best: dict[bool, dict] = {}
    for _ in range(trials):
        for cache in (True, False):
            wait_quiet(args.quiet, args.quiet_wait)
            r = fn(cache)
            if cache not in best or r["tokens_per_s"] > best[cache]["tokens_per_s"]:
                best[cache] = r
    return best


def llama_pps(bin_dir: Path, gguf: Path, threads: int, npp: int, ntg: int, npl: int) -> dict:
    """llama-batched-bench with a shared prompt (-pps): new tokens over its whole time."""
    cmd = ["taskset", "-c", f"0-{threads - 1}" if threads > 1 else "0", str(bin_dir / "llama-batched-bench"),
           "-m", str(gguf), "-c", str(npp + npl * ntg + 64), "-b", "2048", "-ub", "512", "-npp", str(npp),
           "-ntg", str(ntg), "-npl", str(npl), "-pps", "-kvu", "-t", str(threads), "-tb", str(threads), "-fa", "off",
           "-ctk", "f32", "-ctv", "f32", "--output-format", "jsonl"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=7200)
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
    for line in proc.stdout.splitlines():
        if line.startswith("{") and '"speed_tg"' in line:
            row = json.loads(line)
            return {"tokens_per_s": npl * ntg / row["t"], "wall_s": row["t"]}
    raise SystemExit(f"llama-batched-bench: no result row in:\n{proc.stdout[-2000:]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", help=f"the model (default {_MEDIUM} when it exists, else a random --preset)")
    ap.add_argument("--preset", default="medium")
    ap.add_argument("--prompts", type=int, default=128)
    ap.add_argument("--prefix", type=int, default=1024)
    ap.add_argument("--question", type=int, default=32)
    ap.add_argument("--new", type=int, default=16)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2, help="threads of the 1-rank runs (and llama.cpp's)")
    ap.add_argument("--layouts", default="1,2,tp2", help="layouts of the shared case")
    ap.add_argument("--cases", default="shared,random,score")
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--random-prompts", type=int, help="prompts of the random case (default --prompts)")
    ap.add_argument("--random-layouts", help="layouts of the random case (default --layouts)")
    ap.add_argument("--score-questions", type=int, default=32, help="questions of the score case (4 lines each)")
    ap.add_argument("--score-context", type=int, default=600, help="the score case's shared context, tokens")
    ap.add_argument("--score-layouts", help="layouts of the score case (default --layouts)")
    ap.add_argument("--mixed-prompts", type=int, default=64, help="case mixed: its prompts")
    ap.add_argument("--mixed-lengths", default="32,2048", help="case mixed: the prompts' shortest,longest")
    ap.add_argument("--mixed-rows", type=int, default=8, help="case mixed: the KV budget in full-length rows")
    ap.add_argument("--mixed-batch", type=int, default=64, help="case mixed: the block cache's --batch")
    ap.add_argument("--mixed-layouts", default="1", help="layouts of the mixed case")
    ap.add_argument("--quick", action="store_true", help="the ~10 min preset (the docstring): sets --prompts 16 "
                    "--trials 1 --random-prompts 8 --random-layouts 1 --score-questions 8 --score-layouts 1")
    ap.add_argument("--llamacpp", default=str(_LLAMA_BIN) if _LLAMA_BIN.exists() else None)
    ap.add_argument("--gguf", default="/tmp/llamacpp/models/medium-f32.gguf")
    ap.add_argument("--mpiexec", default=default_mpiexec())
    add_common_args(ap, quiet_wait_s=120)
    args = ap.parse_args()
    if args.quick:
        args.prompts, args.trials, args.random_prompts, args.random_layouts = 16, 1, 8, "1"
        args.score_questions, args.score_layouts = 8, "1"
    args.random_prompts = args.random_prompts or args.prompts
    args.random_layouts = args.random_layouts or args.layouts
    args.score_layouts = args.score_layouts or args.layouts
    if args.json is None:
        import time

        args.json = str(Path(__file__).parent / "results" / f"prefix_{time.strftime('%Y-%m-%d')}"
                        f"{'_quick' if args.quick else ''}.json")
    info = machine()
    print(header("Prefix cache: generate with the cache against --no-prefix-cache (issue 33)", info))
    results: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        ckpt = Path(args.checkpoint) if args.checkpoint else (_MEDIUM if _MEDIUM.exists() else folder / "m.h5")
        if not ckpt.exists():
            ensure_checkpoint(ckpt, args.preset)
        from rlx_mpi.model.checkpoint import read_header
        from rlx_mpi.families import get_family

        family, text = read_header(ckpt)
        vocab = get_family(family).load_config(text, str(ckpt)).vocab_size
        # untimed: every path each case takes runs once, so no timed run pays a kernel's compile
        # (numba's on-disk cache keeps them for the runs after)
        job1 = write_job(folder, "warm", ckpt)
        warm = argparse.Namespace(**{**vars(args), "new": 2})
        for cache in (True, False):
            run(args.mpiexec, job1, write_prompts(folder / "warm.jsonl", "shared", 2, 40, 8, vocab), folder, 1, cache,
                warm)
            run_score(args.mpiexec, job1, write_score_lines(folder / "warm_score.jsonl", 1, 40, vocab), folder, 1,
                      cache, warm)
        for case in args.cases.split(","):
            if case == "score":
                continue
            if case == "mixed":  # the block cache against the slot cache (module docstring)
                lo, hi = map(int, args.mixed_lengths.split(","))
                prompts = write_mixed(folder / "mixed.jsonl", args.mixed_prompts, (lo, hi), vocab)
                for name in args.mixed_layouts.split(","):
                    ranks, tp = LAYOUTS[name]
                    r = results[f"mixed/{name}"] = mixed(args, write_job(folder, name, ckpt, tp), prompts, folder, ranks)
                    print(f"  mixed, layout {name}: {r['ratio']:.2f}x tokens/s, rows at once {r['rows_at_once'][0]} "
                          f"against {r['rows_at_once'][1]}, KV bytes {r['kv_bytes'][0]} against {r['kv_bytes'][1]}",
                          flush=True)
                continue
            n = args.random_prompts if case == "random" else args.prompts
            prompts = write_prompts(folder / f"{case}.jsonl", case, n, args.prefix, args.question, vocab)
            for name in (args.random_layouts if case == "random" else args.layouts).split(","):
                ranks, tp = LAYOUTS[name]
                job = write_job(folder, name, ckpt, tp)
                best = best_pair(lambda cache: run(args.mpiexec, job, prompts, folder, ranks, cache, args), args.trials,
                                 args)
                if best[True]["rows"] != best[False]["rows"]:
                    raise SystemExit(f"{case}, layout {name}: rows differ with and without the prefix cache")
                results[f"{case}/{name}"] = {
                    "cache_tokens_per_s": best[True]["tokens_per_s"], "off_tokens_per_s": best[False]["tokens_per_s"],
                    "ratio": best[True]["tokens_per_s"] / best[False]["tokens_per_s"],
                    "prefix_hits": best[True]["prefix_hits"]}
                print(f"  {case}, layout {name}: {results[f'{case}/{name}']['ratio']:.2f}x", flush=True)
        if "score" in args.cases.split(","):
            lines = write_score_lines(folder / "score.jsonl", args.score_questions, args.score_context, vocab)
            for name in args.score_layouts.split(","):
                ranks, tp = LAYOUTS[name]
                job = write_job(folder, name, ckpt, tp)
                best = best_pair(lambda cache: run_score(args.mpiexec, job, lines, folder, ranks, cache, args),
                                 args.trials, args)
                a = np.array([x for row in best[True]["rows"] for x in row])
                b = np.array([x for row in best[False]["rows"] for x in row])
                diff = float(np.abs(a - b).max()) if len(a) == len(b) else float("inf")
                if diff > 1e-6:
                    raise SystemExit(f"score, layout {name}: log-probs differ by {diff} with and without the cache")
                results[f"score/{name}"] = {
                    "cache_tokens_per_s": best[True]["tokens_per_s"], "off_tokens_per_s": best[False]["tokens_per_s"],
                    "ratio": best[True]["tokens_per_s"] / best[False]["tokens_per_s"],
                    "prefix_hits": best[True]["prefix_hits"], "max_logprob_diff": diff, "bitwise": diff == 0.0}
                print(f"  score, layout {name}: {results[f'score/{name}']['ratio']:.2f}x (log-probs "
                      f"{'bitwise equal' if diff == 0.0 else f'within {diff:.1e}'})", flush=True)
        if args.llamacpp and Path(args.gguf).exists() and "shared" in args.cases:
            wait_quiet(args.quiet, args.quiet_wait)
            try:  # (its failure must not lose the cases measured before it)
                results["llama.cpp -pps"] = llama_pps(Path(args.llamacpp), Path(args.gguf), args.threads,
                                                      args.prefix + args.question, args.new, args.prompts)
            except SystemExit as e:
                print(f"  llama.cpp -pps failed: {str(e)[:300]}", flush=True)
    rows = [[k, f"{v['cache_tokens_per_s']:.1f}", f"{v['off_tokens_per_s']:.1f}", f"{v['ratio']:.2f}x",
             f"{v['prefix_hits'][0]}/{v['prefix_hits'][1]}" if v.get("prefix_hits") else
             (f"rows at once {v['rows_at_once'][0]}/{v['rows_at_once'][1]}" if v.get("rows_at_once") else "-")]
            for k, v in results.items() if "ratio" in v]
    if "llama.cpp -pps" in results:
        lc = results["llama.cpp -pps"]
        rows.append(["llama.cpp -pps (shared, 1 rank's cores)", f"{lc['tokens_per_s']:.1f}", "-", "-", "-"])
    print(f"{args.prompts} prompts ({args.random_prompts} random) = {args.prefix} shared (or random) + "
          f"{args.question} own tokens, {args.new} new, batch {args.batch}; score: {args.score_questions} questions x 4 "
          f"answers after a {args.score_context}-token context; best of {args.trials}")
    print(fmt_table(["case/layout", "cache tokens/s", "off tokens/s", "ratio", "reused/prompt tokens"], rows))
    save_json(args.json, {"machine": info, "args": vars(args), "results": results})


if __name__ == "__main__":
    main()
