"""OpenAI batch files without MPI: each request field read into a row's settings, the per-line
error path, the file-level refusals, the output lines validated by the ``openai`` package's own
response models, and the per-row pieces of the scheduler and the sampler."""

import json

import numpy as np
import pytest

pytest.importorskip("tokenizers", reason="the 'text' extra (tokenizers) is not installed")

from rlx_mpi.io.batch_io import (CHAT_URL, COMPLETIONS_URL, MAX_N, format_result, read_requests,  # noqa: E402
                              stop_text)
from rlx_mpi.errors import InputError  # noqa: E402
from rlx_mpi.io.identity import RunIdentity, digest_of, prompt_digest  # noqa: E402
from rlx_mpi.io.prompts import Prompt, read_prompts  # noqa: E402
from rlx_mpi.io.tokenizer import load_tokenizer  # noqa: E402
from rlx_mpi.engine.sampling import RowSettings, SamplingParams, prompt_key, sample, sample_id, sample_rows  # noqa: E402
from rlx_mpi.engine.records import Request  # noqa: E402
from rlx_mpi.engine.scheduler import Scheduler  # noqa: E402

LIMITS = dict(vocab_size=512, max_positions=64, max_new_tokens=8)
TEMPLATE = ("{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"
            "{% if add_generation_prompt %}w3{% endif %}")


