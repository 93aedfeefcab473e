"""An OpenAI batch file (as vLLM's ``run_batch`` reads) through ``rlx-mpi generate`` under a real
mpiexec: chat and completions requests with their own settings, stop strings, n = 2, a
malformed line and a setting we cannot honour. Every output body validates as the ``openai``
package's ``ChatCompletion`` / ``Completion``; greedy rows and their log-probs equal
transformers' (the hf_tiny_llama fixtures, read back through the word-level tokenizer); sampled
rows are the same on 1 rank with batch 1 as on 2 ranks with batch 4; a resume completes a cut
file to the same lines and refuses a request whose settings changed."""

import json
from pathlib import Path

import numpy as np
import pytest

from conftest import run_cli, write_job
from rlx_mpi.io.batch_io import CHAT_URL, COMPLETIONS_URL, EXIT_SOME_FAILED
from rlx_mpi.families import convert_hf

pytestmark = pytest.mark.mpi
pytest.importorskip("tokenizers", reason="the 'text' extra (tokenizers) is not installed")
openai = pytest.importorskip("openai", reason="the test extra's openai package is not installed")
from openai.types import Completion  # noqa: E402
from openai.types.chat import ChatCompletion  # noqa: E402

from test_batch_io import word_tokenizer  # noqa: E402

FIXTURES = Path(__file__).parent / "fixtures"
REF = json.loads((FIXTURES / "hf_tiny_llama" / "generate.json").read_text())  # transformers' greedy tokens
LP = np.load(FIXTURES / "logprobs_generate_hf_tiny_llama.npz")  # and their log-probs


def words(ids) -> str:
    return " ".join(f"w{t}" if t else "<unk>" for t in ids)


def ids(text: str) -> list[int]:
    return [0 if w == "<unk>" else int(w[1:]) for w in text.split()]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """hf_tiny_llama converted, with a word-level tokenizer (token i is "w<i>") and a chat template."""
    d = tmp_path_factory.mktemp("batch")
    convert_hf(FIXTURES / "hf_tiny_llama", d / "m.h5")
    word_tokenizer(d, vocab_size=256)
    return d / "m.h5"


def request(cid, url, **body):
    return {"custom_id": cid, "method": "POST", "url": url, "body": {"model": "tiny-llama", **body}}


STOP_AT = REF["tokens"][0][2]  # the third greedy token of prompt 0: a stop string there ends the row
LINES = [
    request("greedy-ids", COMPLETIONS_URL, prompt=REF["prompts"][0], max_tokens=REF["max_new_tokens"]),
    request("greedy-text-lp", COMPLETIONS_URL, prompt=words(REF["prompts"][1]), max_tokens=REF["max_new_tokens"],
            logprobs=3),
    request("stop", COMPLETIONS_URL, prompt=REF["prompts"][0], max_tokens=REF["max_new_tokens"],
            stop=["w999", f"w{STOP_AT}"]),
    request("chat-n2", CHAT_URL, messages=[{"role": "user", "content": "w5 w6 w7"}], max_completion_tokens=5,
            temperature=1.0, seed=5, n=2),
    '{"custom_id": "broken", "method": "POST", "url": "/v1/chat/completions", "body": {"messages": [',
    request("chat-lp", CHAT_URL, messages=[{"role": "system", "content": "w9"}, {"role": "user", "content": "w8"}],
            max_tokens=4, temperature=0.8, top_p=0.9, logprobs=True, top_logprobs=2),
    request("too-many-logprobs", COMPLETIONS_URL, prompt="w1 w2", logprobs=50),
    request("short", COMPLETIONS_URL, prompt=[7, 8], max_tokens=2),
]


def write_lines(path, lines):
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return path


def generate(tmp_path, ckpt, ranks, prompts, out, *flags, name="job.toml", replicas=1, tp=1):
    job = write_job(tmp_path, name, model={"checkpoint": str(ckpt)}, run={"timeout_s": 30.0},
                    placement={"reserve_ram_gb": 0.0, "replicas": replicas, "tp": tp})
    return run_cli(["generate", job, "--prompts", prompts, "--out", out, *flags], ranks=ranks, timeout=120)


