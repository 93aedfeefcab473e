"""MoE decode (#31, #36): the experts' one-call kernel (`kernels.experts_decode`) against naive
numpy in every storage format, a row's output bitwise the same alone or in a batch of 8 (kernel
and layer, routed and DeepSeek's shared experts), the kernel path bitwise the per-expert path at
one row (so the transformers fixtures' agreement carries over), and the per-expert fallback for
experts that do not share one storage."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from rlx_mpi import kernels
from rlx_mpi.families.decoder import model
from rlx_mpi.families.decoder.arch import Arch
from rlx_mpi.families.decoder.weights import Experts, Mlp, make_linear

FORMATS = ["f32", "bf16", "f16", "int8", "q4"]
# max |kernel - numpy| / max |numpy| with numpy on the dequantized weights: bf16 activations are
# rounded to bf16 where the CPU multiplies bf16 pairs (rowdot's BF16_DOT), int8's to int16 blocks,
# q4's to int8 groups (the kernels' activation notes)
TOL = {"f32": 1e-5, "f16": 1e-5, "bf16": 1e-2, "int8": 1e-3, "q4": 5e-2}
C, I, E, K = 64, 96, 6, 2  # widths multiples of 32: whole q4 groups


def _experts(fmt: str, rng, biases: bool = False, n: int = E) -> list[Mlp]:
    def lin(shape):
        return make_linear(rng.standard_normal(shape, dtype=np.float32) * 0.2, fmt)

    def bias(width):
        return rng.standard_normal(width, dtype=np.float32) * 0.1 if biases else None

    return [Mlp.of(lin((I, C)), lin((I, C)), lin((C, I)), bias(I), bias(I), bias(C)) for _ in range(n)]


def _routing(rng, n: int, first: int = 0):
    index = np.stack([rng.permutation(E)[:K] for _ in range(n)]).astype(np.int64) + first
    return index, rng.random((n, K), dtype=np.float32)


def _naive(x, index, weight, experts, first, activation="silu", limit=7.0, alpha=1.702):
    """float64 numpy over the dequantized weights, expert by expert and row by row."""
    out = np.zeros(x.shape, np.float64)
    for r in range(len(x)):
        for j in range(index.shape[1]):
            e = index[r, j] - first
            if not 0 <= e < len(experts):
                continue
            m = experts[e]
            gu = m.gate_up.to_f32().astype(np.float64) @ x[r]
            if m.gate_up_bias is not None:
                gu += m.gate_up_bias
            g, u = gu[:I], gu[I:]
            if activation == "silu":
                h = g / (1 + np.exp(-g)) * u
            else:
                g = np.minimum(g, limit)
                h = (np.clip(u, -limit, limit) + 1) * g / (1 + np.exp(-alpha * g))
            y = m.down_proj.to_f32().astype(np.float64) @ h
            if m.down_bias is not None:
                y += m.down_bias
            out[r] += weight[r, j] * y
    return out


def _numpy_route(logits, cfg, bias):
    """The routers' rules in numpy (decoder.moe.route's code before the numba kernel)."""
    def top(scores, k):
        return np.argsort(-scores, axis=-1, kind="stable")[:, :k]

    def groups(scores, group_score):
        if cfg.n_group <= 1 or cfg.topk_group >= cfg.n_group:
            return scores
        N, E = scores.shape
        best = top(group_score(scores.reshape(N, cfg.n_group, E // cfg.n_group)), cfg.topk_group)
        keep = np.zeros((N, cfg.n_group), bool)
        np.put_along_axis(keep, best, True, axis=-1)
        return np.where(np.repeat(keep, E // cfg.n_group, axis=-1), scores, -np.inf)

    k = cfg.experts_per_token
    if cfg.routing == "softmax":
        probs = np.exp(logits - logits.max(axis=-1, keepdims=True))
        probs /= probs.sum(axis=-1, keepdims=True)
        index = top(groups(probs, lambda g: g.max(axis=-1)), k)
        weights = np.take_along_axis(probs, index, axis=-1)
        if cfg.norm_topk_prob:
            weights /= weights.sum(axis=-1, keepdims=True)
    elif cfg.routing == "sigmoid":
        scores = 1.0 / (1.0 + np.exp(-logits))
        choice = scores + bias if bias is not None else scores
        index = top(groups(choice, lambda g: np.sort(g, axis=-1)[..., -2:].sum(axis=-1)), k)
        weights = np.take_along_axis(scores, index, axis=-1)
        if cfg.norm_topk_prob:
            weights /= weights.sum(axis=-1, keepdims=True) + 1e-20
    else:
        logits = logits + bias if bias is not None else logits
        index = top(logits, k)
        weights = np.take_along_axis(logits, index, axis=-1)
        weights = np.exp(weights - weights.max(axis=-1, keepdims=True))
        weights /= weights.sum(axis=-1, keepdims=True)
    return index, (weights * np.float32(cfg.routed_scaling_factor)).astype(np.float32)


ROUTERS = {
    "mixtral": dict(num_experts=8, experts_per_token=2),
    "qwen3_moe": dict(num_experts=16, experts_per_token=4, norm_topk_prob=False),
    "deepseek_v2_groups": dict(num_experts=16, experts_per_token=3, n_group=4, topk_group=2, norm_topk_prob=False,
                               routed_scaling_factor=16.0),
    "deepseek_v3": dict(num_experts=16, experts_per_token=4, routing="sigmoid", router_bias=True, n_group=4,
                        topk_group=2, routed_scaling_factor=2.5),
    "deepseek_v3_ungrouped": dict(num_experts=8, experts_per_token=2, routing="sigmoid", norm_topk_prob=False),
    "gpt_oss": dict(num_experts=8, experts_per_token=3, routing="topk_softmax", router_bias=True),
}


@pytest.mark.parametrize("kind", list(ROUTERS))
def test_route_matches_numpy(kind):
    """The numba router against the rules in numpy: the same experts in the same order, weights
    within float32 rounding (exp and sum orders differ by an ulp); ties go to the lower expert."""
    from rlx_mpi.families.decoder.moe import route

    cfg = _arch(**ROUTERS[kind])
    rng = np.random.default_rng(9)
    E = cfg.num_experts
    x = rng.standard_normal((40, C), dtype=np.float32)
    router = rng.standard_normal((E, C), dtype=np.float32) * 0.3
    router[3] = router[5]  # a tie: experts 3 and 5 score alike for every row
    bias = rng.standard_normal(E, dtype=np.float32) * 0.1 if cfg.router_bias else None
    index, weight = route(x, router, cfg.experts_per_token, cfg, bias)
    logits = kernels.lone_rows(x, router)
    want_index, want_weight = _numpy_route(logits, cfg, bias)
    assert np.array_equal(index, want_index)
    np.testing.assert_allclose(weight, want_weight, rtol=2e-6, atol=1e-7)
    assert index.dtype == np.int64 and weight.dtype == np.float32
    alone = [route(x[r:r + 1], router, cfg.experts_per_token, cfg, bias) for r in range(len(x))]
    assert np.array_equal(np.concatenate([a for a, _ in alone]), index)
    assert np.array_equal(np.concatenate([w for _, w in alone]), weight)


def test_route_refuses_what_does_not_fit():
    logits = np.zeros((2, 8), np.float32)
    with pytest.raises(ValueError, match="does not fit"):
        kernels.route_experts(logits, "softmax", 9)
    with pytest.raises(ValueError, match="does not fit"):
        kernels.route_experts(logits, "softmax", 2, None, 3, 1)
    with pytest.raises(ValueError, match="routing 'relu'"):
        kernels.route_experts(logits, "relu", 2)
    with pytest.raises(ValueError, match="bias must be float32"):
        kernels.route_experts(logits, "sigmoid", 2, np.zeros(7, np.float32))


def _call(x, index, weight, first, stack, activation="silu"):
    return kernels.experts_decode(x, index, weight, first, stack.gate_up_fmt, stack.gate_up, stack.gate_up_scale,
                                  stack.gate_up_bias, stack.down, stack.down_scale, stack.down_bias, activation,
                                  down_fmt=stack.down_fmt)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("activation", ["silu", "silu_clamped"])
def test_experts_decode_matches_numpy_and_rows_are_independent(fmt, activation):
    rng = np.random.default_rng(3)
    clamped = activation == "silu_clamped"
    ex = Experts(np.zeros((E, C), np.float32), 0, _experts(fmt, rng, biases=clamped))
    assert ex.stack is not None and ex.stack.gate_up.shape[0] == E
    x = rng.standard_normal((8, C), dtype=np.float32) * (4 if clamped else 1)  # clamped: reach the limit
    index, weight = _routing(rng, 8)
    got = _call(x, index, weight, 0, ex.stack, activation)
    want = _naive(x, index, weight, ex.experts, 0, activation)
    assert np.abs(got - want).max() <= TOL[fmt] * np.abs(want).max()
    for r in range(8):  # alone, and in a batch of other rows in another order: bitwise (#36)
        assert np.array_equal(_call(x[r:r + 1], index[r:r + 1], weight[r:r + 1], 0, ex.stack, activation), got[r:r + 1])
    perm = rng.permutation(8)
    assert np.array_equal(_call(x[perm], index[perm], weight[perm], 0, ex.stack, activation), got[perm])


@pytest.mark.parametrize("fmt", ["f32", "int8"])
def test_experts_decode_computes_only_this_ranks_experts(fmt):
    """Under TP a rank holds experts first .. first + E/tp - 1: the others' rows get zeros there."""
    rng = np.random.default_rng(4)
    mine = _experts(fmt, rng, n=3)
    ex = Experts(np.zeros((E, C), np.float32), 3, mine)  # experts 3, 4, 5 of 6
    x = rng.standard_normal((8, C), dtype=np.float32)
    index, weight = _routing(rng, 8)
    got = _call(x, index, weight, 3, ex.stack)
    want = _naive(x, index, weight, mine, 3)
    assert np.abs(got - want).max() <= TOL[fmt] * np.abs(want).max()
    none_here = ~(index >= 3).any(axis=1)
    assert np.all(got[none_here] == 0)


