"""Prompt files for `rlx-mpi generate`, the optional tokenizer and chat template, and eos ids.

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

End-of-sequence ids (`eos_ids_beside`): ``eos_token_id`` of the checkpoint's
``generation_config.json`` (an int or a list: Llama 3 lists three), which is what
transformers' ``generate`` stops at; only when it names none, the tokenizer config's
``eos_token``. Generation stops at any of them.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from .errors import InputError
from .sampling import RowSettings

__all__ = ["Prompt", "Tokenizer", "ChatTemplate", "read_prompts", "load_tokenizer", "eos_ids_beside",
           "MAX_PROMPT_FILE_BYTES"]

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


class Tokenizer:
    """A Hugging Face ``tokenizer.json`` through the ``tokenizers`` package.

    ``encode`` adds the special tokens the tokenizer's post-processor defines (a Llama BOS),
    as transformers does for ``tokenizer(text)``; ``decode`` drops special tokens.
    ``chat`` renders and tokenizes a conversation with the checkpoint's chat template.
    """

    def __init__(self, path: Path, backend: Any, eos_token_ids: tuple[int, ...] = (),
                 chat_template: ChatTemplate | None = None):
        self.path, self._tok = path, backend
        self.eos_token_ids = tuple(eos_token_ids)  # every id that ends a sequence (Llama 3 has several)
        self.chat_template = chat_template

    @property
    def eos_token_id(self) -> int | None:
        """The first end-of-sequence id, or None when the checkpoint's configs do not say."""
        return self.eos_token_ids[0] if self.eos_token_ids else None

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)

    def token_text(self, token_id: int) -> str:
        """One token as text, special tokens included (how OpenAI's log-probs name a token)."""
        return self._tok.decode([int(token_id)], skip_special_tokens=False)

    def chat(self, messages: list[dict]) -> tuple[str, list[int]]:
        """``messages`` rendered with ``add_generation_prompt=True``, and its token ids.

        As transformers' ``apply_chat_template(messages, add_generation_prompt=True,
        tokenize=True)``: the template writes the special tokens (BOS included), so the text is
        encoded without adding them again. Raises `ChatError` (no template, template error).
        """
        if self.chat_template is None:
            raise ChatError("the checkpoint's tokenizer has no chat template (no \"chat_template\" "
                            f"in the tokenizer_config.json beside {self.path.name})",
                            "use the instruct model's tokenizer_config.json (base models have no "
                            'template), or give the prompt as "text" or "tokens"')
        text = self.chat_template.render(messages)
        return text, self.encode(text, add_special_tokens=False)

    def __repr__(self) -> str:
        return (f"Tokenizer({str(self.path)!r}, eos_token_ids={self.eos_token_ids}, "
                f"chat_template={'yes' if self.chat_template else 'no'})")


# -- the prompt file ------------------------------------------------------------------------------

