"""The price of LoRA adapters chosen per row (issue 44): a step with adapters against the base step.

One `DecoderStage` holds every layer of the ``--preset`` model (float32) and ``--adapters`` random
PEFT adapters of rank ``--rank`` on every projection (q/k/v/o, gate/up/down), written as PEFT
directories and loaded as a job loads them (`DecoderStage.load_adapters`). Measured in one
process, at each of ``--threads`` (a child process per count: numba's and BLAS's threads are
set before numpy loads), best of ``--reps``:

* ``decode``: a decode step of ``--batch`` rows at position ``--context`` with no adapter, and
  with mixed rows (row i takes adapter i mod (K + 1) - 1: base rows beside every adapter);
* ``prefill``: a prefill of one row of ``--prefill`` tokens, base and with adapter 0.

It prints one JSON object: each time in ms and the ratios ``decode_ratio`` (issue target <= 1.3)
and ``prefill_ratio`` (<= 1.15).

    python bench/bench_lora.py                                     # medium, batch 8, 4 x r 16, threads 1 and 2
    python bench/bench_lora.py --preset tiny --prefill 32 --reps 1 --inner 1 --threads 1 --context 16 --quiet-wait 0  # smoke
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))


def write_adapter(folder: Path, cfg, rank: int, seed: int) -> None:
    """A random PEFT LoRA directory on every projection of every layer (B non-zero: it changes the output)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    shapes = {"self_attn.q_proj": (cfg.q_dim, cfg.hidden_size), "self_attn.k_proj": (cfg.kv_dim, cfg.hidden_size),
              "self_attn.v_proj": (cfg.kv_dim, cfg.hidden_size), "self_attn.o_proj": (cfg.hidden_size, cfg.q_dim),
              "mlp.gate_proj": (cfg.intermediate_size, cfg.hidden_size),
              "mlp.up_proj": (cfg.intermediate_size, cfg.hidden_size),
              "mlp.down_proj": (cfg.hidden_size, cfg.intermediate_size)}
    tensors = {}
    for n in range(cfg.num_hidden_layers):
        for m, (o, i) in shapes.items():
            p = f"base_model.model.model.layers.{n}.{m}"
            tensors[f"{p}.lora_A.weight"] = (rng.standard_normal((rank, i)) * 0.02).astype("<f4")
            tensors[f"{p}.lora_B.weight"] = (rng.standard_normal((o, rank)) * 0.02).astype("<f4")
    header, at = {}, 0
    for k, v in tensors.items():
        header[k] = {"dtype": "F32", "shape": list(v.shape), "data_offsets": [at, at + v.nbytes]}
        at += v.nbytes
    raw = json.dumps(header).encode()
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "adapter_model.safetensors", "wb") as f:
        f.write(len(raw).to_bytes(8, "little") + raw)
        for v in tensors.values():
            f.write(v.tobytes())
    (folder / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
        "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]}))


def child(args) -> dict:
    import numpy as np

    from _cli import ensure_checkpoint
    from rlx_mpi import kernels
    from rlx_mpi.families.llama import FAMILY
    from rlx_mpi.model.checkpoint import H5ParamSource
    from rlx_mpi.model.kv_cache import KvSpec
    from rlx_mpi.model.stage import StepBatch

    kernels.set_threads(args.threads)
    ckpt = Path(f"/tmp/rlx_bench_{args.preset}.h5")
    ensure_checkpoint(ckpt, args.preset)
    cfg = FAMILY.presets[args.preset]
    with H5ParamSource(ckpt, FAMILY.expected_shapes(cfg)) as src:
        stage = FAMILY.build_stage(cfg, src, range(cfg.num_hidden_layers), True, True)
    with tempfile.TemporaryDirectory() as tmp:
        names = [f"a{k}" for k in range(args.adapters)]
        for k, n in enumerate(names):
            write_adapter(Path(tmp) / n, cfg, args.rank, k)
        stage.load_adapters([(n, Path(tmp) / n) for n in names])
    B, ctx = args.batch, args.context
    rng = np.random.default_rng(0)
    stage.reset(B, max(ctx + 2, args.prefill + 1), KvSpec("full"))
    ids = rng.integers(0, cfg.vocab_size, (B, ctx))
    stage.step(ids, StepBatch("prefill", np.arange(B), np.full(B, ctx), np.arange(B), np.zeros(B, np.int64)))
    mixed = np.array([i % (args.adapters + 1) - 1 for i in range(B)], np.int64)
    tok = rng.integers(0, cfg.vocab_size, (B, 1))

    def decode(adapters):
        b = StepBatch("decode", np.arange(B), np.full(B, ctx), np.arange(B), np.zeros(B, np.int64), adapters=adapters)
        return lambda: stage.step(tok, b)

    def prefill(adapter):
        T = args.prefill
        x = rng.integers(0, cfg.vocab_size, (1, T))
        b = StepBatch("prefill", np.array([0]), np.array([T]), np.array([0]), np.zeros(1, np.int64),
                      adapters=None if adapter < 0 else np.array([adapter]))
        return lambda: stage.step(x, b)

    def best(*fns) -> list[float]:
        """Best ms of each, the variants interleaved in every repetition (a burst of load hits all alike)."""
        times = [[] for _ in fns]
        for f in fns:
            f()  # (warm)
        for _ in range(args.reps):
            for f, got in zip(fns, times):
                t0 = time.perf_counter()
                for _ in range(args.inner):
                    f()
                got.append((time.perf_counter() - t0) / args.inner * 1e3)
        return [min(t) for t in times]

    d_base, d_mixed = best(decode(None), decode(mixed))
    p_base, p_adapter = best(prefill(-1), prefill(0))
    out = {"threads": args.threads, "decode_base_ms": d_base, "decode_mixed_ms": d_mixed,
           "prefill_base_ms": p_base, "prefill_adapter_ms": p_adapter,
           "adapter_MB": stage.adapter_bytes / 1e6, "weights_MB": stage.weight_bytes / 1e6}
    out["decode_ratio"] = out["decode_mixed_ms"] / out["decode_base_ms"]
    out["prefill_ratio"] = out["prefill_adapter_ms"] / out["prefill_base_ms"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="medium")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--adapters", type=int, default=4)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--context", type=int, default=256, help="positions already cached at the decode step")
    ap.add_argument("--prefill", type=int, default=512)
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--inner", type=int, default=3, help="steps per timed repetition")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    from _machine import add_common_args, header, machine, save_json, wait_quiet

    add_common_args(ap, quiet_wait_s=60.0)
    args = ap.parse_args()
    if args.child:
        args.threads = int(args.threads)
        print(json.dumps(child(args)))
        return
    info = machine()
    print(header("bench_lora: a step with LoRA adapters against the base step", info))
    results = []
    for n in [int(t) for t in args.threads.split(",")]:
        busy = wait_quiet(args.quiet, args.quiet_wait) if args.quiet_wait > 0 else None
        env = {**os.environ, "OMP_NUM_THREADS": str(n), "OPENBLAS_NUM_THREADS": str(n), "MKL_NUM_THREADS": str(n),
               "NUMBA_NUM_THREADS": str(max(n, 1))}
        cmd = [sys.executable, __file__, "--child", "--threads", str(n)] + [
            f"--{k}={getattr(args, k)}" for k in ("preset", "batch", "adapters", "rank", "context", "prefill", "reps",
                                                  "inner")]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
        results.append({**json.loads(proc.stdout.strip().splitlines()[-1]), "busy_before": busy})
    doc = {"preset": args.preset, "batch": args.batch, "adapters": args.adapters, "rank": args.rank,
           "prefill": args.prefill, "context": args.context, "runs": results, "machine": info}
    print(json.dumps({k: v for k, v in doc.items() if k != "machine"}, indent=1))
    save_json(args.json, doc)


if __name__ == "__main__":
    main()