def word_tokenizer(folder, vocab_size=512, template=TEMPLATE):
    """A word-level tokenizer (token i is the word "w<i>") and a chat template, beside
    ``folder/m.h5`` as `rlx-mpi convert` places them; the checkpoint path."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, **{f"w{i}": i for i in range(1, vocab_size)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(folder / "m.tokenizer.json"))
    (folder / "m.tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    return folder / "m.h5"


@pytest.fixture
def tok(tmp_path):
    return load_tokenizer(word_tokenizer(tmp_path))


def chat(cid, content="w7 w8", **body):
    return {"custom_id": cid, "method": "POST", "url": CHAT_URL,
            "body": {"model": "m", "messages": [{"role": "user", "content": content}], **body}}


def cmpl(cid, prompt="w10 w11", **body):
    return {"custom_id": cid, "method": "POST", "url": COMPLETIONS_URL, "body": {"model": "m", "prompt": prompt, **body}}


def write(path, *lines):
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return path


def read(tmp_path, tok, *lines, **limits):
    return read_requests(write(tmp_path / "b.jsonl", *lines), tokenizer=tok, **{**LIMITS, **limits})


# -- reading requests ---------------------------------------------------------------------------

def test_chat_and_completion_requests_become_prompts_with_their_settings(tmp_path, tok):
    ps = read(tmp_path, tok,
              chat("c", max_completion_tokens=5, temperature=0.7, top_p=0.9, seed=11, stop="w9", n=2, logprobs=True,
                   top_logprobs=3),
              cmpl("t", max_tokens=4, stop=["w1", "w2"], logprobs=2),
              cmpl("ids", prompt=[5, 6, 7]))
    c, t, ids = ps
    assert [p.index for p in ps] == [0, 1, 2] and [p.id for p in ps] == ["c", "t", "ids"]
    assert c.tokens == tuple(tok.chat([{"role": "user", "content": "w7 w8"}])[1]) and c.error is None
    assert c.settings == RowSettings(max_tokens=5, temperature=0.7, top_p=0.9, seed=11, stop=("w9",), n=2,
                                     logprobs=True, top_logprobs=3)
    assert c.request == {"custom_id": "c", "url": CHAT_URL, "model": "m", "line": 1, "max_new_tokens": 5}
    assert t.tokens == (10, 11) and t.text == "w10 w11"
    assert t.settings == RowSettings(max_tokens=4, stop=("w1", "w2"), logprobs=True, top_logprobs=2)
    assert ids.tokens == (5, 6, 7) and ids.settings == RowSettings()
    # no max_tokens: the job's default, cut to what fits the model (as OpenAI: as many as fit)
    assert ids.request["max_new_tokens"] == 8
    long = read(tmp_path, tok, cmpl("x", prompt=list(range(1, 60))))[0]
    assert long.request["max_new_tokens"] == 64 - 59


def test_max_tokens_aliases_seed_and_single_prompt_lists(tmp_path, tok):
    a, b, c = read(tmp_path, tok, chat("a", max_tokens=3), cmpl("b", prompt=["w4 w5"], seed=-1), cmpl("c", prompt=[[9]]))
    assert a.settings.max_tokens == 3
    assert b.tokens == (4, 5) and b.settings.seed == (1 << 64) - 1  # numpy seeds are >= 0: stably mapped
    assert c.tokens == (9,)
    parts = chat("p", content=[{"type": "text", "text": "w7"}, {"type": "text", "text": "w8"}])
    assert read(tmp_path, tok, parts)[0].tokens == read(tmp_path, tok, chat("p", content="w7\nw8"))[0].tokens
    # fields that ask for nothing at their default value are accepted
    (d,) = read(tmp_path, tok, chat("d", stream=False, frequency_penalty=0, presence_penalty=0.0, user="me"))
    assert d.error is None


@pytest.mark.parametrize("line, param, words", [
    (cmpl("a", logprobs=21), "logprobs", "[0, 20]"),
    (chat("a", logprobs=True, top_logprobs=21), "top_logprobs", "[0, 20]"),
    (chat("a", top_logprobs=2), "top_logprobs", "needs logprobs"),
    (chat("a", logprobs=3), "logprobs", "true or false"),
    (chat("a", n=MAX_N + 1), "n", f"[1, {MAX_N}]"),
    (chat("a", n=0), "n", "[1, "),
    (chat("a", temperature=2.5), "temperature", "[0, 2]"),
    (chat("a", top_p=0), "top_p", "(0, 1]"),
    (chat("a", seed=1.5), "seed", "integer"),
    (chat("a", max_tokens=0), "max_tokens", ">= 1"),
    (chat("a", max_tokens=2, max_completion_tokens=2), "max_completion_tokens", "give one"),
    (chat("a", stop=["w1", "w2", "w3", "w4", "w5"]), "stop", "up to 4"),
    (chat("a", stop=[""]), "stop", "non-empty"),
    (chat("a", stop=3), "stop", "a string or a list"),
    (chat("a", tools=[]), "tools", "unsupported field 'tools'"),
    (chat("a", stream=True), "stream", "not supported"),
    (chat("a", prompt="w1"), "prompt", "unsupported field"),
    (cmpl("a", messages=[]), "messages", "unsupported field"),
    ({**chat("a"), "url": "/v1/embeddings"}, "url", "/v1/embeddings"),
    ({**chat("a"), "method": "GET"}, "method", '"POST"'),
    ({**chat("a"), "extra": 1}, "extra", "unknown key"),
    ({**chat("a"), "body": "x"}, "body", "not an object"),
    (cmpl("a", prompt=["w1", "w2"]), "prompt", "one prompt per line"),
    (cmpl("a", prompt=[1, 99999]), "prompt", "outside the vocabulary"),
    (cmpl("a", prompt=[]), "prompt", "a string or a list of token ids"),
    (chat("a", content=[{"type": "image_url", "image_url": {"url": "x"}}]), "messages", "not only text parts"),
    ({"custom_id": "a", "method": "POST", "url": CHAT_URL, "body": {"model": "m"}}, "messages", "without"),
    (cmpl("a", max_tokens=10, prompt=list(range(1, 60))), "max_tokens", "64"),
])
def test_a_request_we_cannot_honour_is_a_line_error_and_the_others_run(tmp_path, tok, line, param, words):
    bad, good = read(tmp_path, tok, line, cmpl("ok"))
    assert good.error is None and good.tokens == (10, 11)
    assert bad.tokens == () and bad.error["param"] == param and bad.error["line"] == 1
    assert words in bad.error["message"] and bad.error["message"].startswith("line 1: ")
    assert bad.error["code"] == ("context_length_exceeded" if words == "64" else "invalid_request")
    out = format_result(bad, [], tok)
    assert out["custom_id"] == "a" and out["error"] == {"code": bad.error["code"], "message": bad.error["message"]}
    assert out["response"]["status_code"] == 400
    assert out["response"]["body"]["error"]["param"] == param


def test_lines_that_are_not_requests_get_an_error_line_named_by_their_line(tmp_path, tok):
    ps = read(tmp_path, tok, cmpl("ok"), '{"custom_id": "cut", "method": "POST", "url', "[1, 2]",
              {"method": "POST", "url": CHAT_URL, "body": {}})
    assert [p.id for p in ps] == ["ok", "rlx-line-2", "rlx-line-3", "rlx-line-4"]  # (the output line's "id")
    assert "not valid JSON" in ps[1].error["message"] and ps[1].request["custom_id"] is None
    assert "not a request" in ps[2].error["message"]
    assert ps[3].error["param"] == "custom_id"
    assert format_result(ps[2], [], tok)["custom_id"] is None


@pytest.mark.parametrize("lines, where, words", [
    ([cmpl("a"), {"id": "b", "tokens": [1]}], "b.jsonl:2", "line 1 is an OpenAI batch request"),
    ([{"id": "b", "tokens": [1]}, "", cmpl("a")], "b.jsonl:3", "line 1 is an rlx-mpi prompt"),
    ([cmpl("a"), chat("b"), cmpl("a")], "b.jsonl:3", "custom_id 'a' is already used on line 1"),
    ([cmpl("rlx-line-2"), "not json"], "b.jsonl:2", "the custom_id of line 1"),
])
def test_file_level_refusals_name_the_line(tmp_path, tok, lines, where, words):
    with pytest.raises(InputError) as e:
        read(tmp_path, tok, *lines)
    assert e.value.where.endswith(where) and words in e.value.what, e.value.line()


def test_a_batch_file_needs_the_tokenizer_and_our_format_reads_as_before(tmp_path, tok):
    with pytest.raises(InputError, match="no tokenizer"):
        read(tmp_path, None, cmpl("a"))
    path = write(tmp_path / "ours.jsonl", {"id": "x", "tokens": [1, 2]}, {"id": "y", "text": "w3 w4"})
    assert read_requests(path, tokenizer=tok, **LIMITS) == read_prompts(path, tokenizer=tok, **LIMITS)


def test_our_prompt_lines_take_settings_of_their_own(tmp_path, tok):
    path = write(tmp_path / "ours.jsonl", {"id": "a", "tokens": [1], "max_tokens": 3, "temperature": 0.5, "seed": 2},
                 {"id": "b", "text": "w1", "stop": "w2", "top_p": 0.5}, {"id": "c", "tokens": [1]})
    a, b, c = read_requests(path, tokenizer=tok, **LIMITS)
    assert a.settings == RowSettings(max_tokens=3, temperature=0.5, seed=2) and a.request is None
    assert b.settings == RowSettings(stop=("w2",), top_p=0.5) and c.settings is None
    assert digest_of(a) != prompt_digest(a.tokens) and digest_of(c) == prompt_digest(c.tokens)
    # a long max_tokens of its own must fit the model, and bad values are the file's error (our format is strict)
    for line, where, words in [({"id": "a", "tokens": [1], "max_tokens": 64}, "ours.jsonl:1", 'its "max_tokens"'),
                               ({"id": "a", "tokens": [1], "temperature": -1}, "ours.jsonl:1", "temperature is -1"),
                               ({"id": "a", "tokens": [1], "n": 2}, "ours.jsonl:1", "unknown key 'n'")]:
        with pytest.raises(InputError) as e:
            read_requests(write(tmp_path / "ours.jsonl", line), tokenizer=tok, **LIMITS)
        assert e.value.where.endswith(where) and words in e.value.line(), e.value.line()
    with pytest.raises(InputError, match="no tokenizer"):
        read_requests(write(tmp_path / "ours.jsonl", {"id": "a", "tokens": [1], "stop": "w1"}), **LIMITS)


def test_digests_cover_a_rows_settings_and_stay_as_before_without(tmp_path, tok):
    plain = Prompt(0, "a", (1, 2), None)
    assert digest_of(plain) == prompt_digest((1, 2))  # files written before resume unchanged
    a, b, c, d, e = read(tmp_path, tok, cmpl("a"), cmpl("b", temperature=0.5), cmpl("c", temperature=0.6),
                         cmpl("d", stop="w1"), cmpl("e", n=0))
    assert len({digest_of(p) for p in (a, b, c, d, e)}) == 5
    assert digest_of(a) == prompt_digest(a.tokens)  # no settings of its own
    assert digest_of(e) != prompt_digest(())  # a failed line's error is in its digest


def test_the_jobs_seed_is_in_the_identity_once_a_row_samples(monkeypatch):
    import rlx_mpi.io.identity as identity

    monkeypatch.setattr(identity, "model_identity", lambda checkpoint: {"family": "llama"})
    greedy = SamplingParams(0.0, 0, 1.0, 7)
    assert "seed" not in RunIdentity.for_generate("m.h5", greedy, 8).settings
    assert RunIdentity.for_generate("m.h5", greedy, 8, sampled=True).settings["seed"] == 7


# -- results out ---------------------------------------------------------------------------------

def rows(*token_lists, finish="length", lp=False):
    out = []
    for toks in token_lists:
        r = {"tokens": list(toks), "finish_reason": finish}
        if lp:
            r["logprobs"] = [{"id": t, "logprob": -1.5, "top": [[t, -1.5], [t + 1, -2.0], [t + 2, None]]} for t in toks]
        out.append(r)
    return out


def test_output_bodies_validate_as_the_openai_packages_models(tmp_path, tok):
    openai = pytest.importorskip("openai", reason="the test extra's openai package is not installed")
    from openai.types import Completion
    from openai.types.chat import ChatCompletion

    c, t = read(tmp_path, tok, chat("c", n=2, logprobs=True, top_logprobs=2), cmpl("t", logprobs=1))
    out = format_result(c, rows([5, 6], [7], lp=True), tok, created=1)
    assert out["custom_id"] == "c" and out["error"] is None and out["response"]["status_code"] == 200
    body = ChatCompletion.model_validate(out["response"]["body"])
    assert [ch.index for ch in body.choices] == [0, 1] and body.choices[1].message.content == "w7"
    assert body.usage.prompt_tokens == len(c.tokens) and body.usage.completion_tokens == 3
    lp = body.choices[0].logprobs.content
    assert [x.token for x in lp] == ["w5", "w6"] and [x.token for x in lp[0].top_logprobs] == ["w5", "w6"]
    assert lp[0].bytes == list(b"w5")
    body = Completion.model_validate(format_result(t, rows([5, 6], lp=True), tok)["response"]["body"])
    assert body.object == "text_completion" and body.choices[0].text == "w5 w6"
    assert body.choices[0].logprobs.tokens == ["w5", "w6"] and body.choices[0].logprobs.top_logprobs[1] == {"w6": -1.5}
    assert body.choices[0].logprobs.text_offset == [0, 2]
    assert openai.__version__


def test_stop_strings_are_cut_from_the_text_as_openai_does(tmp_path, tok):
    assert stop_text("w5 w61 w7", ("w6", "w7")) == "w5 "
    assert stop_text("w5 w7", ("w6",)) == "w5 w7"
    (p,) = read(tmp_path, tok, cmpl("t", stop=["w6"]))
    body = format_result(p, rows([5, 6], finish="stop"), tok)["response"]["body"]
    assert body["choices"][0] == {"index": 0, "text": "w5 ", "logprobs": None, "finish_reason": "stop"}
    body = format_result(p, rows([5, 7]), tok)["response"]["body"]  # "length": nothing cut
    assert body["choices"][0]["text"] == "w5 w7" and body["choices"][0]["finish_reason"] == "length"


# -- per-row scheduling and sampling ---------------------------------------------------------------

def run_scheduler(items, tokens_of, **kw):
    """Drive a one-group Scheduler to the end, each row's next token from ``tokens_of(seq)``."""
    s = Scheduler(items, groups=1, batch=4, max_new_tokens=5, eos_ids=frozenset({99}), recompute=False, **kw)
    done = {}
    while not s.idle:
        step = s.next_step(0)
        for r in s.complete(step, np.array([tokens_of(r) for r in step.rows], np.int64)):
            done[(r.index, r.sample)] = r
    return done


