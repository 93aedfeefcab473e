"""Every family's converted checkpoint against transformers (tests/fixtures/families, made by
tests/make_family_fixtures.py): logits, greedy tokens through the KV cache, low precision,
tensor-parallel sharding (expert parallelism included) and one refusal per unsupported feature.
The family-only kernels (GeGLU, soft-cap, attention scale and soft-cap) against naive numpy."""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
import threading

import numpy as np
import pytest

from conftest import TESTS, run_cli
from rlx_mpi import kernels
from rlx_mpi.model.checkpoint import H5ParamSource, part_bounds, read_header, write_checkpoint
from rlx_mpi.errors import CheckpointError, ConfigError
from rlx_mpi.families import family_for_model_type, get_family
from rlx_mpi.families.decoder import ops
from rlx_mpi.families.decoder.arch import Arch
from rlx_mpi.families.decoder.rope import inv_freq
from rlx_mpi.model.kv_cache import KvSpec
from rlx_mpi.model.stage import TensorParallel

FAMILIES = TESTS / "fixtures" / "families"
CASES = ["llama3", "llama_linear", "mistral", "qwen2", "qwen3", "phi3", "phi3_longrope", "gemma2", "mixtral",
         "gemma3", "olmo2", "granite", "qwen3_moe", "qwen3_moe_fused", "mixtral_fused", "gemma3_mm",
         "deepseek_v3", "deepseek_v2", "gpt_oss"]
FAMILY_OF = {"llama3": "llama", "llama_linear": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3",
             "phi3": "phi3", "phi3_longrope": "phi3", "gemma2": "gemma2", "mixtral": "mixtral",
             "gemma3": "gemma3", "olmo2": "olmo2", "granite": "granite", "qwen3_moe": "qwen3_moe",
             "qwen3_moe_fused": "qwen3_moe", "mixtral_fused": "mixtral", "gemma3_mm": "gemma3",
             "deepseek_v3": "deepseek_v3", "deepseek_v2": "deepseek_v2", "gpt_oss": "gpt_oss"}

# Stated bounds: max |logit - f32 logit| / max |f32 logit| on the fixtures' 2 x 40 tokens.
# Measured (transformers 5.24 fixtures, initializer_range 0.2): dense bf16 0.012-0.027,
# f16 0.0017-0.0058, int8 0.044-0.124; Mixtral bf16 0.11, f16 0.09, int8 0.19: a perturbed
# router score changes which experts a token takes (a discontinuity no precision avoids).
# q4 (4-bit groups of 32): dense 0.51-0.97, Mixtral 0.84: on these random weights (initializer_range
# 0.2) the q4 rounding (~7 % of each weight, ~18x int8's) is amplified layer by layer; what q4
# computes is checked tightly below against its own dequantized weights (test_q4_is_its_own_dequantized_model).
# bf16: where the CPU has AVX512-BF16 every row's activations are rounded to bf16 too, prefill's as
# decode's (docs/invariance.md): llama3 0.044 then (the dense fixtures 0.012-0.027 before, above).
BOUNDS = {"bf16": 0.05, "f16": 0.01, "int8": 0.16, "q4": 1.1}
MOE_BOUNDS = {"bf16": 0.15, "f16": 0.12, "int8": 0.25, "q4": 1.1}
# Gemma 3, OLMo 2, Granite 3, Qwen3-MoE measured the same way: bf16 0.011-0.017, f16 0.0012-0.0028,
# int8 0.043-0.10 (Qwen3-MoE 0.014 / 0.0018 / 0.050). The *_fused cases are the Mixtral and
# Qwen3-MoE maths again (they test the fused-layout reader), and a router flip there (mixtral_fused:
# bf16 0.22, int8 0.50) says nothing the other MoE cases do not: not run at low precision.
PRECISION_CASES = [c for c in CASES if not c.endswith("_fused")]
# DeepSeek's grouped routers (a group flips with its experts; V3 x routed_scaling_factor 2.5)
# flip at a few of the 80 positions: measured V3 bf16 4, f16 1, int8 2 positions beyond
# MOE_BOUNDS (0.42-0.79 there), every other position within 0.07; V2 int8 1 (0.250), bf16 and
# f16 none (0.025, 0.002). Allowed: 6 positions beyond, the median position within the dense BOUNDS.
ROUTING_FLIPS = {"deepseek_v3": 6, "deepseek_v2": 6}


def reference(case: str):
    return np.load(FAMILIES / case / "reference.npz", allow_pickle=False)


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """case -> (family, Arch, checkpoint path), each converted once through the family's API."""
    out, root = {}, tmp_path_factory.mktemp("families")

    def get(case: str):
        if case not in out:
            raw = json.loads((FAMILIES / case / "config.json").read_text())
            family = family_for_model_type(raw["model_type"])
            path = root / f"{case}.h5"
            cfg = family.convert_hf(FAMILIES / case, path, dtype="float32", hf_config=raw)
            out[case] = family, cfg, path
        return out[case]
    return get


def build(family, cfg, path, **kw):
    with H5ParamSource(path, family.expected_shapes(cfg)) as src:
        return family.build_stage(cfg, src, range(cfg.num_hidden_layers), True, True, **kw)


def greedy(stage, prompt: np.ndarray, n: int, kv: KvSpec = KvSpec("full")) -> list[int]:
    """Prefill the prompt, then decode one token at a time through the stage API."""
    stage.reset(1, prompt.shape[1] + n, kv)
    logits = stage.prefill(prompt, np.array([0]), np.array([prompt.shape[1]]))
    out = [int(logits[0].argmax())]
    for pos in range(prompt.shape[1], prompt.shape[1] + n - 1):
        out.append(int(stage.decode(np.array([[out[-1]]]), np.array([0]), np.array([pos]))[0].argmax()))
    return out


# -- against transformers ----------------------------------------------------------------------


@pytest.mark.parametrize("case", CASES)
def test_logits_match_transformers(converted, case):
    family, cfg, path = converted(case)
    assert family.name == FAMILY_OF[case] and read_header(path)[0] == family.name
    ref = reference(case)
    stage = build(family, cfg, path)
    for ids, logits in (("input_ids", "logits"), ("input_ids_short", "logits_short")):
        if ids in ref:  # phi3_longrope: one call within the original context (short factors), one past it
            assert np.abs(stage.forward(ref[ids]) - ref[logits]).max() <= 1e-4, (case, ids)


@pytest.mark.parametrize("case", CASES)
def test_greedy_tokens_equal_generate(converted, case):
    family, cfg, path = converted(case)
    ref = reference(case)
    want = ref["greedy_ids"][0].tolist()
    assert greedy(build(family, cfg, path), ref["prompt_ids"], len(want)) == want


@pytest.mark.parametrize("case", ["mistral", "gemma2", "gemma3", "gpt_oss", "deepseek_v3"])
def test_window_layers_keep_a_ring_and_the_recompute_path_agrees(converted, case):
    """A sliding-window layer caches only its window (a ring); ``kv_cache = none`` (recompute
    the prefix every step) gives the same tokens (DeepSeek: no window, the latent cache against
    recomputing)."""
    family, cfg, path = converted(case)
    ref = reference(case)
    stage = build(family, cfg, path)
    want = ref["greedy_ids"][0].tolist()
    assert greedy(stage, ref["prompt_ids"], len(want)) == want
    lengths = [c.k.shape[2] for c in stage.caches]
    windows = [cfg.window(n) for n in range(cfg.num_hidden_layers)]
    assert lengths == [w or ref["prompt_ids"].shape[1] + len(want) for w in windows]
    ids = list(ref["prompt_ids"][0])
    for _ in range(len(want)):  # no cache: a full prefill per token
        stage.reset(1, len(ids), KvSpec("none"))
        ids.append(int(stage.prefill(np.array([ids]), np.array([0]), np.array([len(ids)]))[0].argmax()))
    assert ids[ref["prompt_ids"].shape[1]:] == want


@pytest.mark.parametrize("case", CASES)
def test_cli_convert_matches_transformers(tmp_path, case):
    out = tmp_path / "m.h5"
    proc = run_cli(["convert", FAMILIES / case, out], timeout=120)
    assert proc.returncode == 0, proc.stderr
    family = get_family(read_header(out)[0])
    cfg = family.load_config(read_header(out)[1], str(out))
    ref = reference(case)
    assert np.abs(build(family, cfg, out).forward(ref["input_ids"]) - ref["logits"]).max() <= 1e-4
    if (FAMILIES / case / "generation_config.json").is_file() and (FAMILIES / case / "tokenizer.json").is_file():
        assert (tmp_path / "m.generation_config.json").read_text() == \
            (FAMILIES / case / "generation_config.json").read_text()


@pytest.mark.parametrize("case", PRECISION_CASES)
@pytest.mark.parametrize("precision", ["bf16", "f16", "int8", "q4"])
def test_low_precision_within_the_stated_bound(converted, case, precision):
    family, cfg, path = converted(case)
    ref = reference(case)
    got = build(family, cfg, path, precision=precision).forward(ref["input_ids"])
    bound = (MOE_BOUNDS if cfg.num_experts else BOUNDS)[precision]
    if case in ROUTING_FLIPS:
        per_position = np.abs(got - ref["logits"]).max(axis=-1) / np.abs(ref["logits"]).max()
        assert np.isfinite(got).all() and (per_position > bound).sum() <= ROUTING_FLIPS[case], (precision, per_position)
        assert np.median(per_position) <= BOUNDS[precision], (precision, np.median(per_position))
        return
    err = np.abs(got - ref["logits"]).max() / np.abs(ref["logits"]).max()
    assert np.isfinite(got).all() and err <= bound, (case, precision, err)


