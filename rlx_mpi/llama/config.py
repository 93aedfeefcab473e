"""The shape of a Llama-family model, its presets, and its cost for the planner."""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass

from ..errors import CheckpointError
from ..kernels import attend_workspace_bytes
from ..placement import ModelCost

__all__ = ["LlamaConfig", "PRESETS", "expected_shapes"]


@dataclass(frozen=True)
class LlamaConfig:
    """Hyper-parameters of a Llama decoder, named as in Hugging Face's ``LlamaConfig``."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int  # SwiGLU inner width
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int  # < num_attention_heads means grouped-query attention
    head_dim: int = 0  # 0: hidden_size // num_attention_heads, as transformers does
    max_position_embeddings: int = 2048  # longest sequence we accept
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = False  # lm_head reuses embed_tokens

    def __post_init__(self):
        if self.head_dim == 0 and isinstance(self.hidden_size, int) and isinstance(self.num_attention_heads, int):
            object.__setattr__(self, "head_dim", self.hidden_size // max(self.num_attention_heads, 1))

    def validate(self, where: str) -> "LlamaConfig":
        """Raise a CheckpointError naming the field when the shape is inconsistent."""
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise CheckpointError(where, f"model config {name} = {value!r} must be a positive integer")
        for name in ("rms_norm_eps", "rope_theta"):  # a negative or NaN value gives NaN logits
            value = getattr(self, name)
            if (not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value)
                    or value <= 0):
                raise CheckpointError(where, f"model config {name} = {value!r} must be a finite number > 0")
        if not isinstance(self.tie_word_embeddings, bool):  # "false" is a truthy string
            raise CheckpointError(where, f"model config tie_word_embeddings = {self.tie_word_embeddings!r} "
                                  "must be true or false (a JSON boolean)")
        if self.num_attention_heads % self.num_key_value_heads:
            raise CheckpointError(
                where,
                f"num_attention_heads ({self.num_attention_heads}) is not a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})",
            )
        if self.head_dim % 2:
            raise CheckpointError(where, f"head_dim ({self.head_dim}) must be even for rotary embeddings")
        return self

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str, where: str) -> "LlamaConfig":
        try:
            raw = json.loads(text)
        except ValueError as e:
            raise CheckpointError(where, f"model config is not valid JSON ({e})") from None
        if not isinstance(raw, dict):
            raise CheckpointError(where, f"model config is {type(raw).__name__} {text[:40]!r}, not a JSON object",
                                  "re-convert the model")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise CheckpointError(where, f"model config has unknown keys {unknown}", f"expected keys from {sorted(known)}")
        try:
            return cls(**raw).validate(where)
        except TypeError as e:
            raise CheckpointError(where, f"model config is incomplete ({e})") from None

    # -- cost model ------------------------------------------------------------------------------

    @property
    def q_dim(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_key_value_heads * self.head_dim

    def layer_params(self) -> int:
        h, i = self.hidden_size, self.intermediate_size
        attn = h * self.q_dim + 2 * h * self.kv_dim + self.q_dim * h
        return attn + 3 * h * i + 2 * h

    def cost(self, batch: int, seq: int, weight_bytes: int = 4) -> ModelCost:
        """Bytes and FLOPs the planner needs, for one forward of ``batch`` x ``seq`` tokens."""
        h, v = self.hidden_size, self.vocab_size
        embed = v * h * weight_bytes
        head = h * weight_bytes + (0 if self.tie_word_embeddings else v * h * weight_bytes)
        if self.tie_word_embeddings:
            head += embed  # the last stage needs the embedding matrix as its head
        tokens = batch * seq
        return ModelCost(
            n_layers=self.num_hidden_layers,
            layer_bytes=self.layer_params() * weight_bytes,
            layer_flops_per_token=2.0 * self.layer_params() + 4.0 * seq * self.q_dim,
            embed_bytes=embed,
            head_bytes=head,
            head_flops_per_token=2.0 * v * h,
            kv_bytes_per_layer=2 * tokens * self.kv_dim * 4,
            act_bytes=tokens * 4 * (3 * h + 2 * self.intermediate_size + v)
            + attend_workspace_bytes(batch, self.num_attention_heads, seq, self.head_dim),  # blocked: no seq^2
            tokens=tokens,
            shared_end_bytes=embed if self.tie_word_embeddings else 0,  # LlamaStage: one matrix for both
        )


# Random models for trying the pipeline without downloading anything. "tiny" is the default
# job and the test model; "medium" is big enough that a forward is compute-bound (bench/).
PRESETS: dict[str, LlamaConfig] = {
    "tiny": LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=172, num_hidden_layers=8,
                        num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=256),
    "small": LlamaConfig(vocab_size=4096, hidden_size=512, intermediate_size=1376, num_hidden_layers=8,
                         num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=1024),
    "medium": LlamaConfig(vocab_size=16384, hidden_size=1024, intermediate_size=2816, num_hidden_layers=16,
                          num_attention_heads=16, num_key_value_heads=8, max_position_embeddings=2048),
}


def expected_shapes(cfg: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor name in the checkpoint and the shape ``cfg`` implies for it."""
    h, i, v = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    layer = {"input_layernorm": (h,), "q_proj": (cfg.q_dim, h), "k_proj": (cfg.kv_dim, h),
             "v_proj": (cfg.kv_dim, h), "o_proj": (h, cfg.q_dim), "post_attention_layernorm": (h,),
             "gate_proj": (i, h), "up_proj": (i, h), "down_proj": (h, i)}
    shapes = {"embed_tokens": (v, h), "norm": (h,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head"] = (v, h)
    for n in range(cfg.num_hidden_layers):
        shapes.update({f"layers/{n}/{k}": s for k, s in layer.items()})
    return shapes
