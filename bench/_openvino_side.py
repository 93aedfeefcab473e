"""The OpenVINO GenAI side of bench_openvino.py; run with the OpenVINO venv's Python.

    PY bench/_openvino_side.py info
    PY bench/_openvino_side.py run --model IR_DIR --prompts P.jsonl --new N --threads T
                                   [--hint f32|bf16|default] [--kv f32|bf16|u8|default] --out OUT.json

``info`` prints JSON: the versions (openvino, openvino-genai, optimum-intel, nncf, transformers,
torch and whether it is a CUDA build) and the CPU plugin's defaults on this host (its inference
precision hint and KV-cache precision: on a CPU with AVX512-BF16 or AMX they are bf16 and u8,
which is why the f32 cases set both).

``run`` loads ``openvino_genai.LLMPipeline(IR_DIR, "CPU", ...)`` with

- a ``SchedulerConfig`` that is the pipeline's own default (its continuous-batching backend,
  ``max_num_batched_tokens`` unlimited) bar one field: ``enable_prefix_caching = False`` (the
  pipeline turns it on when it builds the config itself, ours is off too);
- ``INFERENCE_NUM_THREADS`` = --threads (the caller also pins the process to the same first T
  cores with taskset), ``INFERENCE_PRECISION_HINT`` and ``KV_CACHE_PRECISION`` when given;

then makes one ``generate`` of every row of --prompts (our prompt file: {"id", "tokens"}) at
once, token ids in (``ov.Tensor`` for one row, ``TokenizedInputs`` with an all-ones mask for a
batch: the IR has no tokenizer), greedy, ``max_new_tokens`` = --new, ``ignore_eos = True`` and an
``eos_token_id`` >= 0 (the pipeline refuses to run without one; ``min_new_tokens`` would mask the
stop id and could change the greedy path). The JSON written holds the seconds of that one
call (load excluded, as our in-job time excludes start-up), the load seconds, the pipeline's own
perf metrics (TTFT, TPOT), the new tokens of every row and the effective properties. One
generate per process, as our side runs one job per launch: both pay their first call.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from importlib import metadata
from pathlib import Path

SIZE_MAX = 2 ** 64 - 1  # the pipeline's own default: max_num_batched_tokens not limited


def versions() -> dict:
    out = {"python": platform.python_version()}
    for dist in ("openvino", "openvino-genai", "openvino-tokenizers", "optimum-intel", "optimum", "nncf",
                 "transformers", "torch", "torchvision", "numpy"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = None
    return out


def info() -> dict:
    import openvino as ov

    doc = versions()
    try:
        import torch

        doc["torch_cuda"] = torch.version.cuda  # None: the CPU build (the export needs no more)
    except ImportError:
        doc["torch_cuda"] = "no torch"
    core = ov.Core()
    doc["cpu_defaults"] = {}
    for prop in ("INFERENCE_PRECISION_HINT", "KV_CACHE_PRECISION", "OPTIMIZATION_CAPABILITIES", "FULL_DEVICE_NAME"):
        try:
            doc["cpu_defaults"][prop] = str(core.get_property("CPU", prop))
        except Exception as e:  # a property this build lacks
            doc["cpu_defaults"][prop] = f"unavailable ({type(e).__name__})"
    return doc


def run(args) -> dict:
    import numpy as np
    import openvino as ov
    import openvino_genai as ovg

    rows = [json.loads(line) for line in Path(args.prompts).read_text().splitlines() if line.strip()]
    ids = np.array([r["tokens"] for r in rows], dtype=np.int64)  # every prompt of a case is one length
    sc = ovg.SchedulerConfig()
    sc.max_num_batched_tokens = SIZE_MAX
    sc.enable_prefix_caching = False
    props = {"INFERENCE_NUM_THREADS": args.threads}
    if args.hint != "default":
        props["INFERENCE_PRECISION_HINT"] = args.hint
    if args.kv != "default":
        props["KV_CACHE_PRECISION"] = args.kv
    t0 = time.perf_counter()
    pipe = ovg.LLMPipeline(args.model, "CPU", scheduler_config=sc, **props)
    load_s = time.perf_counter() - t0
    cfg = pipe.get_generation_config()
    cfg.max_new_tokens = args.new
    cfg.do_sample = False
    cfg.ignore_eos = True
    if cfg.eos_token_id < 0 or cfg.eos_token_id >= 2 ** 63:  # unset: the pipeline wants one (never reached here)
        cfg.eos_token_id = args.eos_id
    inputs = (ov.Tensor(ids) if len(ids) == 1 else
              ovg.TokenizedInputs(ov.Tensor(ids), ov.Tensor(np.ones_like(ids))))
    t0 = time.perf_counter()
    res = pipe.generate(inputs, cfg)
    gen_s = time.perf_counter() - t0
    pm = res.perf_metrics
    tokens = [list(map(int, t)) for t in res.tokens]
    return {"load_s": load_s, "generate_s": gen_s, "rows": len(ids), "prompt_len": int(ids.shape[1]),
            "new": args.new, "new_tokens": sum(len(t) for t in tokens), "tokens": tokens,
            "ttft_ms": float(pm.get_ttft().mean), "tpot_ms": float(pm.get_tpot().mean),
            "pm_generate_ms": float(pm.get_generate_duration().mean),
            "pm_num_generated": int(pm.get_num_generated_tokens()),
            "properties": {k: str(v) for k, v in props.items()},
            "scheduler": sc.to_string() if hasattr(sc, "to_string") else None,
            "eos_token_id": int(cfg.eos_token_id), "versions": versions()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["info", "run"])
    ap.add_argument("--model", help="the IR directory optimum-cli wrote")
    ap.add_argument("--prompts", help="JSON lines {id, tokens}, every row one length")
    ap.add_argument("--new", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--hint", default="default", help="INFERENCE_PRECISION_HINT (f32, bf16) or default")
    ap.add_argument("--kv", default="default", help="KV_CACHE_PRECISION (f32, bf16, u8) or default")
    ap.add_argument("--eos-id", type=int, default=2)
    ap.add_argument("--out", help="write the JSON here (default: stdout)")
    args = ap.parse_args()
    doc = info() if args.what == "info" else run(args)
    text = json.dumps(doc)
    if args.out:
        Path(args.out).write_text(text + "\n")
    else:
        print(text)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