def _arch(**kw) -> Arch:
    base = dict(vocab_size=64, hidden_size=C, intermediate_size=I, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=1, num_experts=E, experts_per_token=K)
    return Arch(**{**base, **kw}).validate("test")


ARCHS = {
    "mixtral": {},
    "deepseek_v3": dict(routing="sigmoid", router_bias=True, n_group=3, topk_group=2, routed_scaling_factor=2.5,
                        shared_intermediate_size=I),
    "gpt_oss": dict(routing="topk_softmax", router_bias=True, expert_bias=True, activation="silu_clamped"),
}


@pytest.mark.parametrize("kind", list(ARCHS))
@pytest.mark.parametrize("fmt", ["f32", "bf16", "int8", "q4"])
def test_moe_layer_row_alone_equals_row_in_batch_of_8(kind, fmt):
    """model.mlp on a MoE layer (routing, routed experts, shared experts): each of 8 decode rows
    computed alone is bitwise the row computed with the others; at one row the kernel path is
    bitwise the per-expert `Linear` path the transformers fixtures check."""
    cfg = _arch(**ARCHS[kind])
    rng = np.random.default_rng(5)
    shared = None
    if cfg.shared_intermediate_size:
        shared = _experts(fmt, rng, n=1)[0]
    w = Experts(rng.standard_normal((E, C), dtype=np.float32), 0, _experts(fmt, rng, biases=cfg.expert_bias),
                rng.standard_normal(E, dtype=np.float32) * 0.1 if cfg.router_bias else None, shared)
    assert w.stack is not None and (shared is None or w.shared_stack is not None)
    x = rng.standard_normal((8, 1, C), dtype=np.float32)
    batch = model.mlp(x, w, cfg)
    alone = np.concatenate([model.mlp(x[r:r + 1], w, cfg) for r in range(8)])
    assert np.array_equal(alone, batch)
    per_expert = dataclasses.replace(w)
    per_expert.stack = per_expert.shared_stack = None  # the layer-by-layer path (`Linear` per expert)
    for r in range(8):
        assert np.array_equal(model.mlp(x[r:r + 1], per_expert, cfg), alone[r:r + 1])


