"""Make tests/fixtures/logprobs_generate_hf_tiny_llama.npz: transformers' log-probs of its
own greedy generation, the reference for ``rlx-mpi generate --logprobs K``.

For each prompt of ``hf_tiny_llama/generate.json`` (alone, no padding, eager attention,
float32) ``generate(do_sample=False, output_logits=True, return_dict_in_generate=True)``
gives the raw (temperature-free) logits of every step; ``torch.log_softmax`` of them gives the
chosen token's log-prob and, sorted (descending, stable: ties by the lower id), the top K.
Run: ``/work/torchvenv/bin/python tests/make_logprobs_generate_fixture.py``.
"""
import json
import sys
from pathlib import Path

import numpy as np
import torch
import transformers
from transformers import LlamaForCausalLM

K = 5
FIXTURES = Path(__file__).resolve().parent / "fixtures"


def main() -> int:
    src = FIXTURES / "hf_tiny_llama"
    ref = json.loads((src / "generate.json").read_text())
    model = LlamaForCausalLM.from_pretrained(src, attn_implementation="eager", dtype=torch.float32).eval()
    tokens, chosen, top_ids, top_lp = [], [], [], []
    for prompt in ref["prompts"]:
        ids = torch.tensor([prompt], dtype=torch.int64)
        with torch.no_grad():
            out = model.generate(ids, do_sample=False, max_new_tokens=ref["max_new_tokens"],
                                 min_new_tokens=ref["max_new_tokens"], attention_mask=torch.ones_like(ids),
                                 pad_token_id=0, eos_token_id=None, output_logits=True, return_dict_in_generate=True)
        new = out.sequences[0, len(prompt):]
        lp = torch.log_softmax(torch.stack(out.logits)[:, 0].float(), dim=-1)  # (steps, V)
        vals, order = torch.sort(lp, dim=-1, descending=True, stable=True)
        tokens.append(new.numpy())
        chosen.append(lp[torch.arange(len(new)), new].numpy())
        top_ids.append(order[:, :K].numpy())
        top_lp.append(vals[:, :K].numpy())
    tokens = np.stack(tokens)
    assert tokens.tolist() == ref["tokens"], "the greedy tokens differ from generate.json"
    out = FIXTURES / "logprobs_generate_hf_tiny_llama.npz"
    np.savez(out, tokens=tokens, chosen_lp=np.stack(chosen), top_ids=np.stack(top_ids), top_lp=np.stack(top_lp),
             versions=np.array(f"torch {torch.__version__}, transformers {transformers.__version__}"))
    print("wrote", out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
