"""rlx_mpi against llama.cpp (the CPU anchor, issue 16) on one host, same model, same cores, one run.

    python bench/bench_llamacpp.py --llama-bin DIR/build/bin --workdir DIR [--threads 1,2] [--trials 3]
        [--torch-python PY --gguf-python PY --hf-to-gguf PATH]   (only to make the models once)
        [--json bench/results/llamacpp.json]

Options may come from the environment instead: RLX_LLAMA_BIN, RLX_TORCH_PYTHON, RLX_GGUF_PYTHON,
RLX_HF_TO_GGUF (the anchor's hf_to_gguf.py; ../shared/anchors/llamacpp/ builds llama.cpp and
its gguf venv). Nothing here names a machine path.

The model (made once in --workdir, reused after): a transformers random Llama of the medium
preset's shape with a vocabulary of 8192 (205 M parameters) saved by bench/_hf_generate.py,
converted to GGUF f32 / bf16 / q8_0 by hf_to_gguf.py and to our checkpoint by
``rlx-mpi convert``: the same weights on both sides. Our int8 (one float32 scale per 64 weights
of a row) is set against llama.cpp's q8_0 (one f16 scale per 32 weights).

Cases, each side pinned to the same first T cores (``taskset -c 0..T-1``; our rank probes T
cpus and pins T BLAS/numba threads; llama.cpp gets ``-t T``), trials interleaved, medians:

- batch-1 decode after 32 cached tokens, f32 / bf16 / int8-vs-q8_0: ours = 32 / the decode
  time (``decode_ms`` of ``generate --json``, the table's column) of a 32-token prompt and 33
  new tokens; theirs = ``llama-bench -p 0 -n 32 -d 32 -fa off`` (median of its per-repetition
  t/s); both time the decode evaluations alone.
- 8 prompts x 32 new tokens, f32, new tokens over the whole time (prefill included): ours =
  8 x 32 / wall (``--batch 8``); theirs = ``llama-batched-bench -npp 32 -ntg 32 -npl 8
  -ctk f32 -ctv f32 -fa off``: B x TG / T.
- prefill of 128 and 512 tokens, f32, batch 1, warm on both sides: theirs = ``llama-bench -p P
  -n 0 -fa off -r 1`` (a warm-up run, then one timed); ours = P / the median time of the 2nd to
  4th of four P-token prompts in one ``generate`` (batch 1, 1 new token each: a row's ``ms``,
  from taking its slot to its token, so sampling is counted against us). The first prefill of a
  process is left out as llama-bench's warm-up is: it pays OpenBLAS's buffers and threads coming
  up (0-80 ms of a ~550 ms 128-token prefill at 2 threads here; until 2026-12-01 19:55 the bench
  took that single cold prefill).
- decode as a fraction of the memory-bandwidth bound: weight bytes a decode step reads (every
  layer, final norm and head in the side's own format: q8_0 is 34 bytes per 32 weights, our
  int8 1 byte per weight plus a 4-byte scale per 64) over the copy bandwidth measured here with T
  threads (a numba parallel copy of 256 MB, read + write bytes, as STREAM counts them), and over
  the read bandwidth (a numba parallel sum of 256 MB: a decode step only reads; on the 2-core
  VM the copy probe gave less at 2 threads than at 1, the read probe 1.4-1.6x more).
- q4 (issue 32; ``--skip q4`` leaves it out): our ``q4`` (4-bit codes, an f16 scale and minimum
  per 32 weights, from ``rlx-mpi convert --dtype q4``) against llama.cpp's Q4_0 and Q4_K_M, both
  made from the same f32 GGUF by ``llama-quantize``: batch-1 decode (as above; one run of ours
  set against each of theirs), 8 prompts x 32 new whole time (as above, q4 against each), prefill
  128 and 512 (as above, against Q4_0's pp128 / pp512); the bandwidth fractions with each side's own bytes (ours:
  half a byte a weight and 4 bytes a group of 32; theirs: the GGUF's tensors bar the embedding, read
  with gguf's reader); our resident weight bytes over float32's (the stage's own count, target
  <= 0.16); and the accuracy below for q4, Q4_0 and Q4_K_M.
- accuracy against the f32 model on the same 8 x 256 random tokens (ids 3..V-1; the GGUF's
  stand-in vocabulary maps token i to one character, checked with llama-tokenize): ours from
  ``rlx-mpi run --out`` logits at f32 and int8 (and bf16), theirs from ``llama-perplexity -c 256
  --kl-divergence`` (q8_0 and bf16 against f32). Both score the second half of each 256-token
  chunk, as llama-perplexity does: top-1 agreement with the f32 model and mean KL(f32 || q).

``--baseline-tree DIR`` (an A/B of our side: another checkout of rlx_mpi, e.g. ``git worktree
add DIR REV``): each of our runs is taken again right after from DIR (``PYTHONPATH=DIR``, its
own numba cache; run from DIR, as ``python -m`` puts the working folder first), and a column gives this tree's median over the baseline's (> 1: this tree is
faster; issue 42's "within 3 % of before").

Each case reports the ratio of the two sides' medians and, as ``paired``, the median of each
trial's own ratio (the two sides run back to back, so host drift between trials cancels).

wall is ``generate --json``'s wall_s (from the barrier after start-up to the last token), so
start-up and loading are excluded on our side; llama-bench excludes them too. Only ratios
taken in one run mean anything, and only on an otherwise idle host (ggml's threads spin at
every barrier; a busy core collapses its 2-thread figures).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np

from _cli import default_mpiexec
from _machine import add_common_args, fmt_table, header, loadavg, machine, save_json, wait_quiet
from bench_generate import run_generate, write_prompts

HERE = Path(__file__).resolve().parent
VOCAB = 8192
PREC = {"f32": "f32", "bf16": "bf16", "int8": "q8_0"}  # ours -> the GGUF it is set against
Q4_GGUF = {"q4_0": "Q4_0", "q4_k_m": "Q4_K_M"}  # llama.cpp's 4-bit files (llama-quantize types) our q4 is set against
CTX = 256  # accuracy chunk length (llama-perplexity -c); the second half of each chunk is scored
CHUNKS = 8  # 8 x 127 = 1016 scored positions


def paired_ratio(ours: list[float], theirs: list[float]) -> float:
    """The median of each trial's ratio (ours / theirs, the two taken back to back). The host's
    speed drifts between trials (on the 2-core VM both sides' tokens/s moved up to 2x within an
    hour), which the ratio of the two medians does not cancel and a trial's own ratio does."""
    return statistics.median(a / b for a, b in zip(ours, theirs))


