"""Structured output (`engine.constraints`, `kernels.bitmask`): a row's JSON schema, regex, choice or
grammar as a token mask before its draw, with llguidance.

Without MPI: the mask kernel against numpy's bit unpacking; the request keys (OpenAI's
``response_format``, vLLM's ``structured_outputs``) and their one-line errors; the grammars'
check; which rows of a step keep their token (`StepHeader.final`); a `RowTable` that masks and
advances matchers over random logits, so that every row's text matches its constraint.

Under mpiexec, on a random tiny Llama with a byte-level tokenizer (every byte a token, so any
text is reachable): a prompt file mixing four constraints and free rows, greedy and sampled, on 1
rank, 2 stages, TP 2 and 2 replicas: every constrained row ends with "stop" and matches (checked
with ``jsonschema``, ``re.fullmatch``, the choice list), and every layout gives the same tokens.
An OpenAI batch file with response_format and structured_outputs lines, a schema the engine
refuses and a line giving both: the refused lines are error objects (exit 6), the others
validate as ``openai``'s Completion, and the reported log-probs are the constrained ones.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

llg = pytest.importorskip("llguidance", reason="the 'structured' extra (llguidance) is not installed")
jsonschema = pytest.importorskip("jsonschema", reason="the test extra's jsonschema is not installed")
pytest.importorskip("tokenizers", reason="the 'text' extra (tokenizers) is not installed")

from conftest import run_cli, write_job  # noqa: E402
from helpers import rows_of  # noqa: E402
from rlx_mpi.engine.constraints import Constraint, ConstraintError, GrammarMasks, Grammars, from_request  # noqa: E402
from rlx_mpi.engine.records import RowState, RowTable, StepHeader  # noqa: E402
from rlx_mpi.engine.sampling import SamplingParams  # noqa: E402
from rlx_mpi.kernels.bitmask import apply_bitmask  # noqa: E402

EOS = 256  # the byte tokenizer's end token: ids 0..255 are the bytes themselves

PERSON = {"type": "object", "properties": {"name": {"enum": ["ada", "bob"]}, "ok": {"type": "boolean"},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["name", "ok", "n"], "additionalProperties": False}
PAIRS = {"type": "array", "items": {"type": "object", "properties": {"k": {"enum": ["a", "b"]}},
                                    "required": ["k"], "additionalProperties": False},
         "minItems": 1, "maxItems": 2}
KINDS = [("json", PERSON), ("json", PAIRS), ("regex", "[0-9]{3}-[a-c]"), ("choice", ["yes", "no", "maybe"])]


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map (what a ByteLevel BPE's vocabulary is written in)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def byte_tokenizer(path: Path) -> Path:
    """A tokenizer.json whose token i < 256 is byte i and 256 is <|end|>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {c: b for b, c in _bytes_to_unicode().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|end|>"])
    assert tok.token_to_id("<|end|>") == EOS
    tok.save(str(path))
    return path


@pytest.fixture(scope="module")
def grammars(tmp_path_factory) -> Grammars:
    path = byte_tokenizer(tmp_path_factory.mktemp("tok") / "tokenizer.json")
    return Grammars(path.read_text(), 300, [EOS])  # (a model vocabulary padded past the tokenizer's)


def matches(c: Constraint, text: str) -> bool:
    if c.kind in ("json", "json_object"):
        try:
            value = json.loads(text)
        except ValueError:
            return False
        if c.kind == "json_object":
            return isinstance(value, dict)
        try:
            jsonschema.validate(value, c.value)
        except jsonschema.ValidationError:
            return False
        return True
    if c.kind == "regex":
        return re.fullmatch(c.value, text) is not None
    return text in c.value


# -- the mask kernel -------------------------------------------------------------------------------


@pytest.mark.parametrize("V, words", [(100, 4), (100, 2), (64, 2), (33, 2)])
def test_apply_bitmask_equals_numpy(V, words):
    rng = np.random.default_rng(V + words)
    logits = rng.standard_normal((5, V)).astype(np.float32)
    rows = np.array([4, 0, 2])
    mask = rng.integers(-(1 << 31), 1 << 31, (3, words), dtype=np.int64).astype(np.int32)
    mask[1, 0] = -1  # a word of all 32 allowed
    mask[2, -1] = 0  # and one of none
    want = logits.copy()
    bits = np.unpackbits(mask.view(np.uint8), axis=1, bitorder="little").astype(bool)  # (3, 32 words)
    for i, r in enumerate(rows):
        allowed = np.zeros(V, bool)
        allowed[:min(V, 32 * words)] = bits[i, :min(V, 32 * words)]
        want[r, ~allowed] = -np.inf
    got = logits.copy()
    apply_bitmask(got, rows, mask)
    assert np.array_equal(got, want)  # rows 1 and 3 untouched, bit for bit


def test_apply_bitmask_refuses_what_it_cannot_take():
    logits = np.zeros((2, 40), np.float32)
    mask = np.full((1, 2), -1, np.int32)
    with pytest.raises(TypeError, match="float32"):
        apply_bitmask(logits.astype(np.float64), [0], mask)
    with pytest.raises(TypeError, match="int32"):
        apply_bitmask(logits, [0], mask.astype(np.int64))
    with pytest.raises(ValueError, match="rows must be in"):
        apply_bitmask(logits, [2], mask)
    with pytest.raises(ValueError, match="2 rows for 1 masks"):
        apply_bitmask(logits, [0, 1], mask)


# -- the request keys ------------------------------------------------------------------------------


def test_request_keys_become_one_constraint():
    schema = {"type": "object"}
    rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}}
    assert from_request({"response_format": rf}) == Constraint("json", schema)
    assert from_request({"response_format": {"type": "json_object"}}) == Constraint("json_object", True)
    assert from_request({"response_format": {"type": "text"}}) is None
    assert from_request({}) is None
    assert from_request({"structured_outputs": {"json": json.dumps(schema)}}) == Constraint("json", schema)
    assert from_request({"structured_outputs": {"regex": "a+"}}) == Constraint("regex", "a+")
    assert from_request({"structured_outputs": {"choice": ["a", "b"]}}) == Constraint("choice", ["a", "b"])
    assert from_request({"structured_outputs": {"grammar": 'root ::= "a"'}}).kind == "grammar"
    assert from_request({"structured_outputs": {"json_object": True}}) == Constraint("json_object", True)
    # one schema text is one grammar; key order is kept (the order an answer writes properties in)
    a = Constraint("json", {"type": "object", "required": []})
    assert a.key == Constraint("json", json.loads('{"type": "object", "required": []}')).key
    assert a.key != Constraint("json", json.loads('{"required": [], "type": "object"}')).key
    assert Constraint.from_json(a.to_json()) == a


