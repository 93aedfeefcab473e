"""rlx_mpi against OpenVINO GenAI (issue 41, part 2) on one host, same model, same cores, one run.

    python bench/bench_openvino.py [--workdir DIR] [--threads 1,2] [--trials 3]
        [--cases prefill,job,decode,batch8,score] [--precisions f32,bf16,int8,q4]
        [--ov-python PY | --base-python PY] [--json OUT]
    python bench/bench_openvino.py --quick          (small preset, small shapes, 1 thread, 1 trial: a smoke run)

Options may come from the environment instead: RLX_OV_PYTHON (a Python that already has
openvino-genai, optimum-intel and a CPU torch), RLX_OV_BASE_PYTHON (the interpreter the venv is
made from; default: the one under this Python's venv). Nothing here names a machine path.

The OpenVINO venv (made once in --workdir/venv when no --ov-python is given, reused after):
``pip install torch==2.13.0`` first (a CPU wheel; plain ``torch`` would fetch a multi-GB CUDA
build), then openvino-genai, optimum-intel with transformers < 5.6 and nncf *with torch pinned
again* (without the pin pip upgrades torch to the newest CUDA build: optimum-intel pulls
torchvision, whose newest release wants the newest torch), then ``pip uninstall torchvision``
(a text export does not need it; a CUDA torchvision breaks the export against a CPU torch). The
resolved torch is checked to be the pinned CPU build. Versions: --ov-packages (default the ones
#41 was measured with: openvino-genai 2026.4.1.0, optimum-intel 2.2.0, nncf 3.4.0).

The model (made once in --workdir): a transformers random Llama of the medium preset's shape with
a vocabulary of 8192 (bench/_hf_generate.py, as bench_llamacpp.py makes it), converted to our
checkpoint by ``rlx-mpi convert`` (and ``--dtype q4``) and exported by ``optimum-cli export
openvino --task text-generation-with-past --disable-convert-tokenizer`` at ``--weight-format
fp32``, ``int8 --sym`` (per-channel) and ``int4 --sym --group-size 32`` (nncf keeps the embedding
and the head int8 per-channel there; our q4 keeps the embedding float and the head 4-bit): the
same weights on both sides.

Precisions (ours = ``[run] precision``; OpenVINO = IR + INFERENCE_PRECISION_HINT / KV_CACHE_PRECISION):

    f32   f32 checkpoint       fp32 IR, hint f32, KV f32 (the CPU plugin's defaults on a host with
                               AVX512-BF16 or AMX are bf16 and u8: both set explicitly)
    bf16  f32 checkpoint       fp32 IR, hint bf16, KV the plugin's default
    int8  f32 checkpoint       int8 sym per-channel IR, the plugin's defaults
    q4    q4 checkpoint        int4 sym group-32 IR, the plugin's defaults

(--ov-hint / --ov-kv change the OpenVINO column; the effective defaults are printed and saved.)

Cases (--cases), each side pinned to the same first T cores (``taskset -c 0..T-1``; our one rank
probes T cpus and pins T BLAS/numba threads; OpenVINO gets INFERENCE_NUM_THREADS = T), greedy,
every row to its last token (our ``--ignore-eos``, OpenVINO's ``ignore_eos``), prefix caching off
on both sides, all prompts at once (our ``--batch`` = the prompt count; OpenVINO one generate):

- ``prefill``: 8 prompts x 512 tokens, 1 new token: prompt tokens / time.
- ``job``: 32 prompts x (256 + 32 new): all tokens (prompt + new) / time.
- ``decode``: batch-1 decode, 32-token prompt + 64 new: ours = 63 / ``decode_ms`` (the decode
  steps of the generate table), OpenVINO = 1000 / its TPOT (the mean time between tokens after
  the first, from its perf metrics): the decode steps alone (TPOT counts its sampler too; our
  sampling, ``sample_ms``, is apart and well under 1 % of a step).
- ``batch8``: 8 prompts x (32 + 64 new): new tokens / time.
- ``score``: ``rlx-mpi score`` of 32 lines x 512 tokens (its tokens/s: positions over the
  scoring loop's time) against OpenVINO's prefill rate (the ``prefill`` case's figure of the same
  trial, threads and precision; run for it when ``prefill`` is not among --cases); at
  --score-precisions only (default bf16, #41's target).

"time" is in-job on both sides: ours is ``--json``'s wall_s (from the barrier after start-up to
the last token; score: its loop), OpenVINO's the one ``generate`` call (the pipeline's load and
compile excluded); each process is launched afresh per case and trial, so both pay their first
call. The whole-process wall time (launch to exit: start-up, loading, compiling) is kept beside.
Trials interleave the two sides (the order flips every trial); the table gives the ratio of the
medians (ours / OpenVINO, > 1: ours faster) and ``paired``, the median of each trial's own ratio.
Each side runs with its own defaults otherwise: our ``prefill_chunk`` (256 positions a step) and
OpenVINO's unlimited ``max_num_batched_tokens``; --ours-args passes flags to every ``generate``
(e.g. ``--ours-args="--prefill-chunk 0"``). A case OpenVINO cannot run (a crash such as the
SIGFPE #41 saw at 1 thread bf16) is reported as such and the others are compared.

Greedy check: on every generate case the rows' new tokens of both sides are compared (identical
rows, positions equal); at f32 they should agree (a random model's flat logits can flip a near
tie); the bench prints the agreement and never fails on it.

Only ratios taken in one run on an otherwise idle host mean anything; --quick's are for the
script, not for publishing.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

from _cli import default_mpiexec
from _machine import add_common_args, fmt_table, header, loadavg, machine, save_json, wait_quiet
from bench_generate import generate_cmd, write_prompts
from bench_llamacpp import _cores, _job, _run, paired_ratio

HERE = Path(__file__).resolve().parent
SIDE = HERE / "_openvino_side.py"
VOCAB = 8192
TORCH = "torch==2.13.0"  # a CPU wheel; the index's plain torch is a CUDA build
OV_PACKAGES = "openvino-genai==2026.4.1.0 optimum-intel==2.2.0 nncf==3.4.0 transformers<5.6"

# precision -> (our checkpoint, our [run] precision, OpenVINO IR)
PREC = {"f32": ("f32", "f32", "fp32"), "bf16": ("f32", "bf16", "fp32"), "int8": ("f32", "int8", "int8"),
        "q4": ("q4", "q4", "int4")}
IR_EXPORT = {"fp32": ["--weight-format", "fp32"], "int8": ["--weight-format", "int8", "--sym"],
             "int4": ["--weight-format", "int4", "--sym", "--group-size", "32"]}
OV_NAME = {"f32": "f32", "bf16": "bf16", "int8": "int8 sym per-channel", "q4": "int4 sym g32"}

# case -> rows, prompt length, new tokens, what is counted
CASES = {"prefill": (8, 512, 1, "prompt"), "job": (32, 256, 32, "all"), "decode": (1, 32, 64, "decode"),
         "batch8": (8, 32, 64, "new"), "score": (32, 512, 0, "score")}
QUICK_CASES = {"prefill": (2, 128, 1, "prompt"), "job": (4, 64, 16, "all"), "decode": (1, 16, 16, "decode"),
               "batch8": (4, 16, 16, "new"), "score": (4, 128, 0, "score")}


def label(case: str, spec: tuple, prefill_spec: tuple) -> str:
    n, plen, new, _ = spec
    return {"prefill": f"prefill {n} x {plen}",
            "job": f"{n} x ({plen} + {new}), all tokens",
            "decode": f"batch-1 decode, {plen} + {new}",
            "batch8": f"{n} prompts x {new} new ({plen}-token prompts), new tokens",
            "score": f"score {n} x {plen} (OV: prefill {prefill_spec[0]} x {prefill_spec[1]})"}[case]


# -- the OpenVINO venv and the models --------------------------------------------------------

def ov_python(args, work: Path) -> str:
    """The Python with openvino-genai and optimum-intel: --ov-python / RLX_OV_PYTHON, or a venv
    made once in ``work``."""
    given = args.ov_python or os.environ.get("RLX_OV_PYTHON")
    if given:
        return given
    venv = work / "venv"
    py = venv / "bin" / "python"
    done = venv / ".rlx_bench_ready"
    if done.exists():
        return str(py)
    base = args.base_python or os.environ.get("RLX_OV_BASE_PYTHON") or getattr(sys, "_base_executable", sys.executable)
    print(f"# making the OpenVINO venv in {venv} from {base} (once; a few minutes)", file=sys.stderr, flush=True)
    if not py.exists():
        _run([base, "-m", "venv", str(venv)])
    pip = [str(py), "-m", "pip", "install", "-q"]
    _run([*pip, args.torch], timeout=3600)
    _run([*pip, *args.ov_packages.split(), args.torch], timeout=3600)  # torch pinned again: see the docstring
    _run([str(py), "-m", "pip", "uninstall", "-y", "torchvision"])  # absent: pip only warns
    doc = json.loads(_run([str(py), str(SIDE), "info"]).strip().splitlines()[-1])
    want = args.torch.split("==")[-1]
    if doc["torch_cuda"] is not None or not str(doc["torch"]).startswith(want):
        raise SystemExit(f"bench_openvino: the venv's torch is {doc['torch']} (CUDA {doc['torch_cuda']}), "
                         f"not the CPU {args.torch}: pip replaced it; see {venv}")
    done.write_text(json.dumps(doc) + "\n")
    return str(py)


def prepare(work: Path, args, py: str) -> dict:
    """The HF directory, our checkpoints and the OpenVINO IRs the precisions need (made when missing)."""
    from rlx_mpi.families import find_preset

    preset = args.preset
    hf = work / f"hf_{preset}"
    if not (hf / "config.json").exists():
        dims = asdict(find_preset(preset)[1])
        _run([py, str(HERE / "_hf_generate.py"), "build", "--preset", preset, "--vocab", str(VOCAB),
              "--dims", json.dumps(dims), "--hf-dir", str(hf)])
    ckpts, irs = {}, {}
    for prec in args.precision_list:
        ck, _, ir = PREC[prec]
        ckpts[ck] = work / (f"{preset}.h5" if ck == "f32" else f"{preset}-{ck}.h5")
        if not ckpts[ck].exists():
            _run([sys.executable, "-m", "rlx_mpi", "convert", str(hf), str(ckpts[ck]),
                  *([] if ck == "f32" else ["--dtype", ck])])
        irs[ir] = work / f"ov_{preset}_{ir}"
        if not (irs[ir] / "openvino_model.xml").exists():
            cli = Path(py).parent / "optimum-cli"
            cmd = [str(cli)] if cli.exists() else [py, "-m", "optimum.commands.optimum_cli"]
            _run([*cmd, "export", "openvino", "-m", str(hf), "--task", "text-generation-with-past",
                  "--disable-convert-tokenizer", *IR_EXPORT[ir], str(irs[ir])], timeout=3600)
    return {"hf": hf, "ckpt": ckpts, "ir": irs, "config": json.loads((hf / "config.json").read_text())}


# -- one side each ---------------------------------------------------------------------------

def _fail(proc: subprocess.CompletedProcess) -> str:
    rc = proc.returncode
    if rc < 0:
        try:
            return f"killed by {signal.Signals(-rc).name}"
        except ValueError:
            return f"killed by signal {-rc}"
    tail = (proc.stderr or "").strip().splitlines()[-3:]
    return f"exit {rc}: {' / '.join(tail)[-300:]}"


def short(err: str) -> str:
    """An error as the table shows it: the signal, or the exit code (the whole text is in the JSON)."""
    return err.split(":", 1)[0]


def _launch(cmd: list[str], timeout_s: float = 3600.0) -> subprocess.CompletedProcess | str:
    """The finished process, or why it did not finish (a timeout): one run is never the whole bench."""
    try:
        return subprocess.run(cmd, capture_output=True, text=True, errors="replace", timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return f"timeout: no exit after {timeout_s:.0f} s"


def rows_of(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def ours(folder: Path, job: Path, prompts: Path, case: str, spec: tuple, t: int, mpiexec: str,
         extra: list[str]) -> dict:
    """One ``generate`` (``score``) launch on the first ``t`` cores: its rate, in-job and process
    seconds, and the rows' new tokens."""
    n, plen, new, what = spec
    out, stats = folder / "ours_out.jsonl", folder / "ours_stats.json"
    if case == "score":
        for p in (out, stats):
            p.unlink(missing_ok=True)  # score appends to --out and resumes: start clean
        cmd = [*_cores(t), mpiexec, "-n", "1", sys.executable, "-m", "rlx_mpi", "score", str(job), "--prompts",
               str(prompts), "--out", str(out), "--json", str(stats), "--no-prefix-cache"]
    else:
        cmd = generate_cmd(1, job, prompts, out, stats, new, n, 1, mpiexec, _cores(t)) + ["--ignore-eos",
                                                                                         "--no-prefix-cache", *extra]
    t0 = time.perf_counter()
    proc = _launch(cmd)
    process_s = time.perf_counter() - t0
    if isinstance(proc, str) or proc.returncode:
        return {"error": proc if isinstance(proc, str) else _fail(proc), "process_s": process_s}
    st = json.loads(stats.read_text())
    if case == "score":
        return {"rate": st["tokens_per_s"], "in_job_s": st["total_forward_ms"] / 1e3, "process_s": process_s}
    done = rows_of(out)
    made = sum(r["new_tokens"] for r in done)
    wall = st["wall_s"]
    if what == "decode":
        rate = (made - len(done)) / (max(r["decode_ms"] for r in st["rows"]) / 1e3)
    else:
        rate = {"prompt": n * plen, "all": n * plen + made, "new": made}[what] / wall
    order = {r["id"]: r["tokens"] for r in done}
    return {"rate": rate, "in_job_s": wall, "process_s": process_s,
            "tokens": [order[f"b{i}"] for i in range(n)], "new_tokens": made}