def _as_f32(held, twin) -> None:
    """``twin``'s matrices (a float32 stage's) set to the float32 values of ``held``'s (a q4 stage's)."""
    from rlx_mpi.families.decoder.weights import Experts, Linear, Mlp

    def f32(lin):
        return Linear("f32", lin.to_f32())

    twin.embed_tokens, twin.head = f32(held.embed_tokens), f32(held.head)
    for a, b in zip(held.blocks, twin.blocks):
        b.o_proj = f32(a.o_proj)
        if a.mla is None:
            b.qkv = f32(a.qkv)
        else:  # latent attention: its projections (uk / uv are float32 copies of kv_b's halves)
            b.mla.q, b.mla.kv_a, b.mla.kv_b = f32(a.mla.q), f32(a.mla.kv_a), f32(a.mla.kv_b)
            b.mla.uk, b.mla.uv = a.mla.uk, a.mla.uv
            if a.mla.q_a is not None:
                b.mla.q_a = f32(a.mla.q_a)
        mlps = [*a.mlp.experts, *([a.mlp.shared] if a.mlp.shared else [])] if isinstance(a.mlp, Experts) else [a.mlp]
        into = [*b.mlp.experts, *([b.mlp.shared] if b.mlp.shared else [])] if isinstance(b.mlp, Experts) else [b.mlp]
        for m, t in zip(mlps, into):
            assert isinstance(m, Mlp)
            t.gate_up, t.down_proj = f32(m.gate_up), f32(m.down_proj)


@pytest.mark.parametrize("case", PRECISION_CASES)  # the *_fused cases: see PRECISION_CASES
def test_q4_is_its_own_dequantized_model(converted, case, monkeypatch):
    """Every family at q4 computes what a float32 model of its dequantized weights computes:
    within 1e-4 through the prefill tiles (exact products), and through the decode kernels (the
    activations rounded to int8 groups; measured 0.010-0.11 here, Mixtral's router flips included)
    within 0.2."""
    family, cfg, path = converted(case)
    ids = reference(case)["input_ids"]
    held = build(family, cfg, path, precision="q4")
    twin = build(family, cfg, path)
    _as_f32(held, twin)
    want = twin.forward(ids)
    decode = held.forward(ids)  # 80 rows: the q4 GEMM (AVX-512 VNNI) or the decode kernels, x in int8 groups
    for module in (kernels, kernels.lowp):  # every product on the tiles (Linear's and dequant_matmul's limit)
        monkeypatch.setattr(module, "matvec_rows", lambda fmt, threads=None: 0)
    monkeypatch.setattr(kernels, "Q4_GEMM", False)
    fused = kernels.fused_matvec  # q4 takes its fused kernel at every row count (#36): its tiles by hand
    monkeypatch.setattr(kernels, "fused_matvec", lambda x, w, fmt, s, out: kernels.dequant_matmul(x, w, fmt, s, out, False)
                        if fmt == "q4" else fused(x, w, fmt, s, out))
    got = held.forward(ids)
    # (the twin sums in the float tiles' order, the q4 tiles in OpenBLAS's: DeepSeek's grouped
    # routing with V3's routed scaling carries that rounding to 1.8e-4, measured; 1e-4 elsewhere)
    assert np.abs(got - want).max() <= (3e-4 if case.startswith("deepseek") else 1e-4) * np.abs(want).max(), case
    if not case.startswith("deepseek"):
        assert np.abs(decode - want).max() <= 0.2 * np.abs(want).max()
    else:  # grouped sigmoid routing: the int8 activations flip expert groups (max 0.24 V2, 0.62 V3;
        # per-position median measured 0.066 on V3, the tiles above exact): bounded, not explained
        per_position = np.abs(decode - want).max(-1) / np.abs(want).max()
        assert np.median(per_position) <= 0.1, np.sort(per_position.ravel())[-8:]


# -- tensor parallelism in one process ---------------------------------------------------------


class _Group:
    """The TP group's collectives for stages run in threads of one process (lockstep)."""

    def __init__(self, size: int):
        self.size, self.barrier, self.parts = size, threading.Barrier(size), [None] * size

    def _exchange(self, rank: int, part: np.ndarray) -> list[np.ndarray]:
        self.parts[rank] = part
        self.barrier.wait(timeout=60)
        parts = list(self.parts)
        self.barrier.wait(timeout=60)
        return parts

    def attach(self, stage, rank: int) -> None:
        stage._reduce = lambda p: np.sum(self._exchange(rank, p), axis=0, dtype=np.float32)
        stage._gather_vocab = lambda p: np.concatenate(self._exchange(rank, p), axis=-1)


def tp_run(family, cfg, path, tp: int, work):
    """``work(stage)`` on each of ``tp`` ranks' stages in lockstep; returns rank 0's result."""
    group, results, errors = _Group(tp), [None] * tp, []
    stages = []
    for r in range(tp):
        with H5ParamSource(path, family.expected_shapes(cfg)) as src:
            stages.append(family.build_stage(cfg, src, range(cfg.num_hidden_layers), True, True,
                                             TensorParallel(rank=r, size=tp)))
        group.attach(stages[-1], r)

    def run(r):
        try:
            results[r] = work(stages[r])
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)
            group.barrier.abort()
    threads = [threading.Thread(target=run, args=(r,)) for r in range(tp)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    if errors:
        raise errors[0]
    return stages, results


def test_tp_must_divide_the_heads_and_divide_or_cover_the_kv_heads(converted):
    family, cfg, _ = converted("mistral")  # 4 heads, 2 kv heads
    family.check_tp(cfg, 4, "x")  # one replicated kv head per rank
    wide = dataclasses.replace(cfg, num_attention_heads=12, num_key_value_heads=4)
    with pytest.raises(ConfigError, match=r"tp = 6 neither divides nor is a multiple of the model's 4 key/value"):
        family.check_tp(wide, 6, "x")
    with pytest.raises(ConfigError, match=r"tp = 8 does not divide the model's 12 attention heads"):
        family.check_tp(wide, 8, "x")


@pytest.mark.parametrize("case", CASES)  # llama3: 1 kv head, replicated on both ranks
def test_tp2_logits_and_greedy_match_transformers(converted, case):
    family, cfg, path = converted(case)
    family.check_tp(cfg, 2, "test")
    ref = reference(case)
    stages, logits = tp_run(family, cfg, path, 2, lambda s: s.forward(ref["input_ids"]))
    assert np.abs(logits[0] - ref["logits"]).max() <= 1e-4
    want = ref["greedy_ids"][0].tolist()
    _, tokens = tp_run(family, cfg, path, 2, lambda s: greedy(s, ref["prompt_ids"], len(want)))
    assert tokens[0] == want
    if cfg.num_experts:  # expert parallelism: each rank holds E/2 whole experts, not slices
        for r, stage in enumerate(stages):
            moe = next(b.mlp for n, b in enumerate(stage.blocks) if cfg.moe(n))  # (not a dense_layers one)
            assert moe.first == part_bounds(cfg.num_experts, r, 2)[0] and len(moe.experts) == cfg.num_experts // 2
            assert moe.experts[0].gate_proj.shape == (cfg.intermediate_size, cfg.hidden_size)


@pytest.mark.parametrize("case", ["mistral", "qwen2", "gemma2", "mixtral", "gemma3", "olmo2", "qwen3_moe", "gpt_oss"])
def test_tp4_replicates_kv_heads_across_ranks(converted, case):
    """tp = 4 over 2 kv heads: each rank holds the one kv head its query head reads (with its
    bias for Qwen2, GPT-OSS); Mixtral's and GPT-OSS's 4 experts one per rank, GPT-OSS's sinks
    one per rank. OLMo 2's whole-k norm then sums each replicated head twice over the group (and
    divides by twice the width): still exact."""
    family, cfg, path = converted(case)
    family.check_tp(cfg, 4, "test")
    ref = reference(case)
    stages, logits = tp_run(family, cfg, path, 4, lambda s: s.forward(ref["input_ids"]))
    assert np.abs(logits[0] - ref["logits"]).max() <= 1e-4
    assert [s.blocks[0].k_proj.shape[0] for s in stages] == [cfg.head_dim] * 4
    if cfg.attention_sinks:
        assert [s.blocks[0].sinks.shape for s in stages] == [(1,)] * 4
    want = ref["greedy_ids"][0].tolist()
    _, tokens = tp_run(family, cfg, path, 4, lambda s: greedy(s, ref["prompt_ids"], len(want)))
    assert tokens[0] == want


@pytest.mark.parametrize("case", ["mistral", "qwen2", "mixtral", "olmo2", "qwen3_moe", "deepseek_v3", "gpt_oss"])
def test_planner_counts_what_each_tp_rank_holds(converted, case):
    """The planner's per-rank weight bytes (`ModelCost.under_tp`, what `plan` prints) against the
    bytes each TP rank's stage really holds, including kv heads replicated when tp > kv heads
    (the old count, without them, was 4-9 % short at tp 4 on these models)."""
    family, cfg, path = converted(case)
    for tp in (1, 2, 4):
        stages, _ = tp_run(family, cfg, path, tp, lambda s: None)
        cost = family.cost(cfg, 1, 1).under_tp(tp)
        est = (cfg.num_hidden_layers * cost.layer_bytes + cost.embed_bytes + cost.head_bytes
               - cost.shared_end_bytes) / tp
        norms = 4 * cfg.hidden_size * (2 * cfg.num_hidden_layers + 1) * (tp - 1) / tp  # every rank holds them whole
        # as the routers (and GPT-OSS's o_proj bias): left out of the plan (0.02 % of a DeepSeek-V3 layer)
        whole = sum(cfg.num_experts * (cfg.hidden_size + cfg.router_bias) for n in range(cfg.num_hidden_layers)
                    if cfg.moe(n)) + cfg.o_bias * cfg.hidden_size * cfg.num_hidden_layers
        norms += 4 * whole * (tp - 1) / tp
        for s in stages:
            assert abs(s.weight_bytes - norms - est) <= 0.01 * est, (tp, s.weight_bytes, est)


def test_tp_must_divide_the_experts(converted):
    family, cfg, _ = converted("mixtral")
    with pytest.raises(ConfigError, match=r"does not divide the model's 6 experts"):
        family.check_tp(dataclasses.replace(cfg, num_experts=6, num_attention_heads=4, num_key_value_heads=4), 4, "x")


# -- RoPE ----------------------------------------------------------------------------------------


def test_llama3_rope_against_meta_reference():
    """inv_freq of rope_type llama3 against Meta's apply_scaling (llama-models), written here
    as its per-frequency loop in float64."""
    cfg = Arch(vocab_size=8, hidden_size=256, intermediate_size=8, num_hidden_layers=1, num_attention_heads=2,
               num_key_value_heads=2, rope_theta=500000.0, rope_type="llama3", rope_factor=8.0,
               rope_low_freq_factor=1.0, rope_high_freq_factor=4.0, rope_original_max_positions=8192).validate("t")
    base = 1.0 / (500000.0 ** (np.arange(0, 128, 2) / 128))
    want = []
    for f in base:
        wavelen = 2 * math.pi / f
        if wavelen < 8192 / 4.0:
            want.append(f)
        elif wavelen > 8192 / 1.0:
            want.append(f / 8.0)
        else:
            smooth = (8192 / wavelen - 1.0) / (4.0 - 1.0)
            want.append((1 - smooth) * f / 8.0 + smooth * f)
    np.testing.assert_allclose(inv_freq(cfg), want, rtol=2e-6)
    lin = dataclasses.replace(cfg, rope_type="linear", rope_factor=4.0)
    np.testing.assert_allclose(inv_freq(lin), base / 4.0, rtol=2e-6)


def test_longrope_switches_factors_past_the_original_context(converted):
    family, cfg, path = converted("phi3_longrope")
    assert cfg.rope_type == "longrope" and cfg.rope_original_max_positions == 16
    from rlx_mpi.families.decoder.rope import Rope

    rope = Rope(cfg, 64)
    short, long = rope.at(np.array([[15]])), rope.at(np.array([[16]]))
    assert rope.prefix(16)[0] is not None and np.array_equal(rope.prefix(16)[0], rope.short[0][:16])
    assert np.array_equal(short[0][0, 0, 0], rope.short[0][15]) and np.array_equal(long[0][0, 0, 0], rope.long[0][16])
    assert not np.allclose(rope.short[0][16], rope.long[0][16])
    expected = math.sqrt(1 + math.log(64 / 16) / math.log(16))  # max_positions / original
    assert cfg.rope_attention_factor == pytest.approx(expected)


def test_longrope_factors_follow_each_sequence_not_its_batch(converted):
    """A 10-token prompt (within the original 16) padded into a batch with a 20-token one keeps
    the short factors: its logits equal its own single-sequence prefill (transformers' choice
    for that sequence alone)."""
    family, cfg, path = converted("phi3_longrope")
    stage = build(family, cfg, path)
    ids = np.random.default_rng(4).integers(0, cfg.vocab_size, (2, 20))
    stage.reset(2, 24, KvSpec("full"))
    both = stage.prefill(ids, np.array([0, 1]), np.array([10, 20]))
    for b, n in ((0, 10), (1, 20)):
        stage.reset(1, 24, KvSpec("full"))
        alone = stage.prefill(ids[b:b + 1, :n], np.array([0]), np.array([n]))
        np.testing.assert_allclose(both[b], alone[0], atol=1e-5)
    short = stage.forward(ids[:1, :10])[0, -1]  # a plain forward of 10 tokens: short factors
    np.testing.assert_allclose(both[0], short, atol=1e-5)


# -- kernels -------------------------------------------------------------------------------------


def test_gelu_tanh_mul_against_numpy():
    rng = np.random.default_rng(0)
    gate, up = rng.standard_normal((2, 3, 37), dtype=np.float32) * 4, rng.standard_normal((2, 3, 37), dtype=np.float32)
    x = gate.astype(np.float64)
    want = 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3))) * up
    np.testing.assert_allclose(ops.gelu_tanh_mul_(gate.copy(), up), want, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="differ"):
        ops.gelu_tanh_mul_(gate, up[:, :, :5])


