"""Generation speed: decode and prefill tokens/s through the real ``rlx-mpi generate``.

    python bench/bench_generate.py [--presets small,medium] [--new 17] [--prompt-len 64] [--trials 3]
                                   [--torch-python /work/torchvenv/bin/python] [--json bench/results/generate.json]
                                   [--pipeline]

Method. Every case launches ``mpiexec -n R python -m rlx_mpi generate`` twice per trial, with
``--max-new-tokens`` N and 1, on the same seeded prompts (length --prompt-len, all equal), and
reads the loop's wall time from ``--json`` (from the barrier after start-up to the last token,
so start-up is excluded). Trials interleave the cases; medians are kept. Then

    decode tokens/s  = sequences x (N - 1) / (wall_N - wall_1)
    prefill tokens/s = sequences x prompt-len / wall_1      (wall_1 = the prefill + one token)

Cases: 1 rank (all the host's cores as BLAS threads; 2 here) at batch 1 and 8; 2 ranks (one core
each) as 2 pipeline stages, with one sequence (1 group: nothing to overlap) and with 8 sequences as
2 groups of 4 in flight (stage 1 decodes one group while stage 0 decodes the other).
``--pipeline``: 2 stages against 1 rank x 2 threads at 8 and 16 prompts (issue #16), and the
pipeline's ceiling measured in the same run: two one-rank jobs side by side (``taskset`` cores 0
and 1), each decoding half the prompts through the whole model; no split of the layers over the
same two cores has less to do (no bubble, no send, each weight read once per step of a half), so "2
ranks / the bound" says how much of its ceiling the pipeline reaches. The memory-bandwidth bound at
batch 1 is the weight bytes a decode step reads (every layer + final norm + LM head; the embedding
is one row) divided by the read bandwidth of a float32 GEMV over 256 MB with the same 2 BLAS
threads, measured here.

With --torch-python (or RLX_TORCH_PYTHON) the model is a transformers ``LlamaForCausalLM`` of the
preset's shape saved and converted with ``rlx-mpi convert`` (the same weights for both), and
transformers' ``generate`` (eager, float32, KV cache, 2 threads) is timed the same way (N vs 1)
by bench/_hf_generate.py. Without it the preset's random checkpoint is used.
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

import numpy as np

from _cli import default_mpiexec, ensure_checkpoint
from _machine import add_common_args, fmt_table, header, loadavg, machine, save_json, wait_quiet

HERE = Path(__file__).resolve().parent

# (label, ranks, sequences, --batch, --groups, launcher prefix)
CASES = [("1 rank x 2 threads, batch 1", 1, 1, 1, 1, []),
         ("1 rank x 2 threads, batch 8", 1, 8, 8, 1, []),
         ("2 ranks x 1 thread, 1 sequence", 2, 1, 1, 1, []),
         ("2 ranks x 1 thread, 2 groups x 4", 2, 8, 4, 2, []),
         # one core (taskset): the rank probes 1 cpu and pins 1 BLAS thread; shows what 2 BLAS
         # threads cost on a host whose cores other jobs also use
         ("1 rank x 1 thread (taskset -c 0), batch 1", 1, 1, 1, 1, ["taskset", "-c", "0"]),
         ("1 rank x 1 thread (taskset -c 0), batch 8", 1, 8, 8, 1, ["taskset", "-c", "0"])]


PAIR = ["side by side"]  # a case's launcher prefix: run_pair, not one mpiexec

# --pipeline: #16's target, 2 stages of one core against one rank with both, at 8 and 16 prompts
PIPELINE_CASES = [("1 rank x 2 threads, batch 8", 1, 8, 8, 1, []),
                  ("2 ranks x 1 thread, 2 groups x 4", 2, 8, 4, 2, []),
                  ("1 rank x 2 threads, batch 16", 1, 16, 16, 1, []),
                  ("2 ranks x 1 thread, 2 groups x 8", 2, 16, 8, 2, []),
                  ("2 ranks x 1 thread, 4 groups x 4", 2, 16, 4, 4, []),
                  # the same 2 ranks as one stage of tensor parallelism (each holds half of every
                  # layer, so no weight is read twice per step): the one-host layout to compare with
                  ("2 ranks x 1 thread, tp 2, batch 8", 2, 8, 8, 1, [], 2),
                  ("2 ranks x 1 thread, tp 2, batch 16", 2, 16, 16, 1, [], 2),
                  # the pipeline's ceiling, measured: two independent one-rank jobs side by side,
                  # one core each, each decoding half the prompts through the whole model. No
                  # split of the layers over the two cores can beat this (it has no bubble, no send,
                  # and each core reads every weight once per step of its half), so a pipeline at
                  # G groups of b rows is at most this case's figure with b rows per job
                  ("bound: 2 jobs x 1 core side by side, 4 prompts each", 2, 8, 4, 1, PAIR),
                  ("bound: 2 jobs x 1 core side by side, 8 prompts each", 2, 16, 8, 1, PAIR)]


def write_prompts(path: Path, n: int, length: int, vocab: int) -> Path:
    ids = np.random.default_rng(0).integers(0, vocab, (max(n, 8), length))[:n]  # the first 8 as _hf_generate.prompts
    path.write_text("".join(json.dumps({"id": f"b{i}", "tokens": row.tolist()}) + "\n" for i, row in enumerate(ids)))
    return path


def generate_cmd(ranks: int, job: Path, prompts: Path, out: Path, stats: Path, new: int, batch: int, groups: int,
                 mpiexec: str, prefix: list[str]) -> list[str]:
    """The ``generate`` launch of one case, with its old outputs removed first."""
    for p in (out, stats):
        if p.exists():
            p.unlink()
    return [*prefix, mpiexec, "-n", str(ranks), sys.executable, "-m", "rlx_mpi", "generate", str(job), "--prompts",
            str(prompts), "--out", str(out), "--json", str(stats), "--max-new-tokens", str(new), "--batch", str(batch),
            "--groups", str(groups)]


def run_generate(ranks: int, job: Path, prompts: Path, out: Path, stats: Path, new: int, batch: int, groups: int,
                 mpiexec: str, prefix: list[str]) -> float:
    cmd = generate_cmd(ranks, job, prompts, out, stats, new, batch, groups, mpiexec, prefix)
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
    return json.loads(stats.read_text())["wall_s"]


def run_pair(job: Path, prompts: Path, folder: Path, new: int, batch: int, mpiexec: str) -> float:
    """Two one-rank ``generate`` jobs at once, on cores 0 and 1, each with its half of ``prompts``;
    the later of their two walls (each from its barrier after start-up to its last token)."""
    lines = prompts.read_text().splitlines(keepends=True)
    half = len(lines) // 2
    procs, stats = [], []
    for core, part in enumerate((lines[:half], lines[half:])):
        p, st = folder / f"pair{core}.jsonl", folder / f"pair_stats{core}.json"
        p.write_text("".join(part))
        cmd = generate_cmd(1, job, p, folder / f"pair_out{core}.jsonl", st, new, batch, 1, mpiexec,
                           ["taskset", "-c", str(core)])
        procs.append((cmd, subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)))
        stats.append(st)
    for cmd, proc in procs:
        _, err = proc.communicate(timeout=1800)
        if proc.returncode:
            raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{err[-2000:]}")
    return max(json.loads(st.read_text())["wall_s"] for st in stats)


def gemv_bandwidth(threads: int = 2) -> float:
    """Bytes/s of a float32 matrix-vector product over 256 MB (the decode step's access pattern)."""
    from threadpoolctl import threadpool_limits

    w = np.random.default_rng(0).standard_normal((8192, 8192), dtype=np.float32)
    x = np.ones(8192, np.float32)
    best = float("inf")
    with threadpool_limits(threads):
        w @ x
        for _ in range(7):
            t0 = time.perf_counter()
            w @ x
            best = min(best, time.perf_counter() - t0)
    return w.nbytes / best


WEIGHT_BYTES = {"f32": 4, "bf16": 2, "f16": 2, "int8": 1}  # per weight (int8's per-row scales left out)


def decode_bytes(cfg, precision: str = "f32") -> int:
    """Weight bytes one decode step reads: every layer, the final norm and the LM head."""
    return WEIGHT_BYTES[precision] * (cfg.num_hidden_layers * cfg.layer_params() + cfg.hidden_size * (cfg.vocab_size + 1))


def bench_preset(preset: str, args, folder: Path, mpiexec: str) -> dict:
    from rlx_mpi.families.llama import PRESETS

    cfg = PRESETS[preset]
    torch_py = args.torch_python or os.environ.get("RLX_TORCH_PYTHON")
    ckpt = folder / f"{preset}.h5"
    hf = None
    if torch_py:
        hf_dir = folder / f"hf_{preset}"
        from dataclasses import asdict

        subprocess.run([torch_py, str(HERE / "_hf_generate.py"), "build", "--preset", preset, "--hf-dir", str(hf_dir),
                        "--dims", json.dumps(asdict(cfg))], check=True, capture_output=True)
        from rlx_mpi.families import convert_hf

        convert_hf(hf_dir, ckpt)
    else:
        ensure_checkpoint(ckpt, preset)
    jobs = {}
    for tp in (1, 2):  # a case's 7th field, when it has one, is its tp
        jobs[tp] = folder / f"{preset}_tp{tp}.toml"
        jobs[tp].write_text(f'[model]\ncheckpoint = "{ckpt}"\n[run]\ntimeout_s = 600.0\nprecision = "{args.precision}"\n'
                            f'[placement]\nreserve_ram_gb = 0.0\ntp = {tp}\n')
    cases = [c if len(c) == 7 else (*c, 1) for c in (PIPELINE_CASES if args.pipeline else CASES)]
    prompts = {n: write_prompts(folder / f"p{n}.jsonl", n, args.prompt_len, cfg.vocab_size) for n in (1, 8, 16)}
    walls: dict[str, dict[int, list[float]]] = {c[0]: {1: [], args.new: []} for c in cases}
    for trial in range(args.trials):
        for label, ranks, seqs, batch, groups, prefix, tp in cases:
            for n in (1, args.new):
                wait_quiet(args.quiet, args.quiet_wait)
                if prefix is PAIR:
                    walls[label][n].append(run_pair(jobs[tp], prompts[seqs], folder, n, batch, mpiexec))
                    continue
                walls[label][n].append(run_generate(ranks, jobs[tp], prompts[seqs], folder / "out.jsonl",
                                                    folder / "stats.json", n, batch, groups, mpiexec, prefix))
        print(f"  {preset}: trial {trial + 1}/{args.trials} done (load {loadavg()})", file=sys.stderr, flush=True)
    rows = {}
    for label, ranks, seqs, batch, groups, _, tp in cases:
        w1, wn = statistics.median(walls[label][1]), statistics.median(walls[label][args.new])
        rows[label] = {"ranks": ranks, "tp": tp, "sequences": seqs, "batch": batch, "groups": groups, "wall_1": w1, "wall_n": wn,
                       "walls": walls[label], "decode_tok_s": seqs * (args.new - 1) / max(wn - w1, 1e-9),
                       "prefill_tok_s": seqs * args.prompt_len / w1}
    if args.pipeline:
        c = [rows[case[0]] for case in PIPELINE_CASES]
        return {"preset": preset, "cases": rows, "ratios": {
            "8 prompts: 2 ranks (2 groups x 4) / 1 rank x 2 threads, decode": c[1]["decode_tok_s"] / c[0]["decode_tok_s"],
            "16 prompts: 2 ranks (2 groups x 8) / 1 rank x 2 threads, decode": c[3]["decode_tok_s"] / c[2]["decode_tok_s"],
            "16 prompts: 2 ranks (4 groups x 4) / 1 rank x 2 threads, decode": c[4]["decode_tok_s"] / c[2]["decode_tok_s"],
            "8 prompts: 2 ranks as tp 2 / 1 rank x 2 threads, decode": c[5]["decode_tok_s"] / c[0]["decode_tok_s"],
            "16 prompts: 2 ranks as tp 2 / 1 rank x 2 threads, decode": c[6]["decode_tok_s"] / c[2]["decode_tok_s"],
            "8 prompts: the bound (2 one-core jobs, 4 prompts each) / 1 rank x 2 threads, decode":
                c[7]["decode_tok_s"] / c[0]["decode_tok_s"],
            "16 prompts: the bound (2 one-core jobs, 8 prompts each) / 1 rank x 2 threads, decode":
                c[8]["decode_tok_s"] / c[2]["decode_tok_s"],
            "8 prompts: 2 ranks (2 groups x 4) / the bound, decode": c[1]["decode_tok_s"] / c[7]["decode_tok_s"],
            "16 prompts: 2 ranks (2 groups x 8) / the bound, decode": c[3]["decode_tok_s"] / c[8]["decode_tok_s"],
            "8 prompts: 2 ranks / 1 rank, whole wall (prefill included)": c[0]["wall_n"] / c[1]["wall_n"],
            "16 prompts: 2 ranks (2 x 8) / 1 rank, whole wall (prefill included)": c[2]["wall_n"] / c[3]["wall_n"]}}
    bw = gemv_bandwidth(2)
    bound = bw / decode_bytes(cfg, args.precision)
    doc = {"preset": preset, "cases": rows, "gemv_bandwidth_GBs": bw / 1e9, "decode_bytes": decode_bytes(cfg, args.precision),
           "bound_tok_s_batch1": bound}
    if torch_py:  # 2 threads (as our 1 rank) and 1 thread (as our taskset case)
        hf = {}
        for threads in (2, 1):
            proc = subprocess.run([torch_py, str(HERE / "_hf_generate.py"), "time", "--hf-dir",
                                   str(folder / f"hf_{preset}"), "--threads", str(threads), "--prompt-len",
                                   str(args.prompt_len), "--new", str(args.new), "--trials", str(args.trials)],
                                  check=True, capture_output=True, text=True)
            hf[threads] = json.loads(proc.stdout.strip().splitlines()[-1])
            for b, r in hf[threads]["batches"].items():
                r["decode_tok_s"] = int(b) * (args.new - 1) / max(r["wall_n"] - r["wall_1"], 1e-9)
                r["prefill_tok_s"] = int(b) * args.prompt_len / r["wall_1"]
        doc["transformers"] = hf
    one1, one8 = rows[CASES[0][0]], rows[CASES[1][0]]
    two1, two8 = rows[CASES[2][0]], rows[CASES[3][0]]
    solo1, solo8 = rows[CASES[4][0]], rows[CASES[5][0]]
    doc["ratios"] = {
        "2 ranks (2 groups x 4) / 1 rank batch 8, decode": two8["decode_tok_s"] / one8["decode_tok_s"],
        "2 ranks (1 sequence) / 1 rank batch 1, decode": two1["decode_tok_s"] / one1["decode_tok_s"],
        "1 rank batch 1 decode / bandwidth bound": one1["decode_tok_s"] / bound,
        "batch 8 / batch 1 decode, 1 rank": one8["decode_tok_s"] / one1["decode_tok_s"],
        "1 rank x 1 thread / 1 rank x 2 threads decode, batch 1": solo1["decode_tok_s"] / one1["decode_tok_s"],
        "1 rank x 1 thread / 1 rank x 2 threads decode, batch 8": solo8["decode_tok_s"] / one8["decode_tok_s"],
        "2 ranks (2 groups x 4) / 1 rank x 1 thread batch 8, decode": two8["decode_tok_s"] / solo8["decode_tok_s"],
        "1 rank x 1 thread batch 1 decode / bandwidth bound (2 threads)": solo1["decode_tok_s"] / bound,
    }
    if hf:
        for threads, cases in ((2, (("1", one1), ("8", one8))), (1, (("1", solo1), ("8", solo8)))):
            for b, mine in cases:
                theirs = hf[threads]["batches"][b]
                what = f"batch {b}, {threads} thread{'s' if threads > 1 else ''}"
                doc["ratios"][f"ours / transformers decode, {what}"] = mine["decode_tok_s"] / theirs["decode_tok_s"]
                doc["ratios"][f"ours / transformers prefill, {what}"] = mine["prefill_tok_s"] / theirs["prefill_tok_s"]
    return doc


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--presets", default="small,medium")
    ap.add_argument("--new", type=int, default=17, help="new tokens per sequence in the long run (default 17)")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--torch-python", help="a Python with torch + transformers (or env RLX_TORCH_PYTHON)")
    ap.add_argument("--mpiexec", default=default_mpiexec())
    ap.add_argument("--precision", default="f32", choices=["f32", "bf16", "f16", "int8"],
                    help="[run] precision of every rank's weights (default f32)")
    ap.add_argument("--pipeline", action="store_true",
                    help="only 2 stages x 1 thread (and the same 2 ranks as tp 2) against 1 rank x 2 threads at 8 "
                         "and 16 prompts (issue #16's target)")
    add_common_args(ap, quiet_wait_s=20.0)
    args = ap.parse_args()
    info = machine()
    print(header("rlx-mpi generate: decode and prefill tokens/s", info))
    docs = []
    with tempfile.TemporaryDirectory(prefix="rlx_bench_gen_") as tmp:
        for preset in args.presets.split(","):
            doc = bench_preset(preset, args, Path(tmp), args.mpiexec)
            docs.append(doc)
            head = ["case", "decode tok/s", "prefill tok/s"]
            table = [[k, f"{v['decode_tok_s']:.1f}", f"{v['prefill_tok_s']:.1f}"] for k, v in doc["cases"].items()]
            for threads, hf in (doc.get("transformers") or {}).items():
                for b, r in hf["batches"].items():
                    table.append([f"transformers generate, batch {b}, {threads} thread(s)", f"{r['decode_tok_s']:.1f}",
                                  f"{r['prefill_tok_s']:.1f}"])
            if "bound_tok_s_batch1" in doc:
                print(f"\n{preset}: bandwidth bound at batch 1 {doc['bound_tok_s_batch1']:.1f} tok/s "
                      f"({doc['decode_bytes'] / 1e6:.0f} MB per step at {doc['gemv_bandwidth_GBs']:.1f} GB/s)")
            print(fmt_table(head, table))
            for k, v in doc["ratios"].items():
                print(f"  {k}: {v:.2f}")
            sys.stdout.flush()
            save_json(args.json, {"machine": info, "loadavg_end": loadavg(), "new": args.new,  # after each preset
                                  "prompt_len": args.prompt_len, "trials": args.trials, "precision": args.precision,
                                  "presets": docs})
    save_json(args.json, {"machine": info, "loadavg_end": loadavg(), "new": args.new, "prompt_len": args.prompt_len,
                          "trials": args.trials, "precision": args.precision, "presets": docs})


if __name__ == "__main__":
    main()