@pytest.mark.parametrize("body, says", [
    ({"response_format": "json"}, "response_format is a string"),
    ({"response_format": {"type": "xml"}}, 'type "xml" is not one of'),
    ({"response_format": {"type": "json_schema"}}, 'needs "json_schema"'),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, 'has no "schema"'),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}, "extra": 1}}}, "unknown key 'extra'"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "give one"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "gives 2 of"),
    ({"structured_outputs": {}}, "gives 0 of"),
    ({"structured_outputs": {"choice": []}}, "non-empty list"),
    ({"structured_outputs": {"regex": ""}}, "non-empty string"),
    ({"structured_outputs": {"json": "{not json"}}, "not JSON"),
    ({"structured_outputs": {"json": [1]}}, "give a JSON schema object"),
    ({"structured_outputs": {"structural_tag": "x"}}, "unsupported key 'structural_tag'"),
    ({"structured_outputs": {"json_object": False}}, "give true"),
])
def test_bad_request_keys_are_named(body, says):
    with pytest.raises(ConstraintError, match=re.escape(says)) as e:
        from_request(body)
    assert e.value.param in ("response_format", "structured_outputs")


def test_grammars_say_why_a_constraint_cannot_run(grammars):
    for c in (Constraint("json", PERSON), Constraint("regex", "[a-z]+"), Constraint("choice", ["a"]),
              Constraint("grammar", 'root ::= "x" [0-9]+'), Constraint("json_object", True)):
        assert grammars.check(c) is None, c
    assert "strin" in grammars.check(Constraint("json", {"type": "strin"}))
    assert "uniqueItems" in grammars.check(Constraint("json", {"type": "array", "uniqueItems": True}))  # unsupported
    assert "regex" in grammars.check(Constraint("regex", "[a-z"))
    assert grammars.check(Constraint("grammar", "root ::= (")) is not None
    n = len(grammars)
    grammars.check(Constraint("json", json.loads(json.dumps(PERSON))))  # compiled once per distinct constraint
    assert len(grammars) == n


