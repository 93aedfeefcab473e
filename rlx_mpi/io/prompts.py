"""Prompt files for `rlx-mpi generate` (the tokenizer, chat template and eos ids they need: `tokenizer.py`).

A prompt file is JSON lines, one prompt per line::

    {"id": "q1", "tokens": [1, 450, 4996]}
    {"id": 2, "text": "The capital of France is"}
    {"id": "c1", "messages": [{"role": "user", "content": "What is the capital of France?"}]}

``id`` is a string or an integer (kept as a string), unique in the file; ``tokens`` are
integer ids in ``[0, vocab)``; ``text`` needs a tokenizer (``tokenizer.json`` next to the
checkpoint, and the ``tokenizers`` package: ``pip install 'rlx_mpi[text]'``); ``messages`` (a
chat, for instruct models) also needs the checkpoint's chat template (``chat_template`` in
``tokenizer_config.json``, or ``chat_template.jinja``) and ``jinja2`` (also in the ``text``
extra): it is rendered with ``add_generation_prompt=True`` exactly as transformers'
``apply_chat_template`` renders it, then tokenized without adding special tokens again.
A line may carry its own ``max_tokens``, ``temperature``, ``top_p``, ``seed`` and ``stop`` (up
to 4 strings; needs the tokenizer), checked as an OpenAI request's (`batch_io`); the job's
settings are the defaults. Blank lines are skipped and a UTF-8 byte order mark is accepted. Every error is one
`InputError` naming ``FILE:LINE``, the key and value, and the fix; the whole file is checked
before any compute.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Collection

from ..errors import InputError, clip, json_type
from ..engine.sampling import RowSettings
from .tokenizer import ChatError, Tokenizer

__all__ = ["Prompt", "read_prompts", "MAX_PROMPT_FILE_BYTES"]

log = logging.getLogger(__name__)

MAX_PROMPT_FILE_BYTES = 1 << 30  # 1 GiB: millions of prompts; past that it is the wrong file
_KEYS = ("id", "tokens", "text", "messages")
_SOURCES = ("tokens", "text", "messages")  # a line gives exactly one of them
_BOM = b"\xef\xbb\xbf"
# First bytes of files people hand us by mistake: what they are, to say so in the error.
_MAGIC = ((b"\x80", "a Python pickle"), (b"\x93NUMPY", "a numpy .npy file"),
          (b"\x89HDF", "an HDF5 file"), (b"PK\x03\x04", "a zip archive (.npz, .pt)"),
          (b"\x1f\x8b", "a gzip file"), (b"\x28\xb5\x2f\xfd", "a zstd file"))


@dataclass(frozen=True)
class Prompt:
    """One prompt of the file, in file order."""

    index: int  # 0-based position among the file's prompts (blank lines not counted)
    id: str  # the line's "id", as a string
    tokens: tuple[int, ...]  # the prompt's token ids (encoded from "text" or the rendered "messages")
    text: str | None  # the line's "text", or its "messages" as rendered by the chat template;
    # None when it gave "tokens"
    settings: RowSettings | None = None  # the line's own sampling settings (`batch_io`); None: the job's
    request: dict | None = None  # an OpenAI batch line: its custom_id, url, model and line (`batch_io`)
    error: dict | None = None  # a line that cannot be run: its OpenAI error object (no tokens)
    digest: str | None = None  # what the journal records of it when not its tokens' digest (`batch_io`:
    # the tokens with the line's own settings or error, so that a resume checks those too)
    adapter: str | None = None  # the LoRA adapter it names (our "adapter", an OpenAI line's "model"); None: base


def read_prompts(path, *, vocab_size: int, max_positions: int, max_new_tokens: int,
                 tokenizer: Tokenizer | None = None,
                 max_bytes: int = MAX_PROMPT_FILE_BYTES,
                 settings: tuple[tuple[str, ...], Callable[[dict, str], RowSettings | None]] | None = None,
                 adapters: Collection[str] | None = None) -> list[Prompt]:
    """Read and check a whole JSON-lines prompt file; every problem is an `InputError`.

    ``settings``: (keys, reader) when a line may carry settings of its own (`batch_io`): those
    keys are accepted, and ``reader(line, where)`` gives the line's `RowSettings` or None."""
    keys, settings_of = (_KEYS + settings[0], settings[1]) if settings else (_KEYS, None)
    if adapters is not None:  # the job's LoRA adapters' names: a line's "adapter" may give one
        keys = keys + ("adapter",)
    for name, value in (("vocab_size", vocab_size), ("max_positions", max_positions)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
    path = Path(path)
    text = _read_text(path, max_bytes)
    prompts: list[Prompt] = []
    first_line: dict[str, int] = {}  # id -> line it was first seen on
    for lineno, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        obj = _parse_line(line, where, keys)
        pid = _check_id(obj, where)
        if pid in first_line:
            raise InputError(where, f'id {pid!r} is already used on line {first_line[pid]}',
                             "give every prompt a unique id")
        first_line[pid] = lineno
        tokens, text_of = _tokens_of(obj, where, vocab_size, tokenizer)
        own = settings_of(obj, where) if settings_of else None
        limit = own.max_tokens if own and own.max_tokens else max_new_tokens
        if len(tokens) + limit > max_positions:
            raise InputError(where, f"prompt {pid!r} has {len(tokens)} tokens, and with "
                             f"max_new_tokens {limit} needs {len(tokens) + limit}"
                             f" positions but the model has {max_positions}",
                             "shorten the prompt or lower " + ('its "max_tokens"' if limit != max_new_tokens
                                                                else "--max-new-tokens"))
        adapter = obj.get("adapter")
        if adapter is not None and adapter not in adapters:
            raise InputError(f"{where} adapter", f"{clip(json.dumps(adapter))} is not an adapter of this job",
                             f"name one of {sorted(adapters)} ([adapters] in the job file, or --adapter NAME=DIR)"
                             if adapters else "declare it: [adapters] NAME = \"DIR\" in the job file, or --adapter NAME=DIR")
        prompts.append(Prompt(len(prompts), pid, tokens, text_of, settings=own, adapter=adapter))
    if not prompts:
        raise InputError(str(path), "the prompt file has no prompts",
                         'give one JSON object per line: {"id": "...", "tokens": [...]}')
    log.debug("%s: %d prompts", path, len(prompts))
    return prompts


def _read_text(path: Path, max_bytes: int) -> str:
    """The file's text: size-bounded, refusing binary files, BOM removed."""
    try:
        if path.is_dir():
            raise InputError(str(path), "is a directory, not a prompt file",
                             "give the path of a JSON-lines file")
        size = path.stat().st_size
        if size > max_bytes:
            raise InputError(str(path), f"the prompt file has {size} bytes, more than the "
                             f"{max_bytes} allowed", "split it into several jobs")
        with open(path, "rb") as f:
            data = f.read(max_bytes + 1)
    except FileNotFoundError:
        raise InputError(str(path), "prompt file not found", "check the --prompts path") from None
    except OSError as e:
        raise InputError(str(path), f"cannot read the prompt file: {e.strerror}",
                         "check the path and its permissions") from None
    if len(data) > max_bytes:  # it grew while we looked
        raise InputError(str(path), f"the prompt file has more than {max_bytes} bytes",
                         "split it into several jobs")
    if data.startswith(_BOM):
        data = data[len(_BOM):]
    for magic, what in _MAGIC:
        if data.startswith(magic):
            raise InputError(f"{path}:1", f"this is {what}, not a JSON-lines prompt file",
                             'give one JSON object per line: {"id": "...", "tokens": [...]}')
    nul = data.find(b"\x00")
    if nul >= 0:
        raise InputError(f"{path}:{_line_of(data, nul)}",
                         "a NUL byte: this is a binary file, not a JSON-lines prompt file",
                         'give one JSON object per line: {"id": "...", "tokens": [...]}')
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InputError(f"{path}:{_line_of(data, e.start)}",
                         f"byte {data[e.start]:#04x} is not UTF-8", "save the file as UTF-8") from None


def _line_of(data: bytes, offset: int) -> int:
    return data.count(b"\n", 0, offset) + 1


class _Refused(ValueError):
    """A JSON value the decoder hooks refuse; becomes an InputError naming the line."""


def _no_dup_keys(pairs):
    obj = {}
    for key, value in pairs:
        if key in obj:
            raise _Refused(f"key {key!r} appears twice in one line", "keep one")
        obj[key] = value
    return obj


def _no_constant(name):  # NaN, Infinity: not JSON, and never a token
    raise _Refused(f"{name} is not valid JSON", "give integer token ids")


_DECODER = json.JSONDecoder(object_pairs_hook=_no_dup_keys, parse_constant=_no_constant)


def _parse_line(line: str, where: str, keys: tuple[str, ...] = _KEYS) -> dict:
    try:
        obj = _DECODER.decode(line)
    except _Refused as e:
        raise InputError(where, *e.args) from None
    except json.JSONDecodeError as e:
        raise InputError(where, f"not valid JSON ({e.msg} at column {e.colno}): {clip(line)}",
                         'give one JSON object per line: {"id": "...", "tokens": [...]}') from None
    if not isinstance(obj, dict):
        raise InputError(where, f"a JSON {type(obj).__name__}, not an object: {clip(line)}",
                         'give one JSON object per line: {"id": "...", "tokens": [...]}')
    unknown = [k for k in obj if k not in keys]
    if unknown:
        raise InputError(where, f"unknown key {unknown[0]!r}",
                         f"a prompt line has only the keys {', '.join(keys)}")
    return obj


def _check_id(obj: dict, where: str) -> str:
    if "id" not in obj:
        raise InputError(where, 'no "id"', 'give every prompt a unique "id" (a string or an integer)')
    pid = obj["id"]
    if isinstance(pid, bool) or not isinstance(pid, (str, int)):
        raise InputError(where, f'"id" is {clip(json.dumps(pid))}, a {json_type(pid)}',
                         'give a string or an integer "id"')
    pid = str(pid)
    if not pid.strip() or len(pid) > 1000:
        raise InputError(where, f'"id" {clip(json.dumps(pid))} is empty or longer than 1000 characters',
                         'give a short non-empty "id"')
    return pid


def _tokens_of(obj: dict, where: str, vocab_size: int, tokenizer) -> tuple[tuple[int, ...], str | None]:
    """The line's token ids, and its text (given, or rendered from "messages") or None."""
    given = [k for k in _SOURCES if k in obj]
    if len(given) != 1:
        raise InputError(where, ("both " if len(given) == 2 else "all of ") + " and ".join(f'"{k}"' for k in given)
                         if given else 'no "tokens", "text" or "messages"',
                         'give exactly one of "tokens" (a list of ids), "text" (a string) or '
                         '"messages" (a chat: a list of {"role": ..., "content": ...})')
    text = None
    if "text" in obj:
        text = obj["text"]
        if not isinstance(text, str):
            raise InputError(where, f'"text" is a {json_type(text)}', 'give "text" as a string')
        _need_tokenizer(tokenizer, where, '"text"')
        tokens = tokenizer.encode(text)
        what = f"the text {clip(json.dumps(text))} encodes to"
    elif "messages" in obj:
        messages = _check_messages(obj["messages"], where)
        _need_tokenizer(tokenizer, where, '"messages"')
        try:
            text, tokens = tokenizer.chat(messages)
        except ChatError as e:
            raise InputError(where, *e.args) from None
        what = "the rendered messages encode to"
    else:
        tokens = obj["tokens"]
        if not isinstance(tokens, list):
            raise InputError(where, f'"tokens" is a {json_type(tokens)}', 'give "tokens" as a list of integer ids')
        what = '"tokens" has'
    if not tokens:
        raise InputError(where, f"{what} no tokens", "give a non-empty prompt")
    # the common case in C-speed builtins; the loop below only to name what is wrong
    if set(map(type, tokens)) == {int} and 0 <= min(tokens) and max(tokens) < vocab_size:
        return tuple(tokens), text
    for i, t in enumerate(tokens):
        if isinstance(t, bool) or not isinstance(t, int):
            raise InputError(where, f'"tokens"[{i}] is {clip(json.dumps(t))}, a {json_type(t)}',
                             "give integer token ids")
        if not 0 <= t < vocab_size:
            raise InputError(where, f"{what} token {t} at position {i}, outside [0, {vocab_size})",
                             "use ids of this model's vocabulary (tokenize with its tokenizer)")
    return tuple(tokens), text


def _need_tokenizer(tokenizer, where: str, key: str) -> None:
    if tokenizer is None:
        raise InputError(where, f"a {key} prompt but the checkpoint has no tokenizer",
                         'give "tokens", or put the model\'s tokenizer.json (and tokenizer_config.json) '
                         "next to the checkpoint (rlx-mpi convert copies them from the Hugging Face folder)")


def _check_messages(messages, where: str) -> list[dict]:
    """A chat as transformers takes it: a non-empty list of objects with a string "role" and a
    "content"; keys whose value is null are dropped (as ``apply_chat_template`` does)."""
    fix = 'give "messages" as a list of {"role": "user", "content": "..."} objects'
    if not isinstance(messages, list) or not messages:
        what = "an empty list" if messages == [] else f"a {json_type(messages)}"
        raise InputError(where, f'"messages" is {what}', fix)
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise InputError(where, f'"messages"[{i}] is a {json_type(m)}, not an object', fix)
        m = {k: v for k, v in m.items() if v is not None}
        role = m.get("role")
        if not isinstance(role, str) or not role:
            raise InputError(where, f'"messages"[{i}] has no "role" string' if role is None else
                             f'"messages"[{i}]["role"] is {clip(json.dumps(role))}, not a role name', fix)
        if "content" not in m and "tool_calls" not in m:
            raise InputError(where, f'"messages"[{i}] ({role}) has no "content"', fix)
        out.append(m)
    return out
