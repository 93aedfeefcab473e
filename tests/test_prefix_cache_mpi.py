"""Prefix reuse under a real mpiexec (the tiny preset): prompts sharing a 40-token prefix give
the same rows with and without ``--no-prefix-cache`` on 1 rank, 2 stages and TP 2 (sampled, with
log-probs, chunked prefill), the final line and --json report the prompt tokens reused, a job
cut after some rows resumes with the cache on from a file written with it off (the rows'
identity does not depend on it), and a real stage's block copies keep a row's numbers bitwise."""

import json
import shutil

import numpy as np
import pytest

from conftest import write_job
from helpers import in_pairs, rows_of
from test_generate_mpi import generate, write_prompts, without_ms

pytestmark = pytest.mark.mpi

SHARED = np.random.default_rng(7).integers(0, 512, 40)  # 2 full blocks of 16 and 8 more tokens
PROMPTS = [(f"q{i}", np.concatenate([SHARED, np.random.default_rng(100 + i).integers(0, 512, 3 + i)]))
           for i in range(9)]
FLAGS = ("--max-new-tokens", 5, "--batch", 3, "--temperature", 0.8, "--logprobs", 2, "--prefill-chunk", 8)


@pytest.mark.parametrize("ranks, tp, kv", [(1, 1, "full"), (2, 1, "full"), (2, 2, "full"), (2, 1, "window:24")])
def test_rows_equal_without_the_prefix_cache(tmp_path, tiny_ckpt, ranks, tp, kv):
    """8 of the 9 prompts attach the 2 shared blocks (32 positions) the first one computed; under
    ``window:24`` every layer's cache is a ring of 24 that the attached blocks fill.

    Rows are equal bit for bit, log-probs included, on every layout: the steps batch the rows
    differently with and without the cache (fewer prefill positions, other chunks), and a row's
    numbers do not depend on the rows beside it or on its chunks (issue 36's contract)."""
    prompts = write_prompts(tmp_path / "p.jsonl", PROMPTS)
    on, off = in_pairs(
        lambda: generate(tmp_path, tiny_ckpt, ranks, prompts, tmp_path / "on.jsonl", *FLAGS, "--json",
                         tmp_path / "on.json", placement={"tp": tp}, run={"kv_cache": kv}, name="on.toml"),
        lambda: generate(tmp_path, tiny_ckpt, ranks, prompts, tmp_path / "off.jsonl", *FLAGS, "--no-prefix-cache",
                         "--json", tmp_path / "off.json", placement={"tp": tp}, run={"kv_cache": kv},
                         name="off.toml"))
    assert on.returncode == 0, on.stderr
    assert off.returncode == 0, off.stderr
    a, b = rows_of(tmp_path / "on.jsonl"), rows_of(tmp_path / "off.jsonl")
    assert [r["tokens"] for r in a] == [r["tokens"] for r in b]
    assert [r["identity"] for r in a] == [r["identity"] for r in b]
    assert without_ms(a) == without_ms(b)
    total = sum(len(t) for _, t in PROMPTS)
    assert json.loads((tmp_path / "on.json").read_text())["prefix_hits"] == [8 * 32, total]
    assert "prefix_hits" not in json.loads((tmp_path / "off.json").read_text())
    assert f"prefix cache: {8 * 32} of {total} prompt tokens reused" in on.stdout
    assert "prefix cache" not in off.stdout


def test_resume_with_the_cache_from_a_file_written_without_it(tmp_path, tiny_ckpt):
    """A job cut after 4 rows (as a kill -9 leaves it) resumes with the cache on: the rows equal
    the uninterrupted run without it, and the cache is rebuilt (the resumed prompts reuse what
    they compute themselves: the first of them prefills the shared blocks again)."""
    prompts = write_prompts(tmp_path / "p.jsonl", PROMPTS)
    flags = ("--max-new-tokens", 4, "--batch", 2, "--temperature", 0.8)
    full = generate(tmp_path, tiny_ckpt, 2, prompts, tmp_path / "full.jsonl", *flags, "--no-prefix-cache")
    assert full.returncode == 0, full.stderr
    cut = tmp_path / "cut.jsonl"
    cut.write_text("".join((tmp_path / "full.jsonl").read_text().splitlines(keepends=True)[:4]))
    shutil.copy(tmp_path / "full.jsonl.meta.json", tmp_path / "cut.jsonl.meta.json")
    resumed = generate(tmp_path, tiny_ckpt, 2, prompts, cut, *flags, "--json", tmp_path / "r.json")
    assert resumed.returncode == 0, resumed.stderr
    assert without_ms(rows_of(cut)) == without_ms(rows_of(tmp_path / "full.jsonl"))
    hits = json.loads((tmp_path / "r.json").read_text())["prefix_hits"]
    assert hits == [4 * 32, sum(len(t) for _, t in PROMPTS[4:])]


