"""Prompt files for `rlx-mpi generate`, and the optional tokenizer.

A prompt file is JSON lines, one prompt per line::

    {"id": "q1", "tokens": [1, 450, 4996]}
    {"id": 2, "text": "The capital of France is"}

``id`` is a string or an integer (kept as a string), unique in the file; ``tokens`` are
integer ids in ``[0, vocab)``; ``text`` needs a tokenizer (``tokenizer.json`` next to the
checkpoint, and the ``tokenizers`` package: ``pip install 'rlx_mpi[text]'``). Blank lines are
skipped and a UTF-8 byte order mark is accepted. Every error is one `InputError` naming
``FILE:LINE``, the key and value, and the fix; the whole file is checked before any compute.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import InputError

__all__ = ["Prompt", "Tokenizer", "read_prompts", "load_tokenizer", "MAX_PROMPT_FILE_BYTES"]

log = logging.getLogger(__name__)

MAX_PROMPT_FILE_BYTES = 1 << 30  # 1 GiB: millions of prompts; past that it is the wrong file
_KEYS = ("id", "tokens", "text")
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
    tokens: tuple[int, ...]  # the prompt's token ids (encoded from "text" when given as text)
    text: str | None  # the line's "text", or None when it gave "tokens"


class Tokenizer:
    """A Hugging Face ``tokenizer.json`` through the ``tokenizers`` package.

    ``encode`` adds the special tokens the tokenizer's post-processor defines (a Llama BOS),
    as transformers does for ``tokenizer(text)``; ``decode`` drops special tokens.
    """

    def __init__(self, path: Path, backend: Any, eos_token_ids: tuple[int, ...] = ()):
        self.path, self._tok = path, backend
        self.eos_token_ids = tuple(eos_token_ids)  # every id that ends a sequence (Llama 3 has several)

    @property
    def eos_token_id(self) -> int | None:
        """The end-of-sequence id, or None when the tokenizer's config does not say."""
        return self.eos_token_ids[0] if self.eos_token_ids else None

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)

    def __repr__(self) -> str:
        return f"Tokenizer({str(self.path)!r}, eos_token_id={self.eos_token_id})"


# -- the prompt file ------------------------------------------------------------------------------

