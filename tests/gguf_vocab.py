"""Small GGUF files that hold only a tokenizer (and the few keys a loader needs), one per
tokenizer kind `families.gguf` rebuilds: SentencePiece (``llama``) for Llama 2 and Phi-3,
byte-level BPE (``gpt2``) with llama.cpp's ``llama-bpe`` split and without. Shared by
`tests/make_gguf_tokenizer_fixture.py` (transformers' ids, in the torch venv) and
`tests/test_gguf_tokenizer.py` (ours), so both read the very same files.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["KINDS", "TEXTS", "write_vocab_gguf"]

TEXTS = ["hello world", " hello  world", "Hello, World!", "low lower lowest", "héllo wörld ☃",
         "new\nline and\ttab", "<s>inside</s> text", "<|user|>hi<|end|>", "  ", "12345 67"]

# Sentencepiece-style pieces with scores (higher merges first), besides the byte tokens
_SPM_PIECES = [("▁", -1.0), ("▁h", -2.0), ("▁w", -2.5), ("e", -3.0), ("l", -3.0), ("o", -3.0), ("h", -3.5),
               ("w", -3.5), ("r", -3.5), ("d", -3.5), ("t", -4.0), ("x", -4.0), ("n", -4.0), ("i", -4.0),
               ("s", -4.0), ("a", -4.0), ("b", -4.0), ("H", -4.5), ("W", -4.5), ("1", -5.0), ("2", -5.0),
               ("ll", -5.5), ("lo", -5.6), ("or", -5.7), ("▁he", -6.0), ("▁hel", -6.5), ("▁hello", -7.0),
               ("▁wor", -7.5), ("▁world", -8.0), ("ld", -8.5), ("▁l", -9.0), ("▁lo", -9.5), ("▁low", -10.0),
               ("er", -10.5), ("est", -11.0), ("es", -11.5), ("▁lower", -12.0), ("▁t", -12.5), ("ex", -13.0)]
_BYTE_LEVEL_MERGES = ["Ġ h", "e l", "Ġh el", "l o", "Ġhel lo", "Ġ w", "o r", "Ġw or", "Ġwor ld", "l d",
                      "Ġ l", "Ġl o", "Ġlo w", "e r", "Ġlow er", "e s", "es t", "1 2", "12 3"]


def _bytes_to_unicode() -> dict[int, str]:
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    out, extra = {}, 0
    for b in range(256):
        out[b] = chr(b) if b in keep else chr(256 + extra)
        extra += b not in keep
    return out


def _spm(w, arch: str) -> None:
    special = [("<unk>", 2), ("<s>", 3), ("</s>", 3)]
    if arch == "phi3":
        special += [("<|user|>", 4), ("<|end|>", 3)]  # user-defined and control, as Phi-3's
    tokens = [t for t, _ in special] + [f"<0x{b:02X}>" for b in range(256)] + [p for p, _ in _SPM_PIECES]
    scores = [0.0] * len(special) + [0.0] * 256 + [s for _, s in _SPM_PIECES]
    types = [ty for _, ty in special] + [6] * 256 + [1] * len(_SPM_PIECES)  # 6: BYTE, 1: NORMAL
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_unk_token_id(0)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)


def _byte_level(w, pre: str | None) -> None:
    spelled = _bytes_to_unicode()
    tokens = ["<|endoftext|>", "<|user|>"] + [spelled[b] for b in range(256)]
    tokens += ["".join(m.split(" ")) for m in _BYTE_LEVEL_MERGES]
    w.add_tokenizer_model("gpt2")
    if pre:
        w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types([3, 4] + [1] * (len(tokens) - 2))
    w.add_token_merges(_BYTE_LEVEL_MERGES)
    w.add_bos_token_id(0)
    w.add_eos_token_id(0)
    w.add_add_bos_token(False)


# kind -> (architecture, writer)
KINDS = {
    "spm-llama": ("llama", lambda w: _spm(w, "llama")),
    "spm-phi3": ("phi3", lambda w: _spm(w, "phi3")),
    "bpe-gpt2": ("llama", lambda w: _byte_level(w, None)),
    "bpe-llama3": ("llama", lambda w: _byte_level(w, "llama-bpe")),
    "bpe-qwen2": ("qwen2", lambda w: _byte_level(w, "qwen2")),
}


def write_vocab_gguf(path: Path, kind: str) -> Path:
    """A GGUF of ``kind`` with a tokenizer and the shape keys transformers' loader reads (no tensors)."""
    import gguf

    arch, add = KINDS[kind]
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_embedding_length(32)
    w.add_feed_forward_length(64)
    w.add_head_count(4)
    w.add_head_count_kv(4)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    add(w)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