def test_experts_of_mixed_storage_keep_the_per_expert_path():
    """A checkpoint may hold experts in two formats (a q4 rank's q8 groups held as int8): no stack,
    and the layer still computes each expert as its own `Linear`."""
    rng = np.random.default_rng(6)
    experts = _experts("q4", rng, n=E - 1) + _experts("int8", rng, n=1)
    w = Experts(rng.standard_normal((E, C), dtype=np.float32), 0, experts)
    assert w.stack is None
    cfg = _arch()
    x = rng.standard_normal((3, 1, C), dtype=np.float32)
    index, weight = model.moe.route(x.reshape(3, C), w.router, K, cfg)
    want = _naive(x.reshape(3, C), index, weight, experts, 0)
    got = model.mlp(x, w, cfg).reshape(3, C)
    assert np.abs(got - want).max() <= TOL["q4"] * np.abs(want).max()


def test_stacked_experts_hold_their_bytes_once():
    rng = np.random.default_rng(7)
    experts = _experts("int8", rng)
    before = sum(m.nbytes for m in experts)
    w = Experts(np.zeros((E, C), np.float32), 0, experts)
    for e, m in enumerate(w.experts):  # each expert's matrices are views of the stack
        assert np.shares_memory(m.gate_up.data, w.stack.gate_up) and np.shares_memory(m.down_proj.scale, w.stack.down_scale)
    assert sum(m.nbytes for m in w.experts) == before == w.stack.gate_up.nbytes + w.stack.gate_up_scale.nbytes + \
        w.stack.down.nbytes + w.stack.down_scale.nbytes


def test_experts_decode_refuses_what_does_not_fit():
    rng = np.random.default_rng(8)
    s = Experts(np.zeros((E, C), np.float32), 0, _experts("f32", rng)).stack
    x, (index, weight) = np.ones((2, C), np.float32), _routing(rng, 2)
    with pytest.raises(ValueError, match="do not fit"):
        kernels.experts_decode(x, index[:1], weight, 0, "f32", s.gate_up, None, None, s.down, None, None)
    with pytest.raises(ValueError, match="does not take x"):
        kernels.experts_decode(np.ones((2, C + 1), np.float32), index, weight, 0, "f32", s.gate_up, None, None,
                               s.down, None, None)
    with pytest.raises(ValueError, match="are not"):
        kernels.experts_decode(x, index, weight, 0, "f32", s.gate_up, None, None, s.down[:, :, :-1].copy(), None, None)
    with pytest.raises(ValueError, match="activation 'gelu'"):
        kernels.experts_decode(x, index, weight, 0, "f32", s.gate_up, None, None, s.down, None, None, "gelu")
    with pytest.raises(ValueError, match="gate_up_bias"):
        kernels.experts_decode(x, index, weight, 0, "f32", s.gate_up, None, np.zeros((E, 3), np.float32), s.down,
                               None, None)
