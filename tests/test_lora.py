"""LoRA adapters (issue 44) in one process: the kernel against naive numpy, the PEFT reader's
refusals (one line each), and the decoder with adapters against transformers + peft
(tests/fixtures/lora, made by tests/make_lora_fixtures.py): logits at every position through
prefill and decode, greedy tokens, rows of different adapters in one step, TP 2 in threads, and
low-precision base weights."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from conftest import TESTS
from rlx_mpi import kernels
from rlx_mpi.config import parse_job
from rlx_mpi.errors import CheckpointError, ConfigError, InputError
from rlx_mpi.families import family_for_model_type
from rlx_mpi.families.decoder import lora
from rlx_mpi.families.hf.peft import adapter_digest, read_adapter, read_adapter_config
from rlx_mpi.model.checkpoint import H5ParamSource
from rlx_mpi.model.kv_cache import KvSpec
from rlx_mpi.model.stage import StepBatch, TensorParallel
from test_families import tp_run

FAMILIES = TESTS / "fixtures" / "families"
LORA = TESTS / "fixtures" / "lora"
CASES = ["llama_linear", "qwen2"]
NAMES = ["r8", "r16rs", "part"]  # adapter index 0, 1, 2 (-1: the base model)


def reference(case: str):
    return np.load(LORA / case / "reference.npz", allow_pickle=False)


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    out, root = {}, tmp_path_factory.mktemp("lora")

    def get(case: str):
        if case not in out:
            raw = json.loads((FAMILIES / case / "config.json").read_text())
            family = family_for_model_type(raw["model_type"])
            path = root / f"{case}.h5"
            out[case] = family, family.convert_hf(FAMILIES / case, path, dtype="float32", hf_config=raw), path
        return out[case]
    return get


def build(family, cfg, path, case, names=NAMES, **kw):
    with H5ParamSource(path, family.expected_shapes(cfg)) as src:
        stage = family.build_stage(cfg, src, range(cfg.num_hidden_layers), True, True, **kw)
    stage.load_adapters([(n, LORA / case / n) for n in names])
    return stage


def batch(kind, n, adapters, lengths, **kw):
    return StepBatch(kind, np.arange(n), np.asarray(lengths, np.int64), np.arange(n), np.zeros(n, np.int64),
                     adapters=np.asarray(adapters, np.int64), **kw)


def teacher_forced(stage, ids: np.ndarray, adapters, first: int = 1) -> np.ndarray:
    """Logits (B, T, V) at every position: a prefill of the first ``first`` tokens, then one
    decode step per token, each row with its own adapter."""
    B, T = ids.shape
    stage.reset(B, T, KvSpec("full"))
    out = [stage.step(ids[:, :first], batch("prefill", B, adapters, [first] * B))]
    for t in range(first, T):
        out.append(stage.step(ids[:, t:t + 1], batch("decode", B, adapters, [t] * B)))
    return np.stack(out, axis=1)  # (B, T - first + 1, V)


def greedy(stage, prompt: np.ndarray, n: int, adapter: int) -> list[int]:
    stage.reset(1, prompt.shape[1] + n, KvSpec("full"))
    P = prompt.shape[1]
    logits = stage.step(prompt, batch("prefill", 1, [adapter], [P]))
    out = [int(logits[0].argmax())]
    for pos in range(P, P + n - 1):
        out.append(int(stage.step(np.array([[out[-1]]]), batch("decode", 1, [adapter], [pos]))[0].argmax()))
    return out


# -- the kernel --------------------------------------------------------------------------------


def naive(y, x, rows, a, b, ranks, scale, col):
    y = y.astype(np.float64)
    for n, k in enumerate(rows):
        if k >= 0:
            r = ranks[k]
            y[n, col:col + b.shape[2]] += scale[k] * (b[k, :r].T.astype(np.float64) @ (a[k, :r].astype(np.float64) @ x[n]))
    return y


@pytest.mark.parametrize("N", [1, 5, 17, 300])  # 300: segments past F32_MATVEC_ROWS (the team's product)
def test_lora_add_matches_numpy_and_leaves_base_rows_alone(N):
    rng = np.random.default_rng(N)
    K, R, I, O, W, col = 3, 16, 40, 24, 60, 20
    x = rng.standard_normal((N, I)).astype(np.float32)
    a = rng.standard_normal((K, R, I)).astype(np.float32)
    b = rng.standard_normal((K, R, O)).astype(np.float32)
    ranks, scale = np.array([8, 16, 4]), np.array([2.0, 0.5, 1.5], np.float32)
    rows = rng.integers(-1, K, N)
    y0 = rng.standard_normal((N, W)).astype(np.float32)
    y = kernels.lora_add_(y0.copy(), x, rows, a, b, ranks, scale, col)
    np.testing.assert_allclose(y, naive(y0, x, rows, a, b, ranks, scale, col), rtol=1e-5, atol=1e-4)
    assert np.array_equal(y[rows < 0], y0[rows < 0])  # a base row: untouched, bit for bit
    assert np.array_equal(y[:, :col], y0[:, :col]) and np.array_equal(y[:, col + O:], y0[:, col + O:])
    for n in range(N):  # a row alone gives the same bits as in the batch
        alone = kernels.lora_add_(y0[n:n + 1].copy(), x[n:n + 1], rows[n:n + 1], a, b, ranks, scale, col)
        assert np.array_equal(alone[0], y[n])


def test_lora_add_names_what_does_not_fit():
    z = np.zeros
    with pytest.raises(ValueError, match="do not fit"):
        kernels.lora_add_(z((2, 4), np.float32), z((2, 3), np.float32), z(2, int), z((1, 2, 5), np.float32),
                          z((1, 2, 4), np.float32), np.ones(1, int), np.ones(1, np.float32))
    with pytest.raises(ValueError, match=r"row adapters must lie in \[-1, 0\]"):
        kernels.lora_add_(z((2, 4), np.float32), z((2, 3), np.float32), np.array([0, 1]), z((1, 2, 3), np.float32),
                          z((1, 2, 4), np.float32), np.ones(1, int), np.ones(1, np.float32))
    with pytest.raises(TypeError, match="float32"):
        kernels.lora_add_(z((2, 4)), z((2, 3), np.float32), z(2, int), z((1, 2, 3), np.float32),
                          z((1, 2, 4), np.float32), np.ones(1, int), np.ones(1, np.float32))


def test_token_rows_expand_each_rows_adapter_over_its_tokens():
    assert lora.token_rows(np.array([-1, -1]), "decode", 1) is None  # no adapter: the plain path
    assert lora.token_rows(np.array([0, -1]), "decode", 1).tolist() == [0, -1]
    assert lora.token_rows(np.array([1, -1]), "prefill", 3).tolist() == [1, 1, 1, -1, -1, -1]
    assert lora.token_rows(np.array([2, 0, 1]), "mixed", 2, n_decode=1).tolist() == [2, 0, 0, 1, 1]


# -- against transformers + peft ---------------------------------------------------------------


@pytest.mark.parametrize("case", CASES)
def test_each_adapter_matches_peft_at_every_position(converted, case):
    """Rows of the base model and three adapters in the same steps: each row's logits at every
    position (a prefill of 1 token, then decode steps) within 1e-4 of PEFT's."""
    family, cfg, path = converted(case)
    ref = reference(case)
    stage = build(family, cfg, path, case)
    ids = ref["input_ids"]  # (2, 24)
    keys = ["base", *NAMES]
    rows = np.concatenate([ids, ids])  # 4 rows: base, r8 / r16rs, part on the two prompts
    adapters = [-1, 0, 1, 2]
    got = teacher_forced(stage, rows, adapters)
    for b, (k, i) in enumerate(zip(keys, [0, 1, 0, 1])):
        want = ref[f"logits_{k}"][i]
        assert np.abs(got[b] - want).max() <= 1e-4, (case, k)