def read_prompts(path, *, vocab_size: int, max_positions: int, max_new_tokens: int,
                 tokenizer: Tokenizer | None = None,
                 max_bytes: int = MAX_PROMPT_FILE_BYTES,
                 settings: tuple[tuple[str, ...], Callable[[dict, str], RowSettings | None]] | None = None
                 ) -> list[Prompt]:
    """Read and check a whole JSON-lines prompt file; every problem is an `InputError`.

    ``settings``: (keys, reader) when a line may carry settings of its own (`batch_io`): those
    keys are accepted, and ``reader(line, where)`` gives the line's `RowSettings` or None."""
    keys, settings_of = (_KEYS + settings[0], settings[1]) if settings else (_KEYS, None)
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
        prompts.append(Prompt(len(prompts), pid, tokens, text_of, settings=own))
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
            raise InputError(where, f'"text" is a {_json_type(text)}', 'give "text" as a string')
        _need_tokenizer(tokenizer, where, '"text"')
        tokens = tokenizer.encode(text)
        what = f"the text {_clip(json.dumps(text))} encodes to"
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
            raise InputError(where, f'"tokens" is a {_json_type(tokens)}', 'give "tokens" as a list of integer ids')
        what = '"tokens" has'
    if not tokens:
        raise InputError(where, f"{what} no tokens", "give a non-empty prompt")
    # the common case in C-speed builtins; the loop below only to name what is wrong
    if set(map(type, tokens)) == {int} and 0 <= min(tokens) and max(tokens) < vocab_size:
        return tuple(tokens), text
    for i, t in enumerate(tokens):
        if isinstance(t, bool) or not isinstance(t, int):
            raise InputError(where, f'"tokens"[{i}] is {_clip(json.dumps(t))}, a {_json_type(t)}',
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
        what = "an empty list" if messages == [] else f"a {_json_type(messages)}"
        raise InputError(where, f'"messages" is {what}', fix)
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise InputError(where, f'"messages"[{i}] is a {_json_type(m)}, not an object', fix)
        m = {k: v for k, v in m.items() if v is not None}
        role = m.get("role")
        if not isinstance(role, str) or not role:
            raise InputError(where, f'"messages"[{i}] has no "role" string' if role is None else
                             f'"messages"[{i}]["role"] is {_clip(json.dumps(role))}, not a role name', fix)
        if "content" not in m and "tool_calls" not in m:
            raise InputError(where, f'"messages"[{i}] ({role}) has no "content"', fix)
        out.append(m)
    return out


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
    The chat template and special tokens come from ``tokenizer_config.json`` found the same way
    (``chat_template.jinja`` wins over its ``chat_template``, as in transformers), the
    end-of-sequence ids from `eos_ids_beside`.
    """
    checkpoint = Path(checkpoint_path)
    found = _beside(checkpoint, "tokenizer.json")
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
    tok = Tokenizer(found, backend, eos_ids_beside(checkpoint), _chat_template_beside(checkpoint))
    log.debug("%r: vocab %d", tok, tok.vocab_size)
    return tok


def eos_ids_beside(checkpoint_path) -> tuple[int, ...]:
    """Every end-of-sequence id of the checkpoint, in order; () when its configs name none.

    ``eos_token_id`` of ``generation_config.json`` (an int or a list of ints), which is what
    transformers' ``generate`` stops at; only when that file is absent or names none, the
    ``eos_token`` of ``tokenizer_config.json`` looked up in ``tokenizer.json`` (read as JSON:
    the ``tokenizers`` package is not needed). Files are found as `load_tokenizer` finds them.
    A value that is not an id is an `InputError` naming the file.
    """
    checkpoint = Path(checkpoint_path)
    path = _beside(checkpoint, "generation_config.json")
    value = _read_json(path).get("eos_token_id")
    values = value if isinstance(value, list) else [] if value is None else [value]
    ids: list[int] = []
    for v in values:
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise InputError(str(path), f"eos_token_id is {_clip(json.dumps(value))}, not a token id "
                             "or a list of them", "copy generation_config.json again from the "
                             "Hugging Face model folder, or fix eos_token_id")
        if v not in ids:
            ids.append(v)
    if ids:
        return tuple(ids)
    eos = _special_tokens(_read_json(_beside(checkpoint, "tokenizer_config.json"))).get("eos_token")
    if eos is None:
        return ()
    found = _token_id(_beside(checkpoint, "tokenizer.json"), eos)
    return () if found is None else (found,)


def _token_id(tokenizer_json: Path | None, token: str) -> int | None:
    """The id of ``token`` in a tokenizer.json: its added tokens first, then the model vocab."""
    tj = _read_json(tokenizer_json)
    for added in tj.get("added_tokens") or []:
        if isinstance(added, dict) and added.get("content") == token and isinstance(added.get("id"), int):
            return added["id"]
    vocab = (tj.get("model") or {}).get("vocab")
    i = vocab.get(token) if isinstance(vocab, dict) else None
    return i if isinstance(i, int) and not isinstance(i, bool) else None


def _beside(checkpoint: Path, name: str) -> Path | None:
    """``<stem>.name`` beside the checkpoint, else ``name`` in its folder."""
    if checkpoint.is_dir():
        candidates = [checkpoint / name]
    else:
        candidates = [checkpoint.with_name(f"{checkpoint.stem}.{name}"), checkpoint.with_name(name)]
    return next((c for c in candidates if c.is_file()), None)


def _read_json(path: Path | None) -> dict:
    """A JSON object file ({} when path is None); anything else is an `InputError`."""
    if path is None:
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            obj = json.loads(f.read(1 << 26))
    except (OSError, ValueError) as e:
        raise InputError(str(path), f"cannot read it as JSON: {_clip(str(e), 200)}",
                         "copy it again from the Hugging Face model folder") from None
    if not isinstance(obj, dict):
        raise InputError(str(path), f"a JSON {_json_type(obj)}, not an object",
                         "copy it again from the Hugging Face model folder")
    return obj


# -- the chat template ----------------------------------------------------------------------------
# What transformers' `apply_chat_template` does (transformers/utils/chat_template_utils.py, 5.x):
# an ImmutableSandboxedEnvironment with trim_blocks and lstrip_blocks, the loopcontrols
# extension and a `{% generation %}` tag (it only marks assistant text: rendered as is here), a
# `tojson` filter that does not escape HTML, the globals raise_exception, strftime_now, dict and
# a namespace that refuses underscore names; rendered with messages, tools=None,
# documents=None, add_generation_prompt and the tokenizer's named special tokens as strings.

_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
                   "mask_token")  # transformers' SPECIAL_TOKENS_ATTRIBUTES
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class ChatError(ValueError):
    """A conversation the chat template cannot render: (what, fix); the caller names the place."""


class ChatTemplate:
    """A checkpoint's Jinja chat template, rendered as transformers renders it."""

    def __init__(self, source: str, special_tokens: dict[str, str], origin: Path):
        self.source, self.special_tokens, self.origin = source, dict(special_tokens), origin
        self._compiled = None  # compiled on first use: a prompt file of tokens never needs jinja2

    def render(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """The conversation as the model's prompt text; `ChatError` when it cannot be."""
        jinja2 = _import_jinja2()
        if self._compiled is None:
            try:
                self._compiled = _environment(jinja2).from_string(self.source)
            except jinja2.TemplateSyntaxError as e:
                raise ChatError(f"the chat template in {self.origin} is not valid Jinja "
                                f"(template line {e.lineno}: {e.message})",
                                "copy tokenizer_config.json again from the Hugging Face model folder") from None
        messages = [_alias_reasoning(m) for m in messages]
        try:
            return self._compiled.render(messages=messages, tools=None, documents=None,
                                         add_generation_prompt=add_generation_prompt, **self.special_tokens)
        except jinja2.TemplateError as e:  # raise_exception(...), an undefined name, a sandbox refusal
            how = "refused" if type(e) is jinja2.TemplateError else f"failed ({type(e).__name__}) on"
            raise ChatError(f"the chat template {how} these messages: {_clip(str(e), 300)}",
                            "give the roles and order this model's template accepts "
                            "(e.g. optional system, then user and assistant in turn, ending with user)") from None
        except Exception as e:  # a template bug met by these messages (TypeError, KeyError, ...)
            raise ChatError(f"the chat template failed on these messages: {type(e).__name__}: "
                            f"{_clip(str(e), 300)}", 'check "messages" against the model card\'s '
                            "chat format") from None


def _chat_template_beside(checkpoint: Path) -> ChatTemplate | None:
    """The checkpoint's chat template: ``chat_template.jinja``, else tokenizer_config's."""
    config_path = _beside(checkpoint, "tokenizer_config.json")
    config = _read_json(config_path)
    special = _special_tokens(config)
    jinja_path = _beside(checkpoint, "chat_template.jinja")
    if jinja_path is not None:
        try:
            return ChatTemplate(jinja_path.read_text(encoding="utf-8"), special, jinja_path)
        except (OSError, UnicodeDecodeError) as e:
            raise InputError(str(jinja_path), f"cannot read the chat template: {e}",
                             "copy it again from the Hugging Face model folder") from None
    template = config.get("chat_template")
    if isinstance(template, list):  # several named templates: transformers uses "default"
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if template is None:
        return None
    if not isinstance(template, str):
        raise InputError(str(config_path), f'"chat_template" is a {_json_type(template)}',
                         "copy tokenizer_config.json again from the Hugging Face model folder")
    return ChatTemplate(template, special, config_path)


def _special_tokens(config: dict) -> dict[str, str]:
    """The named special tokens of a tokenizer_config, as strings (older files: {"content": ...})."""
    out = {}
    for name in _SPECIAL_TOKENS:
        value = config.get(name)
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str):
            out[name] = value
    return out


def _alias_reasoning(message: dict) -> dict:
    """As transformers: a message's reasoning under any of its names is passed under all."""
    reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
    if reasoning is None:
        return message
    return {"thinking": reasoning, **message, "reasoning_content": reasoning}


def _import_jinja2():
    try:
        import jinja2
        import jinja2.sandbox  # noqa: F401
    except ImportError:
        raise ChatError("a chat prompt needs the jinja2 package, which is not installed",
                        "pip install 'rlx_mpi[text]'") from None
    return jinja2


_ENV = None


def _environment(jinja2):
    """The one Jinja environment of chat templates (transformers' settings); built once."""
    global _ENV
    if _ENV is not None:
        return _ENV
    from datetime import datetime

    import jinja2.ext
    import jinja2.nodes
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationTag(jinja2.ext.Extension):
        """``{% generation %}...{% endgeneration %}``: transformers tracks the assistant's text
        with it (for training masks); rendering is unchanged, so the body is output as is."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(format):
        return datetime.now().strftime(format)

    class TemplateDict:
        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    class TemplateNamespace(jinja2.utils.Namespace):
        def __init__(*args, **kwargs):
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check_name(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"a namespace attribute may not start with '_': {name!r}")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now, dict=TemplateDict(),
                       namespace=TemplateNamespace)
    _ENV = env
    return env