def test_missing_llguidance_is_one_line(monkeypatch):
    import sys

    from rlx_mpi.engine.constraints import require_llguidance
    from rlx_mpi.errors import InputError

    monkeypatch.setitem(sys.modules, "llguidance", None)
    with pytest.raises(InputError, match=r"pip install 'rlx_mpi\[structured\]'") as e:
        require_llguidance("p.jsonl:3")
    assert "p.jsonl:3" in str(e.value) and "\n" not in str(e.value)


# -- the rows of a step ----------------------------------------------------------------------------


def test_header_final_leaves_out_chunks_short_of_their_end():
    # MIXED: 2 decode rows, then 3 chunk rows at positions 8..15 of prompts of 12, 16 and 20
    h = StepHeader(StepHeader.make(4, 0, 8, [0, 1, 2, 3, 4], [30, 31, 12, 16, 20], [1, 2, 3, 4, 5], [3, 3, 0, 0, 0],
                                   64, start=8, n_decode=2))
    assert h.final.tolist() == [True, True, True, True, False]
    d = StepHeader(StepHeader.make(2, 0, 1, [0, 1], [5, 9], [1, 2], [1, 1], 64))
    assert d.final.tolist() == [True, True]


def _run_rows(grammars, constraints, params, steps=60, seed=0):
    """Rows through a RowTable over random logits, one token a step, until each ends (as the
    scheduler does: at the end id, or after ``steps``); {key: tokens}."""
    table = RowTable(lambda key: RowState(key, None, grammars.matcher(constraints[key])), GrammarMasks(grammars, 1))
    keys = list(constraints)
    out = {k: [] for k in keys}
    live = list(keys)
    admitted = set()
    for _ in range(steps):
        if not live:
            break
        flags = [k not in admitted for k in live]
        admitted.update(live)
        h = StepHeader(StepHeader.make(2, 0, 1, list(range(len(live))), [9] * len(live), live,
                                       [len(out[k]) for k in live], 256, admitted=flags))
        table.on_header(h)
        logits = np.stack([np.random.default_rng([seed, k, len(out[k])]).standard_normal(300) * 3
                           for k in live]).astype(np.float32)  # (a row's logits are its own)
        tokens = table.sample(logits, h, params).tolist()
        for k, t in zip(list(live), tokens):
            out[k].append(t)
            if t == EOS:
                live.remove(k)
    return out, table


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_row_table_masks_rows_into_their_constraint(grammars, temperature):
    constraints = {100 + i: Constraint(*KINDS[i % 4]) for i in range(12)}
    out, table = _run_rows(grammars, constraints, SamplingParams(temperature, seed=3))
    for k, c in constraints.items():
        toks = out[k]
        assert toks[-1] == EOS, (c, toks)
        assert matches(c, bytes(toks[:-1]).decode("utf-8")), (c, bytes(toks[:-1]))
    assert table.masks.masked > 0
    # a row's tokens depend on its own logits and constraint only: alone, each gets what it got beside the others
    for k in (101, 106):
        alone, _ = _run_rows(grammars, {k: constraints[k]}, SamplingParams(temperature, seed=3))
        assert alone[k] == out[k]
    assert len(table) == 12  # (no end events in this loop: every row's state is still there)