@pytest.mark.parametrize("case", CASES)
def test_prefill_and_mixed_steps_match_peft(converted, case):
    """A whole-prompt prefill, then a MIXED step (a decode row beside a chunk of another): the
    last position's logits of each row as PEFT's."""
    family, cfg, path = converted(case)
    ref = reference(case)
    stage = build(family, cfg, path, case)
    ids = ref["input_ids"]
    T = ids.shape[1]
    stage.reset(2, T, KvSpec("full"))
    out = stage.step(ids, batch("prefill", 2, [1, 2], [T, T]))
    assert np.abs(out[0] - ref["logits_r16rs"][0, -1]).max() <= 1e-4
    assert np.abs(out[1] - ref["logits_part"][1, -1]).max() <= 1e-4
    # mixed: row 0 (adapter r8) decodes position 8 after a prefill of 8; row 1 (base) prefills its first 16
    stage.reset(2, T, KvSpec("full"))
    stage.step(ids[:1, :8], StepBatch("prefill", np.array([0]), np.array([8]), np.array([0]), np.zeros(1, np.int64),
                                      adapters=np.array([0])))
    x = np.concatenate([ids[0, 8:9], ids[1, :16]])[None]  # (1, 1 + 16)
    out = stage.step(x, StepBatch("mixed", np.array([0, 1]), np.array([8, 16]), np.array([0, 1]),
                                  np.zeros(2, np.int64), start=0, n_decode=1, adapters=np.array([0, -1])))
    assert np.abs(out[0] - ref["logits_r8"][0, 8]).max() <= 1e-4
    assert np.abs(out[1] - ref["logits_base"][1, 15]).max() <= 1e-4


