"""Structured output's price (issue 43): a decode step with every row constrained by a JSON schema
against the same step unconstrained, in one process, interleaved rounds, 1 and 2 threads.

    python bench/bench_structured.py [--rows 32] [--steps 24] [--rounds 7] [--threads 1 2] [--json OUT]

The model: the medium preset (random weights, vocabulary 16,384), one stage holding every layer
(`DecoderStage`), ``--rows`` rows decoding after a 32-token prefill. The tokenizer: a byte-level
BPE of 16,384 tokens trained here on the repository's own text (Python and Markdown: JSON-like
punctuation, words, numbers), so the mask is computed over a vocabulary of the model's size with
realistic multi-byte tokens. (``--checkpoint M.h5`` runs a converted model with its own
tokenizer.json instead, e.g. SmolLM2's.)

A step is what the last stage does: the decode forward, then `records.RowTable.sample` (each
row's grammar mask, llguidance's parallel fill and `kernels.bitmask.apply_bitmask`, the greedy
draw, each matcher advancing). Constrained rows follow a schema of an object with a string, an
integer, an enum and an array of strings; a row whose grammar completes starts again, so every
step masks every row. Prints the median ms per step of each variant, constrained / free (the
issue's bound: <= 1.10), and the mask's time per row per step (fill + apply, llguidance's
executor with as many threads as the step's kernels).
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

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import _machine  # noqa: E402

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer"}, "role": {"enum": ["engineer", "doctor", "teacher"]},
    "tags": {"type": "array", "items": {"type": "string"}}}, "required": ["name", "age", "role", "tags"],
    "additionalProperties": False}


def train_tokenizer(vocab: int, out: Path) -> Path:
    """A byte-level BPE of ``vocab`` tokens (the last one <|end|>) trained on the repo's text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    root = HERE.parent
    files = [str(p) for p in sorted(root.glob("rlx_mpi/**/*.py")) + sorted(root.glob("docs/*.md"))]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab - 1, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train(files, trainer)
    tok.add_special_tokens(["<|end|>"])
    tok.save(str(out))
    return out


