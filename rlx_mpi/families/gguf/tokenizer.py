"""The tokenizer files rebuilt from a GGUF's ``tokenizer.ggml.*`` metadata (`tokenizer_files`):
``tokenizer.json`` as transformers builds it from the same metadata, ``tokenizer_config.json``
(special tokens, chat template), ``generation_config.json`` (end-of-sequence ids)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ...errors import CheckpointError

__all__ = ["tokenizer_files"]


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (byte-level BPE spells every token with it)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


# tokenizer.ggml.pre -> the split regex its merges were learned with (transformers'
# integrations/gguf table, from llama.cpp's llama-vocab.cpp); others keep GPT-2's
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_TEKKEN = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
           r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
           r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_GPT4O = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
          r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
          r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_SPLITS = {**dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral", "dbrx", "smaug-bpe"), _LLAMA3),
           **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "megrez"), _QWEN2), "tekken": _TEKKEN,
           **dict.fromkeys(("gpt-4o", "llama4"), _GPT4O)}


def _merges(meta: dict, vocab: dict[str, int], scores: dict[str, float] | None) -> list[tuple[str, str]]:
    """The file's merges, or (SentencePiece files have none) every split of a token into two
    vocabulary pieces, best score first (transformers' generate_merges)."""
    given = meta.get("tokenizer.ggml.merges")
    if given:
        return [tuple(m.split(" ", 1)) for m in given]
    found = []
    for token, score in (scores or {}).items():
        local = [(token[:i], token[i:], score) for i in range(1, len(token))
                 if token[:i] in vocab and token[i:] in vocab]
        found.extend(sorted(local, key=lambda x: (vocab[x[0]], vocab[x[1]])))
    found.sort(key=lambda x: (x[2], len(x[0]), len(x[1])), reverse=True)
    return [(a, b) for a, b, _ in found]


def _build_tokenizer(meta: dict, arch: str):
    """A `tokenizers.Tokenizer` equal to the one transformers builds from the same metadata
    (integrations/gguf: GPT2Tokenizer for ``gpt2``, LlamaTokenizer / GemmaTokenizer for ``llama``)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

    kind = meta.get("tokenizer.ggml.model")
    tokens = list(meta.get("tokenizer.ggml.tokens") or ())
    types = list(meta.get("tokenizer.ggml.token_type") or ())
    where = "tokenizer.ggml.model"
    if kind == "gpt2":
        spelling = _bytes_to_unicode()
        alphabet = set(spelling.values())
        vocab = {t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8")): i
                 for i, t in enumerate(tokens)}
        tok = Tokenizer(models.BPE(vocab, _merges(meta, vocab, None), dropout=None, continuing_subword_prefix="",
                                   end_of_word_suffix="", fuse_unk=False))
        split = _SPLITS.get(meta.get("tokenizer.ggml.pre"))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False) if split is None else \
            pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), behavior="isolated"),
                                     pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        tok.decoder = decoders.ByteLevel()
        control_ok = lambda t: set(t) <= alphabet  # noqa: E731 (a mislabelled token would grow the vocab)
    elif kind == "llama":
        scores = list(meta.get("tokenizer.ggml.scores") or ())
        gemma = arch in ("gemma", "gemma2", "gemma3")
        if gemma:  # runs of spaces are stored as spaces; merges follow the file's order, not its scores
            tokens = ["\u2581" * len(t) if " " in t and not t.strip() else t for t in tokens]
        vocab = {t: i for i, t in enumerate(tokens)}
        order = {t: -i for i, t in enumerate(tokens)} if gemma else dict(zip(tokens, scores))
        unk = meta.get("tokenizer.ggml.unknown_token_id")
        tok = Tokenizer(models.BPE(vocab, _merges(meta, vocab, order), fuse_unk=True, byte_fallback=True,
                                   dropout=None, unk_token=tokens[unk] if gemma and unk is not None else None))
        if gemma:
            tok.normalizer = normalizers.Replace(" ", "\u2581")
            tok.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
            tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
        else:
            if arch == "phi3":  # the prefix space from a normalizer (Phi-3's tokenizer.json), not Metaspace
                tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
            else:
                tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first", split=False)
            tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                             decoders.Strip(" ", 1, 0)])
        control_ok = lambda t: True  # noqa: E731
    else:
        raise CheckpointError(where, f"is {kind!r}: no tokenizer is built for it",
                              "give token ids in the prompt file (\"tokens\"); supported: gpt2, llama")
    control = [AddedToken(t, normalized=False, special=True)
               for t, ty in zip(tokens, types) if ty == 3 and control_ok(t)]  # 3: CONTROL
    named = [tokens[i] for i in _special_ids(meta).values() if i is not None and 0 <= i < len(tokens)]
    control += [AddedToken(t, normalized=False, special=True) for t in named if t not in {c.content for c in control}]
    if control:
        tok.add_special_tokens(control)
    user = [AddedToken(t, normalized=False, special=False)
            for t, ty in zip(tokens, types) if ty == 4 and t in vocab]  # 4: USER_DEFINED, matched whole
    if user:
        tok.add_tokens(user)
    if _add_bos(meta) and meta.get("tokenizer.ggml.bos_token_id") is not None:
        from tokenizers import processors

        bos = tokens[meta["tokenizer.ggml.bos_token_id"]]
        bos_id = meta["tokenizer.ggml.bos_token_id"]
        tok.post_processor = processors.TemplateProcessing(single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1",
                                                           special_tokens=[(bos, bos_id)])
    return tok


def _special_ids(meta: dict) -> dict[str, int | None]:
    return {name: meta.get(f"tokenizer.ggml.{key}") for name, key in
            (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"), ("unk_token", "unknown_token_id"),
             ("pad_token", "padding_token_id"))}


def _add_bos(meta: dict) -> bool:
    # transformers: a SentencePiece vocabulary that does not say adds BOS, as llama.cpp does
    return bool(meta.get("tokenizer.ggml.add_bos_token", meta.get("tokenizer.ggml.model") == "llama"))


def tokenizer_files(meta: dict, vocabulary: bool = True) -> dict[str, str]:
    """The files `tokenizer.load_tokenizer` reads, as text: ``tokenizer.json`` (when the metadata
    has a vocabulary and ``vocabulary``; it needs the tokenizers package), ``tokenizer_config.json``
    (special tokens, chat template) and ``generation_config.json`` (the end-of-sequence ids
    generate stops at)."""
    tokens = (meta.get("tokenizer.ggml.tokens") or []) if vocabulary else []
    eos = [meta.get(f"tokenizer.ggml.{k}") for k in ("eos_token_id", "eot_token_id", "eom_token_id")]
    eos = list(dict.fromkeys(i for i in eos if isinstance(i, int)))
    generation = {"eos_token_id": eos[0] if len(eos) == 1 else eos, "bos_token_id": meta.get("tokenizer.ggml.bos_token_id")}
    files = {"generation_config.json": json.dumps({k: v for k, v in generation.items() if v not in (None, [])}, indent=1)}
    if not tokens:
        return files
    config: dict[str, Any] = {name: tokens[i] for name, i in _special_ids(meta).items()
                              if isinstance(i, int) and 0 <= i < len(tokens)}
    config["add_bos_token"] = _add_bos(meta)
    config["add_eos_token"] = bool(meta.get("tokenizer.ggml.add_eos_token", False))
    if meta.get("tokenizer.chat_template") is not None:
        config["chat_template"] = meta["tokenizer.chat_template"]
    files["tokenizer_config.json"] = json.dumps(config, indent=1, ensure_ascii=False)
    files["tokenizer.json"] = _build_tokenizer(meta, meta.get("general.architecture")).to_str()
    return files


def _write_beside(out_path: Path, files: dict[str, str]) -> list[Path]:
    """``<stem>.<name>`` beside the checkpoint, each through a temporary name (hf.copy_tokenizer's way)."""
    from ..hf.converter import write_through

    return [write_through(out_path.with_name(f"{out_path.stem}.{name}"),
                          lambda tmp, text=text: tmp.write_text(text, encoding="utf-8"))
            for name, text in files.items()]
