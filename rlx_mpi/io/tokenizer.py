"""A checkpoint's tokenizer, chat template and end-of-sequence ids, found beside it.

The tokenizer is a Hugging Face ``tokenizer.json`` (the ``tokenizers`` package: ``pip install
'rlx_mpi[text]'``); the chat template is ``chat_template`` in ``tokenizer_config.json``, or
``chat_template.jinja``, rendered with ``jinja2`` exactly as transformers' ``apply_chat_template``
renders it. `prompts.py` uses them to read ``text`` and ``messages`` prompts, the drivers to
decode rows and to stop.

End-of-sequence ids (`eos_ids_beside`): ``eos_token_id`` of the checkpoint's
``generation_config.json`` (an int or a list: Llama 3 lists three), which is what
transformers' ``generate`` stops at; only when it names none, the tokenizer config's
``eos_token``. Generation stops at any of them.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from ..errors import InputError, clip, json_type

__all__ = ["Tokenizer", "ChatTemplate", "ChatError", "load_tokenizer", "eos_ids_beside"]

log = logging.getLogger(__name__)


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
        raise InputError(str(found), f"not a tokenizers file: {clip(str(e), 200)}",
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
            raise InputError(str(path), f"eos_token_id is {clip(json.dumps(value))}, not a token id "
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
        raise InputError(str(path), f"cannot read it as JSON: {clip(str(e), 200)}",
                         "copy it again from the Hugging Face model folder") from None
    if not isinstance(obj, dict):
        raise InputError(str(path), f"a JSON {json_type(obj)}, not an object",
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
            raise ChatError(f"the chat template {how} these messages: {clip(str(e), 300)}",
                            "give the roles and order this model's template accepts "
                            "(e.g. optional system, then user and assistant in turn, ending with user)") from None
        except Exception as e:  # a template bug met by these messages (TypeError, KeyError, ...)
            raise ChatError(f"the chat template failed on these messages: {type(e).__name__}: "
                            f"{clip(str(e), 300)}", 'check "messages" against the model card\'s '
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
        raise InputError(str(config_path), f'"chat_template" is a {json_type(template)}',
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
