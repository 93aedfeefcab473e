"""Pure tests of the Hugging Face -> HDF5 converter against the transformers fixtures: no MPI.

The fixtures' logits were computed by transformers (tests/make_hf_fixture.py); here the
converted checkpoint is run through `LlamaStage` and must reproduce them. Safetensors files
are read and written by the small helpers below, so the tests need nothing beyond numpy.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import h5py
import numpy as np
import pytest

from rlx_mpi.model.checkpoint import H5ParamSource, read_header
from rlx_mpi.errors import CheckpointError, ConfigError
from rlx_mpi.families.decoder.arch import Arch as LlamaConfig
from rlx_mpi.families.decoder.arch import expected_shapes
from rlx_mpi.families.decoder.stage import DecoderStage as LlamaStage
from rlx_mpi.families import convert_hf
from rlx_mpi.families.hf import _LAYER


def hf_name(name: str) -> str:
    """The Hugging Face tensor name of our (Llama) checkpoint name (``layers/3/q_proj`` ->
    ``model.layers.3.self_attn.q_proj.weight``)."""
    if name in ("embed_tokens", "norm"):
        return f"model.{name}.weight"
    if name == "lm_head":
        return "lm_head.weight"
    _, n, short = name.split("/")
    return f"model.layers.{n}.{_LAYER[short]}"

FIXTURES = Path(__file__).parent / "fixtures"
UNTIED, TIED = FIXTURES / "hf_tiny_llama", FIXTURES / "hf_tiny_llama_tied"

_NP_TO_ST = {np.dtype(np.float32): "F32", np.dtype(np.float16): "F16", np.dtype(np.int8): "I8"}
_ST_TO_NP = {v: k for k, v in _NP_TO_ST.items()}


# -- helpers -----------------------------------------------------------------------------------


def read_st(path: Path) -> dict[str, np.ndarray]:
    """A safetensors file as {name: array} (F32/F16 only; enough for the fixtures)."""
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    header.pop("__metadata__", None)
    data = raw[8 + n:]
    return {name: np.frombuffer(data[a:b], dtype=_ST_TO_NP[info["dtype"]].newbyteorder("<")).reshape(info["shape"])
            for name, info in header.items() for a, b in [info["data_offsets"]]}


def write_st(path: Path, tensors: dict) -> None:
    """Write a safetensors file; a value is an array or (safetensors dtype, array of its bits)."""
    header, chunks, offset = {"__metadata__": {"format": "pt"}}, [], 0
    for name, value in tensors.items():
        st_dtype, array = value if isinstance(value, tuple) else (_NP_TO_ST[value.dtype], value)
        blob = np.ascontiguousarray(array).astype(array.dtype.newbyteorder("<")).tobytes()
        header[name] = {"dtype": st_dtype, "shape": list(array.shape), "data_offsets": [offset, offset + len(blob)]}
        chunks.append(blob)
        offset += len(blob)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)  # the format pads the header to 8 bytes
    path.write_bytes(len(text).to_bytes(8, "little") + text + b"".join(chunks))


def hf_dir(tmp_path: Path, fixture: Path, *, config: dict | None = None, tensors: dict | None = None,
           config_file: str = "config.json") -> Path:
    """A copy of ``fixture`` in tmp_path, with its config and/or tensors replaced."""
    out = tmp_path / f"hf_{fixture.name}"
    out.mkdir()
    cfg = config if config is not None else json.loads((fixture / config_file).read_text())
    (out / "config.json").write_text(json.dumps(cfg))
    if tensors is None:
        shutil.copy(fixture / "model.safetensors", out / "model.safetensors")
    else:
        write_st(out / "model.safetensors", tensors)
    return out


def fixture_config(fixture: Path, **changes) -> dict:
    return {**json.loads((fixture / "config.json").read_text()), **changes}


def logits_of(path: Path, stages: list[range] | None = None) -> np.ndarray:
    """Run the converted checkpoint through LlamaStage(s) on the fixture's input ids."""
    family, text = read_header(path)
    assert family == "llama"
    cfg = LlamaConfig.from_json(text, str(path))
    stages = stages or [range(0, cfg.num_hidden_layers)]
    x = np.load(UNTIED / "input_ids.npy") if cfg.num_hidden_layers == 4 else np.load(TIED / "input_ids.npy")
    with H5ParamSource(path, expected_shapes(cfg)) as src:
        for k, layers in enumerate(stages):
            x = LlamaStage(cfg, src, layers, first=k == 0, last=k == len(stages) - 1).forward(x)
    return x