def _opt(value: str | None, env: str, what: str, required: bool = True) -> str | None:
    value = value or os.environ.get(env)
    if required and not value:
        raise SystemExit(f"bench_llamacpp: {what} not given; pass it as an option or set {env}")
    return value


def _run(cmd: list[str], timeout: float = 3600.0) -> str:
    proc = subprocess.run(cmd, capture_output=True, text=True, errors="replace", timeout=timeout)  # llama-quantize prints raw token bytes
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return proc.stdout + proc.stderr


def _cores(threads: int) -> list[str]:
    return ["taskset", "-c", f"0-{threads - 1}" if threads > 1 else "0"]


# -- the models ---------------------------------------------------------------------------------

def prepare(work: Path, args) -> dict:
    """The HF directory, the three GGUFs and our checkpoint in ``work`` (made when missing)."""
    preset = args.preset
    hf = work / f"hf_{preset}"
    if not (hf / "config.json").exists():
        from rlx_mpi.families import find_preset

        dims = asdict(find_preset(preset)[1])
        torch_py = _opt(args.torch_python, "RLX_TORCH_PYTHON", "--torch-python (to make the HF model)")
        _run([torch_py, str(HERE / "_hf_generate.py"), "build", "--preset", preset, "--vocab", str(VOCAB),
              "--dims", json.dumps(dims), "--hf-dir", str(hf)])
    ggufs = {t: work / f"{preset}-{t}.gguf" for t in PREC.values()}
    if not all(p.exists() for p in ggufs.values()):
        py = _opt(args.gguf_python, "RLX_GGUF_PYTHON", "--gguf-python (a Python with gguf)")
        conv = _opt(args.hf_to_gguf, "RLX_HF_TO_GGUF", "--hf-to-gguf (the anchor's hf_to_gguf.py)")
        _run([py, conv, str(hf), "--outdir", str(work), "--types", ",".join(PREC.values()), "--name", preset])
    ckpt = work / f"{preset}.h5"
    if not ckpt.exists():
        _run([sys.executable, "-m", "rlx_mpi", "convert", str(hf), str(ckpt)])
    out = {"hf": hf, "gguf": ggufs, "ckpt": ckpt, "config": json.loads((hf / "config.json").read_text())}
    if "q4" not in args.skip_set:
        for name, qtype in Q4_GGUF.items():
            ggufs[name] = work / f"{preset}-{name}.gguf"
            if not ggufs[name].exists():
                bin_dir = Path(_opt(args.llama_bin, "RLX_LLAMA_BIN", "--llama-bin (llama.cpp's build/bin)"))
                _run([str(bin_dir / "llama-quantize"), str(ggufs["f32"]), str(ggufs[name]), qtype])
        out["ckpt_q4"] = work / f"{preset}-q4.h5"
        if not out["ckpt_q4"].exists():
            _run([sys.executable, "-m", "rlx_mpi", "convert", str(hf), str(out["ckpt_q4"]), "--dtype", "q4"])
    return out