def test_softcap_against_numpy():
    x = np.random.default_rng(1).standard_normal((3, 50), dtype=np.float32) * 40
    np.testing.assert_allclose(ops.softcap_(x.copy(), 30.0), 30.0 * np.tanh(x.astype(np.float64) / 30.0),
                               rtol=1e-6, atol=1e-5)
    with pytest.raises(ValueError, match="cap must be > 0"):
        ops.softcap_(x, 0.0)


@pytest.mark.parametrize("T, window", [(5, 0), (70, 0), (70, 9)])
def test_attend_scale_and_softcap_against_numpy(T, window):
    rng = np.random.default_rng(T)
    q = rng.standard_normal((2, 4, T, 8), dtype=np.float32) * 3
    k, v = rng.standard_normal((2, 2, T, 8), dtype=np.float32) * 3, rng.standard_normal((2, 2, T, 8), dtype=np.float32)
    got = kernels.attend(q, k, v, None, window, scale=0.2, softcap=5.0)
    kk, vv = np.repeat(k, 2, axis=1).astype(np.float64), np.repeat(v, 2, axis=1).astype(np.float64)
    s = 5.0 * np.tanh(q.astype(np.float64) @ kk.transpose(0, 1, 3, 2) * 0.2 / 5.0)
    i, j = np.arange(T)[:, None], np.arange(T)[None, :]
    visible = (j <= i) & ((j > i - window) if window else True)
    s = np.where(visible, s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    want = (p / p.sum(-1, keepdims=True)) @ vv  # (B, nh, T, hs)
    np.testing.assert_allclose(got, want.transpose(0, 2, 1, 3), rtol=1e-4, atol=1e-5)


# -- configs, cost, old checkpoints --------------------------------------------------------------


def test_old_llama_header_still_loads(tmp_path):
    """A checkpoint written before families (family llama, the eleven-key config) loads as
    the plain Llama it describes."""
    old = {"vocab_size": 50, "hidden_size": 16, "intermediate_size": 24, "num_hidden_layers": 1,
           "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 4, "max_position_embeddings": 32,
           "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False}
    family = get_family("llama")
    cfg = family.load_config(json.dumps(old), "old.h5")
    assert cfg == Arch(**old) and cfg.rope_type == "default" and not cfg.num_experts
    path = tmp_path / "old.h5"
    write_checkpoint(path, "llama", json.dumps(old), ((n, np.ones(s, np.float32)) for n, s in
                                                       family.expected_shapes(cfg).items()))
    assert build(family, cfg, path).forward(np.zeros((1, 3), np.int64)).shape == (1, 3, 50)


def test_arch_validation_names_the_field():
    good = Arch(vocab_size=8, hidden_size=16, intermediate_size=8, num_hidden_layers=2, num_attention_heads=2,
                num_key_value_heads=2)
    for change, match in [({"activation": "relu"}, "activation = 'relu'"),
                          ({"rope_type": "dynamic"}, "rope_type = 'dynamic'"),
                          ({"rope_type": "yarn"}, "rope_original_max_positions"),
                          ({"routing": "hash"}, "routing = 'hash'"),
                          ({"num_experts": 6, "experts_per_token": 2, "n_group": 4}, "n_group = 4"),
                          ({"kv_lora_rank": 8}, "kv_lora_rank = 8"),
                          ({"layer_windows": (4,)}, "layer_windows = \\(4,\\)"),
                          ({"num_experts": 4, "experts_per_token": 5}, "experts_per_token = 5"),
                          ({"rope_type": "longrope", "rope_original_max_positions": 4}, "rope_short_factor"),
                          ({"qk_norm_scope": "group"}, "qk_norm_scope = 'group'"),
                          ({"pre_norms": False}, "pre_norms = False"),
                          ({"residual_multiplier": 0.0}, "residual_multiplier = 0.0"),
                          ({"logits_scaling": float("nan")}, "logits_scaling = nan"),
                          ({"dense_layers": (0,)}, "dense_layers = \\(0,\\)"),
                          ({"num_experts": 2, "experts_per_token": 1, "dense_layers": (2,)}, "dense_layers = \\(2,\\)"),
                          ({"rope_local_theta": -1.0}, "rope_local_theta = -1.0")]:
        with pytest.raises(CheckpointError, match=match):
            dataclasses.replace(good, **change).validate("x")


def test_moe_cost_counts_every_expert_bytes_but_topk_flops():
    dense = Arch(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                 num_attention_heads=32, num_key_value_heads=8)
    moe = dataclasses.replace(dense, num_experts=8, experts_per_token=2)
    mlp = 3 * 4096 * 14336
    c_dense, c_moe = dense.cost(1, 128), moe.cost(1, 128)
    assert c_moe.layer_bytes - c_dense.layer_bytes == 4 * (7 * mlp + 8 * 4096)
    assert c_moe.layer_flops_per_token - c_dense.layer_flops_per_token == 2.0 * (mlp + 8 * 4096)
    total = c_moe.n_layers * c_moe.layer_bytes + c_moe.embed_bytes + c_moe.head_bytes
    assert 46e9 * 4 < total < 47.5e9 * 4  # Mixtral-8x7B: 46.7 B parameters


def test_mixtral_8x7b_bf16_fits_4_ranks_of_32gb_as_2_stages_tp2():
    from rlx_mpi.cluster.caps import NodeCaps
    from rlx_mpi.config import PlacementPolicy
    from rlx_mpi.cluster.placement import FitError, plan_placement
    from rlx_mpi.comm.topology import make_grid

    cfg = get_family("mixtral").config_from_shape(
        {"layers": 32, "hidden": 4096, "heads": 32, "kv_heads": 8, "intermediate": 14336, "vocab": 32000,
         "experts": 8, "top_k": 2, "max_positions": 32768}, "plan")

    def plan(gb):
        caps = [NodeCaps(rank=r, host=f"h{r // 2}", local_rank=r % 2, local_size=2, cpus=None,
                         ram_total_bytes=gb * 10**9, ram_available_bytes=gb * 10**9) for r in range(4)]
        return plan_placement(cfg.cost(1, 2048), caps, PlacementPolicy.BALANCED, 10**9,
                              grid=make_grid([c.host for c in caps], 2), precision=["bf16"] * 4)
    stages = plan(32)
    assert [len(a.layers) for a in stages] == [16, 16] and all(len(a.ranks) == 2 for a in stages)
    assert all(23e9 < a.est_bytes < 25e9 for a in stages)  # 93 GB of bf16 weights over 4 ranks, + KV
    with pytest.raises(FitError):
        plan(20)


@pytest.mark.parametrize("name, total, active", [("qwen3-30b-a3b", 30.5e9, 3.3e9), ("qwen3-235b-a22b", 235e9, 22e9)])
def test_qwen3_moe_presets_have_the_published_parameter_counts(name, total, active):
    """Qwen's model cards: Qwen3-30B-A3B 30.5 B total / 3.3 B activated, Qwen3-235B-A22B 235 B /
    22 B; the planner's bytes (f32) are the same count x 4."""
    cfg = get_family("qwen3_moe").presets[name].validate(name)
    assert abs(cfg.parameters() - total) <= 0.01 * total and abs(cfg.parameters(active=True) - active) <= 0.02 * active
    cost = cfg.cost(1, 1)
    assert cost.n_layers * cost.layer_bytes + cost.embed_bytes + cost.head_bytes == pytest.approx(4 * cfg.parameters(),
                                                                                                    rel=1e-6)


def test_gemma3_270m_parameter_count_is_the_real_checkpoints():
    """The real Gemma 3 270M's config (as transformers reads it from the GGUF, recorded in
    tests/fixtures/gemma3_270m_reference.json) gives 268,098,176 parameters: the sum of the sizes
    of the 236 tensors transformers saved for that model (counted once, by hand)."""
    from rlx_mpi.families.gemma3 import arch_from_hf

    config = json.loads((TESTS / "fixtures" / "gemma3_270m_reference.json").read_text())["config"]
    cfg = arch_from_hf({"model_type": "gemma3_text", **config}, "270m").validate("270m")
    assert cfg.parameters() == 268_098_176
    assert (cfg.num_hidden_layers, cfg.head_dim, cfg.rope_local_theta, cfg.window(0), cfg.window(5)) == \
        (18, 256, 10000.0, 512, 0)


@pytest.mark.parametrize("model_type, config, published", [
    ("olmo2", dict(vocab_size=100352, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                   num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=4096,
                   rope_theta=500000, rms_norm_eps=1e-6, tie_word_embeddings=False), 7.30e9),  # OLMo-2-1124-7B
    ("granite", dict(vocab_size=49155, hidden_size=4096, intermediate_size=12800, num_hidden_layers=40,
                     num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072,
                     rope_theta=10000000.0, tie_word_embeddings=True, embedding_multiplier=12.0,
                     residual_multiplier=0.22, attention_multiplier=0.0078125, logits_scaling=16.0),
     8.17e9),  # Granite-3.1-8B-instruct
])
def test_olmo2_and_granite_parameter_counts_at_real_sizes(model_type, config, published):
    """The planner's count of the real configs against the model cards' safetensors sizes (OLMo 2's
    whole-projection q/k norms and its two post-norms a layer; Granite's tied head)."""
    cfg = family_for_model_type(model_type).arch_from_hf({"model_type": model_type, **config}, model_type)
    assert abs(cfg.validate(model_type).parameters() - published) <= 0.005 * published


def test_qwen3_235b_plans_on_256_and_512_gb_nodes():
    """bf16 (470 GB of weights): one 512 GB node, or two 256 GB nodes as 2 stages (or 2 x tp 2);
    int8 (~250 GB with its block scales): one node of either size. The KV cache of 4k tokens
    (385 MB per 1k: 94 layers x K and V of 4 x 128, float32) is included."""
    from rlx_mpi.cluster.caps import NodeCaps
    from rlx_mpi.config import PlacementPolicy
    from rlx_mpi.cluster.placement import FitError, plan_placement
    from rlx_mpi.comm.topology import make_grid

    cfg = get_family("qwen3_moe").presets["qwen3-235b-a22b"]
    assert cfg.kv_bytes_per_token() == 94 * 2 * 4 * 128 * 4

    def plan(gb, ranks, precision, tp=1):
        caps = [NodeCaps(rank=r, host=f"h{r // tp}", local_rank=r % tp, local_size=tp, cpus=None,
                         ram_total_bytes=gb * 10**9, ram_available_bytes=gb * 10**9) for r in range(ranks)]
        return plan_placement(cfg.cost(1, 4096), caps, PlacementPolicy.BALANCED, 10**9,
                              grid=make_grid([c.host for c in caps], tp), precision=[precision] * ranks)
    assert [len(a.layers) for a in plan(512, 1, "bf16")] == [94]
    with pytest.raises(FitError):
        plan(256, 1, "bf16")
    stages = plan(256, 2, "bf16")
    assert [len(a.layers) for a in stages] == [48, 46] and all(230e9 < a.est_bytes < 250e9 for a in stages)
    assert all(115e9 < a.est_bytes < 125e9 for a in plan(256 // 2, 4, "bf16", tp=2))  # 2 ranks of a 256 GB node
    assert 245e9 < plan(256, 1, "int8")[0].est_bytes < 256e9


def test_plan_prints_parameters_active_flops_and_kv_per_1k_tokens():
    proc = run_cli(["plan", "--preset", "qwen3-235b-a22b", "--ranks", "2", "--mem-gb", "256", "--precision", "bf16",
                    "--seq", "4096"], timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "235.09 B parameters (22.19 B active: 43.1 GFLOP of 468.9 GFLOP a token); KV cache 385.0 MB per 1k tokens" \
        in proc.stdout, proc.stdout


def test_projection_norm_over_tp_slices_equals_the_whole_projection():
    """OLMo 2's q/k norm (`model.projection_norm_`) on each TP rank's slice, the sums all-reduced,
    equals a naive numpy RMSNorm of the whole projections: tp 2 (kv heads split) and tp 4 (each
    of the 2 kv heads replicated on 2 ranks)."""
    from rlx_mpi.families.decoder.model import projection_norm_
    from rlx_mpi.families.decoder.weights import LayerWeights, make_linear

    rng = np.random.default_rng(3)
    nh, nkv, hs, eps = 4, 2, 8, 1e-6
    qkv = rng.standard_normal((2, 5, (nh + 2 * nkv) * hs), dtype=np.float32) * 3
    wq, wk = rng.standard_normal(nh * hs, dtype=np.float32), rng.standard_normal(nkv * hs, dtype=np.float32)
    q, k = qkv[..., :nh * hs].astype(np.float64), qkv[..., nh * hs:(nh + nkv) * hs].astype(np.float64)
    want_q = q / np.sqrt((q ** 2).mean(-1, keepdims=True) + eps) * wq
    want_k = k / np.sqrt((k ** 2).mean(-1, keepdims=True) + eps) * wk
    for tp in (1, 2, 4):
        kv_rank = [(r * nkv // tp if tp > nkv else r) for r in range(tp)]  # the stage's kv_part
        kv_parts = nkv if tp > nkv else tp
        parts = []
        for r in range(tp):
            qa, qb = part_bounds(nh * hs, r, tp)
            ka, kb = part_bounds(nkv * hs, kv_rank[r], kv_parts)
            qd, kd = qb - qa, kb - ka
            local = np.concatenate([qkv[..., qa:qb], qkv[..., nh * hs + ka:nh * hs + kb],
                                    np.zeros((2, 5, kd), np.float32)], axis=-1)
            w = LayerWeights(None, make_linear(np.zeros((qd + 2 * kd, 4), np.float32), "f32"), qd,
                             make_linear(np.zeros((4, qd), np.float32), "f32"), None, None,
                             q_proj_norm=wq[qa:qb], k_proj_norm=wk[ka:kb], norm_group=tp)
            parts.append((local, w, (qa, qb), (ka, kb)))
        sums = []
        for local, w, _, _ in parts:  # first pass: each rank's local sums (the all-reduce's inputs)
            projection_norm_(local.copy(), w, eps, lambda s: sums.append(s.copy()) or s)
        total = np.sum(sums, axis=0)
        for local, w, (qa, qb), (ka, kb) in parts:
            got = projection_norm_(local, w, eps, lambda s: total.copy())
            np.testing.assert_allclose(got[..., :qb - qa], want_q[..., qa:qb], rtol=1e-5, atol=1e-5)
            np.testing.assert_allclose(got[..., qb - qa:qb - qa + kb - ka], want_k[..., ka:kb], rtol=1e-5, atol=1e-5)


def test_route_keeps_softmax_weights_without_norm_topk_prob():
    from rlx_mpi.families.decoder.moe import route

    rng = np.random.default_rng(5)
    x, router = rng.standard_normal((6, 8), dtype=np.float32), rng.standard_normal((5, 8), dtype=np.float32)
    logits = x.astype(np.float64) @ router.T.astype(np.float64)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    top = np.argsort(-probs, axis=-1)[:, :2]
    for norm in (False, True):
        cfg = Arch(vocab_size=8, hidden_size=8, intermediate_size=8, num_hidden_layers=1, num_attention_heads=1,
                   num_key_value_heads=1, num_experts=5, experts_per_token=2, norm_topk_prob=norm)
        index, weight = route(x, router, 2, cfg)
        want = np.take_along_axis(probs, top, -1)
        want = want / want.sum(-1, keepdims=True) if norm else want
        assert np.array_equal(index, top)
        np.testing.assert_allclose(weight, want, rtol=1e-5)


# -- refusals: one line, exit 2 ------------------------------------------------------------------


REFUSALS = [
    ("llama3", {"rope_parameters": {"rope_type": "yarn", "rope_theta": 5e5, "factor": 4.0}},
     "rope_parameters.rope_type: is 'yarn', not supported"),
    ("llama3", {"rope_parameters": {"rope_type": "dynamic", "rope_theta": 5e5, "factor": 4.0}},
     "rope_parameters.rope_type: is 'dynamic', not supported"),
    ("mistral", {"hidden_act": "gelu"}, "hidden_act: is 'gelu'"),
    ("qwen3", {"attention_bias": True}, "attention_bias: is True"),
    ("phi3", {"partial_rotary_factor": 0.75}, "partial_rotary_factor: is 0.75"),
    ("gemma2", {"hidden_activation": "gelu"}, "hidden_activation: is 'gelu'"),
    ("gemma2", {"layer_types": ["chunked_attention", "full_attention", "sliding_attention", "full_attention"]},
     "layer_types: has 'chunked_attention'"),
    ("mixtral", {"rope_parameters": {"rope_type": "llama3", "rope_theta": 1e6}},
     "rope_parameters.rope_type: is 'llama3', not supported"),
    ("mixtral", {"num_experts_per_tok": 5}, "num_experts_per_tok: is 5"),
    ("qwen2", {"model_type": "qwen2_moe"}, "model_type: 'qwen2_moe' is not a supported model type"),
    ("llama3", {"quantization_config": {"quant_method": "awq"}}, "quantized model (method 'awq')"),
    ("gemma3_mm", {"text_config": None}, "text_config: is None"),
    ("gemma3", {"rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                                    "sliding_attention": {"rope_type": "linear", "factor": 2.0}}},
     "(sliding_attention): rope_parameters.rope_type: is 'linear', not supported"),
    ("gemma3", {"rope_parameters": {"full_attention": {"rope_type": "yarn", "factor": 8.0, "rope_theta": 1e6},
                                    "sliding_attention": {"rope_type": "default"}}},
     "(full_attention): rope_parameters.rope_type: is 'yarn', not supported"),
    ("olmo2", {"attention_bias": True}, "attention_bias: is True"),
    ("olmo2", {"clip_qkv": 8.0}, "clip_qkv: is 8.0"),
    ("granite", {"mlp_bias": True}, "mlp_bias: is True"),
    ("granite", {"logits_scaling": 0}, "logits_scaling: is 0"),
    ("qwen3_moe", {"num_experts_per_tok": 5}, "num_experts_per_tok: is 5"),
    ("qwen3_moe", {"mlp_only_layers": [3]}, "mlp_only_layers: is [3]"),
    ("qwen3_moe_fused", {"moe_intermediate_size": 32}, "disagrees with the config"),
]


@pytest.mark.parametrize("case, changes, message", REFUSALS)
def test_refusal_is_one_line_exit_2(tmp_path, case, changes, message):
    src = tmp_path / "hf"
    shutil.copytree(FAMILIES / case, src)
    raw = json.loads((src / "config.json").read_text())
    raw.update(changes)
    (src / "config.json").write_text(json.dumps(raw))
    proc = run_cli(["convert", src, tmp_path / "m.h5"], timeout=60)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("rlx-mpi: error: ") and message in lines[0], proc.stderr
    assert not (tmp_path / "m.h5").exists()


def test_gemma3_multimodal_text_tower_in_transformers_5_layout(converted, tmp_path):
    """The multimodal Gemma 3 saved by transformers 5 in its own layout (model.language_model.*,
    model.vision_tower.*, lm_head tied away) converts to the same model as the Hub's layout
    (language_model.model.*); the vision tower is left out, a stray text tensor is not."""
    from test_convert import read_st, write_st

    src = tmp_path / "hf"
    shutil.copytree(FAMILIES / "gemma3_mm", src)
    tensors = read_st(src / "model.safetensors")
    moved = {}
    for name, t in tensors.items():
        for old, new in (("language_model.model.", "model.language_model."), ("vision_tower.", "model.vision_tower."),
                         ("multi_modal_projector.", "model.multi_modal_projector.")):
            if name.startswith(old):
                name = new + name[len(old):]
                break
        moved[name] = t
    assert "model.language_model.embed_tokens.weight" in moved and "model.vision_tower.post_layernorm.weight" in moved
    write_st(src / "model.safetensors", moved)
    raw = json.loads((src / "config.json").read_text())
    family, cfg, _ = converted("gemma3_mm")
    got = family.convert_hf(src, tmp_path / "m.h5", dtype="float32", hf_config=raw)
    assert got == cfg
    ref = reference("gemma3_mm")
    assert np.abs(build(family, cfg, tmp_path / "m.h5").forward(ref["input_ids"]) - ref["logits"]).max() <= 1e-4
    moved["model.language_model.layers.9.mlp.up_proj.weight"] = np.ones((2, 2), np.float32)
    write_st(src / "model.safetensors", moved)
    with pytest.raises(CheckpointError, match=r"unexpected tensors \['model.language_model.layers.9.mlp.up_proj"):
        family.convert_hf(src, tmp_path / "m2.h5", dtype="float32", hf_config=raw)


def test_fused_experts_are_read_one_expert_at_a_time_in_bf16(converted, tmp_path):
    """transformers 5's stacked experts stored as bfloat16 (as the Hub's Qwen3-MoE ships): each
    of our expert tensors is exactly its slice of the stack (gate rows first, then up; down
    [E, C, I]), read from its own bytes and widened exactly."""
    from test_convert import read_st, write_st

    src = tmp_path / "hf"
    shutil.copytree(FAMILIES / "qwen3_moe_fused", src)
    tensors = {k: np.array(v) for k, v in read_st(src / "model.safetensors").items()}
    bits = {k: (v.view(np.uint32) >> 16).astype(np.uint16) for k, v in tensors.items()}  # truncated to bf16
    write_st(src / "model.safetensors", {k: ("BF16", b) for k, b in bits.items()})
    family, cfg, _ = converted("qwen3_moe_fused")
    family.convert_hf(src, tmp_path / "m.h5", dtype="float32", hf_config=json.loads((src / "config.json").read_text()))
    widened = {k: (b.astype(np.uint32) << 16).view(np.float32) for k, b in bits.items()}
    i = cfg.intermediate_size
    with H5ParamSource(tmp_path / "m.h5", family.expected_shapes(cfg)) as h5:
        for n in (0, 2):  # the MoE layers (layer 1 is dense)
            stack = f"model.layers.{n}.mlp.experts."
            for e in range(cfg.num_experts):
                gate_up, down = widened[stack + "gate_up_proj"][e], widened[stack + "down_proj"][e]
                assert np.array_equal(h5.read(f"layers/{n}/experts/{e}/gate_proj"), gate_up[:i])
                assert np.array_equal(h5.read(f"layers/{n}/experts/{e}/up_proj"), gate_up[i:])
                assert np.array_equal(h5.read(f"layers/{n}/experts/{e}/down_proj"), down)
        assert np.array_equal(h5.read("layers/1/up_proj"), widened["model.layers.1.mlp.up_proj.weight"])


def test_deepseek_reads_fused_experts(tmp_path):
    """DeepSeek-V3 in transformers 5's fused expert layout (the fixture's per-expert tensors
    stacked as ``save_original_format=False`` writes them: gate_up_proj [E, 2I, C], gate rows
    first, down_proj [E, C, I]) converts through `hf.fused_expert_names` to transformers' logits."""
    from test_convert import read_st, write_st

    src = tmp_path / "hf"
    shutil.copytree(FAMILIES / "deepseek_v3", src)
    tensors = {k: np.array(v) for k, v in read_st(src / "model.safetensors").items()}
    raw = json.loads((src / "config.json").read_text())
    stacked = 0
    for n in range(raw["num_hidden_layers"]):
        p = f"model.layers.{n}.mlp.experts."
        if p + "0.gate_proj.weight" not in tensors:
            continue  # a dense layer
        one = [{k: tensors.pop(f"{p}{e}.{k}.weight") for k in ("gate_proj", "up_proj", "down_proj")}
               for e in range(raw["n_routed_experts"])]
        tensors[p + "gate_up_proj"] = np.stack([np.concatenate([t["gate_proj"], t["up_proj"]]) for t in one])
        tensors[p + "down_proj"] = np.stack([t["down_proj"] for t in one])
        stacked += 1
    assert stacked == 2  # layers 1 and 2 (layer 0 is dense)
    write_st(src / "model.safetensors", tensors)
    family = family_for_model_type("deepseek_v3")
    cfg = family.convert_hf(src, tmp_path / "m.h5", dtype="float32", hf_config=raw)
    ref = reference("deepseek_v3")
    assert np.abs(build(family, cfg, tmp_path / "m.h5").forward(ref["input_ids"]) - ref["logits"]).max() <= 1e-4


def test_o_proj_bias_is_refused(converted, tmp_path):
    """A bias the family does not have (o_proj on a Qwen2) is named, not dropped."""
    from test_convert import read_st, write_st

    src = tmp_path / "hf"
    shutil.copytree(FAMILIES / "qwen2", src)
    tensors = read_st(src / "model.safetensors")
    tensors["model.layers.0.self_attn.o_proj.bias"] = np.ones(64, np.float32)
    write_st(src / "model.safetensors", tensors)
    family, _, _ = converted("qwen2")
    with pytest.raises(CheckpointError, match=r"bias tensors \['model.layers.0.self_attn.o_proj.bias'\]"):
        family.convert_hf(src, tmp_path / "m.h5", dtype="float32",
                          hf_config=json.loads((src / "config.json").read_text()))


def test_qwen2_sliding_layers_follow_layer_types_or_max_window_layers():
    from rlx_mpi.families.qwen import qwen2_arch

    raw = json.loads((FAMILIES / "qwen2" / "config.json").read_text())
    assert qwen2_arch(raw, "c").layer_windows == ()  # released configs: no sliding layers
    v4 = {k: v for k, v in raw.items() if k != "layer_types"}
    v4.update(use_sliding_window=True, sliding_window=4, max_window_layers=1)
    assert qwen2_arch(v4, "c").layer_windows == (0, 4)
    v5 = {**raw, "sliding_window": 4, "layer_types": ["sliding_attention", "full_attention"]}
    assert qwen2_arch(v5, "c").layer_windows == (4, 0)


def test_gemma3_hub_config_4x_and_5x_translate_alike():
    """Gemma-3-4B's text config as the Hub has it (4.x keys: rope_theta, rope_local_base_freq,
    rope_scaling linear x8, sliding_window_pattern 6, no layer_types) and as transformers 5.24's
    Gemma3TextConfig(**it).to_dict() rewrites it (rope_parameters per layer type, layer_types):
    the same Arch, five local layers to one global."""
    from rlx_mpi.families.gemma3 import arch_from_hf

    v4 = {"model_type": "gemma3_text", "vocab_size": 262208, "hidden_size": 2560, "intermediate_size": 10240,
          "num_hidden_layers": 34, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
          "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
          "sliding_window": 1024, "sliding_window_pattern": 6, "query_pre_attn_scalar": 256,
          "max_position_embeddings": 131072, "rms_norm_eps": 1e-6, "final_logit_softcapping": None,
          "attn_logit_softcapping": None}
    types = ["full_attention" if (n + 1) % 6 == 0 else "sliding_attention" for n in range(34)]
    v5 = {k: v for k, v in v4.items() if k not in ("rope_theta", "rope_local_base_freq", "rope_scaling",
                                                     "sliding_window_pattern")}
    v5.update(layer_types=types, rope_parameters={  # transformers 5.24's to_dict() of v4
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0}})
    a4, a5 = arch_from_hf(v4, "v4").validate("v4"), arch_from_hf(v5, "v5").validate("v5")
    assert a4 == a5
    assert (a4.rope_theta, a4.rope_type, a4.rope_factor, a4.rope_local_theta) == (1e6, "linear", 8.0, 1e4)
    assert a4.layer_windows == tuple(0 if t == "full_attention" else 1024 for t in types)
    assert [a4.local_rope(n) for n in range(6)] == [True] * 5 + [False]
    assert a4.attention_scale == 256 ** -0.5 and a4.tie_word_embeddings and a4.head_dim == 256


@pytest.mark.parametrize("case", CASES)
def test_chunked_prefill_matches_transformers(converted, case):
    """Prefill the two 40-token reference rows in chunks of 7 (``start`` > 0: the positions
    before are read from the cache; a window layer's ring of 8 wraps between chunks): the logits
    at each chunk's last token match transformers' full forward, then decoding goes on from the
    chunked cache. Row 1 is shorter (33 tokens), so the last chunks are right-padded."""
    family, cfg, path = converted(case)
    ref = reference(case)
    stage = build(family, cfg, path)
    ids, want = ref["input_ids"], ref["logits"]
    lengths = np.array([40, 33])
    stage.reset(2, 40, KvSpec("full"))
    for start in range(0, 33, 7):
        T = min(7, 40 - start)
        got = stage.prefill(ids[:, start:start + T], np.array([1, 0]), lengths, start=start)
        for b in range(2):
            end = min(start + T, lengths[b]) - 1  # each row's last real token in the chunk
            assert np.abs(got[b] - want[b, end]).max() <= 1e-4, (case, start, b)
    # row 0 on its own for the rest (start 35): then one decode step at position 39
    got = stage.prefill(ids[:1, 35:39], np.array([1]), np.array([39]), start=35)
    assert np.abs(got[0] - want[0, 38]).max() <= 1e-4, case
    got = stage.decode(ids[:1, 39:40], np.array([1]), np.array([39]))
    assert np.abs(got[0] - want[0, 39]).max() <= 1e-4, case


@pytest.mark.parametrize("case", CASES)
def test_mixed_steps_match_transformers(converted, case):
    """`Stage.mixed`: row 0 decodes positions 33.. while row 1 prefills its 33 tokens in chunks
    of 7 beside it, one pass over the weights per step (`model.MixedKv`); every decode token's
    logits and each chunk's last real token match transformers' full forward (a window layer's
    ring of 8 wraps on both rows). The base class's default (decode, then prefill) agrees."""
    from rlx_mpi.model.stage import Stage

    family, cfg, path = converted(case)
    ref = reference(case)
    stage = build(family, cfg, path)
    ids, want = ref["input_ids"], ref["logits"]
    for run in (type(stage).mixed, Stage.mixed):
        stage.reset(2, 40, KvSpec("full"))
        got = stage.prefill(ids[:1, :33], np.array([1]), np.array([33]))  # (longrope: past its short range)
        assert np.abs(got[0] - want[0, 32]).max() <= 1e-4, case
        for k, start in enumerate(range(0, 33, 7)):
            T, p = min(7, 33 - start), 33 + k  # the chunk; row 0's position
            x = np.concatenate([ids[0, p:p + 1], ids[1, start:start + T]])[None]  # (1, 1 + T)
            got = run(stage, x, np.array([1, 0]), np.array([p, 33]), 1, start)
            assert got.shape == (2, cfg.vocab_size), case
            assert np.abs(got[0] - want[0, p]).max() <= 1e-4, (case, run, start)
            assert np.abs(got[1] - want[1, start + T - 1]).max() <= 1e-4, (case, run, start)
        got = stage.decode(ids[1:2, 33:34], np.array([0]), np.array([33]))  # row 1 decodes from its chunks
        assert np.abs(got[0] - want[1, 33]).max() <= 1e-4, (case, run)


@pytest.mark.parametrize("precision", ["f32", "bf16", "f16", "int8", "q4"])
@pytest.mark.parametrize("case", ["llama3", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "mixtral", "granite",
                                  "olmo2"])
def test_one_call_decode_layer_equals_the_layer_by_layer_path(converted, case, precision):
    """A decode step through `kernels.decode_layer` (one numba call per layer) gives bit-for-bit
    the logits of `model.block`'s path, on 6 rows (a group of 4 through the row-group kernels and
    2 left over) over 3 steps (a ring wraps in Mistral's window of 8), with biases (Qwen2) and
    per-head norms (Qwen3); Gemma 2 (GeGLU, sandwich norms), Mixtral (experts), Granite (residual
    multiplier) and OLMo 2 (no pre-norms) keep the layer-by-layer path."""
    family, cfg, path = converted(case)
    ref = reference(case)["input_ids"]
    ids = np.concatenate([ref, np.roll(ref, 5, axis=1), np.roll(ref, 11, axis=1)])  # (6, 40)
    slots, lengths = np.array([2, 0, 5, 1, 4, 3]), np.array([7, 5, 6, 7, 4, 7])
    stage = build(family, cfg, path, precision=precision)
    assert bool(stage._fused_rows) == (case not in ("gemma2", "mixtral", "granite", "olmo2"))
    runs = []
    for fused in (stage._fused_rows, 0):
        stage._fused_rows = fused
        stage.reset(6, 16, KvSpec("full"))
        logits = [stage.prefill(ids[:, :7], slots, lengths)]
        for step in range(3):
            pos = lengths + step
            logits.append(stage.decode(ids[np.arange(6), pos][:, None], slots, pos))
        runs.append(np.stack(logits))
    assert np.array_equal(runs[0], runs[1]) and np.isfinite(runs[0]).all()


# -- DeepSeek: latent attention and its cache, grouped routing -----------------------------------


def test_mla_cache_holds_the_latent_and_absorbed_decode_equals_transformers(converted):
    """The cache of a latent-attention layer is (c, kr): kv_lora_rank + qk_rope_head_dim floats a
    token (16 + 8 here; full K and V would be 4 x (24 + 12)); the planner prices the same; decode
    steps (the up-projections absorbed into q and o) give transformers' logits at every position,
    and the prefill's logits for the same prefix."""
    family, cfg, path = converted("deepseek_v3")
    ref = reference("deepseek_v3")
    stage = build(family, cfg, path)
    B, S, P = 2, ref["input_ids"].shape[1], 8
    latent = cfg.kv_lora_rank + cfg.head_dim
    assert latent == 24 and cfg.latent_dim == latent
    nbytes = stage.reset(B, S, KvSpec("full"))
    assert nbytes == cfg.num_hidden_layers * B * S * latent * 4
    assert all(c.k.shape == (B, 1, S, 16) and c.v.shape == (B, 1, S, 8) and c.entry_floats == latent
               for c in stage.caches)
    assert cfg.cost(B, S).kv_bytes_per_layer == B * S * latent * 4
    full_kv = cfg.num_attention_heads * (cfg.qk_head_dim + cfg.v_head_dim)  # what expanded K and V would hold
    assert full_kv == 144 and full_kv / latent == 6.0
    ids = ref["input_ids"]
    first = stage.prefill(ids[:, :P], np.arange(B), np.full(B, P))
    assert np.abs(first - ref["logits"][:, P - 1]).max() <= 1e-4
    for pos in range(P, S):  # teacher-forced: the next input token at each position
        got = stage.decode(ids[:, pos:pos + 1], np.arange(B), np.full(B, pos))
        assert np.abs(got - ref["logits"][:, pos]).max() <= 1e-4, pos
    stage.reset(B, S, KvSpec("full"))  # the prefill of the whole prefix gives the same last logits
    whole = stage.prefill(ids, np.arange(B), np.full(B, S))
    assert np.abs(whole - got).max() <= 1e-4


def test_mla_tp2_shards_heads_and_replicates_the_latent(converted):
    family, cfg, path = converted("deepseek_v3")
    nh, dn, dv = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.v_head_dim
    stages, sizes = tp_run(family, cfg, path, 2, lambda s: s.reset(3, 16, KvSpec("full")))
    for s in stages:
        m = s.blocks[0].mla
        assert m.kv_b.shape == (nh // 2 * (dn + dv), cfg.kv_lora_rank) and m.uk.shape == (nh // 2, dn, cfg.kv_lora_rank)
        assert m.q.shape[0] == nh // 2 * cfg.qk_head_dim and s.blocks[0].o_proj.shape == (cfg.hidden_size, nh // 2 * dv)
        assert m.kv_a.shape == (cfg.latent_dim, cfg.hidden_size)  # whole on each rank
        assert [c.k.shape for c in s.caches] == [(3, 1, 16, cfg.kv_lora_rank)] * cfg.num_hidden_layers
    assert sizes[0] == cfg.num_hidden_layers * 3 * 16 * cfg.latent_dim * 4  # each rank: the whole latent
    cost = cfg.cost(3, 16)
    assert cost.kv_heads == 1 and cost.under_tp(2).kv_bytes_per_layer == 2 * cost.kv_bytes_per_layer


def test_absorbed_attention_against_naive_numpy():
    """`mla.absorbed` (q moved into the latent space, the latents as values) against expanding
    every key and value per head."""
    from rlx_mpi.families.decoder import mla
    from rlx_mpi.families.decoder.weights import MlaWeights

    rng = np.random.default_rng(5)
    B, nh, dn, dr, dv, r, S = 3, 4, 6, 4, 5, 7, 9
    uk, uv = rng.standard_normal((nh, dn, r), dtype=np.float32), rng.standard_normal((nh, dv, r), dtype=np.float32)
    m = MlaWeights(q=None, kv_a=None, kv_a_norm=None, kv_b=None, uk=uk, uv=uv)
    q_nope, q_rot = rng.standard_normal((B, nh, dn), dtype=np.float32), rng.standard_normal((B, nh, dr), dtype=np.float32)
    c, kr = rng.standard_normal((B, S, r), dtype=np.float32), rng.standard_normal((B, S, dr), dtype=np.float32)
    pos = np.array([0, 4, 8])
    got = mla.absorbed(q_nope, q_rot, c, kr, m, pos, 0.3).reshape(B, nh, dv)
    for b in range(B):
        for h in range(nh):
            n = pos[b] + 1
            k = np.concatenate([c[b, :n].astype(np.float64) @ uk[h].T, kr[b, :n]], axis=-1)  # (n, dn + dr)
            v = c[b, :n].astype(np.float64) @ uv[h].T  # (n, dv)
            s = k @ np.concatenate([q_nope[b, h], q_rot[b, h]]) * 0.3
            p = np.exp(s - s.max())
            np.testing.assert_allclose(got[b, h], (p / p.sum()) @ v, rtol=1e-4, atol=1e-5)


def _naive_route(logits, bias, cfg):
    """Per row, as DeepSeek-V3's / V2's / GPT-OSS's routers are written (plain Python)."""
    out = []
    for row, in zip(logits.astype(np.float64)):
        E, size = len(row), len(row) // cfg.n_group
        if cfg.routing == "topk_softmax":
            z = row + bias
            top = sorted(range(E), key=lambda e: -z[e])[:cfg.experts_per_token]
            w = np.exp([z[e] - z[top[0]] for e in top])
            out.append(dict(zip(top, w / w.sum())))
            continue
        scores = 1 / (1 + np.exp(-row)) if cfg.routing == "sigmoid" else np.exp(row - row.max()) / np.exp(row - row.max()).sum()
        choice = scores + (bias if cfg.routing == "sigmoid" else 0)
        group = [sorted(choice[g * size:(g + 1) * size])[-2:] for g in range(cfg.n_group)]
        group = [sum(x) if cfg.routing == "sigmoid" else max(x) for x in group]
        keep = sorted(range(cfg.n_group), key=lambda g: -group[g])[:cfg.topk_group]
        allowed = [e for e in range(E) if e // size in keep]
        top = sorted(allowed, key=lambda e: -choice[e])[:cfg.experts_per_token]
        w = np.array([scores[e] for e in top])
        if cfg.norm_topk_prob:
            w = w / w.sum()
        out.append(dict(zip(top, w * cfg.routed_scaling_factor)))
    return out


@pytest.mark.parametrize("routing, norm", [("sigmoid", True), ("softmax", False), ("topk_softmax", True)])
def test_routers_against_a_naive_loop(routing, norm):
    from rlx_mpi.families.decoder.moe import route

    rng = np.random.default_rng(3)
    cfg = Arch(vocab_size=8, hidden_size=16, intermediate_size=8, num_hidden_layers=1, num_attention_heads=2,
               num_key_value_heads=2, num_experts=16, experts_per_token=3, routing=routing, n_group=4, topk_group=2,
               norm_topk_prob=norm, routed_scaling_factor=2.5 if routing != "topk_softmax" else 1.0,
               router_bias=routing != "softmax").validate("t")
    x, w = rng.standard_normal((50, 16), dtype=np.float32), rng.standard_normal((16, 16), dtype=np.float32) * 0.3
    bias = rng.standard_normal(16, dtype=np.float32) * 0.2 if cfg.router_bias else None
    index, weight = route(x, w, 3, cfg, bias)
    want = _naive_route(x @ w.T, bias if bias is not None else np.zeros(16), cfg)
    for n in range(50):
        got = dict(zip(index[n].tolist(), weight[n].tolist()))
        assert set(got) == set(want[n]), n
        np.testing.assert_allclose([got[e] for e in want[n]], list(want[n].values()), rtol=1e-5)


def test_deepseek_refuses_what_it_does_not_compute(tmp_path):
    family = get_family("deepseek_v3")
    raw = json.loads((FAMILIES / "deepseek_v3" / "config.json").read_text())
    for change, key in [({"scoring_func": "softmax"}, "scoring_func"), ({"attention_bias": True}, "attention_bias"),
                        ({"num_key_value_heads": 2}, "num_key_value_heads"), ({"hidden_act": "gelu"}, "hidden_act"),
                        ({"quantization_config": {"quant_method": "gptq"}}, "quantization_config"),
                        ({"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}},
                         "rope_parameters.rope_type")]:
        with pytest.raises(CheckpointError, match=key):
            family.arch_from_hf({**raw, **change}, "config.json")
    with pytest.raises(CheckpointError, match="topk_method"):
        get_family("deepseek_v2").arch_from_hf({**raw, "model_type": "deepseek_v2", "topk_method": "noaux_tc"}, "c")


def test_deepseek_mtp_layer_is_left_and_other_strays_refused(tmp_path):
    """DeepSeek-V3 checkpoints carry a multi-token-prediction layer past num_hidden_layers: not read."""
    src = tmp_path / "hf"
    shutil.copytree(FAMILIES / "deepseek_v3", src)
    (src / "model.safetensors").rename(src / "model-1.safetensors")  # two shards: every *.safetensors is read
    mtp = {"model.layers.3.embed_tokens.weight": np.zeros((4, 4), np.float32),  # the MTP module's names
           "model.layers.3.eh_proj.weight": np.zeros((4, 8), np.float32)}
    _save_safetensors(src / "model-2.safetensors", mtp)
    cfg = get_family("deepseek_v3").convert_hf(src, tmp_path / "m.h5")
    assert cfg.num_hidden_layers == 3
    _save_safetensors(src / "model-2.safetensors", {**mtp, "model.extra.weight": np.zeros(2, np.float32)})
    with pytest.raises(CheckpointError, match="unexpected tensors"):
        get_family("deepseek_v3").convert_hf(src, tmp_path / "m2.h5")


def _save_safetensors(path, tensors: dict) -> None:
    """float32 tensors in the safetensors format (the JSON header, then the bytes)."""
    header, offset = {}, 0
    for name, a in tensors.items():
        header[name] = {"dtype": "F32", "shape": list(a.shape), "data_offsets": [offset, offset + a.nbytes]}
        offset += a.nbytes
    raw = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little") + raw)
        for a in tensors.values():
            f.write(np.ascontiguousarray(a, "<f4").tobytes())


# -- GPT-OSS: sinks, clamped SwiGLU, MXFP4 -------------------------------------------------------


def _naive_attention(q, k, v, window, scale, sinks):
    """(B, nh, T, hs) x (B, nkv, S, hs|hv) in float64, causal over the last T of S, softmax over
    [scores, sink] with the sink's share dropped."""
    B, nh, T, _ = q.shape
    S = k.shape[2]
    g = nh // k.shape[1]
    kk, vv = np.repeat(k, g, axis=1).astype(np.float64), np.repeat(v, g, axis=1).astype(np.float64)
    s = q.astype(np.float64) @ kk.transpose(0, 1, 3, 2) * scale
    i, j = np.arange(S - T, S)[:, None], np.arange(S)[None, :]
    s = np.where((j <= i) & ((j > i - window) if window else True), s, -np.inf)
    sink = np.broadcast_to(np.asarray(sinks, np.float64)[None, :, None, None], (B, nh, T, 1))
    both = np.concatenate([s, sink], axis=-1)
    p = np.exp(both - both.max(-1, keepdims=True))
    p = p / p.sum(-1, keepdims=True)
    return (p[..., :-1] @ vv).transpose(0, 2, 1, 3)  # (B, T, nh, hv)


@pytest.mark.parametrize("T, window, hv", [(5, 0, 8), (70, 9, 8), (70, 0, 5)])
def test_attend_with_sinks_and_a_value_width_of_its_own_against_numpy(T, window, hv):
    rng = np.random.default_rng(T + hv)
    q = rng.standard_normal((2, 4, T, 8), dtype=np.float32) * 2
    k, v = rng.standard_normal((2, 2, T, 8), dtype=np.float32) * 2, rng.standard_normal((2, 2, T, hv), dtype=np.float32)
    sinks = np.array([-1.0, 0.5, 3.0, 8.0], np.float32)
    got = kernels.attend(q, k, v, None, window, scale=0.3, sinks=sinks)
    np.testing.assert_allclose(got, _naive_attention(q, k, v, window, 0.3, sinks), rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="sinks"):
        kernels.attend(q, k, v, None, window, sinks=sinks[:3])


def test_decode_attention_with_sinks_against_numpy():
    rng = np.random.default_rng(9)
    B, nh, nkv, L, hs = 2, 4, 2, 12, 8
    ck, cv = rng.standard_normal((3, nkv, L, hs), dtype=np.float32), rng.standard_normal((3, nkv, L, hs), dtype=np.float32)
    q = rng.standard_normal((B, nh, 1, hs), dtype=np.float32)
    slots, pos = np.array([2, 0]), np.array([11, 5])
    sinks = np.array([0.0, -2.0, 1.5, 4.0], np.float32)
    got = kernels.attend_cache(q, ck, cv, slots, pos, scale=0.4, sinks=sinks)
    for b in range(B):
        n = pos[b] + 1
        want = _naive_attention(q[b:b + 1], ck[slots[b]][None, :, :n], cv[slots[b]][None, :, :n], 0, 0.4, sinks)
        np.testing.assert_allclose(got[b], want[0], rtol=1e-4, atol=1e-5)


def test_swiglu_clamped_against_numpy():
    rng = np.random.default_rng(2)
    gate, up = rng.standard_normal((3, 41), dtype=np.float32) * 6, rng.standard_normal((3, 41), dtype=np.float32) * 6
    g, u = np.minimum(gate.astype(np.float64), 7.0), np.clip(up.astype(np.float64), -7.0, 7.0)
    want = (u + 1) * g / (1 + np.exp(-1.702 * g))
    np.testing.assert_allclose(ops.swiglu_clamped_(gate.copy(), up, 7.0, 1.702), want, rtol=1e-5, atol=1e-5)


def test_mxfp4_decode_against_transformers():
    """`hf.mxfp4_decode` against transformers' ``convert_moe_packed_tensors`` on random blocks
    and scales (tests/fixtures/mxfp4.npz, made by tests/make_family_fixtures.py mxfp4); two
    bytes by hand (low nibble first, sign bit 8, scale 2^(e - 127))."""
    from rlx_mpi.families.hf import mxfp4_decode

    ref = np.load(TESTS / "fixtures" / "mxfp4.npz", allow_pickle=False)
    got = mxfp4_decode(ref["blocks"], ref["scales"])  # (E, out, in)
    np.testing.assert_array_equal(got.transpose(0, 2, 1), ref["dequantized"])  # transformers returns (E, in, out)
    one = mxfp4_decode(np.full((1, 16), 0x3A, np.uint8), np.array([128], np.uint8))  # low 0xA = -1, high 0x3 = 1.5
    assert one.shape == (32,) and one[:2].tolist() == [-2.0, 3.0]
    two = mxfp4_decode(np.full((1, 16), 0xC1, np.uint8), np.array([126], np.uint8))  # low 0x1 = .5, high 0xC = -2
    assert two[:2].tolist() == [0.25, -1.0]


def test_gpt_oss_mxfp4_checkpoint_converts_to_transformers_logits(tmp_path, caplog):
    """The Hub's layout (experts as MXFP4 blocks + scales, quantization_config mxfp4):
    dequantized at convert (logged), logits as transformers' own dequantization gives."""
    case = FAMILIES / "gpt_oss_mxfp4"
    family = get_family("gpt_oss")
    with caplog.at_level("WARNING"):
        cfg = family.convert_hf(case, tmp_path / "m.h5")
    assert "MXFP4" in caplog.text and "dequantized" in caplog.text
    ref = np.load(case / "reference.npz", allow_pickle=False)
    assert np.abs(build(family, cfg, tmp_path / "m.h5").forward(ref["input_ids"]) - ref["logits"]).max() <= 1e-4


# -- the giants, on paper --------------------------------------------------------------------------

HUB = TESTS / "fixtures" / "hub_configs"


@pytest.mark.parametrize("name, total, active", [("deepseek_v3", 671e9, 37e9), ("gpt_oss_120b", 116.8e9, 5.1e9),
                                                 ("gpt_oss_20b", 20.9e9, 3.6e9)])
def test_parameter_counts_at_real_sizes(name, total, active):
    """Published counts (DeepSeek-V3: 671 B, 37 B activated, without its 14 B MTP module;
    gpt-oss-120b: 116.8 B, 5.1 B active; gpt-oss-20b: 20.9 B, 3.6 B) from the Hub configs,
    within 0.5 % (total) and 3 % (active, which both count without the input embedding: a lookup)."""
    raw = json.loads((HUB / f"{name}.json").read_text())
    cfg = family_for_model_type(raw["model_type"]).arch_from_hf(
        {k: v for k, v in raw.items() if k != "quantization_config"}, name).validate(name)
    got_total, got_active = cfg.parameters(), cfg.parameters(active=True) - cfg.vocab_size * cfg.hidden_size
    assert abs(got_total / total - 1) <= 0.005, got_total
    assert abs(got_active / active - 1) <= 0.03, got_active
    ends = cfg.vocab_size * cfg.hidden_size * 2 + cfg.hidden_size
    absorbed = cfg.num_attention_heads * (cfg.qk_nope_head_dim + cfg.v_head_dim) * cfg.kv_lora_rank  # MLA's f32 copy
    cost = cfg.cost(1, 1024, weight_bytes=2)
    held = 2 * (got_total - ends + cfg.num_hidden_layers * absorbed)
    assert abs(cfg.num_hidden_layers * cost.layer_bytes / held - 1) < 1e-3  # the average layer, as a rank holds it
    assert cfg.kv_bytes_per_token() == cfg.num_hidden_layers * (576 * 4 if cfg.kv_lora_rank else 2 * 8 * 64 * 4)


def test_plan_prices_the_giants_from_their_configs(tmp_path):
    """``plan --hf-config``: DeepSeek-V3 in int8 on six 256 GB nodes (3 stages hold it: 2
    replicas); its KV is the latent (61 layers x 576 floats a token); gpt-oss-120b in bf16 on
    one 256 GB node."""
    out = run_cli(["plan", "--hf-config", HUB / "deepseek_v3.json", "--ranks", "6", "--mem-gb", "256",
                   "--precision", "int8", "--seq", "4096"], timeout=60)
    assert out.returncode == 0, out.stderr
    assert "6 ranks = 2 replicas x 3 stages x tp 1" in out.stdout and "latent attention" in out.stdout
    kv = 61 * 576 * 4 * 1000 / 1e6
    assert f"KV cache {kv:.1f} MB per 1k tokens" in out.stdout
    assert "671.03 B parameters (37.55 B active: " in out.stdout
    none = run_cli(["plan", "--hf-config", HUB / "deepseek_v3.json", "--ranks", "4", "--mem-gb", "256",
                    "--precision", "bf16"], timeout=60)  # 1.3 TB of weights
    assert none.returncode != 0 and "Traceback" not in none.stderr
    gpt = run_cli(["plan", "--hf-config", HUB / "gpt_oss_120b.json", "--ranks", "1", "--mem-gb", "256",
                   "--precision", "bf16", "--seq", "4096"], timeout=60)
    assert gpt.returncode == 0, gpt.stderr


def test_plan_hf_config_refusals_are_one_line(tmp_path):
    """An unsupported model type, a missing file, a config its family refuses: exit 2, one line."""
    bert = tmp_path / "config.json"
    bert.write_text(json.dumps({"model_type": "bert", "hidden_size": 8}))
    bad = tmp_path / "bad.json"
    raw = json.loads((HUB / "deepseek_v3.json").read_text())
    bad.write_text(json.dumps({**raw, "scoring_func": "softmax"}))
    for path, what in ((bert, "'bert' is not a supported model type"), (tmp_path / "nope.json", "not found"),
                       (bad, "scoring_func")):
        out = run_cli(["plan", "--hf-config", path, "--ranks", "2"], timeout=60)
        assert out.returncode == 2 and what in out.stderr and "Traceback" not in out.stderr, out.stderr
        assert len(out.stderr.strip().splitlines()) == 1, out.stderr


@pytest.mark.parametrize("transposed", [False, True])
def test_head_matmul_against_numpy_and_row_independent(transposed):
    """`ops.head_matmul` (MLA's per-head absorbed products) against einsum in float64; a row's
    result is bit-for-bit the same alone or in a batch of 5."""
    rng = np.random.default_rng(11)
    x = rng.standard_normal((5, 3, 37), dtype=np.float32)
    w = rng.standard_normal((3, 19, 37) if transposed else (3, 37, 19), dtype=np.float32)
    want = np.einsum("bhk,hnk->bhn" if transposed else "bhk,hkn->bhn", x.astype(np.float64), w)
    got = ops.head_matmul(x, w, transposed)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    for b in range(5):
        assert np.array_equal(ops.head_matmul(x[b:b + 1], w, transposed)[0], got[b])
    with pytest.raises(ValueError, match="do not fit"):
        ops.head_matmul(x, w[..., :5] if transposed else w[:, :5], transposed)  # K cut short


def test_fp8_block_decode_by_hand():
    """e4m3fn: bias 7, subnormals at exponent 0, 0x7f NaN, no infinities; one scale per 128 x 128 block."""
    from rlx_mpi.families.hf import fp8_block_decode

    codes = np.array([[0x30, 0x7E, 0x01, 0xB8, 0x7F]], np.uint8)  # 0.5, 448, 2^-9, -1, NaN
    got = fp8_block_decode(codes, np.array([[2.0]], np.float32))
    np.testing.assert_array_equal(got[0, :4], [1.0, 896.0, 2.0 ** -8, -2.0])
    assert np.isnan(got[0, 4])
    big = fp8_block_decode(np.full((130, 3), 0x38, np.uint8), np.array([[1.0], [3.0]], np.float32))  # 1.0 each
    assert big[:128].tolist() == [[1.0] * 3] * 128 and big[128:].tolist() == [[3.0] * 3] * 2


def test_deepseek_fp8_checkpoint_converts_to_transformers_logits(tmp_path, caplog):
    """The Hub's DeepSeek-V3 layout (e4m3 weights, a float32 weight_scale_inv per 128 x 128 block,
    quantization_config fp8): dequantized at convert (logged), logits as transformers' own
    dequantization gives; another block size is refused, naming the key."""
    case = FAMILIES / "deepseek_v3_fp8"
    family = get_family("deepseek_v3")
    with caplog.at_level("WARNING"):
        cfg = family.convert_hf(case, tmp_path / "m.h5")
    assert "FP8 tensors" in caplog.text and "dequantized" in caplog.text
    ref = np.load(case / "reference.npz", allow_pickle=False)
    assert np.abs(build(family, cfg, tmp_path / "m.h5").forward(ref["input_ids"]) - ref["logits"]).max() <= 1e-4
    raw = json.loads((case / "config.json").read_text())
    raw["quantization_config"]["weight_block_size"] = [64, 64]
    with pytest.raises(CheckpointError, match="quantization_config.weight_block_size"):
        family.arch_from_hf(raw, "config.json")


def test_one_call_decode_layer_is_not_taken_for_latent_attention_sinks_or_o_bias(converted):
    """`model.fused_decode_rows` (the one-call decode layer knows none of MLA, sinks, o_proj
    biases): 0 rows for DeepSeek and GPT-OSS, and for a dense model with any one of them."""
    from rlx_mpi.families.decoder import model

    for case in ("deepseek_v3", "gpt_oss"):
        assert model.fused_decode_rows(converted(case)[1], "f32", 1) == 0
    dense = Arch(vocab_size=8, hidden_size=16, intermediate_size=8, num_hidden_layers=1, num_attention_heads=2,
                 num_key_value_heads=2)
    assert model.fused_decode_rows(dense, "f32", 1) > 0
    for change in ({"attention_sinks": True}, {"o_bias": True}, {"kv_lora_rank": 4, "qk_nope_head_dim": 4,
                                                                 "v_head_dim": 4}):
        assert model.fused_decode_rows(dataclasses.replace(dense, **change), "f32", 1) == 0, change


def test_a_header_names_only_what_differs_from_the_defaults():
    # an older rlx_mpi knows fewer Arch keys: a plain Llama's header must hold none it lacks, and a
    # model that needs a new feature names it (the old reader's "unknown keys" error)
    from rlx_mpi.families import find_preset
    from rlx_mpi.families.decoder.arch import Arch

    llama = find_preset("tiny")[1]
    keys = set(json.loads(llama.to_json()))
    legacy = {f.name for f in dataclasses.fields(Arch)[:11]}
    assert keys == legacy, keys - legacy
    assert Arch.from_json(llama.to_json(), "x") == llama
    olmo = dataclasses.replace(llama, pre_norms=False, sandwich_norms=True, qk_norm=True, qk_norm_scope="projection")
    assert set(json.loads(olmo.to_json())) - legacy == {"pre_norms", "sandwich_norms", "qk_norm", "qk_norm_scope"}
    assert Arch.from_json(olmo.to_json(), "x") == olmo
