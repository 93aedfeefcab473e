"""``rlx-mpi generate`` with LoRA adapters under a real mpiexec (issue 44): rows of the base model
and three PEFT adapters in one job, on 1 rank, 2 pipeline stages and TP 2, against transformers
+ peft (tests/fixtures/lora): greedy tokens equal, each new token's top log-probs within 1e-4 of
PEFT's log-softmax (teacher-forced prompts of 20 and 24 tokens, so that the prefix cache has
blocks to reuse, and must not reuse them across adapters); a mixed job gives each row exactly
what a job with only that row's adapter gives, and the same bits on 1 rank, 2 stages and 2
replicas; a resume with a changed adapter file is refused; an OpenAI line naming an unknown model is that
line's error (exit 6), a missing adapter directory one line (exit 2)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from conftest import TESTS, run_cli, write_job
from helpers import rows_of
from rlx_mpi.families import convert_hf
from rlx_mpi.families.hf.peft import adapter_digest

pytestmark = pytest.mark.mpi
LORA = TESTS / "fixtures" / "lora"
FAMILIES = TESTS / "fixtures" / "families"
NAMES = ["r8", "r16rs", "part"]
K = 5  # top log-probs compared


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max()
    return x - m - np.log(np.exp(x - m).sum())


def lines_of(case: str, adapters=(None, *NAMES)) -> list[dict]:
    """Per adapter: the greedy prompt (12 new tokens) and two teacher-forced prompts (1 new token)."""
    ref = np.load(LORA / case / "reference.npz")
    out = []
    for a in adapters:
        key = a or "base"
        out.append({"id": f"{key}-greedy", "tokens": ref["prompt_ids"][0].tolist(), "max_tokens": 12})
        for t in (20, 24):
            out.append({"id": f"{key}-tf{t}", "tokens": ref["input_ids"][1, :t].tolist(), "max_tokens": 1})
        if a:
            for line in out[-3:]:
                line["adapter"] = a
    return out


def check_against_peft(case: str, rows: list[dict]) -> None:
    ref = np.load(LORA / case / "reference.npz")
    by_id = {r["id"]: r for r in rows}
    for key in ("base", *NAMES):
        assert by_id[f"{key}-greedy"]["tokens"] == ref[f"greedy_{key}"].tolist(), (case, key)
        for t in (20, 24):
            want = log_softmax(ref[f"logits_{key}"][1, t - 1])
            got = by_id[f"{key}-tf{t}"]["logprobs"][0]["top"]
            assert [i for i, _ in got] == np.argsort(-want)[:K].tolist(), (case, key, t)
            assert max(abs(lp - want[i]) for i, lp in got) <= 1e-4, (case, key, t)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    out = {}

    def get(case):
        if case not in out:
            out[case] = tmp_path_factory.mktemp(case) / f"{case}.h5"
            convert_hf(FAMILIES / case, out[case])
        return out[case]
    return get


def generate(tmp_path, ckpt, ranks, lines, case, *, tp=1, adapters=NAMES, batch=3, flags=(), name="a", placement=None):
    prompts = tmp_path / f"{name}.jsonl"
    prompts.write_text("".join(json.dumps(x) + "\n" for x in lines))
    job = write_job(tmp_path, f"{name}.toml", model={"checkpoint": str(ckpt)}, run={"timeout_s": 60.0},
                    placement={"reserve_ram_gb": 0.0, "tp": tp, **(placement or {})}, generate={"batch": batch},
                    adapters={n: str(LORA / case / n) for n in adapters})
    out = tmp_path / f"{name}.out.jsonl"
    proc = run_cli(["generate", job, "--prompts", prompts, "--out", out, "--logprobs", str(K), *flags],
                   ranks=ranks, timeout=180)
    return proc, out


@pytest.mark.parametrize("case, ranks, tp", [("llama_linear", 1, 1), ("llama_linear", 2, 1), ("qwen2", 2, 2)])
def test_mixed_adapters_match_peft_across_layouts(tmp_path, ckpts, case, ranks, tp):
    proc, out = generate(tmp_path, ckpts(case), ranks, lines_of(case), case, tp=tp)
    assert proc.returncode == 0, proc.stderr
    check_against_peft(case, rows_of(out))
    reused = proc.stdout.split("prefix cache: ")[1].split(" of ")[0]
    # the 8 teacher-forced prompts begin with the same 16 tokens (one block): shared only within an adapter
    # (the salt), so at most one block per adapter is reused; unsalted keys would reuse up to 7
    assert 0 < int(reused) <= 4 * 16, proc.stdout


def test_each_row_as_in_a_job_of_its_adapter_alone(tmp_path, ckpts):
    """2 stages: the mixed job's rows against a base-only job (no [adapters]) and a job declaring
    only r16rs: the same tokens and log-probs, bit for bit."""
    case = "llama_linear"
    ckpt = ckpts(case)
    proc, out = generate(tmp_path, ckpt, 2, lines_of(case), case, name="mixed")
    assert proc.returncode == 0, proc.stderr
    mixed = {r["id"]: r for r in rows_of(out)}
    for adapters, names in (((None,), ()), (("r16rs",), ("r16rs",))):
        proc, out = generate(tmp_path, ckpt, 2, lines_of(case, adapters), case, adapters=names,
                             name=f"only{len(names)}")
        assert proc.returncode == 0, proc.stderr
        for r in rows_of(out):
            assert (r["tokens"], r["logprobs"]) == (mixed[r["id"]]["tokens"], mixed[r["id"]]["logprobs"]), r["id"]


def test_unknown_model_is_that_lines_error_and_a_missing_adapter_one_line(tmp_path, ckpts):
    pytest.importorskip("tokenizers")
    case = "qwen2"
    ckpt = ckpts(case)
    body = {"prompt": "hello world", "max_tokens": 2}
    lines = [{"custom_id": c, "method": "POST", "url": "/v1/completions", "body": {**body, **({"model": m} if m else {})}}
             for c, m in (("a", "r8"), ("b", None), ("c", "nope"), ("d", "qwen2"))]
    proc, out = generate(tmp_path, ckpt, 1, lines, case, adapters=["r8"], name="openai")
    assert proc.returncode == 6, proc.stderr
    rows = {r["custom_id"]: r for r in rows_of(out)}
    assert rows["c"]["error"]["code"] == "model_not_found" and rows["c"]["response"]["status_code"] == 400
    assert all(rows[c]["error"] is None for c in "abd")
    assert rows["a"]["response"]["body"]["model"] == "r8"
    proc, _ = generate(tmp_path, ckpt, 1, lines[:1], case, adapters=["r8"], name="missing",
                       flags=("--adapter", f"gone={tmp_path / 'gone'}"))
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == (f"rlx-mpi: error: adapter 'gone': {tmp_path / 'gone'} is not a "
                                                    "directory; pass a PEFT adapter directory (holding "
                                                    "adapter_config.json and adapter_model.safetensors)")


def test_the_same_bits_on_one_rank_two_stages_and_two_replicas(tmp_path, ckpts):
    case = "llama_linear"
    ckpt = ckpts(case)
    got = []
    for ranks, placement in ((1, {}), (2, {}), (2, {"replicas": 2})):
        name = f"r{ranks}{'rep' if placement else ''}"
        proc, out = generate(tmp_path, ckpt, ranks, lines_of(case), case, name=name, placement=placement)
        assert proc.returncode == 0, proc.stderr
        assert ("2 replicas" in proc.stdout + proc.stderr) == bool(placement), proc.stderr
        got.append({r["id"]: (r["tokens"], r["logprobs"]) for r in rows_of(out)})
    assert got[0] == got[1] == got[2]


def test_a_resume_refuses_a_changed_adapter(tmp_path, ckpts):
    import shutil

    case = "llama_linear"
    ckpt = ckpts(case)
    ad = tmp_path / "ad"
    shutil.copytree(LORA / case / "r8", ad / "r8")
    lines = lines_of(case, (None, "r8"))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps(x) + "\n" for x in lines[:2]))
    job = write_job(tmp_path, "j.toml", model={"checkpoint": str(ckpt)}, run={"timeout_s": 60.0},
                    placement={"reserve_ram_gb": 0.0}, adapters={"r8": str(ad / "r8")})
    out = tmp_path / "o.jsonl"
    assert run_cli(["generate", job, "--prompts", prompts, "--out", out], ranks=1, timeout=120).returncode == 0
    prompts.write_text("".join(json.dumps(x) + "\n" for x in lines))  # more lines: a resume has work to do
    raw = bytearray((ad / "r8" / "adapter_model.safetensors").read_bytes())
    raw[-1] ^= 1
    (ad / "r8" / "adapter_model.safetensors").write_bytes(bytes(raw))
    proc = run_cli(["generate", job, "--prompts", prompts, "--out", out], ranks=1, timeout=120)
    assert proc.returncode == 2, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert f"its 2 rows were made with adapters {{'r8': '{adapter_digest(LORA / case / 'r8', 'r8')}'}}" in last, last


@pytest.mark.parametrize("change, needle", [
    ({"r": 4}, "model.layers.0.mlp.down_proj: lora_A [8, 128] and lora_B [64, 8] do not fit the base model's down_proj"),
    ({"target_modules": ["q_proj", "c_attn"]}, "target_modules: unknown target module 'c_attn'"),
    ({"use_dora": True}, "use_dora: True is not supported"),
    (None, "adapter_config.json): not valid JSON"),
])
def test_a_bad_adapter_is_one_line_and_exit_2_on_every_rank(tmp_path, ckpts, change, needle):
    import shutil

    case = "llama_linear"
    d = tmp_path / "bad"
    shutil.copytree(LORA / case / "r8", d)
    conf = d / "adapter_config.json"
    conf.write_text("{not json" if change is None else json.dumps({**json.loads(conf.read_text()), **change}))
    proc, _ = generate(tmp_path, ckpts(case), 2, lines_of(case, (None,)), case, adapters=[],
                       flags=("--adapter", f"bad={d}"))
    assert proc.returncode == 2, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("rlx-mpi: error: adapter 'bad' (") and needle in last, proc.stderr
    assert "Traceback" not in proc.stderr
