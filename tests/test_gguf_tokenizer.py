"""The tokenizer `families.gguf` rebuilds from a GGUF's ``tokenizer.ggml.*`` metadata gives the ids
transformers gives from the same file (`tests/fixtures/gguf_tokenizer_ids.json`, made by
`tests/make_gguf_tokenizer_fixture.py`): SentencePiece vocabularies (Llama 2's builder and
Phi-3's), byte-level BPE without a split rule, with llama.cpp's llama-bpe split and as Qwen2.
The real SmolLM2 (byte-level) and Gemma 3 (SentencePiece) vocabularies are in
`test_gguf_realmodel.py`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("gguf")
tokenizers = pytest.importorskip("tokenizers")

from gguf_vocab import KINDS, write_vocab_gguf  # noqa: E402
from rlx_mpi.families.gguf import open_gguf, read_metadata, tokenizer_files  # noqa: E402

FIXTURE = json.loads((Path(__file__).parent / "fixtures" / "gguf_tokenizer_ids.json").read_text())


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_ids_equal_transformers(tmp_path, kind):
    meta = read_metadata(open_gguf(write_vocab_gguf(tmp_path / f"{kind}.gguf", kind)))
    files = tokenizer_files(meta)
    tok = tokenizers.Tokenizer.from_str(files["tokenizer.json"])
    want = FIXTURE["kinds"][kind]
    for text, ids, decoded in zip(FIXTURE["texts"], want["ids"], want["decoded"]):
        got = tok.encode(text).ids
        assert got == ids, (kind, text)
        assert tok.decode(got, skip_special_tokens=True) == decoded, (kind, text)
