"""q4's choices, measured in one process: the weight format's error and the model's accuracy.

    python bench/bench_q4.py formats                      # weight error: Q4_0 against ours
    python bench/bench_q4.py accuracy M.h5 [--chunks 4]   # teacher-forced, against the f32 model

``formats``: relative RMS error of dequantized weights (Gaussian and Student-t(3) matrices,
512 x 1024) for llama.cpp's Q4_0 (symmetric: f16 d = max / -8, codes q - 8), min/max groups
(f16 scale and minimum, no refit) and `kernels.quantize_q4` (min/max then least-squares refits).

``accuracy``: the checkpoint's model (its own family and config) run teacher-forced over
``--chunks`` x 256 random ids (ids 3..V-1, seed 1), the second half of each chunk scored as
llama-perplexity does (>= 1000 positions at 8 chunks), top-1 agreement with the f32 model and
mean KL(f32 || q) for: q4 as the rank holds it (`precision = "q4"`), the same with the LM head
(and embedding) at int8, and Q4_0's weights in the same kernels (its blocks map onto q4 exactly:
scale d, minimum -8d), so the formats are compared with everything else equal. Accuracy needs no
quiet host; ``bench_llamacpp.py --q4`` sets ours against llama.cpp's own Q4_0 / Q4_K_M.
"""

from __future__ import annotations

import argparse
import json

import numpy as np


def q4_0(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """llama.cpp's quantize_row_q4_0 (d = max / -8 with max the signed value of largest |w|,
    code = min(15, (int)(w / d + 8.5))) as our q4 layout: scale d, minimum -8 d, f16 (exact)."""
    n, k = w.shape
    g = w.reshape(n, -1, 32)
    idx = np.abs(g).argmax(axis=2)
    mx = np.take_along_axis(g, idx[..., None], axis=2)[..., 0]
    d = mx / np.float32(-8)
    inv = np.where(d != 0, np.float32(1) / np.where(d != 0, d, 1), 0).astype(np.float32)
    q = np.minimum(15, np.trunc(g * inv[..., None] + np.float32(8.5))).astype(np.uint8).reshape(n, k)
    d16 = d.astype(np.float16)
    sm = np.empty((n, 2 * (k // 32)), np.uint16)
    sm[:, 0::2] = d16.view(np.uint16)
    sm[:, 1::2] = (d16.astype(np.float32) * np.float32(-8)).astype(np.float16).view(np.uint16)
    return q[:, 0::2] | (q[:, 1::2] << 4), sm


def formats() -> dict:
    from rlx_mpi.kernels import quant

    rng = np.random.default_rng(1)
    doc = {}
    for name, w in (("gauss", rng.standard_normal((512, 1024))), ("student_t3", rng.standard_t(3, (512, 1024)))):
        w = w.astype(np.float32)
        rms = float(np.sqrt((w ** 2).mean()))

        def err(codes_sm) -> float:
            return float(np.sqrt(((quant.dequantize_q4(*codes_sm) - w) ** 2).mean())) / rms

        refits = quant._REFITS
        quant._REFITS = 0
        minmax = err(quant.quantize_q4(w))
        quant._REFITS = refits
        doc[name] = {"q4_0": err(q4_0(w)), "minmax_f16": minmax, "ours": err(quant.quantize_q4(w))}
        print(f"{name}: relative RMS error Q4_0 {doc[name]['q4_0']:.4f}, min/max {minmax:.4f}, "
              f"ours {doc[name]['ours']:.4f} ({doc[name]['ours'] / doc[name]['q4_0']:.2f}x Q4_0)")
    return doc


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    x -= x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def _requantize(stage, quantize, head_int8: bool) -> None:
    """Replace the stage's q4 matrices by ``quantize``'s of their float32 values (dense layers)."""
    from rlx_mpi.families.decoder.weights import Linear, make_linear

    def q(lin):
        return Linear("q4", *quantize(lin.to_f32())) if lin.precision == "q4" else lin

    for b in stage.blocks:
        b.qkv, b.o_proj = q(b.qkv), q(b.o_proj)
        b.mlp.gate_up, b.mlp.down_proj = q(b.mlp.gate_up), q(b.mlp.down_proj)
    tied = stage.head is stage.embed_tokens
    if head_int8:
        stage.head = make_linear(stage.head.to_f32(), "int8")
        stage.embed_tokens = stage.head if tied else make_linear(stage.embed_tokens.to_f32(), "int8")
    else:
        stage.head = q(stage.head)
        stage.embed_tokens = stage.head if tied else q(stage.embed_tokens)


def accuracy(path: str, chunks: int, ctx: int = 256) -> dict:
    from rlx_mpi import kernels
    from rlx_mpi.model.checkpoint import H5ParamSource, read_header
    from rlx_mpi.families import get_family

    family_name, config_json = read_header(path)
    family = get_family(family_name)
    cfg = family.load_config(config_json, path)
    ids = np.random.default_rng(1).integers(3, family.dims(cfg).vocab_size, (chunks, ctx))
    scored = slice(ctx // 2, ctx - 1)

    def logits(precision: str, fix=None) -> np.ndarray:
        with H5ParamSource(path, family.expected_shapes(cfg)) as src:
            stage = family.build_stage(cfg, src, range(family.dims(cfg).n_layers), True, True, precision=precision)
        if fix:
            fix(stage)
        return np.concatenate([stage.forward(ids[c:c + 1])[:, scored] for c in range(chunks)])

    base = logits("f32")
    lb = _log_softmax(base)
    variants = {"q4": None,
                "q4, int8 head": lambda s: _requantize(s, kernels.quantize_q4, True),
                "Q4_0 weights": lambda s: _requantize(s, q4_0, False),
                "Q4_0 weights, int8 head": lambda s: _requantize(s, q4_0, True)}
    doc = {"positions": int(base.shape[0] * base.shape[1])}
    for name, fix in variants.items():
        got = logits("q4", fix)
        lq = _log_softmax(got)
        doc[name] = {"top1_agreement": float((lq.argmax(-1) == lb.argmax(-1)).mean()),
                     "mean_kld": float((np.exp(lb) * (lb - lq)).sum(-1).mean())}
        print(f"{name}: top-1 {doc[name]['top1_agreement']:.4f}, mean KL {doc[name]['mean_kld']:.5f} "
              f"({doc['positions']} positions)", flush=True)
    return doc


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("part", choices=["formats", "accuracy"])
    ap.add_argument("checkpoint", nargs="?")
    ap.add_argument("--chunks", type=int, default=8, help="256-token chunks (8: 1016 scored positions)")
    ap.add_argument("--json")
    args = ap.parse_args()
    if args.part == "formats":
        doc = formats()
    else:
        if not args.checkpoint:
            raise SystemExit("bench_q4 accuracy: give a checkpoint (rlx-mpi init-model --preset small M.h5)")
        doc = accuracy(args.checkpoint, args.chunks)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)


if __name__ == "__main__":
    main()
