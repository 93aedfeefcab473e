"""Generate the Hugging Face Llama reference fixtures in ``tests/fixtures/``.

This script is run ONCE, BY HAND, in a separate torch venv; the test suite
never runs or imports it (tests need numpy + safetensors only, never torch).
The fixtures it writes are committed to the repo.

Exact command line used (from the repo root)::

    python3 -m venv /work/torchvenv
    /work/torchvenv/bin/pip install torch==2.13.0 transformers safetensors
    /work/torchvenv/bin/python tests/make_hf_fixture.py

Versions used to produce the committed fixtures: torch 2.13.0+cpu,
transformers 5.24.0, safetensors 0.8.0 (also recorded per fixture in
``versions.json``).  Python 3.11.

What it writes, for each model directory under ``tests/fixtures/``:

* ``config.json`` + ``model.safetensors``: ``LlamaForCausalLM.save_pretrained(
  dir, safe_serialization=True)``.  Tensors are float32.  ``config.json`` is
  in transformers **5.x style**: RoPE is given as
  ``"rope_parameters": {"rope_type": "default", "rope_theta": ...}`` and there
  is no top-level ``rope_theta``.
* ``config_v4.json``: the same config rewritten by this script in transformers
  **4.x style**: top-level ``"rope_theta"`` and ``"rope_scaling": null``, no
  ``rope_parameters``; ``dtype`` renamed to ``torch_dtype``.  (Our converter
  must accept both styles.)
* ``input_ids.npy``: int64 [2, 7], seeded, values < vocab_size.
* ``logits.npy``: float32 [2, 7, vocab_size] = ``model(input_ids).logits``
  under ``torch.no_grad()``, eval mode, ``attn_implementation="eager"``,
  no attention mask (full causal attention on both rows).
* ``versions.json``: torch / transformers / safetensors / numpy versions.
* ``generation_config.json``: written by ``save_pretrained`` itself; unused.
* ``generate.json``: greedy ``generate(do_sample=False)`` tokens of two seeded prompts of
  different lengths (see ``record_generate``; ``--generate`` adds only this file).

Models (``torch.manual_seed(0)`` before each build):

* ``hf_tiny_llama``: vocab 256, hidden 64, intermediate 128, 4 layers,
  8 heads, 4 kv heads (head_dim 8), rope_theta 500000, untied lm_head.
* ``hf_tiny_llama_tied``: same but 3 layers, 2 kv heads, rope_theta 10000,
  ``tie_word_embeddings=True``.

Weight changes after HF's default init (so the test is sensitive to every
weight and logits are O(1)):

* every Linear / Embedding weight is multiplied by 10 (HF init std 0.02 ->
  0.2); a tied embedding/lm_head tensor is scaled only once;
* every RMSNorm weight (input_layernorm, post_attention_layernorm, final norm)
  is set to ``1 + 0.1 * randn``.

Verification done by this script: each saved model is reloaded from disk with
transformers and its logits must equal ``logits.npy`` exactly; an independent
pure-numpy Llama forward (``numpy_llama_logits`` below, reading the
safetensors with ``safetensors.numpy.load_file``) must agree to ~1e-5.
"""

import json
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
FIXTURES = os.path.join(HERE, "fixtures")

COMMON = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=8,
    max_position_embeddings=64,
    rms_norm_eps=1e-5,
    attention_bias=False,
    mlp_bias=False,
)
MODELS = {
    "hf_tiny_llama": dict(COMMON, num_hidden_layers=4, num_key_value_heads=4,
                          tie_word_embeddings=False, rope_theta=500000.0),
    "hf_tiny_llama_tied": dict(COMMON, num_hidden_layers=3, num_key_value_heads=2,
                               tie_word_embeddings=True, rope_theta=10000.0),
}
BATCH, SEQ = 2, 7