def max_diff(logits: np.ndarray, fixture: Path) -> float:
    return float(np.abs(logits - np.load(fixture / "logits.npy")).max())


# -- numerics ----------------------------------------------------------------------------------


@pytest.mark.parametrize("fixture", [UNTIED, TIED], ids=["untied", "tied"])
def test_converted_logits_match_transformers(tmp_path, fixture):
    out = tmp_path / "model.h5"
    cfg = convert_hf(fixture, out)
    assert cfg.num_hidden_layers == (4 if fixture is UNTIED else 3)
    assert cfg.tie_word_embeddings == (fixture is TIED)
    assert cfg.rope_theta == (500000.0 if fixture is UNTIED else 10000.0)
    assert cfg.head_dim == 8 and cfg.rms_norm_eps == 1e-5
    assert LlamaConfig.from_json(read_header(out)[1], "x") == cfg
    assert max_diff(logits_of(out), fixture) <= 1e-4


@pytest.mark.parametrize("fixture", [UNTIED, TIED], ids=["untied", "tied"])
def test_v4_style_config_gives_same_checkpoint(tmp_path, fixture):
    v5, v4 = tmp_path / "v5.h5", tmp_path / "v4.h5"
    convert_hf(fixture, v5)
    cfg4 = convert_hf(hf_dir(tmp_path, fixture, config_file="config_v4.json"), v4)
    assert read_header(v4) == read_header(v5)
    assert cfg4.rope_theta == (500000.0 if fixture is UNTIED else 10000.0)
    np.testing.assert_array_equal(logits_of(v4), logits_of(v5))


def test_config_name_selects_the_config_file(tmp_path):
    out = tmp_path / "m.h5"
    assert convert_hf(UNTIED, out, config_name="config_v4.json").rope_theta == 500000.0


def test_two_stage_split_gives_same_logits(tmp_path):
    out = tmp_path / "model.h5"
    convert_hf(UNTIED, out)
    whole = logits_of(out)
    split = logits_of(out, [range(0, 2), range(2, 4)])
    np.testing.assert_array_equal(split, whole)
    assert max_diff(split, UNTIED) <= 1e-4


@pytest.mark.parametrize("fixture", [UNTIED, TIED], ids=["untied", "tied"])
def test_float16_storage(tmp_path, fixture):
    out = tmp_path / "model16.h5"
    convert_hf(fixture, out, dtype="float16")
    with h5py.File(out, "r", locking=False) as f:
        assert f["embed_tokens"].dtype == np.float16
    # float16 rounds each weight by up to 2^-11 relative; through 3-4 layers that moved the
    # logits (max |logit| ~ 5.7) by 0.016 (untied) and 0.013 (tied) when measured
    assert max_diff(logits_of(out), fixture) <= 3e-2


