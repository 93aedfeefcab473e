"""Shared prompt prefixes computed once (issue 33): ``generate`` with the prefix cache against
``--no-prefix-cache``, and llama.cpp's shared-prompt mode, in one run.

    python bench/bench_prefix.py [--checkpoint /tmp/llamacpp/models/medium.h5 | --preset medium]
                                 [--prompts 128] [--prefix 1024] [--question 32] [--new 16] [--batch 8]
                                 [--layouts 1,2,tp2] [--cases shared,random] [--trials 3]
                                 [--llamacpp /tmp/llamacpp/build/bin] [--gguf /tmp/llamacpp/models/medium-f32.gguf]
                                 [--json bench/results/prefix.json]

Method. ``--prompts`` prompts, each one shared ``--prefix``-token prefix and its own
``--question``-token tail (case ``shared``), or ``--prefix + --question`` random tokens each
(case ``random``: nothing to reuse, what the cache costs), ``--new`` new tokens each
(``--ignore-eos``), ``--batch`` rows per group, greedy. Each layout (``1``: one rank; ``2``: two
stages of one core each; ``tp2``: one stage of two TP ranks) runs with the cache and with
``--no-prefix-cache``, trials interleaved, the best kept; the whole-job tokens/s is new tokens
over the loop's wall (``generate --json``: start-up excluded) and the rows of the two runs must
be identical (tokens), or the bench fails. Targets (issue 33): shared >= 5x on 1 rank, >= 4x on
2 stages and TP 2; random >= 0.97x. With ``--llamacpp DIR`` (default the lead's build when it
exists) and ``--gguf`` the same model's f32 GGUF, ``llama-batched-bench -pps`` (the prompt
computed once and its cache shared by the sequences) runs the shared case's shape (``--prompts``
sequences, a ``--prefix + --question`` prompt, ``--new`` tokens; its prompt is one for all, so
it reuses more than we can) on as many cores as the 1-rank run.

Case ``mixed`` (the block cache, issue 33): ``--prompts`` random prompts of ``--mixed-lengths``
tokens (uniform, default 32-2048), ``--new`` new tokens each, under a KV budget of
``--mixed-rows`` full-length rows (default 8): the slot cache (``--no-prefix-cache --batch 8``:
8 max-length slots) against the block cache in the same memory (``--kv-rows`` 8 less the prefix
pool's 2, ``--batch --mixed-batch``, default 64). Reported: rows decoding at once (``generate
--json``'s ``rows_at_once``), tokens/s, each run's KV bytes; rows must be identical. Targets:
>= 2x the rows at once, >= 1.5x the tokens/s. E.g.
``python bench/bench_prefix.py --cases mixed --layouts 1 --prompts 64``.
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


def write_mixed(path: Path, n: int, lengths: tuple[int, int], vocab: int) -> Path:
    rng = np.random.default_rng(1)
    with path.open("w") as f:
        for i in range(n):
            f.write(json.dumps({"id": f"m{i}", "tokens": rng.integers(0, vocab, int(rng.integers(lengths[0], lengths[1] + 1)))
                                .tolist()}) + "\n")
    return path


def run(mpiexec: str, job: Path, prompts: Path, folder: Path, ranks: int, cache: bool, args,
        extra: tuple = ()) -> dict:
    out, stats = folder / "out.jsonl", folder / "stats.json"
    for p in (out, stats, folder / "out.jsonl.meta.json"):
        p.unlink(missing_ok=True)
    cmd = [mpiexec, "-n", str(ranks), sys.executable, "-m", "rlx_mpi", "generate", str(job), "--prompts", str(prompts),
           "--out", str(out), "--json", str(stats), "--max-new-tokens", str(args.new), "--batch", str(args.batch),
           "--ignore-eos", *([] if cache else ["--no-prefix-cache"]), *map(str, extra)]  # (extra: a later --batch wins)
    env = dict(os.environ, OMP_NUM_THREADS="1" if ranks > 1 else str(args.threads),
               NUMBA_NUM_THREADS="1" if ranks > 1 else str(args.threads))
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=7200, env=env, cwd=folder)
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
    doc = json.loads(stats.read_text())
    rows = [json.loads(line)["tokens"] for line in out.read_text().splitlines() if line]
    return {"tokens_per_s": doc["new_tokens"] / doc["wall_s"], "wall_s": doc["wall_s"],
            "prefix_hits": doc.get("prefix_hits"), "rows": rows, "rows_at_once": doc.get("rows_at_once"),
            "kv_bytes": sum(r.get("kv_bytes") or 0 for r in doc["rows"])}


def mixed(args, mpiexec: str, job: Path, prompts: Path, folder: Path, ranks: int) -> dict:
    """Case ``mixed``: the slot cache (--no-prefix-cache, --mixed-rows slots) against the block cache
    in the same memory (--kv-rows: --mixed-rows less the prefix pool's 2; --mixed-batch rows a step)."""
    from rlx_mpi.drivers.generate import PREFIX_POOL_ROWS

    best: dict[bool, dict] = {}
    for _ in range(args.trials):
        for paged in (True, False):
            wait_quiet(args.quiet, args.quiet_wait)
            extra = ("--batch", args.mixed_batch, "--kv-rows", max(1, args.mixed_rows - PREFIX_POOL_ROWS)) if paged \
                else ("--batch", args.mixed_rows)
            r = run(mpiexec, job, prompts, folder, ranks, paged, args, extra)
            if paged not in best or r["tokens_per_s"] > best[paged]["tokens_per_s"]:
                best[paged] = r
    if best[True]["rows"] != best[False]["rows"]:
        raise SystemExit("mixed: rows differ between the block cache and the slot cache")
    on, off = best[True], best[False]
    return {"cache_tokens_per_s": on["tokens_per_s"], "off_tokens_per_s": off["tokens_per_s"],
            "ratio": on["tokens_per_s"] / off["tokens_per_s"], "rows_at_once": [on["rows_at_once"], off["rows_at_once"]],
            "kv_bytes": [on["kv_bytes"], off["kv_bytes"]], "prefix_hits": None}


def llama_pps(bin_dir: Path, gguf: Path, threads: int, npp: int, ntg: int, npl: int) -> dict:
    """llama-batched-bench with a shared prompt (-pps): new tokens over its whole time."""
    cmd = ["taskset", "-c", f"0-{threads - 1}" if threads > 1 else "0", str(bin_dir / "llama-batched-bench"),
           "-m", str(gguf), "-c", str(npp + npl * ntg + 64), "-b", "2048", "-ub", "512", "-npp", str(npp),
           "-ntg", str(ntg), "-npl", str(npl), "-pps", "-t", str(threads), "-tb", str(threads), "-fa", "off",
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
    ap.add_argument("--layouts", default="1,2,tp2")
    ap.add_argument("--cases", default="shared,random")
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--mixed-lengths", default="32,2048", help="case mixed: the prompts' shortest,longest")
    ap.add_argument("--mixed-rows", type=int, default=8, help="case mixed: the KV budget in full-length rows")
    ap.add_argument("--mixed-batch", type=int, default=64, help="case mixed: the block cache's --batch")
    ap.add_argument("--llamacpp", default=str(_LLAMA_BIN) if _LLAMA_BIN.exists() else None)
    ap.add_argument("--gguf", default="/tmp/llamacpp/models/medium-f32.gguf")
    ap.add_argument("--mpiexec", default=default_mpiexec())
    add_common_args(ap, quiet_wait_s=120)
    args = ap.parse_args()
    info = machine()
    print(header("Prefix cache: generate with the cache against --no-prefix-cache (issue 33)", info))
    results: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        ckpt = Path(args.checkpoint) if args.checkpoint else (_MEDIUM if _MEDIUM.exists() else folder / "m.h5")
        if not ckpt.exists():
            ensure_checkpoint(ckpt, args.preset)
        from rlx_mpi.checkpoint import read_header
        from rlx_mpi.families import get_family

        family, text = read_header(ckpt)
        vocab = get_family(family).load_config(text, str(ckpt)).vocab_size
        for case in args.cases.split(","):
            if case == "mixed":  # the block cache against the slot cache (module docstring)
                lo, hi = map(int, args.mixed_lengths.split(","))
                prompts = write_mixed(folder / "mixed.jsonl", args.prompts, (lo, hi), vocab)
                for name in args.layouts.split(","):
                    ranks, tp = LAYOUTS[name]
                    job = folder / f"job_{name}.toml"
                    job.write_text(f'[model]\ncheckpoint = "{ckpt}"\n[run]\ntimeout_s = 3600.0\n'
                                   f'startup_timeout_s = 3600.0\n[placement]\nreserve_ram_gb = 0.0\ntp = {tp}\n')
                    r = results[f"mixed/{name}"] = mixed(args, args.mpiexec, job, prompts, folder, ranks)
                    print(f"  mixed, layout {name}: {r['ratio']:.2f}x tokens/s, rows at once {r['rows_at_once'][0]} "
                          f"against {r['rows_at_once'][1]}, KV bytes {r['kv_bytes'][0]} against {r['kv_bytes'][1]}",
                          flush=True)
                continue
            prompts = write_prompts(folder / f"{case}.jsonl", case, args.prompts, args.prefix, args.question, vocab)
            for name in args.layouts.split(","):
                ranks, tp = LAYOUTS[name]
                job = folder / f"job_{name}.toml"
                job.write_text(f'[model]\ncheckpoint = "{ckpt}"\n[run]\ntimeout_s = 3600.0\n'
                               f'startup_timeout_s = 3600.0\n[placement]\nreserve_ram_gb = 0.0\ntp = {tp}\n')
                best: dict[bool, dict] = {}
                for _ in range(args.trials):
                    for cache in (True, False):
                        wait_quiet(args.quiet, args.quiet_wait)
                        r = run(args.mpiexec, job, prompts, folder, ranks, cache, args)
                        if cache not in best or r["tokens_per_s"] > best[cache]["tokens_per_s"]:
                            best[cache] = r
                if best[True]["rows"] != best[False]["rows"]:
                    raise SystemExit(f"{case}, layout {name}: rows differ with and without the prefix cache")
                results[f"{case}/{name}"] = {
                    "cache_tokens_per_s": best[True]["tokens_per_s"], "off_tokens_per_s": best[False]["tokens_per_s"],
                    "ratio": best[True]["tokens_per_s"] / best[False]["tokens_per_s"],
                    "prefix_hits": best[True]["prefix_hits"]}
                print(f"  {case}, layout {name}: {results[f'{case}/{name}']['ratio']:.2f}x", flush=True)
        if args.llamacpp and Path(args.gguf).exists() and "shared" in args.cases:
            wait_quiet(args.quiet, args.quiet_wait)
            results["llama.cpp -pps"] = llama_pps(Path(args.llamacpp), Path(args.gguf), args.threads,
                                                  args.prefix + args.question, args.new, args.prompts)
    rows = [[k, f"{v['cache_tokens_per_s']:.1f}", f"{v['off_tokens_per_s']:.1f}", f"{v['ratio']:.2f}x",
             f"{v['prefix_hits'][0]}/{v['prefix_hits'][1]}" if v.get("prefix_hits") else
             (f"rows at once {v['rows_at_once'][0]}/{v['rows_at_once'][1]}" if v.get("rows_at_once") else "-")]
            for k, v in results.items() if "ratio" in v]
    if "llama.cpp -pps" in results:
        lc = results["llama.cpp -pps"]
        rows.append(["llama.cpp -pps (shared, 1 rank's cores)", f"{lc['tokens_per_s']:.1f}", "-", "-", "-"])
    print(f"{args.prompts} prompts = {args.prefix} shared (or random) + {args.question} own tokens, {args.new} new, "
          f"batch {args.batch}, best of {args.trials}")
    print(fmt_table(["case/layout", "cache tokens/s", "off tokens/s", "ratio", "reused/prompt tokens"], rows))
    save_json(args.json, {"machine": info, "args": vars(args), "results": results})


if __name__ == "__main__":
    main()