def test_a_job_key_turns_it_off(tmp_path, tiny_ckpt):
    prompts = write_prompts(tmp_path / "p.jsonl", PROMPTS[:3])
    job = write_job(tmp_path, "job.toml", model={"checkpoint": str(tiny_ckpt)}, run={"timeout_s": 30.0},
                    placement={"reserve_ram_gb": 0.0}, generate={"prefix_cache": False})
    from conftest import run_cli

    proc = run_cli(["generate", job, "--prompts", prompts, "--out", tmp_path / "o.jsonl", "--max-new-tokens", 2],
                   ranks=1, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "prefix cache" not in proc.stdout


def _attached_equals_chunked(st, ids: np.ndarray, kv, max_seq: int, steps: int) -> None:
    """Slot 1 prefills ``ids`` in chunks 0..19, 20..31, 32.. and saves blocks 0 and 1 (block 1
    straddles its chunks) on the way; slot 2 attaches them and prefills 32..; slot 0 computes the
    prompt without the pool in the same chunks (a row's numbers still depend on how its positions
    are batched, issue #36: the reference is chunked where the reuse cuts). Slot 2's logits and
    ``steps`` decode steps equal slot 0's bit for bit, and are within 1e-5 of a whole prefill."""
    from rlx_mpi.model.kv_cache import ATTACH, SAVE

    L = ids.shape[1]
    st.reset(4, max_seq, kv)
    assert st.reset_prefix(4, 16) > 0
    one = lambda a, b, slot: st.prefill(ids[:, a:b], np.array([slot]), np.array([L]), start=a)  # noqa: E731
    st.block_ops(np.array([[SAVE, 3, 0, 0], [SAVE, 3, 1, 1]]), before=True)  # both from one chunk: a ring
    whole = st.prefill(ids, np.array([3]), np.array([L]))                    # keeps only its last positions
    st.block_ops(np.array([[SAVE, 3, 0, 0], [SAVE, 3, 1, 1]]), before=False)
    one(0, 20, 0), one(20, 32, 0)
    ref = one(32, L, 0)
    st.block_ops(np.array([[SAVE, 1, 0, 2]]), before=True)  # block 0 completes in the first chunk
    one(0, 20, 1)
    st.block_ops(np.array([[SAVE, 1, 0, 2]]), before=False)
    st.block_ops(np.array([[SAVE, 1, 1, 3]]), before=True)
    one(20, 32, 1)
    st.block_ops(np.array([[SAVE, 1, 1, 3]]), before=False)
    assert np.array_equal(one(32, L, 1), ref)  # (saving changes nothing)
    st.block_ops(np.array([[ATTACH, 2, 0, 2], [ATTACH, 2, 1, 3]]), before=True)
    part = one(32, L, 2)
    assert np.array_equal(ref, part)
    assert np.abs(whole - part).max() <= 1e-5
    for p in st.pool:  # blocks saved from a whole prefill hold what the chunked one saved
        assert np.abs(p.k[:, :32] - p.k[:, 32:]).max() <= 1e-5 and np.abs(p.v[:, :32] - p.v[:, 32:]).max() <= 1e-5
    x = np.array([[int(ref[0].argmax())]])
    for p in range(L, L + steps):
        a, b = st.decode(x, np.array([0]), np.array([p])), st.decode(x, np.array([2]), np.array([p]))
        assert np.array_equal(a, b)
        x = np.array([[int(a[0].argmax())]])


@pytest.mark.parametrize("kv", ["full", "window:24"])
def test_block_copies_keep_a_real_stage_row_bitwise(tiny_ckpt, kv):
    """`_attached_equals_chunked` on the tiny Llama, and under a window of 24: the saving row's
    ring has lost positions 0..15 by the end of its prefill, the attaching row's ring must hold
    the last 24 of the 32 (the decode steps go past the window). A window shorter than a block
    has no pool."""
    from rlx_mpi.model.checkpoint import H5ParamSource
    from rlx_mpi.families.decoder.stage import DecoderStage
    from rlx_mpi.families.llama import PRESETS
    from rlx_mpi.model.kv_cache import KvSpec

    cfg = PRESETS["tiny"]
    with H5ParamSource(tiny_ckpt) as src:
        st = DecoderStage(cfg, src, range(cfg.num_hidden_layers), True, True)
    _attached_equals_chunked(st, np.concatenate([SHARED, [5, 6, 7]])[None], KvSpec.parse(kv, "test"), 72, 26)
    st.reset(3, 64, KvSpec("window", 8))
    assert st.reset_prefix(4, 16) == 0


def test_latent_attention_pools_its_latents(tmp_path):
    """DeepSeek-V3's latent cache (one shared entry of kv_lora_rank + rope width per position, not
    K and V per head: `decoder.mla`) goes through the pool the same way (the families fixture)."""
    from test_families import FAMILIES, build
    from rlx_mpi.families import family_for_model_type
    from rlx_mpi.model.kv_cache import KvSpec

    raw = json.loads((FAMILIES / "deepseek_v3" / "config.json").read_text())
    family = family_for_model_type(raw["model_type"])
    cfg = family.convert_hf(FAMILIES / "deepseek_v3", tmp_path / "m.h5", dtype="float32", hf_config=raw)
    st = build(family, cfg, tmp_path / "m.h5")
    ids = np.random.default_rng(3).integers(0, cfg.vocab_size, (1, 43))
    _attached_equals_chunked(st, ids, KvSpec("full"), 64, 8)
    assert st.pool[0].k.shape == (1, 4 * 16, cfg.kv_lora_rank)  # the latent, not K per head


def test_n_samples_of_a_batch_request_share_the_prefill(tmp_path_factory):
    """A batch file's request with n = 4 (4 rows of one prompt, sampled apart): 3 of them attach
    the prompt's 2 full blocks the first computed; the output lines equal --no-prefix-cache's."""
    pytest.importorskip("tokenizers", reason="the 'text' extra (tokenizers) is not installed")
    from test_batch_io import word_tokenizer
    from test_batch_mpi import (COMPLETIONS_URL, FIXTURES, generate as batch_generate, lines_of, request,
                                without_created, write_lines)
    from rlx_mpi.families import convert_hf

    d = tmp_path_factory.mktemp("nsamples")
    convert_hf(FIXTURES / "hf_tiny_llama", d / "m.h5")
    word_tokenizer(d, vocab_size=256)
    prompt = np.random.default_rng(9).integers(1, 256, 37).tolist()
    lines = [request("n4", COMPLETIONS_URL, prompt=prompt, max_tokens=4, temperature=0.9, seed=3, n=4),
             request("one", COMPLETIONS_URL, prompt=prompt[:20] + [5, 6], max_tokens=3)]
    reqs = write_lines(d / "r.jsonl", lines)
    on, off = in_pairs(lambda: batch_generate(d, d / "m.h5", 1, reqs, d / "on.jsonl", "--json", d / "on.json",
                                              name="on.toml"),
                       lambda: batch_generate(d, d / "m.h5", 1, reqs, d / "off.jsonl", "--no-prefix-cache",
                                              name="off.toml"))
    assert on.returncode == 0, on.stderr
    assert off.returncode == 0, off.stderr
    assert without_created(lines_of(d / "on.jsonl")) == without_created(lines_of(d / "off.jsonl"))
    hits = json.loads((d / "on.json").read_text())["prefix_hits"]
    assert hits == [3 * 32 + 16, 4 * 37 + 22]  # the other prompt shares block 0 (its first 16 tokens)
