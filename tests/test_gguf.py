"""`rlx-mpi convert MODEL.gguf` (families/gguf/) on GGUF files written here with the gguf
package's own writer, the way llama.cpp's converter lays them out (its tensor names, llama's
q/k row permutation, Gemma's ``1 + w`` norms, Phi-3's fused tensors).

- Quantized blocks: the groups we write reproduce the gguf package's dequantizer bit for bit
  (Q4_0, Q4_1, Q8_0 made by its quantizer; Q4_K, Q6_K as random blocks), and read back from the
  HDF5 file by the quant contract's own words (a naive loop over nibbles) give the same values.
- Families: a random model of each mapped architecture, written as an F32 GGUF, converts back
  to the same config and the same tensors (llama, qwen2, qwen3, gemma2, phi3; gemma3 at the
  config level: its family comes with another branch).
- Bad files through the real CLI: one line, exit 2, no traceback, no output file.
The real SmolLM2 GGUF is `test_gguf_realmodel.py`.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import h5py
import numpy as np
import pytest

gguf = pytest.importorskip("gguf")  # the [gguf] extra (in [test]): CI always has it

from conftest import run_cli  # noqa: E402
from rlx_mpi.model.checkpoint import H5ParamSource, read_header  # noqa: E402
from rlx_mpi.errors import CheckpointError, ConfigError  # noqa: E402
from rlx_mpi.families import get_family  # noqa: E402
from rlx_mpi.families.decoder.arch import expected_shapes  # noqa: E402
from rlx_mpi.families.decoder.family import random_tensors  # noqa: E402
from rlx_mpi.families.gguf import convert_gguf, hf_config, quant_groups  # noqa: E402

Q = gguf.GGMLQuantizationType
BAD_INPUT = 2

# -- GGUF files as llama.cpp writes them --------------------------------------------------------------

# our per-layer name -> llama.cpp's (written out here, independently of the gguf package's map)
_LAYER = {"input_layernorm": "attn_norm.weight", "q_proj": "attn_q.weight", "k_proj": "attn_k.weight",
          "v_proj": "attn_v.weight", "o_proj": "attn_output.weight", "post_attention_layernorm": "ffn_norm.weight",
          "gate_proj": "ffn_gate.weight", "up_proj": "ffn_up.weight", "down_proj": "ffn_down.weight",
          "q_bias": "attn_q.bias", "k_bias": "attn_k.bias", "v_bias": "attn_v.bias",
          "q_norm": "attn_q_norm.weight", "k_norm": "attn_k_norm.weight",
          "attn_out_norm": "post_attention_norm.weight", "mlp_out_norm": "post_ffw_norm.weight"}


def permute(w: np.ndarray, n_head: int, n_head_kv: int | None) -> np.ndarray:
    """llama.cpp's LlamaModel.permute (convert_hf_to_gguf.py): Hugging Face rows -> GGUF rows."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_tensors(arch: str, cfg, ours: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Our tensors under llama.cpp's names and layout for ``arch``."""
    out = {"token_embd.weight": ours["embed_tokens"], "output_norm.weight": ours["norm"]}
    if "lm_head" in ours:
        out["output.weight"] = ours["lm_head"]
    for n in range(cfg.num_hidden_layers):
        layer = {k.split("/", 2)[2]: v for k, v in ours.items() if k.startswith(f"layers/{n}/")}
        if arch == "llama":
            layer["q_proj"] = permute(layer["q_proj"], cfg.num_attention_heads, cfg.num_attention_heads)
            layer["k_proj"] = permute(layer["k_proj"], cfg.num_attention_heads, cfg.num_key_value_heads)
        if arch in ("gemma2", "gemma3"):
            layer = {k: (v + np.float32(1.0) if k.endswith("norm") else v) for k, v in layer.items()}
        if arch == "phi3":
            out[f"blk.{n}.attn_qkv.weight"] = np.concatenate([layer.pop(k) for k in ("q_proj", "k_proj", "v_proj")])
            out[f"blk.{n}.ffn_up.weight"] = np.concatenate([layer.pop(k) for k in ("gate_proj", "up_proj")])
        out.update({f"blk.{n}.{_LAYER[k]}": v for k, v in layer.items()})
    if arch in ("gemma2", "gemma3"):
        out["output_norm.weight"] = out["output_norm.weight"] + np.float32(1.0)
    return out


def write_gguf(path: Path, arch: str, meta: dict, tensors: dict[str, tuple[np.ndarray, object]],
               tokens: list[str] | None = None) -> Path:
    """A GGUF of ``arch`` with ``meta`` (key -> value, keys without the arch prefix for the
    arch's own) and ``tensors`` (name -> (array or raw blocks, GGML type))."""
    w = gguf.GGUFWriter(str(path), arch)
    for key, value in meta.items():
        full = key if key.startswith(("general.", "tokenizer.")) else f"{arch}.{key}"
        if isinstance(value, bool):
            w.add_bool(full, value)
        elif isinstance(value, int):
            w.add_uint32(full, value)
        elif isinstance(value, float):
            w.add_float32(full, value)
        elif isinstance(value, str):
            w.add_string(full, value)
        else:
            w.add_array(full, value)
    if tokens is not None:
        w.add_tokenizer_model("gpt2")
        w.add_token_list(tokens)
    for name, (data, qtype) in tensors.items():
        if qtype in (Q.F32, None):
            w.add_tensor(name, np.ascontiguousarray(data, np.float32))
        else:
            w.add_tensor(name, data, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def base_meta(cfg) -> dict:
    meta = {"context_length": cfg.max_position_embeddings, "embedding_length": cfg.hidden_size,
            "block_count": cfg.num_hidden_layers, "feed_forward_length": cfg.intermediate_size,
            "attention.head_count": cfg.num_attention_heads, "attention.head_count_kv": cfg.num_key_value_heads,
            "attention.layer_norm_rms_epsilon": cfg.rms_norm_eps, "rope.freq_base": cfg.rope_theta,
            "attention.key_length": cfg.head_dim, "attention.value_length": cfg.head_dim,
            "rope.dimension_count": cfg.head_dim}
    return meta


# Hugging Face configs of small random models, one per mapped architecture. Values exact in
# float32 (GGUF stores eps and the RoPE base as float32).
SHAPE = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=2.0 ** -14, rope_theta=10000.0)
CASES = {
    "llama": ("llama", dict(SHAPE, tie_word_embeddings=False), {}),
    "qwen2": ("qwen2", dict(SHAPE, tie_word_embeddings=True), {}),
    "qwen3": ("qwen3", dict(SHAPE, head_dim=32, tie_word_embeddings=True), {}),
    "gemma2": ("gemma2", dict(SHAPE, head_dim=16, sliding_window=8, query_pre_attn_scalar=16,
                              attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
                              layer_types=["sliding_attention", "full_attention"]),
               {"attention.sliding_window": 8, "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0}),
    "phi3": ("phi3", dict(SHAPE, tie_word_embeddings=False, sliding_window=64), {"attention.sliding_window": 64}),
}


def source_model(arch: str):
    family_name, hf, extra = CASES[arch]
    family = get_family(family_name)
    cfg = family.arch_from_hf({"model_type": family_name, **hf}, "test").validate("test")
    ours = dict(random_tensors(cfg, seed=3))
    return family, cfg, ours, extra


@pytest.mark.parametrize("arch", sorted(CASES))
def test_f32_gguf_converts_to_the_same_model(tmp_path, arch):
    family, cfg, ours, extra = source_model(arch)
    tensors = {n: (v, Q.F32) for n, v in gguf_tensors(arch, cfg, ours).items()}
    path = write_gguf(tmp_path / "m.gguf", arch, {**base_meta(cfg), **extra}, tensors)
    out = tmp_path / "m.h5"
    got_family, got, report = convert_gguf(path, out)
    assert got_family.name == family.name and got == cfg
    assert read_header(out) == (family.name, cfg.to_json())
    assert report.float["F32"] == len(tensors) and not report.kept and not report.dequantized
    with H5ParamSource(out, expected_shapes(cfg)) as src:
        for name, want in ours.items():
            # Gemma's norms went through 1 + w and back: one float32 rounding
            tol = 1e-6 if arch.startswith("gemma") and want.ndim == 1 else 0.0
            np.testing.assert_allclose(src.read(name), want, rtol=0, atol=tol, err_msg=name)


def test_llama_quantized_tensors_are_kept_exactly(tmp_path):
    """Q8_0, Q4_0 and Q4_1 linear weights (q and k permuted by llama.cpp) become groups whose
    values are the gguf package's dequantized tensor in Hugging Face row order; the embedding is
    dequantized to float; with ``dequantize`` every tensor is float and equal to those values."""
    family, cfg, ours, _ = source_model("llama")
    types = {"q_proj": Q.Q8_0, "k_proj": Q.Q4_0, "v_proj": Q.Q4_1, "o_proj": Q.Q4_0, "gate_proj": Q.Q4_1,
             "up_proj": Q.Q8_0, "down_proj": Q.Q4_1, "embed_tokens": Q.Q8_0, "lm_head": Q.Q4_0}
    tensors = {}
    for name, data in gguf_tensors("llama", cfg, ours).items():
        short = {"token_embd.weight": "embed_tokens", "output.weight": "lm_head"}.get(
            name, next((k for k, v in _LAYER.items() if name.endswith("." + v)), None))
        qtype = types.get(short, Q.F32)
        tensors[name] = (data, Q.F32) if qtype == Q.F32 else (gguf.quants.quantize(data, qtype), qtype)
    path = write_gguf(tmp_path / "q.gguf", "llama", base_meta(cfg), tensors)

    out = tmp_path / "q.h5"
    _, _, report = convert_gguf(path, out)
    assert report.kept == {"Q8_0": 4, "Q4_0": 5, "Q4_1": 6}  # 2 layers x (q, up | k, o | v, gate, down) + head
    assert report.dequantized == {"Q8_0": ["token_embd.weight"]}
    deq = tmp_path / "d.h5"
    _, _, report = convert_gguf(path, deq, dequantize=True)
    assert not report.kept and sum(map(len, report.dequantized.values())) == 16
    heads = {"q_proj": cfg.num_attention_heads, "k_proj": cfg.num_key_value_heads}
    with h5py.File(out, "r") as f, H5ParamSource(deq, expected_shapes(cfg)) as d:
        assert f.attrs["quantized"]
        for ours_name in expected_shapes(cfg):
            short = ours_name.rsplit("/", 1)[-1]
            top = {"embed_tokens": "token_embd.weight", "norm": "output_norm.weight", "lm_head": "output.weight"}
            gname = top[ours_name] if ours_name in top else f"blk.{ours_name.split('/')[1]}.{_LAYER[short]}"
            raw, qtype = tensors[gname]
            want = gguf.quants.dequantize(raw, qtype).reshape(ours[ours_name].shape) if qtype != Q.F32 else raw
            if short in heads:
                want = unpermute(want, heads[short])
            np.testing.assert_array_equal(d.read(ours_name), want, err_msg=ours_name)
            if qtype != Q.F32 and ours_name != "embed_tokens":
                np.testing.assert_array_equal(contract_values(f[ours_name]), want, err_msg=ours_name)
            else:
                assert isinstance(f[ours_name], h5py.Dataset)


def unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    """transformers' LlamaTensorProcessor._reverse_permute_weights (GGUF rows -> Hugging Face)."""
    dim = w.shape[0] // heads // 2
    return w.reshape(heads, dim, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


def contract_values(group: h5py.Group) -> np.ndarray:
    """A quantized group's weight read by the contract's words, one column at a time."""
    n, k = (int(v) for v in group.attrs["shape"])
    g = int(group.attrs["group_size"])
    codes, scale = group["codes"][()], group["scale"][()].astype(np.float32)
    minimum = group["minimum"][()].astype(np.float32) if "minimum" in group else None
    w = np.empty((n, k), np.float32)
    for col in range(k):
        if group.attrs["quant"] == "q4":
            byte = codes[:, col // 2]
            code = (byte & 0x0F) if col % 2 == 0 else (byte >> 4)
        else:
            code = codes[:, col]
        w[:, col] = scale[:, col // g] * code.astype(np.float32)
        if minimum is not None:
            w[:, col] += minimum[:, col // g]
    return w


def random_blocks(qtype, rows: int, blocks: int, rng) -> np.ndarray:
    """Raw blocks of random bytes with finite float16 d (and dmin) fields."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (rows, blocks, size), dtype=np.uint8)
    halves = {Q.Q4_K: (0, 2), Q.Q6_K: (208,), Q.Q3_K: (108,)}[qtype]
    for at in halves:
        raw[..., at:at + 2] = rng.uniform(-0.05, 0.05, (rows, blocks)).astype("<f2")[..., None].view(np.uint8)
    return raw.reshape(rows, blocks * size)


@pytest.mark.parametrize("name", ["Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q6_K", "Q5_0", "Q3_K"])
def test_groups_reproduce_the_gguf_dequantizer(tmp_path, name):
    rng = np.random.default_rng(7)
    qtype = Q[name]
    if name.endswith("_K"):
        raw = random_blocks(qtype, 6, 2, rng)
    else:
        raw = gguf.quants.quantize(rng.standard_normal((6, 96)).astype(np.float32) * 0.1, qtype)
    want = gguf.quants.dequantize(raw, qtype)
    groups = quant_groups(name, raw)
    assert groups.quant == ("q4" if name.startswith("Q4") else "q8")
    assert groups.group_size == (16 if name in ("Q6_K", "Q3_K") else 32) and groups.shape == want.shape
    assert groups.scale.dtype == (np.float32 if name.endswith("_K") else np.float16)
    np.testing.assert_array_equal(groups.dequantize(), want)
    with h5py.File(tmp_path / "g.h5", "w") as f:
        groups.write_h5(f, "w")
    with h5py.File(tmp_path / "g.h5", "r") as f:
        np.testing.assert_array_equal(contract_values(f["w"]), want)
        if name.startswith("Q4"):
            assert f["w/codes"].dtype == np.uint8 and f["w/codes"].shape == (6, want.shape[1] // 2)
        else:
            assert f["w/codes"].dtype == np.int8 and "minimum" not in f["w"]


def test_q4_0_scale_past_float16_range_is_stored_float32():
    """-8 d overflows float16 for |d| > 8188: scale and minimum go float32, values unchanged."""
    raw = gguf.quants.quantize(np.full((1, 32), 70000.0, np.float32), Q.Q4_0)
    groups = quant_groups("Q4_0", raw)
    assert groups.minimum.dtype == np.float32
    np.testing.assert_array_equal(groups.dequantize(), gguf.quants.dequantize(raw, Q.Q4_0))


def test_other_types_are_dequantized_and_named(tmp_path):
    """Q5_1 has a minimum the int8 groups lack: dequantized to float (Q5_0 beside it is kept)."""
    family, cfg, ours, _ = source_model("llama")
    tensors = {n: (v, Q.F32) for n, v in gguf_tensors("llama", cfg, ours).items()}
    for n in range(cfg.num_hidden_layers):
        name = f"blk.{n}.ffn_down.weight"
        tensors[name] = (gguf.quants.quantize(tensors[name][0], Q.Q5_1), Q.Q5_1)
    tensors["blk.0.ffn_up.weight"] = (gguf.quants.quantize(tensors["blk.0.ffn_up.weight"][0], Q.Q5_0), Q.Q5_0)
    path = write_gguf(tmp_path / "q5.gguf", "llama", base_meta(cfg), tensors)
    _, _, report = convert_gguf(path, tmp_path / "q5.h5")
    assert report.dequantized == {"Q5_1": ["blk.0.ffn_down.weight", "blk.1.ffn_down.weight"]}
    assert report.kept == {"Q5_0": 1}
    assert "Q5_1: 2 dequantized to float: blk.{0-1}.ffn_down.weight" in report.lines()
    with H5ParamSource(tmp_path / "q5.h5", expected_shapes(cfg)) as src:
        np.testing.assert_array_equal(src.read("layers/1/down_proj"),
                                      gguf.quants.dequantize(tensors["blk.1.ffn_down.weight"][0], Q.Q5_1))


# -- config mapping -------------------------------------------------------------------------------------


def test_gemma3_metadata_maps_to_gemma3_text_config():
    """Gemma 3's keys as transformers' Gemma3TextConfig names them (the family comes with fam1's branch)."""
    meta = {"general.architecture": "gemma3", "gemma3.context_length": 32768, "gemma3.embedding_length": 640,
            "gemma3.block_count": 18, "gemma3.feed_forward_length": 2048, "gemma3.attention.head_count": 4,
            "gemma3.attention.head_count_kv": 1, "gemma3.attention.key_length": 256,
            "gemma3.attention.value_length": 256, "gemma3.rope.freq_base": 1000000.0,
            "gemma3.attention.sliding_window": 512, "gemma3.attention.layer_norm_rms_epsilon": 1e-6,
            "tokenizer.ggml.tokens": ["t"] * 262144, "tokenizer.ggml.bos_token_id": 2, "tokenizer.ggml.eos_token_id": 1}
    raw = hf_config(meta, {"token_embd.weight": (262144, 640)}, "g.gguf")
    assert raw["model_type"] == "gemma3_text" and raw["tie_word_embeddings"] is True
    assert (raw["vocab_size"], raw["hidden_size"], raw["head_dim"], raw["num_key_value_heads"]) == (262144, 640, 256, 1)
    assert raw["rope_theta"] == 1e6 and raw["rope_local_base_freq"] == 10000.0
    assert raw["sliding_window"] == 512 and raw["query_pre_attn_scalar"] == 256
    assert raw["layer_types"] == ["full_attention" if (n + 1) % 6 == 0 else "sliding_attention" for n in range(18)]
    assert raw["hidden_activation"] == "gelu_pytorch_tanh" and "rope_scaling" not in raw
    scaled = hf_config({**meta, "gemma3.rope.scaling.type": "linear", "gemma3.rope.scaling.factor": 8.0,
                        "gemma3.attention.sliding_window_pattern": [True, False] * 9}, {}, "g.gguf")
    assert scaled["rope_scaling"] == {"rope_type": "linear", "factor": 8.0}
    assert scaled["layer_types"][:2] == ["sliding_attention", "full_attention"]


@pytest.mark.parametrize("meta, message", [
    ({"general.architecture": "mamba"}, "unknown architecture 'mamba'"),
    ({"general.architecture": "llama", "llama.attention.head_count": 4}, "metadata lacks llama.embedding_length"),
    ({"general.architecture": "llama", "llama.embedding_length": 64, "llama.attention.head_count": 4,
      "llama.feed_forward_length": 96, "llama.block_count": 2, "llama.attention.head_count_kv": [2, 4]},
     "differs per layer"),
    ({"general.architecture": "llama", "llama.embedding_length": 64, "llama.attention.head_count": 4,
      "llama.feed_forward_length": 96, "llama.block_count": 2, "llama.rope.scaling.type": "yarn"}, "'yarn'"),
])
def test_bad_metadata_is_named(meta, message):
    with pytest.raises(CheckpointError, match=message.replace("(", r"\(").replace("[", r"\[")):
        hf_config(meta, {}, "m.gguf")


# -- bad files through the CLI ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def good_gguf(tmp_path_factory) -> Path:
    family, cfg, ours, _ = source_model("llama")
    tensors = {n: (v, Q.F32) for n, v in gguf_tensors("llama", cfg, ours).items()}
    tensors["blk.0.ffn_up.weight"] = (gguf.quants.quantize(tensors["blk.0.ffn_up.weight"][0], Q.Q8_0), Q.Q8_0)
    return write_gguf(tmp_path_factory.mktemp("gguf") / "good.gguf", "llama", base_meta(cfg), tensors,
                      tokens=[chr(32 + i) for i in range(cfg.vocab_size)])  # printable ASCII: 96 bytes


def patched(src: Path, dst: Path, tensor: str, *, type_id: int | None = None, dim0: int | None = None) -> Path:
    dst.write_bytes(src.read_bytes())
    reader = gguf.GGUFReader(dst, "r+")
    t = next(t for t in reader.tensors if t.name == tensor)
    if type_id is not None:
        t.field.parts[4][0] = type_id
    if dim0 is not None:
        t.field.parts[3][0] = dim0
    reader.data.flush()
    del reader
    return dst


def bad_files(good: Path, d: Path) -> dict[str, tuple[Path, str]]:
    data = good.read_bytes()
    (d / "magic.gguf").write_bytes(b"GGML" + data[4:])
    (d / "short.gguf").write_bytes(data[:300])
    (d / "cut.gguf").write_bytes(data[:-100])
    family, cfg, ours, _ = source_model("llama")
    write_gguf(d / "arch.gguf", "mamba", {"block_count": 2}, {"token_embd.weight": (ours["embed_tokens"], Q.F32)})
    return {
        "wrong magic": (d / "magic.gguf", "wrong magic b'GGML'"),
        "truncated header": (d / "short.gguf", "truncated or corrupt header"),
        "truncated data": (d / "cut.gguf", "truncated: its F32 data ends at byte"),
        "unknown architecture": (d / "arch.gguf", "unknown architecture 'mamba'"),
        "unknown type id": (patched(good, d / "id.gguf", "blk.1.ffn_up.weight", type_id=200),
                            "blk.1.ffn_up.weight: unsupported tensor type (type id 200"),
        "unsupported type": (patched(good, d / "i32.gguf", "blk.1.ffn_up.weight", type_id=int(Q.I32)),
                             "blk.1.ffn_up.weight: unsupported tensor type I32"),
        "size vs shape": (patched(good, d / "big.gguf", "blk.0.attn_q.weight", dim0=128),
                          "blk.0.attn_q.weight: size disagrees with its shape: F32 (64, 128) needs 32768 bytes"),
        "partial block": (patched(good, d / "blk.gguf", "blk.0.ffn_up.weight", dim0=48),
                          "blk.0.ffn_up.weight: size disagrees with its shape: rows of 48 values are not whole Q8_0"),
        "shape vs config": (patched(good, d / "cfg.gguf", "blk.1.attn_v.weight", dim0=32),
                            "blk.1.attn_v.weight: shape (32, 32) disagrees with the config, which implies (32, 64)"),
    }


def test_bad_files_are_one_line_each(tmp_path, good_gguf):
    for case, (path, message) in bad_files(good_gguf, tmp_path).items():
        out = tmp_path / f"{path.stem}.h5"
        r = run_cli(["convert", path, out], timeout=60)
        lines = r.stderr.strip().splitlines()
        assert r.returncode == BAD_INPUT, (case, r.stderr)
        assert len(lines) == 1 and lines[0].startswith("rlx-mpi: error: ") and "Traceback" not in r.stderr, (case, r.stderr)
        assert message in lines[0], (case, lines[0])
        assert not out.exists() and not list(tmp_path.glob(f".{out.name}*")), case


def test_cli_converts_and_logs_per_type(tmp_path, good_gguf):
    out = tmp_path / "m.h5"
    r = run_cli(["convert", good_gguf, out, "--dtype", "bfloat16"], timeout=60)
    assert r.returncode == 0, r.stderr
    assert "  Q8_0: 1 kept as int8 groups (exact)" in r.stdout.splitlines()
    assert f"wrote {out}: llama, 2 layers" in r.stdout and f"wrote {tmp_path / 'm.tokenizer.json'}" in r.stdout
    with h5py.File(out, "r") as f:
        assert f["layers/0/up_proj/codes"].dtype == np.int8 and f["layers/0/q_proj"].attrs["dtype"] == "bfloat16"
    # the tokenizer stored beside it reads back through tokenizer.load_tokenizer: one byte a token here
    from rlx_mpi.io.tokenizer import load_tokenizer

    tok = load_tokenizer(out)
    assert tok.encode("A b") == [ord("A") - 32, ord(" ") - 32, ord("b") - 32] and tok.decode([33, 66]) == "Ab"
    r = run_cli(["convert", good_gguf, out, "--dequantize"], timeout=60)
    assert r.returncode == 0 and "  Q8_0: 1 dequantized to float: blk.0.ffn_up.weight" in r.stdout.splitlines()
    r = run_cli(["convert", tmp_path, tmp_path / "x.h5", "--dequantize"], timeout=60)
    assert r.returncode == BAD_INPUT and "applies to a .gguf source only" in r.stderr
    r = run_cli(["convert", good_gguf, good_gguf], timeout=60)  # never overwrites its input
    assert r.returncode == BAD_INPUT and good_gguf.read_bytes()[:4] == b"GGUF"


def test_phi3_longrope_factors_come_from_their_tensors(tmp_path):
    """llama.cpp stores Phi-3's longrope factors as tensors and its attention factor as metadata."""
    family = get_family("phi3")
    half = SHAPE["hidden_size"] // SHAPE["num_attention_heads"] // 2
    rng = np.random.default_rng(1)
    long, short = (rng.uniform(1.0, 4.0, half).astype(np.float32) for _ in range(2))
    hf = dict(SHAPE, model_type="phi3", original_max_position_embeddings=64,
              rope_scaling={"type": "longrope", "long_factor": long.tolist(), "short_factor": short.tolist()})
    cfg = family.arch_from_hf(hf, "test").validate("test")
    ours = dict(random_tensors(cfg, seed=3))
    tensors = {n: (v, Q.F32) for n, v in gguf_tensors("phi3", cfg, ours).items()}
    tensors.update({"rope_factors_long.weight": (long, Q.F32), "rope_factors_short.weight": (short, Q.F32)})
    meta = {**base_meta(cfg), "rope.scaling.original_context_length": 64,
            "rope.scaling.attn_factor": float(cfg.rope_attention_factor)}
    _, got, _ = convert_gguf(write_gguf(tmp_path / "p.gguf", "phi3", meta, tensors), tmp_path / "p.h5")
    assert got.rope_type == "longrope" and got.rope_original_max_positions == 64
    assert got.rope_long_factor == cfg.rope_long_factor and got.rope_short_factor == cfg.rope_short_factor
    assert got.rope_attention_factor == pytest.approx(cfg.rope_attention_factor, rel=1e-7)  # float32 in the file


def test_dtype_q4_requantizes_only_the_float_linear_weights(tmp_path):
    """``dtype="q4"``: kept groups stay exact, float linear weights become q4 groups and are listed;
    a build without the q4 precision refuses it in one line."""
    family, cfg, ours, _ = source_model("llama")
    tensors = {n: (v, Q.F32) for n, v in gguf_tensors("llama", cfg, ours).items()}
    kept = "blk.0.ffn_gate.weight"
    tensors[kept] = (gguf.quants.quantize(tensors[kept][0], Q.Q4_1), Q.Q4_1)
    path = write_gguf(tmp_path / "m.gguf", "llama", base_meta(cfg), tensors)
    try:
        from rlx_mpi.families.decoder.weights import q4_tensor  # noqa: F401
    except ImportError:
        with pytest.raises(ConfigError, match="q4 needs the q4 precision"):
            convert_gguf(path, tmp_path / "q4.h5", dtype="q4")
        return
    _, _, report = convert_gguf(path, tmp_path / "q4.h5", dtype="q4")
    linear = [n for n in tensors if n.endswith(("attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight",
                                                "ffn_gate.weight", "ffn_up.weight", "ffn_down.weight"))]
    assert sorted(report.requantized) == sorted([n for n in linear if n != kept] + ["output.weight"])
    assert report.kept == {"Q4_1": 1}
    with h5py.File(tmp_path / "q4.h5", "r") as f:
        np.testing.assert_array_equal(contract_values(f["layers/0/gate_proj"]),
                                      gguf.quants.dequantize(tensors[kept][0], Q.Q4_1))
        assert f["layers/1/up_proj"].attrs["quant"] == "q4" and isinstance(f["embed_tokens"], h5py.Dataset)


def test_llama3_rope_scaling_comes_back_from_rope_freqs(tmp_path):
    """llama.cpp keeps Llama 3.1's llama3 scaling only as the rope_freqs tensor; it converts to the
    config transformers reads from the safetensors; factors of no such scaling are refused."""
    family = get_family("llama")
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    cfg = family.arch_from_hf(dict(SHAPE, model_type="llama", max_position_embeddings=16384,
                                   rope_scaling=scaling), "test").validate("test")
    ours = dict(random_tensors(cfg, seed=3))
    tensors = {n: (v, Q.F32) for n, v in gguf_tensors("llama", cfg, ours).items()}
    # llama.cpp's LlamaModel.generate_extra_tensors, in float64 from float32 frequencies
    freqs = 1.0 / (cfg.rope_theta ** (np.arange(0, cfg.head_dim, 2, dtype=np.float32) / cfg.head_dim))
    factors = []
    for f in freqs.astype(np.float64):
        wavelen = 2 * math.pi / f
        smooth = (8192 / wavelen - 1.0) / (4.0 - 1.0)
        factors.append(1.0 if wavelen < 8192 / 4 else 8.0 if wavelen > 8192 else 1 / ((1 - smooth) / 8.0 + smooth))
    assert 1.0 < factors[-2] < 8.0 and factors[-1] == 8.0  # the tiny head still has all three bands
    tensors["rope_freqs.weight"] = (np.asarray(factors, np.float32), Q.F32)
    _, got, _ = convert_gguf(write_gguf(tmp_path / "l3.gguf", "llama", base_meta(cfg), tensors), tmp_path / "l3.h5")
    assert got == cfg
    tensors["rope_freqs.weight"] = (np.asarray(factors, np.float32) * 1.5, Q.F32)
    with pytest.raises(CheckpointError, match="rope_freqs.weight: per-frequency RoPE factors"):
        convert_gguf(write_gguf(tmp_path / "x.gguf", "llama", base_meta(cfg), tensors), tmp_path / "x.h5")


def test_without_tokenizers_the_ids_only_files_are_written(tmp_path, good_gguf, monkeypatch):
    import builtins

    real = builtins.__import__

    def no_tokenizers(name, *args, **kw):
        if name == "tokenizers" or name.startswith("tokenizers."):
            raise ImportError("No module named 'tokenizers'")
        return real(name, *args, **kw)

    monkeypatch.setattr(builtins, "__import__", no_tokenizers)
    _, _, report = convert_gguf(good_gguf, tmp_path / "m.h5")
    assert [p.name for p in report.files] == ["m.generation_config.json"]
    assert any("no tokenizer.json written" in line for line in report.lines())
    assert json.loads((tmp_path / "m.generation_config.json").read_text()) == {}  # the file names no eos


def test_split_gguf_converts_from_its_first_shard(tmp_path):
    """llama.cpp's gguf-split files (NAME-00001-of-0000N.gguf): the first shard names them all."""
    family, cfg, ours, _ = source_model("qwen3")
    tensors = {n: (v, Q.F32) for n, v in gguf_tensors("qwen3", cfg, ours).items()}
    w = gguf.GGUFWriter(str(tmp_path / "m.gguf"), "qwen3", split_max_tensors=9)
    for key, value in base_meta(cfg).items():
        (w.add_uint32 if isinstance(value, int) else w.add_float32)(f"qwen3.{key}", value)
    for name, (data, _) in tensors.items():
        w.add_tensor(name, data)
    w.write_header_to_file(tmp_path / "m.gguf")
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    shards = sorted(tmp_path.glob("m-*-of-*.gguf"))
    assert len(shards) == 3, shards
    _, got, report = convert_gguf(shards[0], tmp_path / "m.h5")
    assert got == cfg and report.float["F32"] == len(tensors)
    with H5ParamSource(tmp_path / "m.h5", expected_shapes(cfg)) as src:
        np.testing.assert_array_equal(src.read("layers/1/down_proj"), ours["layers/1/down_proj"])
    with pytest.raises(CheckpointError, match="not the first"):
        convert_gguf(shards[1], tmp_path / "x.h5")
    shards[2].unlink()
    with pytest.raises(CheckpointError, match="shard 3 of 3 not found beside the first"):
        convert_gguf(shards[0], tmp_path / "x.h5")