# -- under mpiexec -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def byte_ckpt(tiny_ckpt, tmp_path_factory) -> Path:
    """The tiny checkpoint with a byte-level tokenizer and <|end|> as its end-of-sequence id."""
    import shutil

    d = tmp_path_factory.mktemp("structured")
    shutil.copy(tiny_ckpt, d / "m.h5")
    byte_tokenizer(d / "m.tokenizer.json")
    (d / "m.generation_config.json").write_text(json.dumps({"eos_token_id": EOS}))
    return d / "m.h5"


def _prompt_lines() -> list[dict]:
    lines = []
    for i in range(16):
        kind, value = KINDS[i % 4]
        d = {"id": f"p{i}", "text": f"row {i}:"}
        if i % 5 == 4:
            pass  # a free row beside the constrained ones
        elif kind == "json" and i % 2 == 0:
            d["response_format"] = {"type": "json_schema", "json_schema": {"name": "s", "schema": value}}
        else:
            d["structured_outputs"] = {kind: value}
        if i % 3 == 1:
            d["temperature"] = 0.8
        lines.append(d)
    return lines


def _constraint_of(line: dict) -> Constraint | None:
    return from_request(line)


def _generate(tmp_path, ckpt, name, prompts, ranks, *flags, **placement):
    job = write_job(tmp_path, f"{name}.toml", model={"checkpoint": str(ckpt)}, run={"timeout_s": 60.0},
                    placement={"reserve_ram_gb": 0.0, **placement}, generate={"max_new_tokens": 48})
    out = tmp_path / f"{name}.jsonl"
    r = run_cli(["generate", job, "--prompts", prompts, "--out", out, *flags], ranks=ranks, timeout=180)
    return r, out


@pytest.mark.mpi
def test_every_layout_gives_rows_that_match_their_constraint(tmp_path, byte_ckpt):
    lines = _prompt_lines()
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps(x) + "\n" for x in lines))
    got = {}
    for name, ranks, placement in (("one", 1, {}), ("stages", 2, {}), ("tp", 2, {"tp": 2}),
                                   ("replicas", 2, {"replicas": 2})):
        r, out = _generate(tmp_path, byte_ckpt, name, prompts, ranks, "--batch", "3", **placement)
        assert r.returncode == 0, r.stderr[-3000:]
        rows = rows_of(out)
        assert [row["id"] for row in rows] == [x["id"] for x in lines]
        got[name] = rows
    for line, row in zip(lines, got["one"]):
        c = _constraint_of(line)
        if c is None:
            continue
        assert row["finish_reason"] == "stop", row
        assert matches(c, row["text"]), (c, row["text"])
    for name in ("stages", "tp", "replicas"):  # the mask is the row's own: the same bits on every layout
        assert [r["tokens"] for r in got[name]] == [r["tokens"] for r in got["one"]], name


@pytest.mark.mpi
def test_job_wide_constraint_and_its_errors(tmp_path, byte_ckpt):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"q{i}", "text": f"q {i}"}) + "\n" for i in range(3)))
    spec = tmp_path / "choice.json"
    spec.write_text(json.dumps({"choice": ["red", "green"]}))
    r, out = _generate(tmp_path, byte_ckpt, "job", prompts, 2, "--structured", spec)
    assert r.returncode == 0, r.stderr[-3000:]
    assert all(row["text"] in ("red", "green") and row["finish_reason"] == "stop" for row in rows_of(out))
    # a grammar the engine refuses: one line naming the flag, before any compute
    r, _ = _generate(tmp_path, byte_ckpt, "bad", prompts, 2, "--structured", '{"regex": "[a-"}')
    assert r.returncode != 0 and "generate --structured" in r.stderr and "Traceback" not in r.stderr
    # --ignore-eos would never end a constrained row: refused, saying why
    r, _ = _generate(tmp_path, byte_ckpt, "noeos", prompts, 1, "--structured", spec, "--ignore-eos")
    assert r.returncode != 0 and "--ignore-eos" in r.stderr and "Traceback" not in r.stderr
    # our prompt file: a bad constraint is one line naming the prompt
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"id": "z1", "text": "x", "structured_outputs": {"json": {"type": "strin"}}}) + "\n")
    r, _ = _generate(tmp_path, byte_ckpt, "badline", bad, 1)
    assert r.returncode != 0 and "prompt 'z1'" in r.stderr and "strin" in r.stderr, r.stderr[-2000:]
    assert "Traceback" not in r.stderr


