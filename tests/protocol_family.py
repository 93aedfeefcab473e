"""A model family written only to the documented `rlx_mpi.ModelFamily` / `Stage` contract.

Nothing here comes from the Llama family: if the core calls anything the Protocol does not
document (or passes other arguments), a run of this family fails. The model is a residual
tanh MLP: ``h = E[ids]; h = h + tanh(h @ W_i) for each layer; logits = h @ H``, so a naive
numpy `reference` checks the pipeline's logits and `greedy` the tokens ``generate`` writes.
Each position is computed on its own, so generation needs no cache (``reset`` keeps nothing,
``prefill``/``decode`` are the forward at the rows' last position). Import it through ``[model] plugins =
["protocol_family"]`` with tests/ on PYTHONPATH; `write_checkpoint` makes a checkpoint.
"""

from __future__ import annotations

import json
import os
import time

import numpy as np

from rlx_mpi.model import checkpoint
from rlx_mpi.errors import ConfigError, InputError
from rlx_mpi.model.cost import ModelCost
from rlx_mpi.families import register_family
from rlx_mpi.model.stage import ModelDims, Stage

__all__ = ["NAME", "ProtoFamily", "write_checkpoint", "reference", "greedy"]

NAME = "proto_mlp"


class ProtoStage(Stage):
    def __init__(self, cfg, source, layers, first, last):
        self.layers, self.first, self.last = layers, first, last
        self.embed = source.read("embed") if first else None
        self.ws = [source.read(f"layers/{i}/w") for i in layers]
        self.head = source.read("head") if last else None

    @property
    def weight_bytes(self) -> int:
        return sum(a.nbytes for a in [self.embed, self.head, *self.ws] if a is not None)

    def forward(self, x):
        h = self.embed[x] if self.first else x  # (B, T, C)
        for w in self.ws:
            h = h + np.tanh(h @ w)
        return (h @ self.head if self.last else h).astype(np.float32)

    def reset(self, slots, max_seq, kv):
        return 0  # position-wise: nothing to keep

    def prefill(self, x, slots, lengths):
        out = self.forward(x)  # (B, T, C) or logits (B, T, V)
        return out[np.arange(len(out)), np.asarray(lengths) - 1] if self.last else out

    def decode(self, x, slots, positions):
        out = self.forward(x)  # (B, 1, ...)
        return out[:, 0] if self.last else out