# ---------------------------------------------------------------- numpy check
def numpy_llama_logits(tensors, cfg, input_ids):
    """Independent float32 numpy Llama forward; cfg is a config.json dict."""
    H, nh, nkv = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg.get("head_dim") or H // nh
    eps = cfg["rms_norm_eps"]
    theta = (cfg.get("rope_parameters") or {}).get("rope_theta", cfg.get("rope_theta"))
    W = {k: v.astype(np.float32) for k, v in tensors.items()}

    def rmsnorm(x, w):
        var = np.mean(x * x, axis=-1, keepdims=True)
        return (x / np.sqrt(var + np.float32(eps))).astype(np.float32) * w

    def silu(x):
        return x / (np.float32(1) + np.exp(-x))

    B, T = input_ids.shape
    inv_freq = 1.0 / (theta ** (np.arange(0, hd, 2, dtype=np.float64) / hd))
    ang = np.arange(T, dtype=np.float64)[:, None] * inv_freq[None, :]
    emb = np.concatenate([ang, ang], axis=-1)  # [T, hd]
    cos, sin = np.cos(emb).astype(np.float32), np.sin(emb).astype(np.float32)

    def rope(x):  # x [B, heads, T, hd], rotate-half convention
        x1, x2 = x[..., : hd // 2], x[..., hd // 2:]
        return x * cos + np.concatenate([-x2, x1], axis=-1) * sin

    mask = np.triu(np.full((T, T), -np.inf, dtype=np.float32), k=1)
    x = W["model.embed_tokens.weight"][input_ids]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        h = rmsnorm(x, W[p + "input_layernorm.weight"])
        q = (h @ W[p + "self_attn.q_proj.weight"].T).reshape(B, T, nh, hd).transpose(0, 2, 1, 3)
        k = (h @ W[p + "self_attn.k_proj.weight"].T).reshape(B, T, nkv, hd).transpose(0, 2, 1, 3)
        v = (h @ W[p + "self_attn.v_proj.weight"].T).reshape(B, T, nkv, hd).transpose(0, 2, 1, 3)
        q, k = rope(q), rope(k)
        k, v = np.repeat(k, nh // nkv, axis=1), np.repeat(v, nh // nkv, axis=1)  # repeat_interleave
        s = q @ k.transpose(0, 1, 3, 2) / np.float32(np.sqrt(hd)) + mask
        s = np.exp(s - s.max(-1, keepdims=True))
        a = (s / s.sum(-1, keepdims=True)) @ v  # [B, nh, T, hd]
        a = a.transpose(0, 2, 1, 3).reshape(B, T, nh * hd)
        x = x + a @ W[p + "self_attn.o_proj.weight"].T
        h = rmsnorm(x, W[p + "post_attention_layernorm.weight"])
        g = h @ W[p + "mlp.gate_proj.weight"].T
        u = h @ W[p + "mlp.up_proj.weight"].T
        x = x + (silu(g) * u) @ W[p + "mlp.down_proj.weight"].T
    x = rmsnorm(x, W["model.norm.weight"])
    lm = W.get("lm_head.weight", W["model.embed_tokens.weight"])
    return (x @ lm.T).astype(np.float32)


# ---------------------------------------------------------------- generation
def make_config(spec, transformers):
    from transformers import LlamaConfig

    kw = dict(spec)
    theta = kw.pop("rope_theta")
    if int(transformers.__version__.split(".")[0]) >= 5:
        kw["rope_parameters"] = {"rope_type": "default", "rope_theta": theta}
    else:
        kw["rope_theta"] = theta
    return LlamaConfig(**kw)


def alt_style_config(cfg):
    """Return (filename, dict) of the config in the *other* major style."""
    cfg = dict(cfg)
    if "rope_parameters" in cfg:  # 5.x -> 4.x
        rp = cfg.pop("rope_parameters")
        assert rp.get("rope_type", "default") == "default", rp
        cfg["rope_theta"] = rp["rope_theta"]
        cfg["rope_scaling"] = None
        if "dtype" in cfg:
            cfg["torch_dtype"] = cfg.pop("dtype")
        return "config_v4.json", dict(sorted(cfg.items()))
    theta = cfg.pop("rope_theta")  # 4.x -> 5.x
    assert cfg.pop("rope_scaling", None) is None
    cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": theta}
    if "torch_dtype" in cfg:
        cfg["dtype"] = cfg.pop("torch_dtype")
    return "config_v5.json", dict(sorted(cfg.items()))


def build(name, spec):
    import safetensors
    import torch
    import transformers
    from safetensors.numpy import load_file
    from transformers import LlamaConfig, LlamaForCausalLM

    out = os.path.join(FIXTURES, name)
    os.makedirs(out, exist_ok=True)

    torch.manual_seed(0)
    config = make_config(spec, transformers)
    model = LlamaForCausalLM._from_config(config, attn_implementation="eager", dtype=torch.float32)
    model.eval()
    assert model.config._attn_implementation == "eager"

    with torch.no_grad():
        seen = set()
        for mod in model.modules():
            if isinstance(mod, (torch.nn.Linear, torch.nn.Embedding)) and id(mod.weight) not in seen:
                seen.add(id(mod.weight))
                mod.weight.mul_(10.0)
        for mname, mod in model.named_modules():
            if type(mod).__name__.endswith("RMSNorm"):
                mod.weight.copy_(1.0 + 0.1 * torch.randn_like(mod.weight))
        if spec["tie_word_embeddings"]:
            assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()

    gen = torch.Generator().manual_seed(1234)
    input_ids = torch.randint(0, spec["vocab_size"], (BATCH, SEQ), generator=gen, dtype=torch.int64)
    with torch.no_grad():
        logits = model(input_ids).logits.float().numpy()

    model.save_pretrained(out, safe_serialization=True)
    np.save(os.path.join(out, "input_ids.npy"), input_ids.numpy().astype(np.int64))
    np.save(os.path.join(out, "logits.npy"), logits.astype(np.float32))
    versions = {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "safetensors": safetensors.__version__,
        "numpy": np.__version__,
    }
    with open(os.path.join(out, "versions.json"), "w") as f:
        json.dump(versions, f, indent=2, sort_keys=True)
        f.write("\n")
    with open(os.path.join(out, "config.json")) as f:
        saved_cfg = json.load(f)
    alt_name, alt_cfg = alt_style_config(saved_cfg)
    with open(os.path.join(out, alt_name), "w") as f:
        json.dump(alt_cfg, f, indent=2)
        f.write("\n")

    # ---- report + verification
    print(f"=== {name}  ({versions})")
    print("files:", {f: os.path.getsize(os.path.join(out, f)) for f in sorted(os.listdir(out))})
    print("config.json keys:", sorted(saved_cfg))
    print("config.json:", json.dumps(saved_cfg, sort_keys=True))
    print(f"{alt_name} keys:", sorted(alt_cfg))
    tensors = load_file(os.path.join(out, "model.safetensors"))
    for k in sorted(tensors):
        print(f"  {k:45s} {str(tensors[k].dtype):8s} {tensors[k].shape}")
    print("lm_head.weight saved:", "lm_head.weight" in tensors)
    print("tensor dtypes:", sorted({str(t.dtype) for t in tensors.values()}))
    print("input_ids:", input_ids.tolist())
    print("max |logits|: %.6f   std: %.6f" % (np.abs(logits).max(), logits.std()))

    re = LlamaForCausalLM.from_pretrained(out, attn_implementation="eager", dtype=torch.float32).eval()
    with torch.no_grad():
        re_logits = re(torch.from_numpy(np.load(os.path.join(out, "input_ids.npy")))).logits.numpy()
    reload_diff = float(np.abs(re_logits - np.load(os.path.join(out, "logits.npy"))).max())
    print("reload max abs diff:", reload_diff)
    assert reload_diff == 0.0, reload_diff

    # the alt-style config must load to the same rope theta in this transformers
    alt_loaded = LlamaConfig.from_dict(alt_cfg)
    rp = getattr(alt_loaded, "rope_parameters", None) or {}
    alt_theta = rp.get("rope_theta", getattr(alt_loaded, "rope_theta", None))
    print(f"{alt_name} loads in transformers with rope_theta =", alt_theta)
    assert alt_theta == spec["rope_theta"]

    np_logits = numpy_llama_logits(tensors, saved_cfg, input_ids.numpy())
    np_diff = float(np.abs(np_logits - logits).max())
    print("numpy forward max abs diff:", np_diff)
    assert np_diff < 1e-4, np_diff
    np_logits4 = numpy_llama_logits(tensors, alt_cfg, input_ids.numpy())
    assert float(np.abs(np_logits4 - logits).max()) == np_diff
    return np_diff


GENERATE_PROMPT_LENGTHS = (5, 11)  # two prompts of different lengths
GENERATE_NEW_TOKENS = 12


def record_generate(name):
    """Add ``generate.json`` to an existing fixture: transformers' greedy ``generate`` tokens.

    Loads the saved model (the other fixture files are left as they are), draws two prompts of
    different lengths (seeded) and runs ``generate(do_sample=False, max_new_tokens=12)`` on each
    alone (no padding, so no attention-mask convention is involved), eager attention, float32.
    Run: ``/work/torchvenv/bin/python tests/make_hf_fixture.py --generate``.
    """
    import torch
    from transformers import LlamaForCausalLM

    out = os.path.join(FIXTURES, name)
    model = LlamaForCausalLM.from_pretrained(out, attn_implementation="eager", dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(4321)
    vocab = model.config.vocab_size
    prompts, tokens = [], []
    for n in GENERATE_PROMPT_LENGTHS:
        ids = torch.randint(0, vocab, (1, n), generator=gen, dtype=torch.int64)
        with torch.no_grad():
            full = model.generate(ids, do_sample=False, max_new_tokens=GENERATE_NEW_TOKENS, min_new_tokens=GENERATE_NEW_TOKENS,
                                  attention_mask=torch.ones_like(ids), pad_token_id=0, eos_token_id=None)
        prompts.append(ids[0].tolist())
        tokens.append(full[0, n:].tolist())
    with open(os.path.join(out, "generate.json"), "w") as f:
        json.dump({"prompts": prompts, "max_new_tokens": GENERATE_NEW_TOKENS, "tokens": tokens,
                   "made_with": "generate(do_sample=False), eager, float32, each prompt alone"}, f, indent=1)
        f.write("\n")
    print(name, "generate:", tokens)


def main():
    if "--generate" in sys.argv:  # only add generate.json to the existing fixtures
        for name in MODELS:
            record_generate(name)
        print("OK")
        return 0
    for name, spec in MODELS.items():
        build(name, spec)
        record_generate(name)
    print("OK")


if __name__ == "__main__":
    sys.exit(main())