def test_rows_end_at_their_own_max_tokens_and_stop_strings(tok):
    items = [Request(0, "a", (1, 2), max_new_tokens=2), Request(1, "b", (3,)),
             Request(2, "c", (4,), stop=("w12",), max_new_tokens=9), Request(3, "d", (5,), stop=("w13 w14",))]
    done = run_scheduler(items, lambda r: 10 + len(r.new), decode=tok.decode)
    assert done[(0, 0)].new == [10, 11] and done[(0, 0)].finish_reason == "length"
    assert done[(1, 0)].new == [10, 11, 12, 13, 14] and done[(1, 0)].finish_reason == "length"  # the job's 5
    assert done[(2, 0)].new == [10, 11, 12] and done[(2, 0)].finish_reason == "stop"
    assert done[(3, 0)].new == [10, 11, 12, 13, 14] and done[(3, 0)].finish_reason == "stop"  # across tokens


def test_samples_of_one_request_draw_with_their_own_keys():
    items = [Request(0, "a", (1,), sample=j, draw_id=sample_id("a", j)) for j in range(3)]
    keys = {}
    run_scheduler(items, lambda r: keys.setdefault(r.sample, r.key) and 1)
    assert keys[0] == prompt_key("a") and len(set(keys.values())) == 3


def test_sampled_rows_are_identical_whatever_the_batch():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(5, 64)).astype(np.float32)
    keys, steps = np.arange(100, 105), np.array([0, 3, 1, 7, 2])
    job = SamplingParams(0.0, seed=1)
    own = {101: SamplingParams(0.8, 0, 0.9, 5), 103: SamplingParams(1.3, 0, 1.0, 2), 104: SamplingParams(0.5, 0, 1.0, 1)}
    batch = sample_rows(logits, keys, steps, job, own)
    for b in range(5):  # each row alone, and in another order, gives its token
        assert sample_rows(logits[b:b + 1], keys[b:b + 1], steps[b:b + 1], job, own)[0] == batch[b]
    order = [4, 2, 0, 3, 1]
    assert (sample_rows(logits[order], keys[order], steps[order], job, own) == batch[order]).all()
    assert batch[0] == logits[0].argmax() and batch[2] == logits[2].argmax()  # greedy rows: argmax
    for b in (1, 3, 4):  # a sampled row draws as `sample` with its own settings would alone
        assert batch[b] == sample(logits[b:b + 1], keys[b:b + 1], steps[b:b + 1], own[int(keys[b])])[0]
    reseeded = {**own, 101: SamplingParams(0.8, 0, 0.9, 6)}
    draws = {int(sample_rows(logits[1:2], keys[1:2], np.array([s]), job, reseeded)[0]) for s in range(20)}
    assert len(draws) > 1  # (not stuck on one token: the draws do depend on the key and step)