@pytest.mark.parametrize("case", CASES)
def test_greedy_tokens_equal_peft(converted, case):
    family, cfg, path = converted(case)
    ref = reference(case)
    stage = build(family, cfg, path, case)
    for k, key in enumerate(["base", *NAMES], start=-1):
        want = ref[f"greedy_{key}"].tolist()
        assert greedy(stage, ref["prompt_ids"], len(want), k) == want, (case, key)


@pytest.mark.parametrize("case", CASES)
def test_a_row_gives_the_same_bits_whatever_rows_are_beside_it(converted, case):
    """A step mixing the base model and two adapters gives each row exactly (bit for bit) what a
    step of that row alone gives, prefill and decode (the base row takes the one-call decode
    layer alone and the layer-by-layer path beside adapter rows: the same bits)."""
    family, cfg, path = converted(case)
    ids = reference(case)["input_ids"]
    stage = build(family, cfg, path, case)
    rows = np.concatenate([ids, ids[:1]])[:, :12]  # 3 rows
    mixed = teacher_forced(stage, rows, [-1, 0, 1], first=6)
    for b, k in enumerate([-1, 0, 1]):
        alone = teacher_forced(stage, rows[b:b + 1], [k], first=6)
        assert np.array_equal(alone[0], mixed[b]), (case, k)
    only = build(family, cfg, path, case, names=["r16rs"])  # a job that loaded only that adapter
    assert np.array_equal(teacher_forced(only, rows[2:3], [0], first=6)[0], mixed[2])


@pytest.mark.parametrize("case", CASES)
def test_tp2_shards_the_adapters_and_matches_peft(converted, case):
    """TP 2 (two stages in threads): B cut by output rows on q/k/v/gate/up, A by input columns on
    o/down; each rank holds its share."""
    family, cfg, path = converted(case)
    ref = reference(case)
    ids = ref["input_ids"]

    def work(stage):
        stage.load_adapters([(n, LORA / case / n) for n in NAMES])
        return teacher_forced(stage, np.concatenate([ids, ids]), [-1, 0, 1, 2])

    stages, results = tp_run(family, cfg, path, 2, work)
    for b, (k, i) in enumerate(zip(["base", *NAMES], [0, 1, 0, 1])):
        assert np.abs(results[0][b] - ref[f"logits_{k}"][i]).max() <= 1e-4, (case, k)
    q = stages[0].lora_layers[0]["q_proj"]  # (K, R, I) whole A, (K, O/2, R) B
    assert q.a.shape[2] == cfg.hidden_size and q.b.shape[2] == cfg.q_dim // 2
    o = stages[1].lora_layers[0]["o_proj"]
    assert o.a.shape[2] == cfg.q_dim // 2 and o.b.shape[2] == cfg.hidden_size


def test_tp4_over_two_kv_heads_replicates_the_kv_adapters(converted):
    """qwen2 at TP 4 (2 kv heads): each rank's k/v adapter rows are its one kv head's, as its weights."""
    family, cfg, path = converted("qwen2")
    ref = reference("qwen2")
    ids = ref["input_ids"][:, :10]

    def work(stage):
        stage.load_adapters([(n, LORA / "qwen2" / n) for n in NAMES])
        return teacher_forced(stage, ids, [0, 1])

    _, results = tp_run(family, cfg, path, 4, work)
    assert np.abs(results[0][0] - ref["logits_r8"][0, :10]).max() <= 1e-4
    assert np.abs(results[0][1] - ref["logits_r16rs"][1, :10]).max() <= 1e-4


