"""Request files in, result lines out: our prompt lines, or OpenAI batch files (as vLLM's run_batch).

A ``generate`` prompt file is one of two formats, recognised from its lines (mixing them in one
file is refused, naming the first line of the other kind):

* ours, ``{"id", "tokens" | "text" | "messages"}`` (`prompts.read_prompts`); rows out as today;
* OpenAI batch input lines::

    {"custom_id": "r1", "method": "POST", "url": "/v1/chat/completions",
     "body": {"model": "m", "messages": [...], "max_completion_tokens": 64, "temperature": 0.7,
              "top_p": 0.9, "seed": 1, "stop": ["\\n\\n"], "n": 2, "logprobs": true, "top_logprobs": 2}}

  (``"url": "/v1/completions"`` with ``"prompt"``: a string or a list of token ids; ``logprobs``
  there is the number of alternatives). Each line is one `prompts.Prompt` with its own
  `sampling.RowSettings`; the job's flags and ``[generate]`` give what a line leaves out. Out
  goes one OpenAI batch output line per input line, in input order::

    {"id": "r1", "custom_id": "r1", "response": {"status_code": 200, "request_id": "...",
     "body": <a chat.completion or text_completion object>}, "error": null}

Note: one bad line never stops the others. A line of an OpenAI file that cannot be run (not
JSON, an unknown or out-of-range field, a prompt too long for the model) becomes a `Prompt`
with an ``error`` and no tokens; its output line has ``"response": {"status_code": 400, "body":
{"error": {...}}}`` and ``"error": {"code", "message"}`` (vLLM's readers test ``error``, OpenAI's
the status code), and the job exits `EXIT_SOME_FAILED` once every other line is done. What
concerns the whole file (no tokenizer, two lines with one custom_id, mixed formats) is still
one `InputError` before any compute.

Note: the output line's ``"id"`` is the ``custom_id`` (OpenAI and vLLM write a random request
id there; readers match on ``custom_id``): the journal resumes a file by its rows' ids, so a
stopped batch job carries on and its file equals an uninterrupted run's line for line. The
``request_id`` and body ids are digests of the request, stable across runs for the same reason.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import replace
from pathlib import Path

from ..errors import InputError, clip, json_type
from .identity import prompt_digest
from .prompts import (MAX_PROMPT_FILE_BYTES, Prompt, _check_messages, _DECODER, _read_text, _Refused, read_prompts)
from ..engine.constraints import KEYS, ConstraintError, from_request
from ..engine.sampling import RowSettings
from .tokenizer import ChatError

__all__ = ["read_requests", "format_result", "is_batch", "stop_at", "stop_text", "CHAT_URL", "COMPLETIONS_URL",
           "MAX_N", "MAX_STOP", "EXIT_SOME_FAILED"]

CHAT_URL, COMPLETIONS_URL = "/v1/chat/completions", "/v1/completions"
MAX_N = 16  # samples per request at most: each is a row of its own (sharing the prefill is #33's)
MAX_STOP = 4  # stop strings per request, as OpenAI's API allows
MAX_TOP_LOGPROBS = 20  # alternatives per token, as OpenAI's chat API (and rules.LOGPROBS_MAX)
# Every line is done, but some failed (each has its error in its output line): a distinct code,
# so a batch script tells "all done" (0) from "done, look at the errors" without reading the file.
EXIT_SOME_FAILED = 6

_TOP_KEYS = ("custom_id", "method", "url", "body")
OUR_SETTINGS = ("max_tokens", "temperature", "top_p", "seed", "stop", *KEYS)  # what our prompt lines may carry
_OURS = ("id", "tokens", "text", "messages")
# Fields that ask for nothing we do not do at the value given: accepted, and otherwise refused
# per line (a request we would answer differently from OpenAI must say so, not be ignored).
_NO_OP = {"stream": False, "frequency_penalty": 0, "presence_penalty": 0, "echo": False, "best_of": 1,
          "logit_bias": None}
_NO_OP_ANY = ("user", "metadata", "store", "service_tier")  # bookkeeping: any value


def is_batch(prompt: Prompt) -> bool:
    """Is this an OpenAI batch line (its result is written as `format_result`)?"""
    return prompt.request is not None


def read_requests(path, *, vocab_size: int, max_positions: int, max_new_tokens: int, tokenizer=None,
                  max_bytes: int = MAX_PROMPT_FILE_BYTES, check_constraint=None, adapters: tuple[str, ...] = (),
                  base_names: frozenset[str] = frozenset()) -> list[Prompt]:
    """A prompt file of either format as `Prompt`s in file order (see the module's notes).

    ``check_constraint(constraint, where)``: why a line's constraint (structured output) cannot
    run, or None; it may raise the `InputError` of a job that cannot run any (no llguidance).
    Without it, a line that asks for structure is refused. ``adapters``: the job's LoRA adapters'
    names. With any, an OpenAI line's body "model" names the row's adapter (absent or one of
    ``base_names``: the base model; another name: that line's error), and our lines may give
    "adapter"; without, "model" is not read (as before)."""
    if check_constraint is None:
        def check_constraint(c, where):
            raise InputError(where, "this line asks for structured output, which this command does not take",
                             "remove its response_format / structured_outputs")
    path = Path(path)
    text = _read_text(path, max_bytes)
    lines = [(n, line) for n, line in enumerate(text.split("\n"), start=1) if line.strip()]
    kind = _format_of(path, lines)
    if kind == "ours":
        def settings_of(obj: dict, where: str) -> RowSettings | None:
            return _our_settings(obj, where, tokenizer, check_constraint)

        prompts = read_prompts(path, vocab_size=vocab_size, max_positions=max_positions,
                               max_new_tokens=max_new_tokens, tokenizer=tokenizer, max_bytes=max_bytes,
                               settings=(OUR_SETTINGS, settings_of), adapters=adapters or None)
        return [with_digest(p) for p in prompts]
    if tokenizer is None:
        raise InputError(f"{path}:{lines[0][0]}", "an OpenAI batch file but the checkpoint has no tokenizer",
                         "put the model's tokenizer.json (and tokenizer_config.json) next to the checkpoint "
                         "(rlx-mpi convert copies them): the results are text")
    prompts: list[Prompt] = []
    seen: dict[str, int] = {}
    for lineno, line in lines:
        where = f"{path}:{lineno}"
        p = _request(line, lineno, len(prompts), vocab_size, max_positions, max_new_tokens, tokenizer,
                     lambda c: check_constraint(c, where), adapters, base_names)
        cid = p.request.get("custom_id")
        if cid is not None:  # (a line without one gets a placeholder id: its output says so)
            if cid in seen:
                raise InputError(where, f"custom_id {cid!r} is already used on line {seen[cid]}",
                                 "give every request a unique custom_id: results are matched to requests by it")
            seen[cid] = lineno
        prompts.append(with_digest(p))
    for p in prompts:  # a line without a custom_id is written under a placeholder id: not one of theirs
        if p.request["custom_id"] is None and p.id in seen:
            raise InputError(f"{path}:{p.request['line']}", f"this line has no custom_id, and its output's id "
                             f"{p.id!r} is the custom_id of line {seen[p.id]}", "give the line a custom_id")
    return prompts


def with_digest(p: Prompt) -> Prompt:
    """``p`` with the digest the journal records when it has settings of its own or an error:
    its tokens' digest and those, so a resume refuses a line whose settings changed."""
    extra = {k: v for k, v in (("settings", p.settings and p.settings.to_json()), ("error", p.error),
                               ("adapter", p.adapter)) if v}
    if not extra:
        return p  # (the journal takes its tokens' digest: files written before resume unchanged)
    blob = json.dumps([prompt_digest(p.tokens), extra], sort_keys=True, separators=(",", ":")).encode("utf-8")
    return replace(p, digest=hashlib.sha256(blob).hexdigest()[:16])


def _our_settings(obj: dict, where: str, tokenizer, check_constraint) -> RowSettings | None:
    """Our line's own settings (`OUR_SETTINGS`, checked as an OpenAI body's), or None when it
    gives none; a bad one is the file's `InputError` (our format is strict), naming the prompt."""
    if not any(k in obj for k in OUR_SETTINGS):
        return None
    named = f"{where} (prompt {obj['id']!r})" if isinstance(obj.get("id"), str) else where
    try:
        settings = _settings({k: obj[k] for k in OUR_SETTINGS if k in obj}, COMPLETIONS_URL)
    except _LineError as e:
        what, _, fix = e.message.partition("; ")
        raise InputError(named if e.param in KEYS else where, what, fix or None) from None
    if settings.constraint is not None:
        bad = check_constraint(settings.constraint, named)
        if bad:
            raise InputError(named, f"its {settings.constraint.kind} constraint cannot run: {bad}",
                             "fix the schema / grammar (docs/structured-output.md lists what is supported)")
    if settings.stop and tokenizer is None:
        raise InputError(where, 'a "stop" but the checkpoint has no tokenizer',
                         "put the model's tokenizer.json next to the checkpoint: stop strings are matched on text")
    return settings


def _format_of(path: Path, lines: list[tuple[int, str]]) -> str:
    """"ours" or "openai", from the lines that parse; a line of the other kind is refused."""
    kind, first = None, 0
    for lineno, line in lines:
        try:
            obj = json.loads(line)
        except ValueError:
            continue  # the reader of its format says what is wrong with it
        if not isinstance(obj, dict):
            continue
        mine = "openai" if any(k in obj for k in _TOP_KEYS) else "ours" if any(k in obj for k in _OURS) else None
        if mine is None:
            continue
        if kind is None:
            kind, first = mine, lineno
        elif mine != kind:
            name = {"ours": 'an rlx-mpi prompt ({"id", "tokens" | "text" | "messages"})',
                    "openai": 'an OpenAI batch request ({"custom_id", "method", "url", "body"})'}
            raise InputError(f"{path}:{lineno}", f"this line is {name[mine]} but line {first} is {name[kind]}",
                             "give one format per file (split it into two jobs)")
    return kind or "ours"


class _LineError(Exception):
    """A line that cannot be run: (message, param, code)."""

    def __init__(self, message: str, param: str | None = None, code: str = "invalid_request"):
        super().__init__(message)
        self.message, self.param, self.code = message, param, code


def _request(line: str, lineno: int, index: int, vocab_size: int, max_positions: int, default_max: int,
             tokenizer, check, adapters: tuple[str, ...] = (),
             base_names: frozenset[str] = frozenset()) -> Prompt:
    """One OpenAI batch line as a `Prompt`: runnable, or with its ``error``."""
    cid, url, model = None, None, None
    try:
        try:
            obj = _DECODER.decode(line)
        except _Refused as e:
            raise _LineError(f"{e.args[0]}; {e.args[1]}") from None
        except json.JSONDecodeError as e:
            raise _LineError(f"not valid JSON ({e.msg}, column {e.colno})") from None
        if not isinstance(obj, dict):
            raise _LineError(f"a JSON {json_type(obj)}, not a request object")
        if isinstance(obj.get("custom_id"), str) and obj["custom_id"].strip():
            cid = obj["custom_id"]
        for k in obj:
            if k not in _TOP_KEYS:
                raise _LineError(f"unknown key {k!r} (a request has {', '.join(_TOP_KEYS)})", k)
        if cid is None:
            raise _LineError('no "custom_id" (a non-empty string)', "custom_id")
        if len(cid) > 1000:
            raise _LineError("custom_id is longer than 1000 characters", "custom_id")
        if obj.get("method", "POST") != "POST":
            raise _LineError(f'method {clip(json.dumps(obj["method"]))} is not "POST"', "method")
        url = obj.get("url")
        if url not in (CHAT_URL, COMPLETIONS_URL):
            raise _LineError(f"url {clip(json.dumps(url))} is not {CHAT_URL} or {COMPLETIONS_URL}", "url")
        body = obj.get("body")
        if not isinstance(body, dict):
            raise _LineError(f'"body" is a {json_type(body)}, not an object', "body")
        model = body.get("model")
        if model is not None and not isinstance(model, str):
            raise _LineError(f'"model" is a {json_type(model)}', "model")
        adapter = None
        if adapters and model is not None and model not in base_names:  # (the LoRA adapter the row uses)
            if model not in adapters:
                raise _LineError(f'"model" {clip(json.dumps(model))} is neither the base model '
                                 f'({", ".join(sorted(base_names))}) nor one of this job\'s adapters '
                                 f'({", ".join(adapters)})', "model", "model_not_found")
            adapter = model
        settings = _settings(body, url)
        if settings.constraint is not None:
            bad = check(settings.constraint)
            if bad:
                raise _LineError(f"its {settings.constraint.kind} constraint cannot run: {bad}",
                                 "response_format" if "response_format" in body else "structured_outputs",
                                 "invalid_response_format")
        if url == CHAT_URL:
            text, tokens = _chat_tokens(body, tokenizer)
        else:
            text, tokens = _completion_tokens(body, tokenizer, vocab_size)
        room = max_positions - len(tokens)
        if settings.max_tokens is None:  # as OpenAI: as many as fit, up to the job's default
            if room < 1:
                raise _LineError(f"the prompt has {len(tokens)} tokens; the model has {max_positions} positions",
                                 "messages" if url == CHAT_URL else "prompt", "context_length_exceeded")
            limit = min(default_max, room)
        else:
            limit = settings.max_tokens
            if limit > room:
                raise _LineError(f"the prompt has {len(tokens)} tokens and max_tokens is {limit}: "
                                 f"{len(tokens) + limit} positions, but the model has {max_positions}",
                                 "max_tokens", "context_length_exceeded")
        request = {"custom_id": cid, "url": url, "model": model, "line": lineno, "max_new_tokens": limit}
        return Prompt(index, cid, tuple(tokens), text, settings=settings, request=request, adapter=adapter)
    except _LineError as e:
        error = {"code": e.code, "message": f"line {lineno}: {e.message}", "param": e.param, "line": lineno}
        request = {"custom_id": cid, "url": url, "model": model, "line": lineno, "max_new_tokens": 0}
        pid = cid if cid is not None else f"rlx-line-{lineno}"
        return Prompt(index, pid, (), None, request=request, error=error)


def _number(body: dict, key: str, low: float, high: float, low_open: bool = False) -> float | None:
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not (low < v if low_open else low <= v) or v > high:
        raise _LineError(f"{key} is {clip(json.dumps(v))}; give a number in {'(' if low_open else '['}{low}, {high}]",
                         key)
    return float(v)


def _integer(body: dict, key: str, low: int, high: int | None = None) -> int | None:
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < low or (high is not None and v > high):
        rng = f"an integer >= {low}" if high is None else f"an integer in [{low}, {high}]"
        raise _LineError(f"{key} is {clip(json.dumps(v))}; give {rng}", key)
    return v


_CHAT_FIELDS = ("model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "seed", "stop",
                "n", "logprobs", "top_logprobs", *KEYS)
_COMPLETION_FIELDS = ("model", "prompt", "max_tokens", "temperature", "top_p", "seed", "stop", "n", "logprobs", *KEYS)


def _settings(body: dict, url: str) -> RowSettings:
    """The body's sampling settings, checked; anything we cannot honour is a `_LineError`."""
    known = _CHAT_FIELDS if url == CHAT_URL else _COMPLETION_FIELDS
    for k, v in body.items():
        if k in known or k in _NO_OP_ANY or (k in _NO_OP and v in (_NO_OP[k], None, {})):
            continue
        if k in _NO_OP:
            raise _LineError(f"{k} {clip(json.dumps(v))} is not supported (only {json.dumps(_NO_OP[k])})", k)
        raise _LineError(f"unsupported field {k!r} for {url} (supported: {', '.join(known)})", k)
    if body.get("max_tokens") is not None and body.get("max_completion_tokens") is not None:
        raise _LineError("both max_tokens and max_completion_tokens; give one", "max_completion_tokens")
    key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _integer(body, key, 1)
    n = _integer(body, "n", 1, MAX_N)
    seed = _integer(body, "seed", -(1 << 63))
    if seed is not None and seed < 0:  # numpy's seeds are >= 0: a negative seed maps to one, stably
        seed += 1 << 64
    stop = body.get("stop")
    stops: tuple[str, ...] = ()
    if isinstance(stop, str):
        stops = (stop,)
    elif isinstance(stop, list):
        stops = tuple(stop)
    elif stop is not None:
        raise _LineError(f"stop is a {json_type(stop)}; give a string or a list of up to {MAX_STOP}", "stop")
    if len(stops) > MAX_STOP or not all(isinstance(s, str) and s for s in stops):
        raise _LineError(f"stop has {len(stops)} entries; give up to {MAX_STOP} non-empty strings", "stop")
    logprobs, top = False, 0
    if url == CHAT_URL:
        lp = body.get("logprobs")
        if lp is not None and not isinstance(lp, bool):
            raise _LineError(f"logprobs is {clip(json.dumps(lp))}; give true or false", "logprobs")
        logprobs = bool(lp)
        top = _integer(body, "top_logprobs", 0, MAX_TOP_LOGPROBS) or 0
        if top and not logprobs:
            raise _LineError("top_logprobs needs logprobs: true", "top_logprobs")
    else:
        k = _integer(body, "logprobs", 0, MAX_TOP_LOGPROBS)
        logprobs, top = k is not None, k or 0
    try:
        constraint = from_request(body)
    except ConstraintError as e:
        raise _LineError(e.message, e.param, "invalid_response_format") from None
    return RowSettings(max_tokens=max_tokens, temperature=_number(body, "temperature", 0, 2),
                       top_p=_number(body, "top_p", 0, 1, low_open=True), seed=seed, stop=stops, n=n or 1,
                       logprobs=logprobs, top_logprobs=top, constraint=constraint)


def _chat_tokens(body: dict, tokenizer) -> tuple[str, list[int]]:
    if "messages" not in body:
        raise _LineError('a chat request without "messages"', "messages")
    try:
        messages = _check_messages(body["messages"], "")
    except InputError as e:
        raise _LineError(f"{e.what}; {e.fix}", "messages") from None
    for i, m in enumerate(messages):
        content = m.get("content", "")
        if isinstance(content, list) and content and all(isinstance(c, dict) and c.get("type") == "text"
                                                         and isinstance(c.get("text"), str) for c in content):
            m["content"] = "\n".join(c["text"] for c in content)  # text parts joined, as vLLM does for string templates
        elif not isinstance(content, str):  # (image or audio parts: a text model has no use for them)
            raise _LineError(f'"messages"[{i}]["content"] is a {json_type(content)} that is not only text parts; '
                             'give a string, or a list of {"type": "text", "text": ...}', "messages")
    try:
        return tokenizer.chat(messages)
    except ChatError as e:
        raise _LineError(f"{e.args[0]}; {e.args[1]}", "messages") from None


def _completion_tokens(body: dict, tokenizer, vocab_size: int) -> tuple[str | None, list[int]]:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a list of one prompt is that prompt
    if isinstance(prompt, str):
        tokens = tokenizer.encode(prompt)
        text = prompt
    elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        tokens, text = prompt, None
    elif isinstance(prompt, list) and len(prompt) > 1:
        raise _LineError(f"prompt is a list of {len(prompt)} prompts; give one prompt per line "
                         "(a string or a list of token ids)", "prompt")
    else:
        raise _LineError('a completion request needs "prompt": a string or a list of token ids', "prompt")
    if not tokens:
        raise _LineError("the prompt has no tokens", "prompt")
    bad = next((t for t in tokens if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise _LineError(f"token {bad} is outside the vocabulary [0, {vocab_size})", "prompt")
    return text, list(tokens)


# -- results out ----------------------------------------------------------------------------------

def format_result(prompt: Prompt, samples: list[dict], tokenizer, created: int | None = None) -> dict:
    """The output line of OpenAI batch request ``prompt`` (without its "id": the journal puts
    ``custom_id`` there). ``samples`` are its n rows in sample order, each as the generate
    driver keeps a row: tokens, finish_reason, and with log-probs `sampling.logprob_entries`."""
    req = prompt.request
    rid = prompt.digest or prompt_digest(prompt.tokens)
    if prompt.error is not None:
        err = prompt.error
        body = {"error": {"message": err["message"], "type": "invalid_request_error", "param": err["param"],
                          "code": err["code"]}}
        return {"custom_id": req["custom_id"], "response": {"status_code": 400, "request_id": f"req-{rid}",
                                                            "body": body},
                "error": {"code": err["code"], "message": err["message"]}}
    chat = req["url"] == CHAT_URL
    s = prompt.settings or RowSettings()
    choices = []
    for j, row in enumerate(samples):
        tokens = row["tokens"]
        text = tokenizer.decode(tokens)
        if row["finish_reason"] == "stop":  # (an end-of-sequence id, or a stop string: cut before it)
            text = stop_text(text, s.stop)
        lp = _logprobs(row.get("logprobs"), tokenizer, s.top_logprobs, chat) if s.logprobs else None
        reason = "stop" if row["finish_reason"] == "stop" else "length"
        if chat:
            choices.append({"index": j, "message": {"role": "assistant", "content": text}, "logprobs": lp,
                            "finish_reason": reason})
        else:
            choices.append({"index": j, "text": text, "logprobs": lp, "finish_reason": reason})
    new = sum(len(r["tokens"]) for r in samples)
    body = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{rid}", "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()) if created is None else created, "model": req.get("model") or "",
            "choices": choices, "usage": {"prompt_tokens": len(prompt.tokens), "completion_tokens": new,
                                          "total_tokens": len(prompt.tokens) + new}}
    return {"custom_id": req["custom_id"], "response": {"status_code": 200, "request_id": f"req-{rid}", "body": body},
            "error": None}


def stop_at(text: str, stops) -> int:
    """Where the first of ``stops`` begins in ``text``; -1 when none is in it."""
    return min((i for i in (text.find(s) for s in stops) if i >= 0), default=-1)


def stop_text(text: str, stops) -> str:
    """The text up to (not including) the first stop string in it, as OpenAI returns it."""
    at = stop_at(text, stops)
    return text[:at] if at >= 0 else text


def _lp(v) -> float:
    return -9999.0 if v is None else v  # (OpenAI writes a -inf log-prob so: JSON has no -inf)


def _logprobs(entries: list[dict] | None, tokenizer, k: int, chat: bool) -> dict | None:
    """`sampling.logprob_entries` in OpenAI's shape: chat's ``{"content": [...]}``, or the
    completions API's parallel lists."""
    if entries is None:
        return None
    piece = tokenizer.token_text
    if chat:
        def tok(i, v):
            t = piece(i)
            return {"token": t, "logprob": _lp(v), "bytes": list(t.encode("utf-8"))}

        return {"content": [{**tok(e["id"], e["logprob"]), "top_logprobs": [tok(i, v) for i, v in e["top"][:k]]}
                            for e in entries], "refusal": None}
    tokens = [piece(e["id"]) for e in entries]
    offsets, at = [], 0
    for t in tokens:
        offsets.append(at)
        at += len(t)
    return {"tokens": tokens, "token_logprobs": [_lp(e["logprob"]) for e in entries],
            "top_logprobs": [{piece(i): _lp(v) for i, v in e["top"][:k]} for e in entries], "text_offset": offsets}