def case(args, threads: int) -> dict:
    """One thread count, in this process."""
    from threadpoolctl import threadpool_limits

    threadpool_limits(threads)
    from rlx_mpi import kernels
    from rlx_mpi.engine.constraints import Constraint, GrammarMasks, Grammars
    from rlx_mpi.engine.records import RowState, RowTable, StepHeader
    from rlx_mpi.engine.sampling import SamplingParams
    from rlx_mpi.families import get_family
    from rlx_mpi.families.decoder.stage import DecoderStage
    from rlx_mpi.model.checkpoint import H5ParamSource, read_header
    from rlx_mpi.model.kv_cache import KvSpec

    kernels.set_threads(threads)
    tmp = Path(tempfile.mkdtemp(prefix="bench_structured_"))
    if args.checkpoint:
        path = Path(args.checkpoint)
        family, config_json = read_header(path)
        cfg = get_family(family).load_config(config_json, path)
        tok_json = path.with_name(path.stem + ".tokenizer.json")
        if not tok_json.exists():
            tok_json = path.with_name("tokenizer.json")
        eos = json.loads(path.with_name(path.stem + ".generation_config.json").read_text())["eos_token_id"]
        eos = eos if isinstance(eos, list) else [eos]
    else:
        fam = get_family("llama")
        cfg = fam.presets["medium"]
        path = tmp / "medium.h5"
        fam.init_random(path, cfg, seed=0)
        tok_json = train_tokenizer(cfg.vocab_size, tmp / "tokenizer.json")
        eos = [json.loads(tok_json.read_text())["added_tokens"][-1]["id"]]  # <|end|>
    with H5ParamSource(str(path)) as src:
        stage = DecoderStage(cfg, src, range(cfg.num_hidden_layers), True, True, precision=args.precision)
    B, P = args.rows, 32
    stage.reset(B, P + args.steps * (args.rounds + 2) + 8, KvSpec("full"))
    grammars = Grammars(tok_json.read_text(), cfg.vocab_size, eos)
    c = Constraint("json", SCHEMA)
    grammars.matcher(c)  # (compiled before timing, as the driver does)
    masks = GrammarMasks(grammars, threads=threads)
    keys = np.arange(1, B + 1, dtype=np.int64)
    tables = {"free": RowTable(lambda k: RowState(k)),
              "constrained": RowTable(lambda k: RowState(k, None, grammars.matcher(c)), masks)}
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size - 1, (B, P))
    stage.prefill(ids, np.arange(B), np.full(B, P))
    params = SamplingParams()
    pos = [P]
    last = {name: np.zeros((B, 1), np.int64) for name in tables}
    admitted = {name: False for name in tables}

    def run(name: str) -> float:
        table = tables[name]
        t0 = time.perf_counter()
        for _ in range(args.steps):
            h = StepHeader(StepHeader.make(2, 0, 1, np.arange(B), np.full(B, pos[0]), keys, np.zeros(B), 8 + 5 * B,
                                           admitted=[not admitted[name]] * B))
            admitted[name] = True
            table.on_header(h)
            logits = stage.decode(last[name], np.arange(B), np.full(B, pos[0]))
            tokens = table.sample(logits, h, params)
            for k in keys.tolist():  # a row whose grammar completed starts again: every step masks every row
                s = table.get(k)
                if s.grammar is not None and s.grammar.is_stopped():
                    s.grammar.reset()
            last[name] = tokens[:, None]
            pos[0] += 1  # (both variants write the same cache positions in turn: the time is the point)
            if pos[0] >= stage_len - 1:
                pos[0] = P
        return (time.perf_counter() - t0) / args.steps * 1e3

    stage_len = P + args.steps * (args.rounds + 2)
    run("free"), run("constrained")  # warm: numba, llguidance's first masks
    masks.mask_s, masks.masked = 0.0, 0
    times: dict[str, list[float]] = {"free": [], "constrained": []}
    busy = _machine.wait_quiet(args.quiet, args.quiet_wait)
    for r in range(args.rounds):
        for name in (("free", "constrained") if r % 2 == 0 else ("constrained", "free")):
            times[name].append(run(name))
    med = {n: statistics.median(v) for n, v in times.items()}
    return {"threads": threads, "rows": B, "vocab": cfg.vocab_size, "busy_before": busy,
            "ms_per_step": med, "ratio_constrained_over_free": med["constrained"] / med["free"],
            "mask_us_per_row_step": masks.mask_s / max(1, masks.masked) * 1e6, "rounds": times}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=32, help="rows decoding together (default 32)")
    ap.add_argument("--steps", type=int, default=24, help="decode steps per round (default 24)")
    ap.add_argument("--rounds", type=int, default=7, help="interleaved rounds, median taken (default 7)")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2], help="thread counts, each a fresh process")
    ap.add_argument("--precision", default="f32")
    ap.add_argument("--checkpoint", help="a converted model with its tokenizer.json (default: the medium preset)")
    ap.add_argument("--one", type=int, help=argparse.SUPPRESS)  # (a child: this thread count, JSON out)
    _machine.add_common_args(ap, quiet_wait_s=60)
    args = ap.parse_args()
    if args.one is not None:
        print(json.dumps(case(args, args.one)))
        return
    info = _machine.machine()
    print(_machine.header("structured output: a decode step with every row constrained vs free", info,
                          f"{args.rows} rows, {args.steps} steps x {args.rounds} rounds, {args.precision}, "
                          f"{args.checkpoint or 'medium preset'}"))
    results = []
    for t in args.threads:
        cmd = [sys.executable, __file__, "--one", str(t), "--rows", str(args.rows), "--steps", str(args.steps),
               "--rounds", str(args.rounds), "--precision", args.precision, "--quiet", str(args.quiet),
               "--quiet-wait", str(args.quiet_wait), *(["--checkpoint", args.checkpoint] if args.checkpoint else [])]
        env = {**os.environ, "OMP_NUM_THREADS": str(t), "NUMBA_NUM_THREADS": str(t)}
        out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True).stdout
        results.append(json.loads(out.strip().splitlines()[-1]))
    rows = [[r["threads"], f"{r['ms_per_step']['free']:.2f}", f"{r['ms_per_step']['constrained']:.2f}",
             f"{r['ratio_constrained_over_free']:.3f}", f"{r['mask_us_per_row_step']:.1f}", _machine.pct(r["busy_before"])]
            for r in results]
    print(_machine.fmt_table(["threads", "free ms/step", "constrained ms/step", "constrained/free",
                              "mask us/row/step", "busy before"], rows))
    _machine.save_json(args.json, {"machine": info, "results": results})


if __name__ == "__main__":
    main()