def weight_bytes(cfg: dict, fmt: str) -> float:
    """Bytes one decode step reads in ``fmt``: every layer's matrices and norms, the final norm
    and the head (the embedding is one row). Norms are float32 in every format."""
    h, i, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    hd = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    rows_cols = [(q, h), (kv, h), (kv, h), (h, q), (i, h), (i, h), (h, i)] * cfg["num_hidden_layers"] + [(v, h)]
    per = {"f32": 4.0, "bf16": 2.0, "q8_0": 34 / 32, "int8": 1.0, "q4": 0.5 + 4 / 32, "q4_0": 18 / 32}[fmt]
    total = sum(n * k * per + (4 * n * -(-k // 64) if fmt == "int8" else 0) for n, k in rows_cols)
    return total + 4 * h * (2 * cfg["num_hidden_layers"] + 1)


def gguf_weight_bytes(gguf_python: str, path: Path) -> float:
    """Bytes of a GGUF's tensors but the embedding (a decode step reads one row of it), by gguf's
    own reader: Q4_K_M mixes Q4_K, Q6_K and float32 tensors, so its bytes are counted, not priced."""
    code = ("import sys, gguf\n"
            "r = gguf.GGUFReader(sys.argv[1])\n"
            "print(sum(int(t.n_bytes) for t in r.tensors if t.name != 'token_embd.weight'))\n")
    return float(_run([gguf_python, "-c", code, str(path)]).split()[-1])


def q4_resident_fraction(ckpt: Path) -> float:
    """Our q4 stage's resident weight bytes over the float32 bytes of the same tensors."""
    from rlx_mpi.model.checkpoint import H5ParamSource, read_header
    from rlx_mpi.families import get_family

    family_name, config_json = read_header(ckpt)
    family = get_family(family_name)
    cfg = family.load_config(config_json, str(ckpt))
    with H5ParamSource(ckpt, family.expected_shapes(cfg)) as src:
        stage = family.build_stage(cfg, src, range(family.dims(cfg).n_layers), True, True, precision="q4")
    f32 = sum(4 * int(np.prod(s)) for s in family.expected_shapes(cfg).values())
    return stage.weight_bytes / f32


def copy_bandwidth(threads: int) -> float:
    """Read + write bytes/s of a 256 MB float32 copy on ``threads`` numba threads (best of 7)."""
    import numba

    @numba.njit(parallel=True)
    def copy(src, dst):
        for i in numba.prange(src.shape[0]):
            dst[i] = src[i]

    src = np.ones(64 << 20, np.float32)
    dst = np.empty_like(src)
    numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
    return 2 * src.nbytes / _best_of(lambda: copy(src, dst))


def _best_of(fn, reps: int = 7) -> float:
    """The shortest of ``reps`` timed calls of ``fn``, after one untimed call (compile, page in)."""
    fn()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def read_bandwidth(threads: int) -> float:
    """Bytes/s read by a sum over 256 MB of float32 on ``threads`` numba threads (best of 7): the
    access pattern of a decode step, which only reads its weights."""
    import numba

    @numba.njit(fastmath=True)
    def part(src, lo, hi):  # unsigned indices: numba's negative-index wrap kept a signed loop scalar
        acc = np.float32(0.0)
        for i in range(np.uint64(lo), np.uint64(hi)):
            acc += src[i]
        return acc

    @numba.njit(parallel=True)
    def total(src, chunks):
        parts = np.zeros(chunks, np.float32)
        n = src.shape[0]
        for c in numba.prange(chunks):
            parts[c] = part(src, c * n // chunks, (c + 1) * n // chunks)
        return parts.sum()

    src = np.ones(64 << 20, np.float32)
    numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))
    return src.nbytes / _best_of(lambda: total(src, 4 * threads))


# -- one side each --------------------------------------------------------------------------

def _job(folder: Path, ckpt: Path, precision: str) -> Path:
    job = folder / f"job_{precision}.toml"
    job.write_text(f'[model]\ncheckpoint = "{ckpt}"\n[run]\nprecision = "{precision}"\ntimeout_s = 600.0\n'
                   '[placement]\nreserve_ram_gb = 0.0\n')
    return job


def ours(folder: Path, job: Path, prompts: Path, new: int, batch: int, threads: int, mpiexec: str) -> float:
    """Wall seconds of one ``generate`` (start-up excluded) on the first ``threads`` cores."""
    return run_generate(1, job, prompts, folder / "out.jsonl", folder / "stats.json", new, batch, 1, mpiexec,
                        _cores(threads))


def ours_decode(folder: Path, job: Path, prompts: Path, new: int, threads: int, mpiexec: str) -> float:
    """Batch-1 decode tokens/s of one ``generate``: the new - 1 decode steps over their time in
    the generate table (decode_ms: the stage's decode steps, sampling apart), as llama-bench's tg
    times its decode evaluations alone."""
    ours(folder, job, prompts, new, 1, threads, mpiexec)
    rows = json.loads((folder / "stats.json").read_text())["rows"]
    return (new_tokens(folder) - 1) / (max(r["decode_ms"] for r in rows) / 1e3)


def _batch8(folder: Path, job: Path, prompts: Path, threads: int, mpiexec: str) -> float:
    """New tokens a second of 8 prompts x 32 new (batch 8), over the whole time: the run first,
    then its output's tokens (read before it, they were the last run's)."""
    wall = ours(folder, job, prompts, 32, 8, threads, mpiexec)
    return new_tokens(folder) / wall


def _prefill(folder: Path, job: Path, prompts: Path, n: int, threads: int, mpiexec: str) -> float:
    """Prefill tokens/s of ``n``-token prompts: ``n`` over the median ``ms`` of the 2nd to 4th row
    (the first prefill of a process is cold, as llama-bench's warm-up run is left out)."""
    ours(folder, job, prompts, 1, 1, threads, mpiexec)
    done = [json.loads(line) for line in (folder / "out.jsonl").read_text().splitlines()]
    return n / (statistics.median(r["ms"] for r in done[1:]) / 1e3)


def new_tokens(folder: Path) -> int:
    """New tokens of the last ``generate``'s completions: fewer than asked where a row sampled
    an end-of-sequence id (llama.cpp's benches never stop early; a random model's greedy text may:
    seen on the small preset at q4), so rates count the tokens made, not the tokens asked for."""
    return sum(json.loads(line)["new_tokens"] for line in (folder / "out.jsonl").read_text().splitlines() if line)


def llama_bench(bin_dir: Path, gguf: Path, threads: int, reps: int, *, p: int, n: int, d: int = 0) -> float:
    """Median t/s over llama-bench's repetitions."""
    out = _run([*_cores(threads), str(bin_dir / "llama-bench"), "-m", str(gguf), "-p", str(p), "-n", str(n),
                "-d", str(d), "-t", str(threads), "-fa", "off", "-r", str(reps), "-o", "json"])
    rows = json.loads(out[out.index("["):out.rindex("]") + 1])
    return statistics.median(rows[0]["samples_ts"])


def llama_batched(bin_dir: Path, gguf: Path, threads: int, npp: int, ntg: int, npl: int) -> float:
    """New tokens over the whole time (prefill included) of llama-batched-bench: B x TG / T."""
    out = _run([*_cores(threads), str(bin_dir / "llama-batched-bench"), "-m", str(gguf), "-c", "2048",
                "-npp", str(npp), "-ntg", str(ntg), "-npl", str(npl), "-t", str(threads), "-tb", str(threads),
                "-fa", "off", "-ctk", "f32", "-ctv", "f32", "--output-format", "jsonl"])
    for line in out.splitlines():
        if line.startswith("{") and '"speed_tg"' in line:
            row = json.loads(line)
            if (row["pp"], row["tg"], row["pl"]) == (npp, ntg, npl):
                return npl * ntg / row["t"]
    raise SystemExit(f"llama-batched-bench: no result row for PP {npp} TG {ntg} B {npl} in:\n{out[-2000:]}")


# -- accuracy ---------------------------------------------------------------------------------

def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    x -= x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def accuracy(m: dict, args, folder: Path, bin_dir: Path, mpiexec: str) -> dict:
    """Top-1 agreement and mean KL against the f32 model: ours at bf16 / int8 (/ q4), llama.cpp's bf16 /
    q8_0 (/ Q4_0 / Q4_K_M)."""
    import h5py

    ids = np.random.default_rng(1).integers(3, VOCAB, (CHUNKS, CTX))
    np.save(folder / "ids.npy", ids)
    scored = slice(CTX // 2, CTX - 1)  # logits at t predict token t + 1 (llama-perplexity's first = n_ctx / 2)
    logits = {}
    with_q4 = "q4" not in args.skip_set
    ours_prec = ("bf16", "int8", "q4") if with_q4 else ("bf16", "int8")
    for prec in ("f32", *ours_prec):
        _run([mpiexec, "-n", "1", sys.executable, "-m", "rlx_mpi", "run", str(_job(folder, m["ckpt"], prec)),
              "--input-ids", str(folder / "ids.npy"), "--out", str(folder / f"logits_{prec}.h5")])
        with h5py.File(folder / f"logits_{prec}.h5", "r") as f:
            logits[prec] = f["logits"][:, scored]
    base = _log_softmax(logits["f32"])
    doc = {"positions": int(base.shape[0] * base.shape[1]), "ours": {}, "llama.cpp": {}}
    for prec in ours_prec:
        lq = _log_softmax(logits[prec])
        doc["ours"][prec] = {"top1_agreement": float((lq.argmax(-1) == base.argmax(-1)).mean()),
                             "mean_kld": float((np.exp(base) * (base - lq)).sum(-1).mean()),
                             "max_abs_logit_err_rel": float(np.abs(logits[prec] - logits["f32"]).max()
                                                            / np.abs(logits["f32"]).max())}
    text = folder / "tokens.txt"
    text.write_text("".join(chr(0xF0000 + int(i)) for i in ids.reshape(-1)), encoding="utf-8")  # hf_to_gguf's spm map
    tok = _run([str(bin_dir / "llama-tokenize"), "-m", str(m["gguf"]["f32"]), "-f", str(text), "--ids", "--log-disable"])
    got = [int(t) for t in re.findall(r"-?\d+", tok[tok.rindex("["):])]
    doc["llama.cpp_tokens_match"] = got == ids.reshape(-1).tolist()
    kl_base = folder / "kl_base.dat"
    common = ["-f", str(text), "-c", str(CTX), "-b", str(CTX), "-t", str(max(args.threads_list)), "-fa", "off"]
    _run([str(bin_dir / "llama-perplexity"), "-m", str(m["gguf"]["f32"]), *common, "--kl-divergence-base", str(kl_base)])
    for fmt in ("bf16", "q8_0", *(Q4_GGUF if with_q4 else ())):
        out = _run([str(bin_dir / "llama-perplexity"), "-m", str(m["gguf"][fmt]), *common, "--kl-divergence-base",
                    str(kl_base), "--kl-divergence"])
        kld = re.search(r"Mean\s+KLD:\s*([-+\d.eE]+)", out)
        same = re.search(r"Same top p:\s*([\d.]+)", out)
        doc["llama.cpp"][fmt] = {"top1_agreement": float(same.group(1)) / 100 if same else None,
                                 "mean_kld": float(kld.group(1)) if kld else None}
    return doc


# -- the run ----------------------------------------------------------------------------------

def q4_trial(folder: Path, job: Path, m: dict, p32: dict, plong: dict, new: int, t: int, skip: set, args,
             bin_dir: Path, mine: dict, theirs: dict) -> None:
    """One trial of the q4 cases on ``t`` threads: each of our runs set against Q4_0 and Q4_K_M."""
    if "decode" not in skip:
        wait_quiet(args.quiet, args.quiet_wait)
        ours_ts = BASE.take(f"decode batch 1, q4, {t} thread(s)", lambda: ours_decode(folder, job, p32[1], new, t, args.mpiexec))
        for name, q in Q4_GGUF.items():
            key = f"decode batch 1, q4 vs {q}, {t} thread(s)"
            mine.setdefault(key, []).append(ours_ts)
            theirs.setdefault(key, []).append(llama_bench(bin_dir, m["gguf"][name], t, 1, p=0, n=32, d=32))
    if "batch8" not in skip:
        wait_quiet(args.quiet, args.quiet_wait)
        ours_ts = BASE.take(f"8 prompts x 32 new, whole time, q4, {t} thread(s)",
                            lambda: _batch8(folder, job, p32[8], t, args.mpiexec))
        for name, q in Q4_GGUF.items():
            key = f"8 prompts x 32 new, whole time, q4 vs {q}, {t} thread(s)"
            mine.setdefault(key, []).append(ours_ts)
            theirs.setdefault(key, []).append(llama_batched(bin_dir, m["gguf"][name], t, 32, 32, 8))
    if "prefill" not in skip:
        for n in (128, 512):  # 128 / 512 rows a product: kernels/q4gemm.py on AVX-512 VNNI
            key = f"prefill {n}, q4 vs Q4_0, {t} thread(s)"
            wait_quiet(args.quiet, args.quiet_wait)
            mine.setdefault(key, []).append(BASE.take(key, lambda: _prefill(folder, job, plong[n], n, t, args.mpiexec)))
            theirs.setdefault(key, []).append(llama_bench(bin_dir, m["gguf"]["q4_0"], t, 1, p=n, n=0))


class _Baseline:
    """Our runs taken twice, from this tree and from ``--baseline-tree`` (its ``PYTHONPATH``)."""

    def __init__(self, tree: str | None):
        self.tree, self.rates, self.here = tree, {}, {}

    def take(self, key: str, fn):
        """``fn()`` here and, with a baseline, from it too (recorded under ``key``), in turns: the
        baseline first every other time, so neither side always follows llama.cpp's runs; this
        tree's value."""
        if not self.tree:
            return fn()
        first = len(self.here.get(key, [])) % 2 == 1
        if first:
            self.rates.setdefault(key, []).append(self._from_baseline(fn))
        value = fn()
        self.here.setdefault(key, []).append(value)
        if not first:
            self.rates.setdefault(key, []).append(self._from_baseline(fn))
        return value

    def _from_baseline(self, fn):
        old, here = os.environ.get("PYTHONPATH"), os.getcwd()
        os.environ["PYTHONPATH"] = self.tree
        os.chdir(self.tree)  # (``python -m`` puts the working folder before PYTHONPATH)
        try:
            return fn()
        finally:
            os.chdir(here)
            if old is None:
                os.environ.pop("PYTHONPATH")
            else:
                os.environ["PYTHONPATH"] = old

    def compile(self) -> None:
        if self.tree:
            subprocess.run([sys.executable, "-m", "rlx_mpi", "compile-kernels"], env={**os.environ, "PYTHONPATH": self.tree},
                           cwd=self.tree, capture_output=True, timeout=1800, check=True)
            seen = subprocess.run([sys.executable, "-c", "import rlx_mpi; print(rlx_mpi.__file__)"], cwd=self.tree,
                                  env={**os.environ, "PYTHONPATH": self.tree}, capture_output=True, text=True).stdout.strip()
            if not seen.startswith(self.tree):
                raise SystemExit(f"--baseline-tree {self.tree}: its runs import {seen}, not the baseline's rlx_mpi")
            print(f"baseline: {seen}", file=sys.stderr)


BASE = _Baseline(None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-bin", help="llama.cpp's build/bin (or env RLX_LLAMA_BIN)")
    ap.add_argument("--workdir", required=True, help="where the models are made once and reused")
    ap.add_argument("--torch-python", help="a Python with torch + transformers (or env RLX_TORCH_PYTHON)")
    ap.add_argument("--gguf-python", help="a Python with gguf for hf_to_gguf.py (or env RLX_GGUF_PYTHON)")
    ap.add_argument("--hf-to-gguf", help="the anchor's hf_to_gguf.py (or env RLX_HF_TO_GGUF)")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--preset", default="medium", help="the model's shape (a llama preset; tiny only to smoke-test this script)")
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--precisions", default="f32,bf16,int8", help="batch-1 decode precisions (ours)")
    ap.add_argument("--skip", default="", help="comma list of parts to leave out: decode,batch8,prefill,accuracy,q4")
    ap.add_argument("--mpiexec", default=default_mpiexec())
    ap.add_argument("--baseline-tree", help="another checkout of rlx_mpi: each of our runs is repeated from it (an A/B)")
    add_common_args(ap, quiet_wait_s=20.0)
    args = ap.parse_args()
    BASE.tree = str(Path(args.baseline_tree).resolve()) if args.baseline_tree else None
    BASE.compile()
    args.threads_list = [int(t) for t in args.threads.split(",")]
    skip = args.skip_set = set(filter(None, args.skip.split(",")))
    bin_dir = Path(_opt(args.llama_bin, "RLX_LLAMA_BIN", "--llama-bin (llama.cpp's build/bin)"))
    work = Path(args.workdir).resolve()
    work.mkdir(parents=True, exist_ok=True)
    m = prepare(work, args)
    cfg = m["config"]
    info = machine()
    print(header(f"rlx-mpi against llama.cpp: {args.preset} preset, vocab {VOCAB}", info))
    mine: dict[str, list[float]] = {}
    theirs: dict[str, list[float]] = {}
    new, plen = 33, 32  # 32 decode steps after a 32-token prompt (llama-bench -n 32 -d 32)
    with tempfile.TemporaryDirectory(prefix="rlx_bench_llamacpp_") as tmp:
        folder = Path(tmp)
        jobs = {p: _job(folder, m["ckpt"], p) for p in PREC}
        if "q4" not in skip:
            jobs["q4"] = _job(folder, m["ckpt_q4"], "q4")
        p32 = {n: write_prompts(folder / f"p{n}.jsonl", n, plen, VOCAB) for n in (1, 8)}
        plong = {n: write_prompts(folder / f"long{n}.jsonl", 4, n, VOCAB) for n in (128, 512)}
        for trial in range(args.trials):
            for t in args.threads_list:
                if "decode" not in skip:
                    for prec in args.precisions.split(","):
                        key = f"decode batch 1, {prec} vs {PREC[prec]}, {t} thread(s)"
                        wait_quiet(args.quiet, args.quiet_wait)
                        mine.setdefault(key, []).append(BASE.take(key, lambda: ours_decode(folder, jobs[prec], p32[1], new, t,
                                                                                            args.mpiexec)))
                        theirs.setdefault(key, []).append(llama_bench(bin_dir, m["gguf"][PREC[prec]], t, 1, p=0, n=32,
                                                                      d=32))
                if "batch8" not in skip:
                    key = f"8 prompts x 32 new, whole time, f32, {t} thread(s)"
                    wait_quiet(args.quiet, args.quiet_wait)
                    mine.setdefault(key, []).append(BASE.take(key, lambda: _batch8(folder, jobs["f32"], p32[8], t,
                                                                                    args.mpiexec)))
                    theirs.setdefault(key, []).append(llama_batched(bin_dir, m["gguf"]["f32"], t, 32, 32, 8))
                if "prefill" not in skip:
                    for n in (128, 512):
                        key = f"prefill {n}, f32, {t} thread(s)"
                        wait_quiet(args.quiet, args.quiet_wait)
                        mine.setdefault(key, []).append(BASE.take(key, lambda: _prefill(folder, jobs["f32"], plong[n], n, t,
                                                                                         args.mpiexec)))
                        theirs.setdefault(key, []).append(llama_bench(bin_dir, m["gguf"]["f32"], t, 1, p=n, n=0))
                if "q4" not in skip:
                    q4_trial(folder, jobs["q4"], m, p32, plong, new, t, skip, args, bin_dir, mine, theirs)
            print(f"  trial {trial + 1}/{args.trials} done (load {loadavg()})", file=sys.stderr, flush=True)
        bw = {t: copy_bandwidth(t) for t in args.threads_list}
        rbw = {t: read_bandwidth(t) for t in args.threads_list}
        gguf_bytes = {}
        if "q4" not in skip:
            py = _opt(args.gguf_python, "RLX_GGUF_PYTHON", "--gguf-python (a Python with gguf, to count Q4_K_M's bytes)")
            gguf_bytes = {q: gguf_weight_bytes(py, m["gguf"][name]) for name, q in Q4_GGUF.items()}
        rows, table = {}, []
        for key in mine:
            a, b = statistics.median(mine[key]), statistics.median(theirs[key])
            row = {"ours_tok_s": a, "llamacpp_tok_s": b, "ratio": a / b, "ratio_paired": paired_ratio(mine[key], theirs[key]),
                   "ours_trials": mine[key], "llamacpp_trials": theirs[key]}
            if key.startswith("decode"):
                prec, other = key.split(", ")[1].split(" vs ")
                t = int(key.split(", ")[2].split()[0])
                theirs_bytes = (gguf_bytes[other] if other in Q4_GGUF.values() else weight_bytes(cfg, PREC[prec]))
                row["ours_of_bound"] = a * weight_bytes(cfg, prec) / bw[t]
                row["llamacpp_of_bound"] = b * theirs_bytes / bw[t]
                row["ours_of_read_bound"] = a * weight_bytes(cfg, prec) / rbw[t]
                row["llamacpp_of_read_bound"] = b * theirs_bytes / rbw[t]
            rows[key] = row
            bound = "ours_of_bound" in row
            table.append([key, f"{a:.1f}", f"{b:.1f}", f"{a / b:.2f}", f"{row['ratio_paired']:.2f}",
                          f"{row['ours_of_bound']:.2f} / {row['llamacpp_of_bound']:.2f}" if bound else "",
                          f"{row['ours_of_read_bound']:.2f} / {row['llamacpp_of_read_bound']:.2f}" if bound else ""])
        print(fmt_table(["case (tokens/s, medians)", "ours", "llama.cpp", "ratio", "paired", "of copy bw (ours / theirs)",
                         "of read bw"], table))
        if BASE.tree:
            med = statistics.median
            ab = [[k, f"{med(BASE.here[k]):.1f}", f"{med(v):.1f}", f"{med(BASE.here[k]) / med(v):.3f}",
                   f"{med(a / b for a, b in zip(BASE.here[k], v)):.3f}"] for k, v in BASE.rates.items()]
            print(f"A/B of our side against {BASE.tree}:")
            print(fmt_table(["case (tokens/s, medians)", "this tree", "baseline", "this / baseline", "paired"], ab))
        print("copy bandwidth (read + write): " + ", ".join(f"{t} thread(s) {v / 1e9:.1f} GB/s" for t, v in bw.items()))
        print("read bandwidth: " + ", ".join(f"{t} thread(s) {v / 1e9:.1f} GB/s" for t, v in rbw.items()))
        doc = {"machine": info, "loadavg_end": loadavg(), "trials": args.trials, "model": cfg,
               "copy_bandwidth_GBs": {t: v / 1e9 for t, v in bw.items()},
               "read_bandwidth_GBs": {t: v / 1e9 for t, v in rbw.items()},
               "decode_weight_bytes": {**{f: weight_bytes(cfg, f) for f in ("f32", "bf16", "int8", "q8_0")},
                                       **({"q4": weight_bytes(cfg, "q4"), **gguf_bytes} if gguf_bytes else {})},
               "cases": rows, **({"baseline_tree": BASE.tree, "baseline_tok_s": BASE.rates,
                                    "this_tree_tok_s": BASE.here} if BASE.tree else {})}
        if "q4" not in skip:
            doc["q4_resident_of_f32"] = frac = q4_resident_fraction(m["ckpt_q4"])
            print(f"q4 resident weight bytes / f32: {frac:.4f} (target <= 0.16)")
        save_json(args.json, doc)
        if "accuracy" not in skip:
            doc["accuracy"] = acc = accuracy(m, args, folder, bin_dir, args.mpiexec)
            print(f"accuracy vs the f32 model over {acc['positions']} positions (top-1 agreement, mean KL):")
            for side in ("ours", "llama.cpp"):
                for fmt, r in acc[side].items():
                    print(f"  {side} {fmt}: {r['top1_agreement']}, {r['mean_kld']}")
            print(f"  llama.cpp tokenised our ids 1:1: {acc['llama.cpp_tokens_match']}")
            doc["loadavg_end"] = loadavg()
            save_json(args.json, doc)


if __name__ == "__main__":
    main()