def lines_of(path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def without_created(lines):
    return [{**x, "response": {**x["response"], "body": {k: v for k, v in (x["response"]["body"] or {}).items()
                                                          if k != "created"}}} for x in lines]


def split_floats(value, floats):
    """``value`` with every float replaced by 0.0 and appended to ``floats`` (compared apart)."""
    if isinstance(value, float):
        floats.append(value)
        return 0.0
    if isinstance(value, dict):
        return {k: split_floats(v, floats) for k, v in value.items()}
    if isinstance(value, list):
        return [split_floats(v, floats) for v in value]
    return value


def assert_same_rows(a, b):
    """The same lines, tokens and texts; log-probs equal up to float32 rounding (a prompt's
    logits are summed in another order on another layout: its tokens are the same)."""
    fa, fb = [], []
    assert split_floats(without_created(a), fa) == split_floats(without_created(b), fb)
    np.testing.assert_allclose(fa, fb, rtol=0, atol=1e-5)


@pytest.fixture(scope="module")
def batch_run(ckpt, tmp_path_factory):
    d = tmp_path_factory.mktemp("run")
    prompts = write_lines(d / "requests.jsonl", LINES)
    out = d / "results.jsonl"
    proc = generate(d, ckpt, 2, prompts, out, "--batch", "4")
    return d, prompts, out, proc


def test_a_run_batch_file_on_two_ranks(batch_run):
    d, prompts, out, proc = batch_run
    assert proc.returncode == EXIT_SOME_FAILED, proc.stderr
    assert "Traceback" not in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert "2 of 8 requests" in last and f"exit code {EXIT_SOME_FAILED}" in last, proc.stderr
    got = lines_of(out)
    assert [x["custom_id"] for x in got] == [x["custom_id"] if isinstance(x, dict) else None for x in LINES]
    assert [x["id"] for x in got][4] == "rlx-line-5"
    for x in got:
        if x["error"] is not None:
            assert x["response"]["status_code"] == 400 and x["error"]["message"] == \
                x["response"]["body"]["error"]["message"]
            continue
        assert x["response"]["status_code"] == 200
        body = x["response"]["body"]
        model = ChatCompletion if x["custom_id"].startswith("chat") else Completion
        model.model_validate(body)
        assert body["model"] == "tiny-llama"
    by = {x["custom_id"]: x for x in got}
    assert "line 5: not valid JSON" in got[4]["error"]["message"]
    assert by["too-many-logprobs"]["error"]["message"] == "line 7: logprobs is 50; give an integer in [0, 20]"

    # greedy rows are transformers' tokens (prompt as ids, and as text)
    c0 = by["greedy-ids"]["response"]["body"]["choices"][0]
    assert ids(c0["text"]) == REF["tokens"][0] and c0["finish_reason"] == "length"
    c1 = by["greedy-text-lp"]["response"]["body"]["choices"][0]
    assert ids(c1["text"]) == REF["tokens"][1]
    # ... and their log-probs transformers' (float32 rounding), the top 3 alternatives its best 3
    lp = c1["logprobs"]
    np.testing.assert_allclose(lp["token_logprobs"], LP["chosen_lp"][1], atol=2e-5)
    assert lp["tokens"] == [words([t]) for t in REF["tokens"][1]]
    for k, top in enumerate(lp["top_logprobs"]):
        assert [ids(w)[0] for w in top] == list(LP["top_ids"][1, k, :3])
        np.testing.assert_allclose(list(top.values()), LP["top_lp"][1, k, :3], atol=2e-5)
    assert lp["text_offset"][1] == len(lp["tokens"][0])

    # a stop string ends the row there, and is not in the text
    s = by["stop"]["response"]["body"]
    assert s["choices"][0]["text"] == words(REF["tokens"][0][:2]) + " " and s["choices"][0]["finish_reason"] == "stop"
    assert s["usage"]["completion_tokens"] == 3 and s["usage"]["prompt_tokens"] == len(REF["prompts"][0])

    # n = 2: two samples of one prompt, each with its own draws, both within max tokens
    n2 = by["chat-n2"]["response"]["body"]
    assert [c["index"] for c in n2["choices"]] == [0, 1]
    assert all(len(ids(c["message"]["content"])) == 5 for c in n2["choices"])
    assert n2["choices"][0]["message"]["content"] != n2["choices"][1]["message"]["content"]
    assert n2["usage"]["completion_tokens"] == 10

    cl = by["chat-lp"]["response"]["body"]["choices"][0]
    assert len(cl["logprobs"]["content"]) == 4 and all(len(t["top_logprobs"]) == 2 for t in cl["logprobs"]["content"])
    assert [t["token"] for t in cl["logprobs"]["content"]] == cl["message"]["content"].split()
    assert by["short"]["response"]["body"]["usage"]["completion_tokens"] == 2


def test_sampled_rows_are_the_same_on_one_rank_with_batch_one_on_two_replicas_and_under_tp(batch_run, ckpt):
    """Whatever the batch; when a request's two samples run on two replicas (rank 0 joins them);
    and under tensor parallelism, where both ranks of stage 0 decide when a stop string ends a row."""
    d, prompts, out, _ = batch_run
    one, two, tp = d / "one.jsonl", d / "replicas.jsonl", d / "tp.jsonl"
    proc = generate(d, ckpt, 1, prompts, one, "--batch", "1", name="one.toml")
    assert proc.returncode == EXIT_SOME_FAILED, proc.stderr
    assert_same_rows(lines_of(one), lines_of(out))
    proc = generate(d, ckpt, 2, prompts, two, "--batch", "1", name="replicas.toml", replicas=2)
    assert proc.returncode == EXIT_SOME_FAILED, proc.stderr
    assert "replica" in proc.stdout, proc.stdout
    assert_same_rows(lines_of(two), lines_of(out))
    proc = generate(d, ckpt, 2, prompts, tp, "--batch", "3", name="tp.toml", tp=2)
    assert proc.returncode == EXIT_SOME_FAILED, proc.stderr
    assert_same_rows(lines_of(tp), lines_of(out))


def test_resume_completes_a_cut_file_and_refuses_changed_settings(batch_run, ckpt):
    d, prompts, out, _ = batch_run
    cut = d / "cut.jsonl"
    cut.write_text("".join(out.read_text().splitlines(keepends=True)[:3]))
    (d / "cut.jsonl.meta.json").write_bytes((d / "results.jsonl.meta.json").read_bytes())
    proc = generate(d, ckpt, 2, prompts, cut, name="cut.toml")
    assert proc.returncode == EXIT_SOME_FAILED, proc.stderr
    assert_same_rows(lines_of(cut), lines_of(out))

    changed = list(LINES)
    changed[2] = request("stop", COMPLETIONS_URL, prompt=REF["prompts"][0], max_tokens=REF["max_new_tokens"],
                         stop=["w998"])
    other = write_lines(d / "changed.jsonl", changed)
    before = out.read_bytes()
    proc = generate(d, ckpt, 2, other, out, name="changed.toml")
    assert proc.returncode == 2, proc.stderr
    errors = [x for x in proc.stderr.splitlines() if x.startswith("rlx-mpi: error:")]
    # (the journal's line says "other tokens": the digest now covers a request's settings too)
    assert len(errors) == 1 and "prompt 'stop' (prompt 3 " in errors[0] and "digest" in errors[0], proc.stderr
    assert out.read_bytes() == before


def test_a_file_of_failed_lines_and_its_rerun_exit_6(tmp_path, ckpt):
    """Nothing to compute: the error lines are written, and a rerun (all done) still says they failed."""
    prompts = write_lines(tmp_path / "bad.jsonl", [LINES[4], LINES[6]])
    out = tmp_path / "bad_out.jsonl"
    for run in range(2):
        proc = generate(tmp_path, ckpt, 2, prompts, out, name=f"bad{run}.toml")
        assert proc.returncode == EXIT_SOME_FAILED, proc.stderr
        assert "2 of 2 requests" in proc.stderr.strip().splitlines()[-1]
        got = lines_of(out)
        assert [x["custom_id"] for x in got] == [None, "too-many-logprobs"] and all(x["error"] for x in got)


def test_ignore_eos_and_our_prompt_lines_with_their_own_settings(tmp_path, ckpt):
    """--ignore-eos runs a row past its end-of-sequence id; our own prompt lines take
    max_tokens and stop per row too (the stop string cut from "text", as OpenAI does)."""
    eos = REF["tokens"][0][2]
    prompts = write_lines(tmp_path / "p.jsonl", [
        {"id": "a", "tokens": REF["prompts"][0]},
        {"id": "b", "text": words(REF["prompts"][1]), "stop": [f"w{REF['tokens'][1][1]}"]},
        {"id": "c", "tokens": REF["prompts"][0], "max_tokens": 2}])
    out, free = tmp_path / "eos.jsonl", tmp_path / "free.jsonl"
    n = str(REF["max_new_tokens"])
    proc = generate(tmp_path, ckpt, 2, prompts, out, "--eos-id", eos, "--max-new-tokens", n)
    assert proc.returncode == 0, proc.stderr
    a, b, c = lines_of(out)
    assert a["tokens"] == REF["tokens"][0][:3] and a["finish_reason"] == "stop"
    assert b["tokens"] == REF["tokens"][1][:2] and b["finish_reason"] == "stop"
    assert b["text"] == words(REF["tokens"][1][:1]) + " "
    assert c["tokens"] == REF["tokens"][0][:2] and c["finish_reason"] == "length"
    proc = generate(tmp_path, ckpt, 2, prompts, free, "--eos-id", eos, "--max-new-tokens", n, "--ignore-eos")
    assert proc.returncode == 0, proc.stderr
    assert lines_of(free)[0]["tokens"] == REF["tokens"][0] and lines_of(free)[0]["finish_reason"] == "length"
