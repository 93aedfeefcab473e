"""Make tests/fixtures/logprobs_torch.npz: torch.log_softmax of random float32 logits (the
reference for rlx_mpi.engine.sampling.logprobs). Run with /work/torchvenv/bin/python."""
import sys
import numpy as np
import torch

rng = np.random.default_rng(17)
logits = (rng.standard_normal((4, 512)) * 4).astype(np.float32)
logits[1, [7, 9, 300, 301]] = logits[1].max() + 1  # ties at the top
logits[2, :] = np.float32(-3.5)  # all tied
logits[3, 100] = 60.0  # peaked: tiny tail probabilities
t = torch.from_numpy(logits)
lp = torch.log_softmax(t, dim=-1)
vals, ids = torch.sort(lp, dim=-1, descending=True, stable=True)
np.savez(sys.argv[1], logits=logits, log_softmax=lp.numpy(), sorted_ids=ids[:, :16].numpy(),
         sorted_lp=vals[:, :16].numpy(), torch_version=np.array(torch.__version__))
