"""Our 2-stage pipeline vs `torch.distributed.pipelining` (ScheduleGPipe, gloo) on the same model.

    python bench/bench_torch_pipe.py --torch-python /work/torchvenv/bin/python
                                     [--preset medium] [--batch 16] [--seq 128] [--microbatches 8]
                                     [--reps 2] [--forwards 3] [--json OUT]

(or set RLX_TORCH_PYTHON; without either it says so and exits 0: torch is never required.)
The torch Python needs torch and transformers only (bench/_torch_pipe.py runs there).

One ``LlamaForCausalLM`` of the preset's shape is saved once (/tmp/rlx_bench_hf_<preset>) and
converted with `rlx-mpi convert`; then, round-robin, ``--reps`` launches of each case, every
launch timing ``--forwards`` warm forwards of batch x seq after a warm-up:

  ours_2r     mpiexec -n 2: 2 stages (the balanced plan), 1 BLAS thread each, M microbatches
  ours_1r1t   one rank pinned to one core (taskset -c 0)
  torch_2r    2 processes, gloo, torch.set_num_threads(1), ScheduleGPipe(n_microbatches=M),
              forward only, manual split at the same layer as ours
  torch_1t    the same wrapped model in one process, 1 thread (taskset -c 0)

Reported (best and median over all warm forwards):
  ours_2r / torch_2r                       target >= 1.2
  schedule efficiency = 2r / (2M/(M+1) x 1r1t), for each framework
  compute = ours_1r1t / torch_1t           (our per-rank kernels against torch's)
so that ours/torch = (our efficiency / torch's efficiency) x compute.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from _cli import default_mpiexec, run_warm, write_job
from _machine import add_common_args, fmt_table, header, loadavg, machine, pct, save_json, wait_quiet

HERE = Path(__file__).resolve().parent


def _torch(py: str, *args: str, prefix: list[str] | None = None, timeout_s: float = 1800.0) -> dict:
    cmd = [*(prefix or []), py, str(HERE / "_torch_pipe.py"), *args]
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"`{' '.join(cmd)}` exited with {proc.returncode}:\n{proc.stderr[-3000:]}")
    lines = [x for x in proc.stdout.splitlines() if x.startswith("{")]
    return json.loads(lines[-1]) if lines else {}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--torch-python", default=os.environ.get("RLX_TORCH_PYTHON"),
                    help="a Python with torch and transformers (default: $RLX_TORCH_PYTHON)")
    ap.add_argument("--preset", default="medium")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--reps", type=int, default=2, help="launches per case (default 2)")
    ap.add_argument("--forwards", type=int, default=3, help="warm forwards per launch (default 3)")
    ap.add_argument("--mpiexec", default=default_mpiexec())
    add_common_args(ap, quiet_wait_s=30.0)
    args = ap.parse_args()
    if not args.torch_python:
        print("bench_torch_pipe: skipped, no torch Python (give --torch-python or set RLX_TORCH_PYTHON)")
        return
    from rlx_mpi.families.llama import PRESETS
    from rlx_mpi.families import convert_hf

    p = PRESETS[args.preset]
    shape = dict(vocab_size=p.vocab_size, hidden_size=p.hidden_size, intermediate_size=p.intermediate_size,
                 num_hidden_layers=p.num_hidden_layers, num_attention_heads=p.num_attention_heads,
                 num_key_value_heads=p.num_key_value_heads, max_position_embeddings=p.max_position_embeddings,
                 rms_norm_eps=p.rms_norm_eps, rope_theta=p.rope_theta)
    hf, ckpt = Path(f"/tmp/rlx_bench_hf_{args.preset}"), Path(f"/tmp/rlx_bench_hf_{args.preset}.h5")
    if not (hf / "config.json").exists():
        _torch(args.torch_python, "build", "--shape", json.dumps(shape), "--out", str(hf))
    if not ckpt.exists():
        convert_hf(hf, ckpt)
    info = machine()
    torch_v = subprocess.run([args.torch_python, "-c", "import torch, transformers; print(torch.__version__, "
                              "transformers.__version__)"], capture_output=True, text=True).stdout.split()
    info["torch"], info["transformers"] = (torch_v + ["?", "?"])[:2]
    M = args.microbatches
    print(header(f"bench_torch_pipe: {args.preset} (converted HF model), batch {args.batch} x seq {args.seq}, "
                 f"2 stages x M={M}: ours vs torch.distributed.pipelining ScheduleGPipe", info,
                 f"{args.reps} launches per case, {args.forwards} warm forwards each, round-robin"))
    common = ["--hf", str(hf), "--batch", str(args.batch), "--seq", str(args.seq), "--reps", str(args.forwards)]
    secs: dict[str, list[float]] = {k: [] for k in ("ours_2r", "ours_1r1t", "torch_2r", "torch_1t")}
    split = None
    with tempfile.TemporaryDirectory(prefix="rlx_bench_tp_") as tmp:
        folder = Path(tmp)
        jc = dict(checkpoint=ckpt, preset=args.preset, batch=args.batch, seq=args.seq)
        job2, job1 = write_job(folder, "two", microbatches=M, **jc), write_job(folder, "one", **jc)
        for rep in range(args.reps):
            for case in secs:
                busy = wait_quiet(args.quiet, args.quiet_wait) if args.quiet_wait > 0 else None
                if case == "ours_2r":
                    runs = run_warm(2, job2, folder / "r.json", mpiexec=args.mpiexec, reps=args.forwards)
                    split = split or next(t["layers"][1] for t in runs[0]["timings"] if t["stage"] == 0)
                    got = [r["total_forward_ms"] / 1e3 for r in runs if not r["cold"]]
                elif case == "ours_1r1t":
                    runs = run_warm(1, job1, folder / "r.json", mpiexec=args.mpiexec, reps=args.forwards,
                                    prefix=["taskset", "-c", "0"])
                    got = [r["total_forward_ms"] / 1e3 for r in runs if not r["cold"]]
                elif case == "torch_2r":
                    got = _torch(args.torch_python, "pipe", *common, "--split", str(split), "--microbatches",
                                 str(M))["seconds"]
                else:
                    got = _torch(args.torch_python, "single", *common, "--threads", "1",
                                 prefix=["taskset", "-c", "0"])["seconds"]
                secs[case] += got
                print(f"# launch {rep + 1} {case}: best {min(got) * 1e3:.0f} ms ({pct(busy)} busy before)", flush=True)
    tokens = args.batch * args.seq
    factor = 2 * M / (M + 1)
    res = {}
    for how, key in ((min, "best"), (statistics.median, "median")):
        tps = {k: tokens / how(v) for k, v in secs.items()}
        res[key] = {"tokens_per_s": tps, "ours_over_torch": tps["ours_2r"] / tps["torch_2r"],
                    "ours_schedule_eff": tps["ours_2r"] / (factor * tps["ours_1r1t"]),
                    "torch_schedule_eff": tps["torch_2r"] / (factor * tps["torch_1t"]),
                    "compute_ours_over_torch": tps["ours_1r1t"] / tps["torch_1t"]}
    rows = [[key, *(f"{r['tokens_per_s'][k]:.1f}" for k in secs), f"{r['ours_over_torch']:.3f}",
             f"{r['ours_schedule_eff']:.3f}", f"{r['torch_schedule_eff']:.3f}", f"{r['compute_ours_over_torch']:.3f}"]
            for key, r in res.items()]
    print(f"\n## tokens/s, {tokens} tokens per forward; split at layer {split}; bound factor 2M/(M+1) = {factor:.3f}")
    print(fmt_table(["", *(f"{k}_tok/s" for k in secs), "ours/torch", "ours_eff", "torch_eff", "compute"], rows))
    print(f"# load average at the end: {loadavg()}")
    save_json(args.json, {"bench": "torch_pipe", "machine": info, "preset": args.preset, "batch": args.batch,
                          "seq": args.seq, "microbatches": M, "split": split, "seconds": secs, "results": res})


if __name__ == "__main__":
    main()
