"""Make ``tests/fixtures/score_hf_tiny_llama.npz``: transformers' teacher-forced log-likelihood
of ``hf_tiny_llama``'s input ids, the reference for `rlx_mpi.io.scoring`.

Run once, by hand, in the torch venv: ``/work/torchvenv/bin/python tests/make_score_fixture.py``.
Saves the per-token log-probs ``token_logprobs`` (B, T-1) = log_softmax(logits)[t-1, ids[t]]
(float32, torch), the loss transformers computes itself for ``labels=input_ids`` (``loss``:
mean negative log-likelihood of tokens 1..T-1, so the perplexity is exp(loss)), and the
versions used.
"""
import os

import numpy as np
import torch
import transformers
from transformers import AutoModelForCausalLM

here = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures")
src = os.path.join(here, "hf_tiny_llama")
model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
ids = torch.from_numpy(np.load(os.path.join(src, "input_ids.npy")))
with torch.no_grad():
    out = model(ids, labels=ids)
# the per-token values from logits.npy itself (what the tests feed rlx_mpi.io.scoring), the loss
# from this run of the model (its logits equal logits.npy to float32 rounding)
logits_ref = torch.from_numpy(np.load(os.path.join(src, "logits.npy")))
diff = float((out.logits - logits_ref).abs().max())
assert diff < 1e-4, f"the model's logits differ from logits.npy by {diff}"
lp = torch.log_softmax(logits_ref, dim=-1)  # (B, T, V)
tok = lp[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]  # (B, T-1): token t given 0..t-1
np.savez(os.path.join(here, "score_hf_tiny_llama.npz"), token_logprobs=tok.numpy().astype(np.float32),
         loss=np.float32(out.loss.item()), versions=np.array(f"torch {torch.__version__}, "
                                                             f"transformers {transformers.__version__}"))
print("logits diff", diff, "loss", out.loss.item(), "ppl", float(np.exp(out.loss.item())))
