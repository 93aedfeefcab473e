"""Generate the LoRA reference fixtures in ``tests/fixtures/lora/`` (issue 44).

Run ONCE, BY HAND, in a torch venv; the test suite never runs or imports this script (tests
need numpy + safetensors, never torch or peft). Its outputs are committed.

Exact command line used (from the repo root)::

    python3 -m venv /tmp/tvenv && /tmp/tvenv/bin/pip install torch==2.13.0 transformers safetensors peft
    /tmp/tvenv/bin/python tests/make_lora_fixtures.py

Versions used: recorded in ``tests/fixtures/lora/versions.json`` (torch 2.13.0+cpu,
transformers 5.25.0, peft 0.21.2 at the time of writing).

Base models: the committed family fixtures ``tests/fixtures/families/llama_linear`` (llama, 2
layers, 4 heads / 2 kv, untied) and ``qwen2`` (q/k/v biases, tied head), loaded as they are.

For each base ``<case>`` it writes ``tests/fixtures/lora/<case>/<adapter>/`` (PEFT's
``save_pretrained``: ``adapter_config.json`` + ``adapter_model.safetensors``) for:

=========  ===========================================================================
``r8``     r 8, lora_alpha 16, target_modules the list q/k/v/o_proj, gate/up/down_proj
``r16rs``  r 16, lora_alpha 24, ``use_rslora`` (scaling alpha / sqrt(r)), target_modules
           the regex string ``.*\\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)``,
           ``rank_pattern`` {"o_proj": 4}, ``alpha_pattern`` {"down_proj": 8}
``part``   r 16, lora_alpha 16, q_proj/v_proj/down_proj only, ``layers_to_transform`` [1]
=========  ===========================================================================

PEFT initialises B to zero (an adapter that changes nothing); every lora_A / lora_B here is
drawn ``normal_(0, 0.2)`` after ``torch.manual_seed(s)`` (s = 7 + i, then + 100 until the
greedy run passes the margin check below; the seed is in ``seeds.json``), so each adapter moves the logits
(checked: by more than 0.05).

``reference.npz`` per case (plain arrays): ``input_ids`` int64 [2, 24] (seed 99), and for each
adapter ``logits_<adapter>`` float32 [2, 24, V] (the PeftModel's forward, eval, no_grad,
eager attention) and ``greedy_<adapter>`` int64 [12]: the new tokens of an argmax loop over
full forwards from ``prompt_ids`` [1, 8] (seed 4321), each step's top-1 beating top-2 by at
least 1e-3; ``logits_base`` / ``greedy_base`` the same for the base model.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent
FAMILIES = ROOT / "fixtures" / "families"
OUT = ROOT / "fixtures" / "lora"
MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ADAPTERS = {
    "r8": dict(r=8, lora_alpha=16, target_modules=MODULES),
    "r16rs": dict(r=16, lora_alpha=24, use_rslora=True,
                  target_modules=r".*\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)",
                  rank_pattern={"o_proj": 4}, alpha_pattern={"down_proj": 8}),
    "part": dict(r=16, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"], layers_to_transform=[1]),
}
CASES = ["llama_linear", "qwen2"]
MIN_MARGIN = 1e-3


def greedy(model, prompt: torch.Tensor, n: int) -> list[int]:
    ids = prompt.clone()
    out = []
    for _ in range(n):
        logits = model(ids).logits[0, -1]
        top = torch.topk(logits, 2).values
        if float(top[0] - top[1]) < MIN_MARGIN:
            return None
        t = int(logits.argmax())
        out.append(t)
        ids = torch.cat([ids, torch.tensor([[t]])], dim=1)
    return out


def main() -> None:
    import peft
    import safetensors
    import transformers
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    cases = sys.argv[1:] or CASES
    seeds: dict[str, int] = {}
    for case in cases:
        base_dir = FAMILIES / case
        out = OUT / case
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
        ref: dict[str, np.ndarray] = {}
        ids = torch.randint(3, 200, (2, 24), generator=torch.Generator().manual_seed(99))
        prompt = torch.randint(3, 200, (1, 8), generator=torch.Generator().manual_seed(4321))
        ref["input_ids"], ref["prompt_ids"] = ids.numpy(), prompt.numpy()
        with torch.no_grad():
            base = AutoModelForCausalLM.from_pretrained(base_dir, attn_implementation="eager").eval()
            ref["logits_base"] = base(ids).logits.float().numpy()
            ref["greedy_base"] = np.array(greedy(base, prompt, 12), np.int64)
        for i, (name, kw) in enumerate(ADAPTERS.items()):
            for seed in range(7 + i, 1000, 100):  # the first seed whose greedy run passes the margin
                model = AutoModelForCausalLM.from_pretrained(base_dir, attn_implementation="eager").eval()
                model = get_peft_model(model, LoraConfig(task_type="CAUSAL_LM", lora_dropout=0.0, **kw)).eval()
                torch.manual_seed(seed)
                with torch.no_grad():
                    for pname, p in model.named_parameters():
                        if "lora_A" in pname or "lora_B" in pname:
                            p.normal_(0.0, 0.2)
                    if greedy(model, prompt, 12) is not None:
                        break
            with torch.no_grad():
                logits = model(ids).logits.float().numpy()
                moved = float(np.abs(logits - ref["logits_base"]).max())
                if moved < 0.05:
                    raise SystemExit(f"{case}/{name} moves the logits by only {moved}")
                ref[f"logits_{name}"] = logits
                ref[f"greedy_{name}"] = np.array(greedy(model, prompt, 12), np.int64)
            model.save_pretrained(out / name, safe_serialization=True)
            (out / name / "README.md").unlink(missing_ok=True)  # (PEFT's model-card template: 200 lines of nothing)
            conf = json.loads((out / name / "adapter_config.json").read_text())  # (no absolute path in a fixture)
            conf["base_model_name_or_path"] = f"tests/fixtures/families/{case}"
            (out / name / "adapter_config.json").write_text(json.dumps(conf, indent=2, sort_keys=True) + "\n")
            seeds[f"{case}/{name}"] = seed
            print(case, name, "moves logits by", round(moved, 3), "greedy", ref[f"greedy_{name}"].tolist())
        np.savez(out / "reference.npz", **ref)
    versions = {"torch": torch.__version__, "transformers": transformers.__version__, "peft": peft.__version__,
                "safetensors": safetensors.__version__, "numpy": np.__version__}
    (OUT / "seeds.json").write_text(json.dumps(seeds, indent=1) + "\n")
    (OUT / "versions.json").write_text(json.dumps(versions, indent=1) + "\n")


if __name__ == "__main__":
    main()