def test_a_rows_settings_override_the_jobs():
    job = SamplingParams(0.0, 40, 0.95, 7)
    assert RowSettings().params(job) == job
    assert RowSettings(temperature=0.5, seed=3).params(job) == SamplingParams(0.5, 40, 0.95, 3)
    assert RowSettings(top_p=0.5).to_json() == {"top_p": 0.5} and RowSettings().to_json() == {}


def test_stop_strings_across_byte_level_bpe_tokens(tmp_path):
    """A real byte-level BPE tokenizer (Qwen2's fixture): a stop string spanning several tokens,
    with a space in it, ends the row at the token that completes it; the text is cut before it
    and log-probs name the tokens as text (a leading space included)."""
    import shutil
    from pathlib import Path

    src = Path(__file__).parent / "fixtures" / "families" / "qwen2"
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(src / name, tmp_path / f"m.{name}")
    qwen = load_tokenizer(tmp_path / "m.h5")
    reply = qwen.encode("Hello world, this is a test.", add_special_tokens=False)
    (p,) = read(tmp_path, qwen, cmpl("q", prompt="Say", stop=[", this is"], logprobs=0), vocab_size=qwen.vocab_size)
    row = Request(0, "q", tuple(p.tokens), stop=tuple(p.settings.stop), max_new_tokens=len(reply))
    done = run_scheduler([row], lambda r: reply[len(r.new)], decode=qwen.decode)
    row = done[(0, 0)]
    assert row.finish_reason == "stop" and qwen.decode(row.new).endswith(", this is")
    assert ", this is" not in qwen.decode(row.new[:-1])  # the first token that completed it
    entries = [{"id": t, "logprob": -1.0, "top": []} for t in row.new]
    body = format_result(p, [{"tokens": row.new, "finish_reason": "stop", "logprobs": entries}], qwen)["response"]["body"]
    assert body["choices"][0]["text"] == "Hello world"
    assert "".join(body["choices"][0]["logprobs"]["tokens"]) == qwen.decode(row.new)


def test_the_example_file_of_the_docs_reads_without_errors(tmp_path):
    """jobs/openai_batch.jsonl (docs/batch-files.md's worked example), with a real chat template."""
    import shutil
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    src = root / "tests" / "fixtures" / "families" / "qwen2"
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(src / name, tmp_path / f"m.{name}")
    qwen = load_tokenizer(tmp_path / "m.h5")
    ps = read_requests(root / "jobs" / "openai_batch.jsonl", tokenizer=qwen, vocab_size=qwen.vocab_size,
                       max_positions=512, max_new_tokens=16)
    assert [p.id for p in ps] == ["capital", "haiku", "list"] and all(p.error is None for p in ps)
    assert ps[1].settings.n == 2 and ps[2].settings.stop == ("\n4.", "\n\n") and ps[2].settings.top_logprobs == 2