def theirs(folder: Path, py: str, ir: Path, prompts: Path, spec: tuple, t: int, hint: str, kv: str) -> dict:
    """One OpenVINO GenAI process (bench/_openvino_side.py) on the first ``t`` cores."""
    n, plen, new, what = spec
    out = folder / "ov_out.json"
    out.unlink(missing_ok=True)
    cmd = [*_cores(t), py, str(SIDE), "run", "--model", str(ir), "--prompts", str(prompts), "--new", str(max(new, 1)),
           "--threads", str(t), "--hint", hint, "--kv", kv, "--out", str(out)]
    t0 = time.perf_counter()
    proc = _launch(cmd)
    process_s = time.perf_counter() - t0
    if isinstance(proc, str) or proc.returncode or not out.exists():
        return {"error": proc if isinstance(proc, str) else _fail(proc), "process_s": process_s}
    doc = json.loads(out.read_text())
    g = doc["generate_s"]
    made = doc["new_tokens"]
    if what == "decode":
        rate = 1e3 / doc["tpot_ms"]
    else:
        rate = {"prompt": n * plen, "score": n * plen, "all": n * plen + made, "new": made}[what] / g
    return {"rate": rate, "in_job_s": g, "process_s": process_s, "load_s": doc["load_s"], "tokens": doc["tokens"],
            "new_tokens": made, "ttft_ms": doc["ttft_ms"], "tpot_ms": doc["tpot_ms"], "properties": doc["properties"]}