@pytest.mark.parametrize("precision", ["bf16", "int8", "q4"])
def test_adapters_sit_beside_low_precision_weights(converted, precision):
    """The adapters stay float32 beside bf16 / int8 / q4 base weights: each row's adapter moves its
    logits as much as in float32 (the difference adapter - base within the precision's error)."""
    family, cfg, path = converted("llama_linear")
    ref = reference("llama_linear")
    f32 = build(family, cfg, path, "llama_linear")
    low = build(family, cfg, path, "llama_linear", precision=precision)
    assert low.lora_layers[0]["q_proj"].a.dtype == np.float32
    ids = ref["input_ids"][:1, :10]
    rows = np.concatenate([ids, ids])
    a, b = teacher_forced(f32, rows, [-1, 0]), teacher_forced(low, rows, [-1, 0])
    shift_f32, shift_low = a[1] - a[0], b[1] - b[0]
    bound = {"bf16": 0.1, "int8": 0.3, "q4": 2.0}[precision]  # (BOUNDS in test_families: relative)
    assert np.abs(shift_low - shift_f32).max() <= bound * np.abs(shift_f32).max()


# -- refusals, one line each -------------------------------------------------------------------


def copy_adapter(tmp_path, name="r8", case="llama_linear", **changes) -> Path:
    d = tmp_path / name
    shutil.copytree(LORA / case / name, d)
    if changes:
        conf = json.loads((d / "adapter_config.json").read_text())
        conf.update(changes)
        (d / "adapter_config.json").write_text(json.dumps(conf))
    return d


@pytest.mark.parametrize("key, value", [("use_dora", True), ("modules_to_save", ["lm_head"]), ("lora_bias", True),
                                        ("bias", "all"), ("fan_in_fan_out", True), ("layer_replication", [[0, 1]])])
def test_options_that_change_the_maths_are_refused_by_key(tmp_path, key, value):
    d = copy_adapter(tmp_path, **{key: value})
    with pytest.raises(ConfigError, match=rf"adapter 'a' \(.*adapter_config.json\): {key}: .* is not supported; merge"):
        read_adapter_config(d, "a")


