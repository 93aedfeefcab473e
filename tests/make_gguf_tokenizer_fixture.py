"""Record the ids transformers gives for `tests/gguf_vocab.py`'s small tokenizer-only GGUFs
(SentencePiece for Llama 2 and Phi-3, byte-level BPE plain, with llama.cpp's llama-bpe split and
as Qwen2): `tests/test_gguf_tokenizer.py` checks the tokenizer.json `families.gguf` builds from the
same files against them. Run once, in the torch venv (tests never import transformers):

    /work/tvenv/bin/python tests/make_gguf_tokenizer_fixture.py
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

from transformers import AutoTokenizer

sys.path.insert(0, str(Path(__file__).parent))
from gguf_vocab import KINDS, TEXTS, write_vocab_gguf  # noqa: E402

OUT = Path(__file__).parent / "fixtures" / "gguf_tokenizer_ids.json"


def main() -> None:
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for kind in KINDS:
            path = write_vocab_gguf(Path(tmp) / f"{kind}.gguf", kind)
            tok = AutoTokenizer.from_pretrained(tmp, gguf_file=path.name)
            out[kind] = {"ids": [tok(t)["input_ids"] for t in TEXTS],
                         "decoded": [tok.decode(tok(t)["input_ids"], skip_special_tokens=True) for t in TEXTS]}
    OUT.write_text(json.dumps({"texts": TEXTS, "kinds": out}, ensure_ascii=False) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
