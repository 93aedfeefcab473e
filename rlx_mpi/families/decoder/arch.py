"""`Arch`: everything that tells one decoder family from another, as data.

The record is the config stored in our checkpoint's header (JSON). Its first eleven fields
are named and defaulted exactly as the Llama config of checkpoints written before families
existed, so such a header (``family = "llama"``) loads unchanged: every later field defaults
to plain Llama-2 behaviour. Like llama.cpp's per-architecture hyper-parameters, the one
decoder (`decoder.model`, `decoder.stage`) reads only this record; a family module only
fills it from a Hugging Face config.

Tensor names in our checkpoint (one scheme for every family; `expected_shapes`):
``embed_tokens``, ``norm``, ``lm_head`` (untied), and per layer ``layers/{n}/...``:
``input_layernorm``, ``q_proj``/``k_proj``/``v_proj``/``o_proj`` (+ ``q_bias``/``k_bias``/
``v_bias`` with ``qkv_bias``; ``q_norm``/``k_norm`` (head_dim,) with ``qk_norm``, or
(nh*hs,)/(nkv*hs,) with ``qk_norm_scope = "projection"``),
``post_attention_layernorm`` (the norm before the MLP, as in Llama; with ``input_layernorm``
absent when ``pre_norms`` is false), ``attn_out_norm`` and
``mlp_out_norm`` with ``sandwich_norms`` (Gemma 2's norms applied to the attention and MLP
outputs), and either ``gate_proj``/``up_proj``/``down_proj`` or, with experts, ``router``
(E, C) and ``experts/{e}/gate_proj|up_proj|down_proj`` (a MoE model's ``dense_layers`` have
the dense names, of width ``dense_intermediate_size``). Norm weights are stored as the
checkpoint has them; ``norm_offset`` is added at load (Gemma's ``1 + w``).
DeepSeek's latent attention has, instead of q/k/v_proj, ``q_a_proj``/``q_a_norm``/``q_b_proj``
(or ``q_proj``), ``kv_a_proj`` (latent + RoPE key), ``kv_a_norm`` and ``kv_b_proj``; its MoE
layers (all but ``dense_layers``) add ``router_bias`` and ``shared_gate_proj|up_proj|down_proj``.
GPT-OSS adds ``o_bias``, ``sinks`` (heads,), ``router_bias`` and ``experts/{e}/gate_bias|up_bias|
down_bias``.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass

from ...errors import CheckpointError
from ...model.cost import ModelCost

__all__ = ["Arch", "ACTIVATIONS", "ROPE_TYPES", "QK_NORM_SCOPES", "ROUTINGS", "expected_shapes"]

ACTIVATIONS = ("silu", "gelu_tanh", "silu_clamped")  # SwiGLU; GeGLU (tanh, Gemma); GPT-OSS's clamped SwiGLU
ROPE_TYPES = ("default", "linear", "llama3", "longrope", "yarn")
QK_NORM_SCOPES = ("head", "projection")  # per head (Qwen3) | over the whole q, k projection (OLMo 2)
ROUTINGS = ("softmax", "sigmoid", "topk_softmax")  # MoE router kinds (`decoder.moe.route`)


@dataclass(frozen=True)
class Arch:
    """Hyper-parameters of a decoder; HF names where Hugging Face has one."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int  # MLP inner width (of each expert with MoE)
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int  # < num_attention_heads means grouped-query attention
    head_dim: int = 0  # 0: hidden_size // num_attention_heads (Mistral-Nemo, Qwen3, Gemma differ)
    max_position_embeddings: int = 2048  # longest sequence we accept
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = False  # lm_head reuses embed_tokens
    # -- what differs between families (defaults: Llama 2) --
    norm_offset: float = 0.0  # RMSNorm multiplies by (norm_offset + w): Gemma 1.0
    qkv_bias: bool = False  # q/k/v projections have biases (Qwen2)
    qk_norm: bool = False  # per-head RMSNorm of q and k before RoPE (Qwen3)
    activation: str = "silu"  # gated MLP: act(gate) * up; "silu" | "gelu_tanh" | "silu_clamped"
    rope_type: str = "default"  # "default" | "linear" | "llama3" | "longrope" | "yarn"
    rope_factor: float = 1.0  # linear, llama3, yarn
    rope_low_freq_factor: float = 1.0  # llama3
    rope_high_freq_factor: float = 4.0  # llama3
    rope_original_max_positions: int = 0  # llama3, longrope, yarn: the pre-training context
    rope_short_factor: tuple = ()  # longrope: head_dim/2 per-frequency divisors up to the original context
    rope_long_factor: tuple = ()  # longrope: beyond it
    rope_attention_factor: float = 1.0  # longrope, yarn: cos and sin are multiplied by it
    embedding_multiplier: float = 1.0  # embeddings x this, in float32 (Gemma: sqrt(hidden_size))
    attention_scale: float = 0.0  # scores x this; 0: head_dim ** -0.5 (Gemma: query_pre_attn_scalar ** -0.5)
    attn_logit_softcap: float = 0.0  # scores -> cap * tanh(scores / cap); 0: none (Gemma 2)
    final_logit_softcap: float = 0.0  # logits likewise (Gemma 2)
    sandwich_norms: bool = False  # extra norms on the attention and MLP outputs (Gemma 2)
    layer_windows: tuple = ()  # per layer: sliding window W (a query sees W keys), 0 full; () all full
    num_experts: int = 0  # MoE experts per layer; 0: a dense MLP
    experts_per_token: int = 0  # top-k of the router (weights renormalised over the k, as Mixtral)
    # -- issue 31, part 1 (Gemma 3, OLMo 2, Granite 3, Qwen3-MoE); defaults: as before --
    rope_local_theta: float = 0.0  # >0: sliding-window layers use default RoPE at this base, the
    # full layers rope_theta with rope_type (Gemma 3's local 10 000 vs global 1 000 000, linear x8)
    qk_norm_scope: str = "head"  # with qk_norm: "head" (each head's hs values, Qwen3, Gemma 3) |
    # "projection" (the whole q and k projections, nh*hs and nkv*hs values: OLMo 2)
    pre_norms: bool = True  # norms before attention and MLP; False: only the output norms (OLMo 2)
    residual_multiplier: float = 1.0  # attention and MLP outputs x this before the residual add (Granite)
    logits_scaling: float = 1.0  # logits divided by this (Granite)
    # -- DeepSeek-V2/V3 (multi-head latent attention, grouped routing, shared experts) and GPT-OSS --
    kv_lora_rank: int = 0  # MLA: width of the cached k/v latent; 0: ordinary attention (no MLA)
    q_lora_rank: int = 0  # MLA: q through q_a_proj (to this width) -> norm -> q_b_proj; 0: one q_proj
    qk_nope_head_dim: int = 0  # MLA: per-head q/k dims without RoPE (head_dim is the RoPE part)
    v_head_dim: int = 0  # MLA: per-head value width
    rope_interleave: bool = False  # RoPE over interleaved pairs (DeepSeek): de-interleaved first
    rope_beta_fast: float = 32.0  # yarn
    rope_beta_slow: float = 1.0  # yarn
    rope_truncate: bool = True  # yarn: the correction range rounded to whole dims
    routing: str = "softmax"  # softmax (Mixtral, DeepSeek-V2) | sigmoid (DeepSeek-V3) | topk_softmax (GPT-OSS)
    router_bias: bool = False  # GPT-OSS: added to the logits; sigmoid: e_score_correction_bias, choice only
    n_group: int = 1  # grouped top-k: experts in n_group groups, only the topk_group best groups compete
    topk_group: int = 1
    norm_topk_prob: bool = True  # the k weights renormalised to sum 1 (Mixtral: always; Qwen3-MoE's
    # and DeepSeek's flag)
    routed_scaling_factor: float = 1.0  # the routed experts' weights x this
    shared_intermediate_size: int = 0  # an always-on dense MLP beside the experts (n_shared x width); 0: none
    dense_layers: tuple = ()  # MoE models: layers with a dense MLP instead of experts (DeepSeek's
    # first_k_dense_replace; Qwen3-MoE's mlp_only_layers / decoder_sparse_step)
    dense_intermediate_size: int = 0  # their MLP width; 0: intermediate_size (DeepSeek's and Qwen3-MoE's
    # intermediate_size, the experts' being moe_intermediate_size)
    expert_bias: bool = False  # GPT-OSS: experts' gate/up/down have biases
    swiglu_limit: float = 7.0  # silu_clamped: gate <= limit, |up| <= limit
    swiglu_alpha: float = 1.702  # silu_clamped: gate * sigmoid(alpha * gate) * (up + 1)
    o_bias: bool = False  # GPT-OSS: o_proj has a bias (added once, after the TP sum)
    attention_sinks: bool = False  # GPT-OSS: a learned per-head logit in each softmax's denominator

    def __post_init__(self):
        if self.head_dim == 0 and isinstance(self.hidden_size, int) and isinstance(self.num_attention_heads, int):
            object.__setattr__(self, "head_dim", self.hidden_size // max(self.num_attention_heads, 1))
        for name in ("rope_short_factor", "rope_long_factor", "layer_windows", "dense_layers"):  # JSON lists -> tuples
            value = getattr(self, name)
            if isinstance(value, list):
                object.__setattr__(self, name, tuple(value))

    # -- validation ------------------------------------------------------------------------------

    def validate(self, where: str) -> "Arch":
        """Raise a CheckpointError naming the field when the record is inconsistent."""
        def bad(name, what):
            raise CheckpointError(where, f"model config {name} = {getattr(self, name)!r} {what}")

        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                bad(name, "must be a positive integer")
        for name in ("rms_norm_eps", "rope_theta", "rope_factor", "rope_low_freq_factor",
                     "rope_high_freq_factor", "rope_attention_factor", "embedding_multiplier"):
            value = getattr(self, name)  # a negative or NaN value gives NaN logits
            if not _number(value) or value <= 0:
                bad(name, "must be a finite number > 0")
        for name in ("norm_offset", "attention_scale", "attn_logit_softcap", "final_logit_softcap"):
            value = getattr(self, name)
            if not _number(value) or value < 0:
                bad(name, "must be a finite number >= 0")
        for name in ("tie_word_embeddings", "qkv_bias", "qk_norm", "sandwich_norms"):
            if not isinstance(getattr(self, name), bool):  # "false" is a truthy string
                bad(name, "must be true or false (a JSON boolean)")
        if self.activation not in ACTIVATIONS:
            bad("activation", f"is not one of {list(ACTIVATIONS)}")
        if self.rope_type not in ROPE_TYPES:
            bad("rope_type", f"is not one of {list(ROPE_TYPES)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise CheckpointError(where, f"num_attention_heads ({self.num_attention_heads}) is not a multiple of "
                                  f"num_key_value_heads ({self.num_key_value_heads})")
        if self.head_dim % 2:
            raise CheckpointError(where, f"head_dim ({self.head_dim}) must be even for rotary embeddings")
        if self.rope_type in ("llama3", "longrope"):
            if not isinstance(self.rope_original_max_positions, int) or self.rope_original_max_positions <= 0:
                bad("rope_original_max_positions", f"must be a positive integer with rope_type {self.rope_type!r}")
        if self.rope_type == "llama3" and not self.rope_high_freq_factor > self.rope_low_freq_factor:
            bad("rope_high_freq_factor", f"must exceed rope_low_freq_factor ({self.rope_low_freq_factor})")
        if self.rope_type == "longrope":
            for name in ("rope_short_factor", "rope_long_factor"):
                value = getattr(self, name)
                if len(value) != self.head_dim // 2 or not all(_number(f) and f > 0 for f in value):
                    bad(name, f"must be {self.head_dim // 2} positive numbers (head_dim / 2)")
        if self.layer_windows and (len(self.layer_windows) != self.num_hidden_layers or not all(
                isinstance(w, int) and not isinstance(w, bool) and w >= 0 for w in self.layer_windows)):
            bad("layer_windows", f"must be {self.num_hidden_layers} integers >= 0 (one per layer; 0 = full)")
        for name in ("num_experts", "experts_per_token"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                bad(name, "must be an integer >= 0")
        if self.num_experts and not 1 <= self.experts_per_token <= self.num_experts:
            bad("experts_per_token", f"must be 1..num_experts ({self.num_experts})")
        if not self.num_experts and self.experts_per_token:
            bad("experts_per_token", "needs num_experts > 0")
        if not _number(self.rope_local_theta) or self.rope_local_theta < 0:
            bad("rope_local_theta", "must be a finite number >= 0")
        if self.rope_local_theta and self.rope_type == "longrope":
            bad("rope_local_theta", "cannot be combined with rope_type 'longrope'")
        if self.qk_norm_scope not in QK_NORM_SCOPES:
            bad("qk_norm_scope", f"is not one of {list(QK_NORM_SCOPES)}")
        for name in ("residual_multiplier", "logits_scaling"):
            if not _number(getattr(self, name)) or getattr(self, name) <= 0:
                bad(name, "must be a finite number > 0")
        if not isinstance(self.pre_norms, bool):
            bad("pre_norms", "must be true or false (a JSON boolean)")
        if not self.pre_norms and not self.sandwich_norms:
            bad("pre_norms", "is false without sandwich_norms: a layer would have no norm at all")
        self._validate_mla_moe(bad)  # norm_topk_prob, dense_layers and dense_intermediate_size there
        return self

    def _validate_mla_moe(self, bad) -> None:
        """The DeepSeek / GPT-OSS block's fields (validate)."""
        for name in ("kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "v_head_dim", "shared_intermediate_size",
                     "dense_intermediate_size", "n_group", "topk_group"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                bad(name, "must be an integer >= 0")
        for name in ("rope_interleave", "rope_truncate", "router_bias", "norm_topk_prob", "expert_bias", "o_bias",
                     "attention_sinks"):
            if not isinstance(getattr(self, name), bool):
                bad(name, "must be true or false (a JSON boolean)")
        for name in ("rope_beta_fast", "rope_beta_slow", "routed_scaling_factor", "swiglu_limit", "swiglu_alpha"):
            value = getattr(self, name)
            if not _number(value) or value <= 0:
                bad(name, "must be a finite number > 0")
        if self.routing not in ROUTINGS:
            bad("routing", f"is not one of {list(ROUTINGS)}")
        if self.kv_lora_rank and (not self.qk_nope_head_dim or not self.v_head_dim):
            bad("kv_lora_rank", "needs qk_nope_head_dim and v_head_dim > 0 (multi-head latent attention)")
        if self.kv_lora_rank and (self.num_key_value_heads != self.num_attention_heads or self.layer_windows
                                  or self.qkv_bias or self.qk_norm or self.attention_sinks):
            bad("kv_lora_rank", "(latent attention) takes no kv heads, windows, q/k/v biases, q/k norms or sinks")
        if self.num_experts and (self.n_group < 1 or self.num_experts % self.n_group
                                 or not 1 <= self.topk_group <= self.n_group):
            bad("n_group", f"must divide num_experts ({self.num_experts}) with 1 <= topk_group "
                f"({self.topk_group}) <= n_group")
        if self.num_experts and self.experts_per_token > self.topk_group * (self.num_experts // self.n_group):
            bad("experts_per_token", "exceeds the experts of the topk_group groups that compete")
        if self.dense_layers and (not self.num_experts or len(set(self.dense_layers)) != len(self.dense_layers)
                                  or not all(isinstance(n, int) and not isinstance(n, bool)
                                             and 0 <= n < self.num_hidden_layers for n in self.dense_layers)):
            bad("dense_layers", f"must be distinct layer numbers 0..{self.num_hidden_layers - 1} of a MoE model")
        if self.rope_type == "yarn" and (not isinstance(self.rope_original_max_positions, int)
                                         or self.rope_original_max_positions <= 0):
            bad("rope_original_max_positions", "must be a positive integer with rope_type 'yarn'")

    # -- JSON ------------------------------------------------------------------------------------

    def to_json(self) -> str:
        """The header: the first eleven fields always, a later one only where it differs from its
        default. An older rlx_mpi then reads any checkpoint that needs nothing it lacks, and refuses
        one that does naming the key (its "unknown keys" error), instead of refusing them all."""
        out = {}
        for i, f in enumerate(dataclasses.fields(self)):
            value = getattr(self, f.name)
            default = f.default_factory() if f.default is dataclasses.MISSING and \
                f.default_factory is not dataclasses.MISSING else f.default
            if i < 11 or value != default:
                out[f.name] = list(value) if isinstance(value, tuple) else value
        return json.dumps(out, sort_keys=True)

    @classmethod
    def from_json(cls, text: str, where: str) -> "Arch":
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

    # -- derived ---------------------------------------------------------------------------------

    @property
    def q_dim(self) -> int:
        return self.num_attention_heads * self.qk_head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @property
    def qk_head_dim(self) -> int:
        """Per-head width of q and k: head_dim, or with MLA the no-RoPE dims plus the RoPE ones."""
        return self.qk_nope_head_dim + self.head_dim if self.kv_lora_rank else self.head_dim

    @property
    def latent_dim(self) -> int:
        """MLA: floats a token's cache entry holds per layer (the latent and the shared RoPE key)."""
        return self.kv_lora_rank + self.head_dim

    def window(self, layer: int) -> int:
        """The sliding window of ``layer`` (0: full attention)."""
        return self.layer_windows[layer] if self.layer_windows else 0

    def local_rope(self, layer: int) -> bool:
        """Whether ``layer`` uses the local RoPE base (`rope_local_theta`: Gemma 3's sliding layers)."""
        return bool(self.rope_local_theta) and self.window(layer) > 0

    def moe(self, layer: int) -> bool:
        """Whether ``layer`` has experts (a MoE model's `dense_layers` have a dense MLP)."""
        return bool(self.num_experts) and layer not in self.dense_layers

    def mlp_width(self, layer: int) -> int:
        """The inner width of ``layer``'s MLP (of each expert in a MoE layer)."""
        if self.moe(layer) or not self.num_experts:
            return self.intermediate_size
        return self.dense_intermediate_size or self.intermediate_size

    def parameters(self, active: bool = False) -> int:
        """The whole model's parameters; with ``active`` only the experts a token uses (top-k and
        shared) of each MoE layer, the embeddings included (the published "activated" count:
        Qwen3-235B-A22B's 22 B)."""
        h, v = self.hidden_size, self.vocab_size
        return self._stack_params(active) + (1 if self.tie_word_embeddings else 2) * v * h + h  # embedding, head, final norm

    def _stack_params(self, active: bool) -> int:
        """Every layer's parameters, by kind (dense or MoE: the only per-layer difference in
        size), not layer by layer: an absurd layer count is refused by the planner, not summed."""
        L = self.num_hidden_layers
        dense = {d for d in self.dense_layers if 0 <= d < L} if self.num_experts else set(range(min(L, 1)))
        n_dense = len(dense) if self.num_experts else L
        total = n_dense * self.layer_params(active, next(iter(dense))) if n_dense else 0
        if n_dense < L:  # the MoE layers: the first index not among the dense ones
            first_moe = next(n for n in range(L) if n not in dense)
            total += (L - n_dense) * self.layer_params(active, first_moe)
        return total

    def kv_bytes_per_token(self, cache_bytes: int = 4) -> int:
        """Cache bytes one token of context adds over every layer (float32 caches): K and V, or
        MLA's latent (a sliding-window layer counted whole: its ring stops growing at the window)."""
        per_layer = self.latent_dim if self.kv_lora_rank else 2 * self.kv_dim
        return self.num_hidden_layers * per_layer * cache_bytes

    def attention_params(self) -> int:
        """Parameters of one layer's attention (with its q/k norms, biases and sinks)."""
        h, nh = self.hidden_size, self.num_attention_heads
        if self.kv_lora_rank:  # MLA: q (low-rank or not), the latent's down- and up-projections, o
            q = (h * self.q_lora_rank + self.q_lora_rank + self.q_lora_rank * self.q_dim if self.q_lora_rank
                 else h * self.q_dim)
            kv = h * self.latent_dim + self.kv_lora_rank + self.kv_lora_rank * nh * (
                self.qk_nope_head_dim + self.v_head_dim)
            attn = q + kv + nh * self.v_head_dim * h
        else:
            attn = h * self.q_dim + 2 * h * self.kv_dim + self.q_dim * h
            attn += (self.q_dim + 2 * self.kv_dim) if self.qkv_bias else 0
            attn += (self.q_dim + self.kv_dim if self.qk_norm_scope == "projection" else 2 * self.head_dim) \
                if self.qk_norm else 0
        return attn + (h if self.o_bias else 0) + (nh if self.attention_sinks else 0)

    def layer_params(self, active: bool = False, layer: int | None = None) -> int:
        """Parameters of layer ``layer`` (None: the mean over the layers, rounded up, so that
        n_layers x it is the whole stack); with ``active`` only the experts a token uses (top-k,
        plus the shared experts)."""
        if layer is None:
            return -(-self._stack_params(active) // self.num_hidden_layers)
        h = self.hidden_size
        norms = ((4 if self.sandwich_norms else 2) - (0 if self.pre_norms else 2)) * h
        attn = self.attention_params()
        if not self.moe(layer):
            return attn + 3 * h * self.mlp_width(layer) + norms
        i = self.intermediate_size
        expert = 3 * h * i + ((2 * i + h) if self.expert_bias else 0)
        experts = self.experts_per_token if active else self.num_experts
        router = self.num_experts * h + (self.num_experts if self.router_bias else 0)
        return attn + experts * expert + router + 3 * h * self.shared_intermediate_size + norms

    def cost(self, batch: int, seq: int, weight_bytes: int = 4) -> ModelCost:
        """Bytes and FLOPs the planner needs, for one forward of ``batch`` x ``seq`` tokens.

        With experts, bytes count every expert (a stage holds them all) but FLOPs only the
        top-k a token is routed to (plus the router and shared experts). Layers are priced
        at their average (DeepSeek's first dense layers differ). With MLA the cache holds the
        latent (`latent_dim` floats a token, replicated on each TP rank: ``kv_heads`` 1)."""
        from ...kernels import attend_workspace_bytes

        h, v = self.hidden_size, self.vocab_size
        embed = v * h * weight_bytes
        head = h * weight_bytes + (0 if self.tie_word_embeddings else v * h * weight_bytes)
        if self.tie_word_embeddings:
            head += embed  # the last stage needs the embedding matrix as its head
        tokens = batch * seq
        inner = self.intermediate_size * (self.experts_per_token if self.num_experts else 1)
        inner = max(inner + self.shared_intermediate_size, self.dense_intermediate_size)  # a MoE model's dense layers too (Qwen3-MoE, DeepSeek)
        held = self.layer_params()
        if self.kv_lora_rank:
            held += self.num_attention_heads * (self.qk_nope_head_dim + self.v_head_dim) * self.kv_lora_rank  # kv_b's
            # halves again, float32 for the absorbed decode (priced as weights: low for a bf16 rank by 0.15 %)
            kv_bytes = tokens * self.latent_dim * 4  # float32 cache
            kv_heads = 1
            replicated = h * self.latent_dim + self.kv_lora_rank + (h * self.q_lora_rank + self.q_lora_rank)
            attn_flops = 2.0 * seq * self.num_attention_heads * (self.qk_head_dim + self.v_head_dim)
            heads_dim = self.qk_head_dim
        else:  # a sliding-window layer keeps its window: the average layer's cache
            kept = (sum(min(w or seq, seq) for w in self.layer_windows) if self.layer_windows
                    else self.num_hidden_layers * seq)
            kv_bytes = 2 * batch * kept * self.kv_dim * 4 // self.num_hidden_layers
            kv_heads = self.num_key_value_heads
            replicated = 2 * self.kv_dim * (h + (1 if self.qkv_bias else 0))
            attn_flops = 4.0 * seq * self.q_dim
            heads_dim = self.head_dim
        return ModelCost(
            n_layers=self.num_hidden_layers,
            layer_bytes=held * weight_bytes,
            layer_flops_per_token=2.0 * self.layer_params(active=True) + attn_flops,
            embed_bytes=embed,
            head_bytes=head,
            head_flops_per_token=2.0 * v * h,
            kv_bytes_per_layer=kv_bytes,
            act_bytes=tokens * 4 * (3 * h + 2 * inner + v)
            + attend_workspace_bytes(batch, self.num_attention_heads, seq, heads_dim),  # blocked: no seq^2
            tokens=tokens,
            shared_end_bytes=embed if self.tie_word_embeddings else 0,  # the stage holds one matrix for both
            kv_heads=kv_heads,
            kv_weight_bytes=replicated * weight_bytes,  # MLA: the latent's (and q's) down-projections
            attn_flops_per_pos=attn_flops / max(1, seq),
            dense_flops_per_token=2.0 * self.layer_params(active=True),
            hidden_size=h,
            seq=seq,
        )


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def expected_shapes(cfg: Arch) -> dict[str, tuple[int, ...]]:
    """Every tensor name in the checkpoint and the shape ``cfg`` implies for it (module doc)."""
    h, v = cfg.hidden_size, cfg.vocab_size
    shapes = {"embed_tokens": (v, h), "norm": (h,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head"] = (v, h)
    for n in range(cfg.num_hidden_layers):
        shapes.update({f"layers/{n}/{k}": s for k, s in _layer_shapes(cfg, n).items()})
    return shapes


def _layer_shapes(cfg: Arch, n: int) -> dict[str, tuple[int, ...]]:
    h, i, hs = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    layer = {"input_layernorm": (h,)}
    if cfg.kv_lora_rank:  # MLA (DeepSeek): q_a_proj/q_a_norm/q_b_proj or q_proj; the latent's kv_a/kv_a_norm/kv_b
        nh, r = cfg.num_attention_heads, cfg.kv_lora_rank
        if cfg.q_lora_rank:
            layer.update(q_a_proj=(cfg.q_lora_rank, h), q_a_norm=(cfg.q_lora_rank,),
                         q_b_proj=(cfg.q_dim, cfg.q_lora_rank))
        else:
            layer["q_proj"] = (cfg.q_dim, h)
        layer.update(kv_a_proj=(cfg.latent_dim, h), kv_a_norm=(r,),
                     kv_b_proj=(nh * (cfg.qk_nope_head_dim + cfg.v_head_dim), r), o_proj=(h, nh * cfg.v_head_dim))
    else:
        layer.update(q_proj=(cfg.q_dim, h), k_proj=(cfg.kv_dim, h), v_proj=(cfg.kv_dim, h), o_proj=(h, cfg.q_dim))
    layer["post_attention_layernorm"] = (h,)
    if cfg.qkv_bias:
        layer.update(q_bias=(cfg.q_dim,), k_bias=(cfg.kv_dim,), v_bias=(cfg.kv_dim,))
    if cfg.o_bias:
        layer["o_bias"] = (h,)
    if cfg.attention_sinks:
        layer["sinks"] = (cfg.num_attention_heads,)
    if cfg.qk_norm and cfg.qk_norm_scope == "projection":  # OLMo 2: over the whole projections
        layer.update(q_norm=(cfg.q_dim,), k_norm=(cfg.kv_dim,))
    elif cfg.qk_norm:
        layer.update(q_norm=(hs,), k_norm=(hs,))
    if cfg.sandwich_norms:
        layer.update(attn_out_norm=(h,), mlp_out_norm=(h,))
    if not cfg.pre_norms:  # OLMo 2: only the output norms
        del layer["input_layernorm"], layer["post_attention_layernorm"]
    if cfg.moe(n):
        layer["router"] = (cfg.num_experts, h)
        if cfg.router_bias:
            layer["router_bias"] = (cfg.num_experts,)
        for e in range(cfg.num_experts):
            layer.update({f"experts/{e}/gate_proj": (i, h), f"experts/{e}/up_proj": (i, h),
                          f"experts/{e}/down_proj": (h, i)})
            if cfg.expert_bias:
                layer.update({f"experts/{e}/gate_bias": (i,), f"experts/{e}/up_bias": (i,),
                              f"experts/{e}/down_bias": (h,)})
        si = cfg.shared_intermediate_size
        if si:
            layer.update(shared_gate_proj=(si, h), shared_up_proj=(si, h), shared_down_proj=(h, si))
    else:
        d = cfg.mlp_width(n)
        layer.update(gate_proj=(d, h), up_proj=(d, h), down_proj=(h, d))
    return layer