@pytest.mark.mpi
def test_openai_batch_lines_with_structure(tmp_path, byte_ckpt):
    from openai.types import Completion

    from rlx_mpi.io.batch_io import COMPLETIONS_URL, EXIT_SOME_FAILED

    def req(cid, **body):
        return {"custom_id": cid, "method": "POST", "url": COMPLETIONS_URL,
                "body": {"model": "tiny", "prompt": f"{cid}:", "max_tokens": 40, **body}}

    rf = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    lines = [req("schema", response_format=rf),
             req("sampled-n2", response_format=rf, temperature=0.9, seed=4, n=2),
             req("choice-lp", structured_outputs={"choice": ["yes", "no"]}, logprobs=5),
             req("refused", response_format={"type": "json_schema",
                                             "json_schema": {"name": "x", "schema": {"type": "strin"}}}),
             req("both", response_format={"type": "json_object"}, structured_outputs={"regex": "a"}),
             req("object", response_format={"type": "json_object"}, max_tokens=60),
             req("free")]
    prompts = tmp_path / "requests.jsonl"
    prompts.write_text("".join(json.dumps(x) + "\n" for x in lines))
    r, out = _generate(tmp_path, byte_ckpt, "batch", prompts, 2)
    assert r.returncode == EXIT_SOME_FAILED, r.stderr[-3000:]
    rows = {row["custom_id"]: row for row in rows_of(out)}
    for cid in ("refused", "both"):
        assert rows[cid]["response"]["status_code"] == 400 and rows[cid]["error"]["code"] == "invalid_response_format"
    assert "strin" in rows["refused"]["error"]["message"]
    for cid, c in (("schema", Constraint("json", PERSON)), ("sampled-n2", Constraint("json", PERSON)),
                   ("choice-lp", Constraint("choice", ["yes", "no"]))):
        body = Completion.model_validate(rows[cid]["response"]["body"])
        assert len(body.choices) == (2 if cid == "sampled-n2" else 1)
        for ch in body.choices:
            assert ch.finish_reason == "stop" and matches(c, ch.text), (cid, ch.text)
    obj = Completion.model_validate(rows["object"]["response"]["body"]).choices[0]
    assert obj.finish_reason == "length" or isinstance(json.loads(obj.text), dict)
    # the log-probs are the constrained distribution's: at the first token only "y" and "n" are
    # possible, so their probabilities sum to 1 and the other alternatives are -inf (-9999)
    lp = Completion.model_validate(rows["choice-lp"]["response"]["body"]).choices[0].logprobs
    first = lp.top_logprobs[0]
    finite = {t: v for t, v in first.items() if v > -9999}
    assert set(finite) == {"y", "n"}
    assert abs(np.logaddexp(*finite.values())) < 1e-5


def test_a_changed_constraint_changes_the_row_digest(tmp_path):
    """A resume compares each pending line's digest with the one written: a line whose constraint
    changed is another request (refused), one whose constraint is the same resumes."""
    from rlx_mpi.io.batch_io import read_requests

    def digest(so) -> str:
        p = tmp_path / "p.jsonl"
        p.write_text(json.dumps({"id": "a", "tokens": [1, 2], "structured_outputs": so}) + "\n")
        (got,) = read_requests(p, vocab_size=300, max_positions=64, max_new_tokens=4,
                               check_constraint=lambda c, where: None)
        return got.digest

    assert digest({"choice": ["x", "y"]}) == digest({"choice": ["x", "y"]})
    assert digest({"choice": ["x", "y"]}) != digest({"choice": ["x", "z"]})
    assert digest({"regex": "x+"}) != digest({"choice": ["x"]})