def test_sharded_with_and_without_index(tmp_path):
    tensors = read_st(UNTIED / "model.safetensors")
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    ref = tmp_path / "ref.h5"
    convert_hf(UNTIED, ref)
    for with_index in (False, True):
        d = tmp_path / f"sharded_{with_index}"
        d.mkdir()
        shutil.copy(UNTIED / "config.json", d / "config.json")
        for file, part in shards.items():
            write_st(d / file, {n: tensors[n] for n in part})
        if with_index:
            weight_map = {n: f for f, part in shards.items() for n in part}
            (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
            # a stray file the index does not list is not read (Mistral repos ship consolidated.safetensors)
            write_st(d / "consolidated.safetensors", {"layers.0.attention.wq.weight": np.zeros((2, 2), np.float32)})
        out = tmp_path / f"sharded_{with_index}.h5"
        convert_hf(d, out)
        np.testing.assert_array_equal(logits_of(out), logits_of(ref))


def test_bf16_round_trips_exactly(tmp_path):
    tensors = read_st(TIED / "model.safetensors")
    # truncate every weight to a bf16-representable float32: its top 16 bits
    exact = {n: (a.view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32) for n, a in tensors.items()}
    bits = {n: ("BF16", (a.view(np.uint32) >> 16).astype(np.uint16)) for n, a in exact.items()}
    d = hf_dir(tmp_path, TIED, tensors=bits)
    out = tmp_path / "bf16.h5"
    cfg = convert_hf(d, out)
    with H5ParamSource(out) as src:
        for name in expected_shapes(cfg):
            np.testing.assert_array_equal(src.read(name), exact[hf_name(name)], err_msg=name)
    assert max_diff(logits_of(out), TIED) < 0.5  # bf16 weights: close to, not equal to, float32


def test_f16_source_tensors(tmp_path):
    tensors = {n: a.astype(np.float16) for n, a in read_st(TIED / "model.safetensors").items()}
    out = tmp_path / "f16.h5"
    cfg = convert_hf(hf_dir(tmp_path, TIED, tensors=tensors), out)
    with H5ParamSource(out) as src:
        np.testing.assert_array_equal(src.read("norm"), tensors["model.norm.weight"].astype(np.float32))
    assert cfg.tie_word_embeddings


def test_harmless_extras_are_ignored(tmp_path):
    tensors = read_st(TIED / "model.safetensors")
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = np.ones(4, np.float32)
    tensors["lm_head.weight"] = np.zeros((256, 64), np.float32)  # tied: the embedding is the head
    out = tmp_path / "m.h5"
    convert_hf(hf_dir(tmp_path, TIED, tensors=tensors), out)
    assert max_diff(logits_of(out), TIED) <= 1e-4


# -- refusals ----------------------------------------------------------------------------------


@pytest.mark.parametrize("changes, message", [
    ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0}},
     "rope_parameters.low_freq_factor: is missing"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 5e5, "factor": 4.0}},
     "rope_parameters.rope_type: is 'yarn', not supported"),
    ({"rope_parameters": None, "rope_theta": 5e5, "rope_scaling": {"rope_type": "dynamic", "factor": 8.0}},
     "rope_scaling.rope_type: is 'dynamic'"),
    ({"rope_parameters": None, "rope_theta": 5e5, "rope_scaling": {"type": "linear"}},
     "rope_scaling.factor: is missing"),
    ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 5e5}}, "rope_type: is 'longrope'"),
    ({"rope_theta": 10000.0}, "disagrees with rope_parameters.rope_theta"),
    ({"attention_bias": True}, "attention_bias: is True"),
    ({"mlp_bias": True}, "mlp_bias: is True"),
    ({"model_type": "gpt2"}, "model_type: 'gpt2' is not a supported model type"),
    ({"hidden_act": "gelu"}, "hidden_act: is 'gelu'"),
    ({"pretraining_tp": 2}, "pretraining_tp: is 2"),
    ({"quantization_config": {"quant_method": "gptq"}}, "quantized model (method 'gptq')"),
    ({"hidden_size": "64"}, "hidden_size: is '64'"),
    ({"num_key_value_heads": 3}, "not a multiple of num_key_value_heads (3)"),
])
def test_refuses_unsupported_config(tmp_path, changes, message):
    d = hf_dir(tmp_path, UNTIED, config=fixture_config(UNTIED, **changes))
    with pytest.raises(CheckpointError) as e:
        convert_hf(d, tmp_path / "m.h5")
    assert message in str(e.value)
    assert e.value.where.startswith(str(d / "config.json"))
    assert not (tmp_path / "m.h5").exists()


def test_v4_default_rope_scaling_is_accepted(tmp_path):
    cfg = json.loads((UNTIED / "config_v4.json").read_text())
    cfg["rope_scaling"] = {"rope_type": "default"}
    assert convert_hf(hf_dir(tmp_path, UNTIED, config=cfg), tmp_path / "m.h5").rope_theta == 500000.0