def agreement(a: list[list[int]], b: list[list[int]]) -> dict:
    """Rows identical, positions equal and the mean common prefix of two sides' new tokens."""
    prefix, equal, total = [], 0, 0
    for x, y in zip(a, b):
        k = 0
        while k < min(len(x), len(y)) and x[k] == y[k]:
            k += 1
        prefix.append(k)
        equal += sum(p == q for p, q in zip(x, y))
        total += max(len(x), len(y))
    return {"rows": len(prefix), "identical_rows": sum(x == y for x, y in zip(a, b)),
            "positions_equal": equal / total if total else None,
            "mean_common_prefix": statistics.mean(prefix) if prefix else None,
            "new_tokens": statistics.mean(len(x) for x in a) if a else None}


# -- the run ---------------------------------------------------------------------------------

def _pairs(text: str) -> dict:
    return dict(p.split("=", 1) for p in text.split(",") if p)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "rlx_ov"),
                    help="where the venv and models are made once and reused (default: TMPDIR/rlx_ov)")
    ap.add_argument("--ov-python", help="a Python with openvino-genai, optimum-intel and a CPU torch (or env "
                    "RLX_OV_PYTHON); default: a venv made in --workdir")
    ap.add_argument("--base-python", help="the interpreter that venv is made from (or env RLX_OV_BASE_PYTHON; "
                    "default: this Python's base)")
    ap.add_argument("--torch", default=TORCH, help=f"the torch requirement of that venv (default {TORCH}: CPU wheel)")
    ap.add_argument("--ov-packages", default=OV_PACKAGES, help=f"the rest of it (default: {OV_PACKAGES})")
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: small preset, small shapes (2 x 128 prefill, ...), 1 thread, 1 trial")
    ap.add_argument("--preset", help="the model's shape (default medium; --quick: small)")
    ap.add_argument("--threads", help="comma list of thread counts (default 1,2; --quick: 1)")
    ap.add_argument("--trials", type=int, help="interleaved trials (default 3; --quick: 1)")
    ap.add_argument("--cases", default=",".join(CASES), help=f"comma list of {', '.join(CASES)}")
    ap.add_argument("--precisions", default=",".join(PREC), help=f"comma list of {', '.join(PREC)}")
    ap.add_argument("--score-precisions", default="bf16", help="the precisions the score case runs at (default bf16)")
    ap.add_argument("--ov-hint", default="f32=f32,bf16=bf16",
                    help="OpenVINO's INFERENCE_PRECISION_HINT per precision (unnamed: the plugin's default)")
    ap.add_argument("--ov-kv", default="f32=f32", help="OpenVINO's KV_CACHE_PRECISION per precision (unnamed: default)")
    ap.add_argument("--ours-args", default="",
                    help="more flags for every `rlx-mpi generate` (e.g. \"--prefill-chunk 0\")")
    ap.add_argument("--mpiexec", default=default_mpiexec())
    add_common_args(ap, quiet_wait_s=20.0)
    args = ap.parse_args()
    args.preset = args.preset or ("small" if args.quick else "medium")
    args.trials = args.trials or (1 if args.quick else 3)
    shapes = QUICK_CASES if args.quick else CASES
    threads = [int(t) for t in (args.threads or ("1" if args.quick else "1,2")).split(",")]
    cases = [c for c in args.cases.split(",") if c]
    args.precision_list = precs = [p for p in args.precisions.split(",") if p]
    for c in cases:
        if c not in CASES:
            raise SystemExit(f"bench_openvino: unknown case {c!r} (choose from {', '.join(CASES)})")
    for p in precs:
        if p not in PREC:
            raise SystemExit(f"bench_openvino: unknown precision {p!r} (choose from {', '.join(PREC)})")
    score_precs = set(args.score_precisions.split(","))
    hints, kvs = _pairs(args.ov_hint), _pairs(args.ov_kv)
    if args.json is None:
        day = datetime.date.today().isoformat()
        args.json = str(HERE / "results" / f"openvino_{day}{'_quick' if args.quick else ''}.json")
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    py = ov_python(args, work)
    ov_info = json.loads(_run([py, str(SIDE), "info"]).strip().splitlines()[-1])
    if ov_info.get("torch_cuda") is not None:
        print(f"# warning: {py}'s torch {ov_info['torch']} is a CUDA build (CUDA {ov_info['torch_cuda']}); the export "
              "wants the CPU wheel", file=sys.stderr)
    m = prepare(work, args, py)
    info = machine()
    ver = ", ".join(f"{k} {ov_info.get(k)}" for k in ("openvino", "openvino-genai", "optimum-intel", "nncf",
                                                      "transformers", "torch"))
    dflt = ov_info["cpu_defaults"]
    print(header(f"rlx-mpi against OpenVINO GenAI: {args.preset} preset, vocab {VOCAB}"
                 f"{' (--quick: not for publishing)' if args.quick else ''}", info,
                 f"OpenVINO side: {ver}; CPU plugin defaults here: hint {dflt['INFERENCE_PRECISION_HINT']}, "
                 f"KV {dflt['KV_CACHE_PRECISION']}"))
    res: dict[str, dict] = {}
    order: list[str] = []
    with tempfile.TemporaryDirectory(prefix="rlx_bench_openvino_") as tmp:
        folder = Path(tmp)
        jobs = {p: _job(folder, m["ckpt"][PREC[p][0]], PREC[p][1]) for p in precs}
        prompts = {c: write_prompts(folder / f"p_{c}.jsonl", s[0], s[1], VOCAB) for c, s in shapes.items()}
        for trial in range(args.trials):
            for t in threads:
                for prec in precs:
                    ir = m["ir"][PREC[prec][2]]
                    hint, kv = hints.get(prec, "default"), kvs.get(prec, "default")
                    ov_prefill = None  # this trial's OpenVINO prefill at (t, prec): the score case's reference
                    for case in cases:
                        if case == "score" and prec not in score_precs:
                            continue
                        spec = shapes[case]
                        key = f"{label(case, spec, shapes['prefill'])}, {prec}, {t} thread(s)"
                        if key not in res:
                            order.append(key)
                            res[key] = {"case": case, "precision": prec, "threads": t, "ours": [], "ov": [],
                                        "ov_errors": [], "ours_errors": [], "ours_process_s": [],
                                        "ov_process_s": [], "ours_in_job_s": [], "ov_in_job_s": [],
                                        "ov_setting": {"weights": OV_NAME[prec], "ir": PREC[prec][2],
                                                       "hint": hint, "kv": kv}}
                        r = res[key]
                        sides = ["ours", "ov"] if trial % 2 == 0 else ["ov", "ours"]
                        got = {}
                        for side in sides:
                            wait_quiet(args.quiet, args.quiet_wait)
                            if side == "ours":
                                got[side] = ours(folder, jobs[prec], prompts[case], case, spec, t, args.mpiexec,
                                                 shlex.split(args.ours_args))
                            elif case == "score" and ov_prefill is not None:
                                got[side] = ov_prefill  # the same trial's prefill: no second run
                            else:
                                ref = "prefill" if case == "score" else case
                                got[side] = theirs(folder, py, ir, prompts[ref], shapes[ref], t, hint, kv)
                                if ref == "prefill":
                                    ov_prefill = got[side]
                        a, b = got["ours"], got["ov"]
                        r["ours_process_s"].append(a["process_s"])
                        r["ov_process_s"].append(b["process_s"])
                        for side, doc, errs in (("ours", a, r["ours_errors"]), ("ov", b, r["ov_errors"])):
                            if "error" in doc:
                                errs.append(doc["error"])
                                print(f"  {key}: {'rlx-mpi' if side == 'ours' else 'OpenVINO'} failed: {doc['error']}",
                                      file=sys.stderr, flush=True)
                        ok = "error" not in a and "error" not in b
                        r["ours"].append(a.get("rate"))
                        r["ov"].append(b.get("rate"))
                        r["ours_in_job_s"].append(a.get("in_job_s"))
                        r["ov_in_job_s"].append(b.get("in_job_s"))
                        if ok and case != "score" and "agreement" not in r:
                            r["agreement"] = agreement(a["tokens"], b["tokens"])
            print(f"  trial {trial + 1}/{args.trials} done (load {loadavg()})", file=sys.stderr, flush=True)
    table, md = [], []
    for key in order:
        r = res[key]
        pairs = [(x, y) for x, y in zip(r["ours"], r["ov"]) if x is not None and y is not None]
        mine = [x for x in r["ours"] if x is not None]
        other = [y for y in r["ov"] if y is not None]
        a = statistics.median(mine) if mine else None
        b = statistics.median(other) if other else None
        r["ours_tok_s"], r["ov_tok_s"] = a, b
        r["ratio"] = a / b if a and b else None
        r["ratio_paired"] = paired_ratio(*zip(*pairs)) if pairs else None
        proc = [statistics.median(v) for v in (r["ov_process_s"], r["ours_process_s"])]
        if b is None:
            ov_txt = f"failed ({', '.join(sorted({short(e) for e in r['ov_errors']}))})"
        else:
            ov_txt = f"{b:.1f}" + (f" ({len(r['ov_errors'])} of {args.trials} failed)" if r["ov_errors"] else "")
        ours_txt = (f"{a:.1f}" if a is not None else
                    f"failed ({', '.join(sorted({short(e) for e in r['ours_errors']}))})")
        ratio = f"{r['ratio']:.2f}" if r["ratio"] else "-"
        paired = f"{r['ratio_paired']:.2f}" if r["ratio_paired"] else "-"
        ag = r.get("agreement")
        agree = f"{ag['identical_rows']}/{ag['rows']} rows, {ag['positions_equal']:.2f}" if ag else ""
        table.append([key, ov_txt, ours_txt, ratio, paired, f"{proc[0]:.1f} / {proc[1]:.1f}", agree])
        md.append(f"| {key.replace(' x ', ' × ')} | {ov_txt} | {ours_txt} | {ratio} / {paired} |")
    print(fmt_table(["case (tokens/s, medians)", "OpenVINO", "ours", "ratio", "paired", "process s (OV / ours)",
                     "greedy tokens equal"], table))
    print()
    print(f"| tokens/s, in-job, medians of {args.trials} interleaved trial(s) | OpenVINO | rlx-mpi | ratio / paired |")
    print("| --- | --- | --- | --- |")
    print("\n".join(md))
    failed = [(k, side, e) for k in order
              for side, errs in (("OpenVINO", res[k]["ov_errors"]), ("rlx-mpi", res[k]["ours_errors"]))
              for e in sorted(set(errs))]
    if failed:
        print("\nruns that failed (the cases compared are the others):")
        for k, side, e in failed:
            print(f"  {k}: {side} {e}")
    f32 = [(k, res[k]["agreement"]) for k in order if res[k]["precision"] == "f32" and res[k].get("agreement")]
    if f32:
        print("\ngreedy tokens, OpenVINO f32 against ours f32 (rows identical; positions equal; mean common prefix):")
        for k, ag in f32:
            print(f"  {k}: {ag['identical_rows']}/{ag['rows']}; {ag['positions_equal']:.3f}; "
                  f"{ag['mean_common_prefix']:.1f} of {ag['new_tokens']:.0f}")
    doc = {"machine": info, "loadavg_end": loadavg(), "trials": args.trials, "quick": args.quick,
           "ours_args": args.ours_args, "argv": sys.argv[1:],
           "preset": args.preset, "vocab": VOCAB, "model": m["config"], "openvino": ov_info,
           "shapes": {c: list(s) for c, s in shapes.items()}, "cases": res}
    save_json(args.json, doc)


if __name__ == "__main__":
    main()
