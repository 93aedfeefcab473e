"""The numpy Llama against a naive, loop-by-token reference written independently here."""

import math

import numpy as np
import pytest

from rlx_mpi.model.checkpoint import H5ParamSource
from rlx_mpi.families.decoder.arch import Arch as LlamaConfig
from rlx_mpi.families.decoder.stage import DecoderStage as LlamaStage
from rlx_mpi.families.llama import FAMILY, PRESETS


def init_random(path, cfg, seed=0, dtype="float32"):
    FAMILY.init_random(path, cfg, seed=seed, dtype=dtype)

CFG = LlamaConfig(vocab_size=50, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32, rope_theta=1000.0)


def naive_forward(cfg, weights, ids):
    """Token by token, head by head, in float64: slow and obviously right."""
    hd, eps = cfg.head_dim, cfg.rms_norm_eps
    group = cfg.num_attention_heads // cfg.num_key_value_heads

    def norm(v, w):
        return v / math.sqrt(float(np.mean(v * v)) + eps) * w

    def rope(v, pos):
        out = np.empty_like(v)
        half = hd // 2
        for i in range(half):
            angle = pos / cfg.rope_theta ** (2 * i / hd)
            c, s = math.cos(angle), math.sin(angle)
            out[i] = v[i] * c - v[i + half] * s
            out[i + half] = v[i + half] * c + v[i] * s
        return out

    w = {k: v.astype(np.float64) for k, v in weights.items()}
    logits = np.zeros(ids.shape + (cfg.vocab_size,))
    for b in range(ids.shape[0]):
        xs = [w["embed_tokens"][t].copy() for t in ids[b]]
        for layer in range(cfg.num_hidden_layers):
            p = {k.split("/")[-1]: v for k, v in w.items() if k.startswith(f"layers/{layer}/")}
            hs = [norm(x, p["input_layernorm"]) for x in xs]
            qs = [p["q_proj"] @ h for h in hs]
            ks = [p["k_proj"] @ h for h in hs]
            vs = [p["v_proj"] @ h for h in hs]
            new = []
            for t in range(len(xs)):
                heads = []
                for head in range(cfg.num_attention_heads):
                    kv = head // group
                    q = rope(qs[t][head * hd:(head + 1) * hd], t)
                    scores = [q @ rope(ks[u][kv * hd:(kv + 1) * hd], u) / math.sqrt(hd) for u in range(t + 1)]
                    e = np.exp(np.array(scores) - max(scores))
                    probs = e / e.sum()
                    heads.append(sum(probs[u] * vs[u][kv * hd:(kv + 1) * hd] for u in range(t + 1)))
                x = xs[t] + p["o_proj"] @ np.concatenate(heads)
                h = norm(x, p["post_attention_layernorm"])
                g = p["gate_proj"] @ h
                new.append(x + p["down_proj"] @ (g / (1 + np.exp(-g)) * (p["up_proj"] @ h)))
            xs = new
        head = w["embed_tokens"] if cfg.tie_word_embeddings else w["lm_head"]
        for t, x in enumerate(xs):
            logits[b, t] = head @ norm(x, w["norm"])
    return logits


@pytest.mark.parametrize("tied", [False, True])
def test_stage_matches_naive_reference(tmp_path, tied):
    cfg = LlamaConfig(**{**CFG.__dict__, "tie_word_embeddings": tied})
    path = tmp_path / "m.h5"
    init_random(path, cfg, seed=3)
    ids = np.random.default_rng(1).integers(0, cfg.vocab_size, (2, 9))
    with H5ParamSource(path) as src:
        weights = {name: src.read(name) for name in _names(src)}
        out = LlamaStage(cfg, src, range(cfg.num_hidden_layers), True, True).forward(ids)
    ref = naive_forward(cfg, weights, ids)
    assert out.shape == (2, 9, cfg.vocab_size) and out.dtype == np.float32
    assert np.abs(out - ref).max() < 1e-4, np.abs(out - ref).max()


def _names(src):
    names = []
    src._file.visititems(lambda n, obj: names.append(n) if hasattr(obj, "shape") else None)
    return names


def test_split_stages_equal_whole(tmp_path):
    cfg = PRESETS["tiny"]
    path = tmp_path / "t.h5"
    init_random(path, cfg, seed=0)
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, (3, 11))
    with H5ParamSource(path) as src:
        whole = LlamaStage(cfg, src, range(8), True, True).forward(ids)
        parts = [LlamaStage(cfg, src, r, r.start == 0, r.stop == 8) for r in (range(0, 3), range(3, 4), range(4, 8))]
    x = ids
    for stage in parts:
        x = stage.forward(x)
    np.testing.assert_array_equal(x, whole)


def test_causality(tmp_path):
    """Changing a later token never changes an earlier position's logits."""
    cfg = PRESETS["tiny"]
    path = tmp_path / "t.h5"
    init_random(path, cfg, seed=0)
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, (1, 10))
    with H5ParamSource(path) as src:
        stage = LlamaStage(cfg, src, range(8), True, True)
        a = stage.forward(ids)
        ids2 = ids.copy()
        ids2[0, 7] = (ids2[0, 7] + 1) % cfg.vocab_size
        b = stage.forward(ids2)
    np.testing.assert_array_equal(a[:, :7], b[:, :7])
    assert np.abs(a[:, 7:] - b[:, 7:]).max() > 1e-3


def test_block_leaves_its_input_alone(tmp_path):
    """The residual is added into the block's fresh output: the input (an executor's receive
    buffer on a middle stage) must come back unchanged."""
    from rlx_mpi.families.decoder import model
    from rlx_mpi.families.decoder.rope import Rope

    path = tmp_path / "m.h5"
    init_random(path, CFG, seed=5)
    with H5ParamSource(path) as src:
        stage = LlamaStage(CFG, src, range(2), True, True)
    x = np.random.default_rng(2).standard_normal((2, 9, CFG.hidden_size)).astype(np.float32)
    before = x.copy()
    cos, sin = Rope(CFG, 9).prefix(9)
    y = model.block(x, stage.blocks[0], CFG, cos, sin)
    np.testing.assert_array_equal(x, before)
    assert not np.shares_memory(x, y) and np.abs(y - x).max() > 0


def test_warm_up_covers_every_kernel_a_forward_calls(tmp_path):
    """No numba compile inside a timed forward: after the stage's build (which calls
    kernels.warm_up), forwards of several shapes, a decode-sized one and attention at given
    positions add no kernel signature. (A read-only position array once made a second
    compile of the attention kernel inside the first forward: 0.5 s on the quick start.)"""
    import numba

    from rlx_mpi import kernels

    def signatures():
        return {name: len(f.signatures) for name, f in vars(kernels).items()
                if isinstance(f, numba.core.registry.CPUDispatcher)}

    path = tmp_path / "m.h5"
    init_random(path, CFG, seed=4)
    with H5ParamSource(path) as src:
        stage = LlamaStage(CFG, src, range(2), True, True)
    before = signatures()
    rng = np.random.default_rng(0)
    for B, T in ((1, 1), (2, 9), (3, 70), (1, 130)):
        stage.forward(rng.integers(0, CFG.vocab_size, (B, T)))
    q = rng.standard_normal((2, 4, 3, 4)).astype(np.float32)
    kv = rng.standard_normal((2, 2, 8, 4)).astype(np.float32)
    kernels.attend(q, kv, kv, np.array([[5, 6, 7], [2, 3, 4]]), 4)
    grew = {k: (before.get(k), n) for k, n in signatures().items() if n != before.get(k)}
    assert not grew, f"compiled after warm_up: {grew}"