class ProtoFamily:
    name = NAME
    hf_model_types = ("proto_mlp",)
    presets = {"proto-tiny": {"vocab": 40, "hidden": 16, "layers": 4}}

    def dims(self, cfg):
        return ModelDims(vocab_size=cfg["vocab"], hidden_size=cfg["hidden"], max_positions=64, n_layers=cfg["layers"])

    def describe(self, cfg):
        return f"{NAME}, {cfg['layers']} layers, hidden {cfg['hidden']}, vocab {cfg['vocab']}"

    def config_from_shape(self, shape, where):
        missing = [k for k in ("layers", "hidden", "vocab") if not shape.get(k)]
        if missing:
            raise ConfigError(where, f"missing --{', --'.join(missing)}", "give --layers --hidden --vocab")
        return {"vocab": shape["vocab"], "hidden": shape["hidden"], "layers": shape["layers"]}

    def init_random(self, path, cfg, *, seed, dtype="float32"):
        checkpoint.write_checkpoint(path, NAME, json.dumps(cfg), _tensors(cfg, seed), dtype=dtype)

    def convert_hf(self, hf_dir, out, *, dtype, hf_config):
        cfg = {"vocab": hf_config["vocab_size"], "hidden": hf_config["hidden_size"],
               "layers": hf_config["num_hidden_layers"]}
        self.init_random(out, cfg, seed=0, dtype=dtype)
        return cfg

    def load_config(self, config_json, where):
        cfg = json.loads(config_json)
        if set(cfg) != {"vocab", "hidden", "layers"}:
            raise ConfigError(where, f"config keys {sorted(cfg)}", "expected vocab, hidden, layers")
        return cfg

    def cost(self, cfg, batch, seq):
        H, V, L = cfg["hidden"], cfg["vocab"], cfg["layers"]
        return ModelCost(n_layers=L, layer_bytes=4 * H * H, layer_flops_per_token=2.0 * H * H,
                         embed_bytes=4 * V * H, head_bytes=4 * V * H, head_flops_per_token=2.0 * V * H,
                         kv_bytes_per_layer=0, act_bytes=4 * batch * seq * max(H, V), tokens=batch * seq)

    def check_tp(self, cfg, tp, where):
        if tp != 1:
            raise ConfigError(where, f"tp = {tp}", "this family has no tensor parallelism: use tp = 1")

    def expected_shapes(self, cfg):
        H, V = cfg["hidden"], cfg["vocab"]
        return {"embed": (V, H), "head": (H, V), **{f"layers/{i}/w": (H, H) for i in range(cfg["layers"])}}

    def output_spec(self, cfg, batch, seq, last):
        return (batch, seq, cfg["vocab"] if last else cfg["hidden"]), np.dtype(np.float32)

    def check_inputs(self, cfg, ids, where):
        if (ids.ndim != 2 or not np.issubdtype(ids.dtype, np.integer) or ids.min() < 0 or ids.max() >= cfg["vocab"]
                or ids.shape[1] > self.dims(cfg).max_positions):
            raise InputError(where, "bad ids", f"integer [batch, seq] in [0, {cfg['vocab']})")

    def warm_up(self, cfg, precision, tp, decode):  # optional in the contract: nothing to compile here
        _event("warm", precision=precision, tp=tp, decode=decode)

    def build_stage(self, cfg, source, layers, first, last, tp, ctx):
        _event("build")
        return ProtoStage(cfg, source, layers, first, last)


def _event(kind: str, **fields) -> None:
    """With RLX_TEST_EVENTS=DIR, record that this rank called ``kind`` (file DIR/kind.RANK)."""
    folder = os.environ.get("RLX_TEST_EVENTS")
    if folder:
        from mpi4py import MPI

        with open(os.path.join(folder, f"{kind}.{MPI.COMM_WORLD.rank}"), "w") as f:
            json.dump({"t": time.time(), **fields}, f)


register_family(ProtoFamily())


def _tensors(cfg, seed):
    rng = np.random.default_rng(seed)
    H, V = cfg["hidden"], cfg["vocab"]
    yield "embed", rng.standard_normal((V, H)).astype(np.float32)
    for i in range(cfg["layers"]):
        yield f"layers/{i}/w", (rng.standard_normal((H, H)) / np.sqrt(H)).astype(np.float32)
    yield "head", rng.standard_normal((H, V)).astype(np.float32)


def write_checkpoint(path: str | os.PathLike, vocab=50, hidden=24, layers=6, seed=0) -> dict:
    cfg = {"vocab": vocab, "hidden": hidden, "layers": layers}
    checkpoint.write_checkpoint(path, NAME, json.dumps(cfg), _tensors(cfg, seed))
    return cfg


def reference(cfg, ids, seed=0) -> np.ndarray:
    """The logits in float64 numpy, from the same random tensors."""
    t = {k: v.astype(np.float64) for k, v in _tensors(cfg, seed)}
    h = t["embed"][ids]
    for i in range(cfg["layers"]):
        h = h + np.tanh(h @ t[f"layers/{i}/w"])
    return h @ t["head"]


def greedy(cfg, prompt, max_new_tokens, seed=0) -> list[int]:
    """The tokens greedy generation appends to ``prompt``, from `reference`'s logits."""
    seq = list(prompt)
    for _ in range(max_new_tokens):
        seq.append(int(np.argmax(reference(cfg, np.array([seq]), seed)[0, -1])))
    return seq[len(prompt):]