def test_bad_adapter_inputs_get_one_line(tmp_path, converted):
    _, cfg, _ = converted("llama_linear")
    with pytest.raises(ConfigError, match=r"adapter 'a'.*: file not found; pass a PEFT adapter directory"):
        read_adapter(tmp_path, "a", cfg)  # an empty directory
    with pytest.raises(ConfigError, match=r"is not a directory"):
        read_adapter(tmp_path / "nope", "a", cfg)
    d = copy_adapter(tmp_path)
    (d / "adapter_config.json").write_text("{not json")
    with pytest.raises(ConfigError, match=r"adapter_config.json\): not valid JSON"):
        read_adapter(d, "a", cfg)
    d = copy_adapter(tmp_path / "p", target_modules=["self_attn.q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                     "mlp.up_proj", "down_proj"])
    assert len(read_adapter(d, "a", cfg)) == 14  # a list entry may be a name's ending (PEFT's rule)
    d = copy_adapter(tmp_path / "t", target_modules=["q_proj", "k_proj"])
    with pytest.raises(CheckpointError, match=r"model.layers.0.mlp.down_proj: has LoRA tensors but target_modules "
                                              r"\['q_proj', 'k_proj'\] does not name it"):
        read_adapter(d, "a", cfg)
    d = copy_adapter(tmp_path / "u", target_modules=["q_proj", "c_attn"])
    with pytest.raises(ConfigError, match=r"target_modules: unknown target module 'c_attn'; this decoder's adapters take"):
        read_adapter(d, "a", cfg)
    d = copy_adapter(tmp_path / "s", r=4)  # the file's tensors are rank 8
    with pytest.raises(CheckpointError, match=r"model.layers.0.mlp.down_proj: lora_A \[8, 128\] and lora_B \[64, 8\] "
                                              r"do not fit the base model's down_proj \(64 x 128\) at rank 4"):
        read_adapter(d, "a", cfg)
    wide = dataclasses.replace(cfg, intermediate_size=96)  # a base model of another MLP width
    with pytest.raises(CheckpointError, match=r"do not fit the base model's"):
        read_adapter(copy_adapter(tmp_path / "w"), "a", wide)
    (d / "adapter_model.safetensors").unlink()
    with pytest.raises(ConfigError, match=r"adapter_model.safetensors\): file not found"):
        read_adapter(d, "a", cfg)


def test_another_familys_tensor_names_are_refused(tmp_path, converted):
    _, cfg, _ = converted("llama_linear")
    d = copy_adapter(tmp_path)
    raw = (d / "adapter_model.safetensors").read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = raw[8:8 + n].decode().replace("self_attn.q_proj", "self_attn.c_attn")
    (d / "adapter_model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header.encode() + raw[8 + n:])
    with pytest.raises(CheckpointError, match=r"c_attn.lora_A.weight: not a LoRA tensor of this decoder's"):
        read_adapter(d, "a", cfg)


def test_job_file_and_flag_declare_adapters(tmp_path):
    raw = {"model": {"checkpoint": "m.h5"}, "adapters": {"sql": "ad/sql", "ft:org/chat-1": "/abs/chat"}}
    job = parse_job(raw, tmp_path / "job.toml")
    assert job.adapters == (("sql", tmp_path / "ad/sql"), ("ft:org/chat-1", Path("/abs/chat")))
    assert job.model.base_names == {"m"}
    job2 = job.with_adapters(["sql=/other", "new=x"])
    assert [n for n, _ in job2.adapters] == ["sql", "ft:org/chat-1", "new"] and job2.adapters[0][1] == Path("/other")
    with pytest.raises(ConfigError, match=r"adapter name 'a b'; use 1-200 letters"):
        parse_job({**raw, "adapters": {"a b": "x"}}, tmp_path / "job.toml")
    with pytest.raises(ConfigError, match=r"\[adapters\] m: is the base model's name"):
        parse_job({**raw, "adapters": {"m": "x"}}, tmp_path / "job.toml")
    with pytest.raises(ConfigError, match=r"generate --adapter: got 'sql'; pass --adapter NAME=DIR"):
        job.with_adapters(["sql"])


def test_adapter_digest_changes_with_the_weights(tmp_path):
    d = copy_adapter(tmp_path)
    before = adapter_digest(d)
    assert before == adapter_digest(LORA / "llama_linear" / "r8")
    raw = bytearray((d / "adapter_model.safetensors").read_bytes())
    raw[-1] ^= 1
    (d / "adapter_model.safetensors").write_bytes(bytes(raw))
    assert adapter_digest(d) != before


def test_prompt_lines_name_adapters(tmp_path):
    from rlx_mpi.io.batch_io import read_requests

    p = tmp_path / "p.jsonl"
    p.write_text('{"id": "a", "tokens": [1, 2], "adapter": "sql"}\n{"id": "b", "tokens": [3]}\n')
    got = read_requests(p, vocab_size=10, max_positions=20, max_new_tokens=2, adapters=("sql",))
    assert [x.adapter for x in got] == ["sql", None] and got[0].digest != got[1].digest
    p.write_text('{"id": "a", "tokens": [1, 2], "adapter": "nope"}\n')
    with pytest.raises(InputError, match=r'p.jsonl:1 adapter: "nope" is not an adapter of this job; name one of'):
        read_requests(p, vocab_size=10, max_positions=20, max_new_tokens=2, adapters=("sql",))
    with pytest.raises(InputError, match=r"unknown key"):  # a job without adapters: the key is not ours
        p.write_text('{"id": "a", "tokens": [1, 2], "adapter": "sql"}\n')
        read_requests(p, vocab_size=10, max_positions=20, max_new_tokens=2)


def test_request_kv_salt_keeps_adapters_apart():
    from rlx_mpi.engine.block_pool import chain_keys
    from rlx_mpi.engine.records import Request

    base, a, b = Request(0, "x", (1,) * 40), Request(0, "x", (1,) * 40, adapter="a"), Request(0, "x", (1,) * 40, adapter="b")
    assert Request.from_wire(a.to_wire()).adapter == "a"
    keys = {r.adapter: chain_keys(r.tokens, 16, salt=r.kv_salt) for r in (base, a, b)}
    assert len({tuple(k) for k in keys.values()}) == 3


def test_openai_lines_name_their_adapter_in_model(tmp_path):
    pytest.importorskip("tokenizers")
    from test_batch_io import cmpl, read, word_tokenizer
    from rlx_mpi.io.tokenizer import load_tokenizer

    tok = load_tokenizer(word_tokenizer(tmp_path))
    lines = [cmpl("a", model="sql"), cmpl("b", model="m"), cmpl("c"), cmpl("d", model="gpt-x")]
    got = read(tmp_path, tok, *lines, adapters=("sql",), base_names=frozenset({"m"}))
    assert [p.adapter for p in got[:3]] == ["sql", None, None] and got[3].error is not None
    err = got[3].error  # that line's error object (the job exits EXIT_SOME_FAILED once the rest are done)
    assert err["param"] == "model" and err["code"] == "model_not_found"
    assert err["message"] == ('line 4: "model" "gpt-x" is neither the base model (m) nor one of this job\'s '
                              'adapters (sql)')
    assert all(p.error is None for p in read(tmp_path, tok, *lines))  # no adapters: "model" is not read


def test_plan_counts_the_adapters_as_the_stages_hold_them(tmp_path, converted):
    from conftest import run_cli
    from rlx_mpi.families.hf.peft import stacked_layer_bytes

    family, cfg, path = converted("llama_linear")
    stage = build(family, cfg, path, "llama_linear")
    held = max(sum(s.nbytes for s in layer.values()) for layer in stage.lora_layers)
    assert stacked_layer_bytes([(n, LORA / "llama_linear" / n) for n in NAMES], cfg) == held == stage.adapter_bytes // 2
    (tmp_path / "a.toml").write_text(f'[model]\ncheckpoint = "{path}"\n')
    (tmp_path / "b.toml").write_text(f'[model]\ncheckpoint = "{path}"\n[adapters]\n'
                                     + "".join(f'{n} = "{LORA / "llama_linear" / n}"\n' for n in NAMES))
    totals = []
    for job in ("a", "b"):
        proc = run_cli(["plan", tmp_path / f"{job}.toml", "--ranks", "1"])
        assert proc.returncode == 0, proc.stderr
        totals.append(float(proc.stdout.split(" MB estimated in total")[0].split()[-1]))
    assert abs((totals[1] - totals[0]) * 1e6 - 2 * held) < 0.01e6  # two layers' adapters (the table's 0.01 MB)


def test_a_stage_loads_only_its_own_layers_adapters(converted):
    family, cfg, path = converted("llama_linear")
    with H5ParamSource(path, family.expected_shapes(cfg)) as src:
        stage = family.build_stage(cfg, src, range(1, 2), False, True)
    stage.load_adapters([(n, LORA / "llama_linear" / n) for n in NAMES])
    assert len(stage.lora_layers) == 1
    whole = build(family, cfg, path, "llama_linear")
    for module, s in stage.lora_layers[0].items():
        assert np.array_equal(s.a, whole.lora_layers[1][module].a) and np.array_equal(s.b, whole.lora_layers[1][module].b)
    assert set(whole.lora_layers[0]) == set(MODULE_NAMES) and set(whole.lora_layers[1]) == set(MODULE_NAMES)
    part = whole.lora_layers[0]["q_proj"]  # "part" covers layer 1 only: rank 0 on layer 0
    assert part.ranks.tolist() == [8, 16, 0]


MODULE_NAMES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def test_an_adapter_of_a_local_base_model_of_another_family_is_refused(tmp_path, monkeypatch):
    from rlx_mpi.families.hf.peft import check_base_family

    monkeypatch.chdir(TESTS.parent)  # (the fixtures name their base model from the repository's root)
    qwen_adapter = LORA / "qwen2" / "r8"  # base_model_name_or_path: tests/fixtures/families/qwen2
    check_base_family(qwen_adapter, "a", ("qwen2",), "qwen2")
    with pytest.raises(ConfigError, match=r"base_model_name_or_path: 'tests/fixtures/families/qwen2' is a 'qwen2' "
                                          r"model; this job's is of family 'llama' \(llama\); use an adapter trained"):
        check_base_family(qwen_adapter, "a", ("llama",), "llama")
    d = copy_adapter(tmp_path, base_model_name_or_path="meta-llama/Llama-3.1-8B")  # a Hub name: nothing to check
    check_base_family(d, "a", ("qwen2",), "qwen2")