def read_prompts(path, *, vocab_size: int, max_positions: int, max_new_tokens: int,
                 tokenizer: Tokenizer | None = None,
                 max_bytes: int = MAX_PROMPT_FILE_BYTES) -> list[Prompt]:
    """Read and check a whole JSON-lines prompt file; every problem is an `InputError`."""
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
        obj = _parse_line(line, where)
        pid = _check_id(obj, where)
        if pid in first_line:
            raise InputError(where, f'id {pid!r} is already used on line {first_line[pid]}',
                             "give every prompt a unique id")
        first_line[pid] = lineno
        tokens = _tokens_of(obj, where, vocab_size, tokenizer)
        if len(tokens) + max_new_tokens > max_positions:
            raise InputError(where, f"prompt {pid!r} has {len(tokens)} tokens, and with "
                             f"max_new_tokens {max_new_tokens} needs {len(tokens) + max_new_tokens}"
                             f" positions but the model has {max_positions}",
                             "shorten the prompt or lower --max-new-tokens")
        prompts.append(Prompt(len(prompts), pid, tokens, obj.get("text")))
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
        raise InputError(where, f"not valid JSON ({e.msg} at column {e.colno}): {_clip(line)}",
                         'give one JSON object per line: {"id": "...", "tokens": [...]}') from None
    if not isinstance(obj, dict):
        raise InputError(where, f"a JSON {type(obj).__name__}, not an object: {_clip(line)}",
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
        raise InputError(where, f'"id" is {_clip(json.dumps(pid))}, a {_json_type(pid)}',
                         'give a string or an integer "id"')
    pid = str(pid)
    if not pid.strip() or len(pid) > 1000:
        raise InputError(where, f'"id" {_clip(json.dumps(pid))} is empty or longer than 1000 characters',
                         'give a short non-empty "id"')
    return pid


def _tokens_of(obj: dict, where: str, vocab_size: int, tokenizer) -> tuple[int, ...]:
    has_tokens, has_text = "tokens" in obj, "text" in obj
    if has_tokens == has_text:
        raise InputError(where, 'both "tokens" and "text"' if has_tokens else 'no "tokens" or "text"',
                         'give exactly one of "tokens" (a list of ids) or "text" (a string)')
    if has_text:
        text = obj["text"]
        if not isinstance(text, str):
            raise InputError(where, f'"text" is a {_json_type(text)}', 'give "text" as a string')
        if tokenizer is None:
            raise InputError(where, 'a "text" prompt but the checkpoint has no tokenizer',
                             'give "tokens", or put the model\'s tokenizer.json next to the '
                             'checkpoint (rlx-mpi convert copies it from the Hugging Face folder)')
        tokens = tokenizer.encode(text)
        what = f"the text {_clip(json.dumps(text))} encodes to"
    else:
        tokens = obj["tokens"]
        if not isinstance(tokens, list):
            raise InputError(where, f'"tokens" is a {_json_type(tokens)}', 'give "tokens" as a list of integer ids')
        what = '"tokens" has'
    if not tokens:
        raise InputError(where, f"{what} no tokens", "give a non-empty prompt")
    # the common case in C-speed builtins; the loop below only to name what is wrong
    if set(map(type, tokens)) == {int} and 0 <= min(tokens) and max(tokens) < vocab_size:
        return tuple(tokens)
    for i, t in enumerate(tokens):
        if isinstance(t, bool) or not isinstance(t, int):
            raise InputError(where, f'"tokens"[{i}] is {_clip(json.dumps(t))}, a {_json_type(t)}',
                             "give integer token ids")
        if not 0 <= t < vocab_size:
            raise InputError(where, f"{what} token {t} at position {i}, outside [0, {vocab_size})",
                             "use ids of this model's vocabulary (tokenize with its tokenizer)")
    return tuple(tokens)


def _json_type(value) -> str:
    return {bool: "boolean", int: "integer", float: "number", str: "string", list: "list",
            dict: "object", type(None): "null"}.get(type(value), type(value).__name__)


def _clip(text: str, n: int = 60) -> str:
    return text if len(text) <= n else text[:n] + "..."


# -- the tokenizer --------------------------------------------------------------------------------

def load_tokenizer(checkpoint_path) -> Tokenizer | None:
    """The tokenizer stored with a checkpoint, or None when there is none.

    Looks for ``<stem>.tokenizer.json`` beside ``model.h5`` (one folder, several models), then
    ``tokenizer.json`` in the same folder (or in the checkpoint path itself if it is a folder).
    The end-of-sequence ids come from the ``eos_token`` of the ``tokenizer_config.json`` found
    the same way, then from ``eos_token_id`` in ``generation_config.json`` (an int or a list);
    ``eos_token_id`` is the first of them, or None.
    """
    found = _beside(Path(checkpoint_path), "tokenizer.json")
    if found is None:
        return None
    try:
        import tokenizers
    except ImportError:
        raise InputError(str(found), "a tokenizer is here but the tokenizers package is not installed",
                         "pip install 'rlx_mpi[text]'") from None
    try:
        backend = tokenizers.Tokenizer.from_file(str(found))
    except Exception as e:  # the Rust side raises plain Exception for any bad file
        raise InputError(str(found), f"not a tokenizers file: {_clip(str(e), 200)}",
                         "copy tokenizer.json again from the Hugging Face model folder") from None
    tok = Tokenizer(found, backend, _eos_token_ids(Path(checkpoint_path), backend))
    log.debug("tokenizer %s: vocab %d, eos %s", found, tok.vocab_size, tok.eos_token_id)
    return tok


def _beside(checkpoint: Path, name: str) -> Path | None:
    """``<stem>.name`` beside the checkpoint, else ``name`` in its folder."""
    if checkpoint.is_dir():
        candidates = [checkpoint / name]
    else:
        candidates = [checkpoint.with_name(f"{checkpoint.stem}.{name}"), checkpoint.with_name(name)]
    return next((c for c in candidates if c.is_file()), None)


def _eos_token_ids(checkpoint: Path, backend: Any) -> tuple[int, ...]:
    """The ids of the tokenizer config's ``eos_token``, then the generation config's ids."""
    ids: list[int] = []
    eos = _read_json(_beside(checkpoint, "tokenizer_config.json")).get("eos_token")
    if isinstance(eos, dict):  # older files: {"content": "</s>", ...}
        eos = eos.get("content")
    if isinstance(eos, str) and backend.token_to_id(eos) is not None:
        ids.append(int(backend.token_to_id(eos)))
    more = _read_json(_beside(checkpoint, "generation_config.json")).get("eos_token_id")
    for i in more if isinstance(more, list) else [more]:  # Llama 3 lists several
        if isinstance(i, int) and not isinstance(i, bool) and i >= 0 and i not in ids:
            ids.append(i)
    return tuple(ids)


def _read_json(path: Path | None) -> dict:
    if path is None:
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            obj = json.loads(f.read(1 << 24))
    except (OSError, ValueError) as e:
        log.warning("%s: ignored (%s)", path, e)
        return {}
    return obj if isinstance(obj, dict) else {}
