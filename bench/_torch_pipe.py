"""The torch side of bench_torch_pipe.py; run with a Python that has torch and transformers.

    TORCH_PY _torch_pipe.py build --shape JSON --out HF_DIR [--seed 0]
    TORCH_PY _torch_pipe.py single --hf HF_DIR --threads T --batch B --seq S --reps R
    TORCH_PY _torch_pipe.py pipe --hf HF_DIR --split K --batch B --seq S --microbatches M --reps R

``build`` saves a ``LlamaForCausalLM`` of the given shape with O(1) random weights (as
bench_hf.py: linear N(0, 1/fan_in), embedding N(0, 1), norms 1 + 0.1 N(0, 1)). ``single``
times the whole model in one process. ``pipe`` spawns 2 processes (gloo, 1 thread each) and
runs `torch.distributed.pipelining.ScheduleGPipe` forward only over a manual split: stage 0 =
embedding + layers [0, K), stage 1 = layers [K, L) + norm + LM head. Both print one JSON line
{"seconds": [...]} (every timed forward, after one warm-up; for ``pipe``, rank 0's time from
a barrier to the logits on the last rank and a second barrier).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def build(shape: dict, out: str, seed: int) -> None:
    import torch
    import transformers
    from transformers import LlamaConfig, LlamaForCausalLM

    kw = dict(shape, tie_word_embeddings=False, attention_bias=False, mlp_bias=False)
    theta = kw.pop("rope_theta")
    if int(transformers.__version__.split(".")[0]) >= 5:
        kw["rope_parameters"] = {"rope_type": "default", "rope_theta": theta}
    else:
        kw["rope_theta"] = theta
    torch.manual_seed(seed)
    model = LlamaForCausalLM._from_config(LlamaConfig(**kw), attn_implementation="eager", dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif "embed_tokens" in name:
                p.copy_(torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) * p.shape[1] ** -0.5)
    model.save_pretrained(out, safe_serialization=True)


def _load(hf: str):
    import torch
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(hf, attn_implementation="eager", dtype=torch.float32).eval()


def _part(model, layers: range, first: bool, last: bool):
    """A pipeline stage as a plain module: embedding / decoder layers / norm + head."""
    import torch

    class Part(torch.nn.Module):
        def __init__(self):
            super().__init__()
            m = model.model
            self.embed = m.embed_tokens if first else None
            self.layers = torch.nn.ModuleList(m.layers[i] for i in layers)
            self.rotary = m.rotary_emb
            self.norm = m.norm if last else None
            self.head = model.lm_head if last else None

        def forward(self, x):
            h = self.embed(x) if first else x
            B, T = h.shape[:2]
            pos = torch.arange(T).unsqueeze(0).expand(B, T)
            pe = self.rotary(h, pos)
            mask = torch.full((T, T), torch.finfo(h.dtype).min).triu(1)[None, None]  # causal, additive
            for layer in self.layers:
                out = layer(h, attention_mask=mask, position_ids=pos, position_embeddings=pe)
                h = out[0] if isinstance(out, tuple) else out
            return self.head(self.norm(h)) if last else h

    return Part().eval()


def single(args) -> None:
    import torch

    torch.set_num_threads(args.threads)
    model = _load(args.hf)
    L = model.config.num_hidden_layers
    part = _part(model, range(L), True, True)  # the same wrapper as the pipeline stages
    ids = torch.randint(0, model.config.vocab_size, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))
    times = []
    with torch.inference_mode():
        for i in range(args.reps + 1):
            t0 = time.perf_counter()
            part(ids)
            if i:
                times.append(time.perf_counter() - t0)
    print(json.dumps({"seconds": times, "threads": args.threads}))


def _pipe_worker(rank: int, args) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    model = _load(args.hf)
    L = model.config.num_hidden_layers
    layers = range(0, args.split) if rank == 0 else range(args.split, L)
    part = _part(model, layers, rank == 0, rank == 1)
    del model
    mb = args.batch // args.microbatches
    example = (torch.zeros(mb, args.seq, dtype=torch.long) if rank == 0 else
               torch.zeros(mb, args.seq, part.layers[0].hidden_size if hasattr(part.layers[0], "hidden_size")
                           else part.layers[0].self_attn.config.hidden_size),)
    stage = PipelineStage(part, rank, 2, torch.device("cpu"), input_args=example)
    sched = ScheduleGPipe(stage, n_microbatches=args.microbatches)
    ids = torch.randint(0, 16384 if args.vocab is None else args.vocab, (args.batch, args.seq),
                        generator=torch.Generator().manual_seed(0))
    times = []
    with torch.no_grad():
        for i in range(args.reps + 1):
            dist.barrier()
            t0 = time.perf_counter()
            if rank == 0:
                sched.step(ids)
            else:
                sched.step()
            dist.barrier()
            if i:
                times.append(time.perf_counter() - t0)
    if rank == 0:
        print(json.dumps({"seconds": times, "split": args.split}), flush=True)
    dist.destroy_process_group()


def pipe(args) -> None:
    import torch.multiprocessing as mp

    from transformers import AutoConfig

    args.vocab = AutoConfig.from_pretrained(args.hf).vocab_size
    mp.spawn(_pipe_worker, args=(args,), nprocs=2, join=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build")
    b.add_argument("--shape", required=True)
    b.add_argument("--out", required=True)
    b.add_argument("--seed", type=int, default=0)
    for name in ("single", "pipe"):
        p = sub.add_parser(name)
        p.add_argument("--hf", required=True)
        p.add_argument("--batch", type=int, default=16)
        p.add_argument("--seq", type=int, default=128)
        p.add_argument("--reps", type=int, default=3)
        if name == "single":
            p.add_argument("--threads", type=int, default=1)
        else:
            p.add_argument("--split", type=int, required=True)
            p.add_argument("--microbatches", type=int, default=8)
            p.add_argument("--port", type=int, default=29517)
    args = ap.parse_args()
    if args.cmd == "build":
        build(json.loads(args.shape), args.out, args.seed)
    elif args.cmd == "single":
        single(args)
    else:
        pipe(args)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