def test_refuses_missing_tensor(tmp_path):
    tensors = read_st(UNTIED / "model.safetensors")
    del tensors["model.layers.2.mlp.up_proj.weight"]
    with pytest.raises(CheckpointError, match=r"missing tensors \['model.layers.2.mlp.up_proj.weight'\]"):
        convert_hf(hf_dir(tmp_path, UNTIED, tensors=tensors), tmp_path / "m.h5")


def test_untied_config_without_lm_head_suggests_tying(tmp_path):
    d = hf_dir(tmp_path, TIED, config=fixture_config(TIED, tie_word_embeddings=False))
    with pytest.raises(CheckpointError, match=r"missing tensors \['lm_head.weight'\].*tie_word_embeddings: true"):
        convert_hf(d, tmp_path / "m.h5")


def test_refuses_wrong_shape(tmp_path):
    tensors = read_st(UNTIED / "model.safetensors")
    tensors["model.layers.1.self_attn.k_proj.weight"] = np.zeros((16, 64), np.float32)
    with pytest.raises(CheckpointError) as e:
        convert_hf(hf_dir(tmp_path, UNTIED, tensors=tensors), tmp_path / "m.h5")
    assert e.value.where.endswith("model.layers.1.self_attn.k_proj.weight")
    assert "shape (16, 64) disagrees with the config, which implies (32, 64)" in e.value.what


def test_refuses_unsupported_dtype(tmp_path):
    tensors = read_st(TIED / "model.safetensors")
    tensors["model.norm.weight"] = np.zeros(64, np.int8)
    with pytest.raises(CheckpointError, match="dtype I8 is not supported"):
        convert_hf(hf_dir(tmp_path, TIED, tensors=tensors), tmp_path / "m.h5")


@pytest.mark.parametrize("name, message", [
    ("model.layers.0.self_attn.q_proj.bias", "bias tensors ['model.layers.0.self_attn.q_proj.bias']"),
    ("model.layers.3.input_layernorm.weight", "unexpected tensors ['model.layers.3.input_layernorm.weight']"),
])
def test_refuses_unmapped_tensors(tmp_path, name, message):
    tensors = read_st(TIED / "model.safetensors")
    tensors[name] = np.zeros(64, np.float32)
    with pytest.raises(CheckpointError) as e:
        convert_hf(hf_dir(tmp_path, TIED, tensors=tensors), tmp_path / "m.h5")
    assert message in str(e.value)


def test_refuses_directory_without_safetensors(tmp_path):
    d = tmp_path / "bin_only"
    d.mkdir()
    shutil.copy(UNTIED / "config.json", d / "config.json")
    (d / "pytorch_model.bin").write_bytes(b"\0" * 16)
    with pytest.raises(CheckpointError, match=r"no \*\.safetensors files.*not pytorch_model\.bin"):
        convert_hf(d, tmp_path / "m.h5")


def test_refuses_missing_config(tmp_path):
    d = tmp_path / "no_config"
    d.mkdir()
    shutil.copy(UNTIED / "model.safetensors", d / "model.safetensors")
    with pytest.raises(CheckpointError, match="config file not found") as e:
        convert_hf(d, tmp_path / "m.h5")
    assert e.value.where == str(d / "config.json")


def test_refuses_unreadable_config(tmp_path):
    d = hf_dir(tmp_path, UNTIED)
    (d / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="unreadable config"):
        convert_hf(d, tmp_path / "m.h5")


def test_refuses_truncated_safetensors(tmp_path):
    d = hf_dir(tmp_path, UNTIED)
    data = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(data[:-100])
    with pytest.raises(CheckpointError, match="does not hold a F32 tensor"):
        convert_hf(d, tmp_path / "m.h5")


def test_refuses_missing_output_directory(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        convert_hf(UNTIED, tmp_path / "nowhere" / "m.h5")


def test_refuses_unknown_output_dtype(tmp_path):
    with pytest.raises(ConfigError, match="'float8' is not a checkpoint dtype"):
        convert_hf(UNTIED, tmp_path / "m.h5", dtype="float8")
