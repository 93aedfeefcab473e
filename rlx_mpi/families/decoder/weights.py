"""Linear layers that multiply themselves, in the precision the rank holds its weights in.

``Linear(x)`` maps float32 activations ``(..., in)`` to float32 ``(..., out)`` whatever the
storage: f32 (one BLAS GEMM over all B*T rows), bf16 / f16 (uint16 bit patterns) or int8 with
symmetric scales per block of 64 weights of a row, computed at load (kernels.quantize_int8), or q4
(4-bit codes with a scale and a minimum per group of 32: kernels/quant.py; quantized at load, or
read as the checkpoint holds them). Low-precision weights are multiplied by
the fused kernels in `rlx_mpi.kernels` and never expanded to a float32 copy of the matrix.
A `Linear` also answers ``table[ids]`` (float32 rows), so one object serves as the
embedding table and, with tied embeddings, as the LM head.

Note: under tensor parallelism a row-parallel shard (o_proj, down_proj: a slice of the
input columns) gets int8 blocks cut from its own columns; no communication at load. A q4
checkpoint's groups are sliced on whole groups (checkpoint.py refuses a degree that cuts one).

Note: q4 holds a matrix whose input width is not a multiple of 32 (kernels.Q4_GROUP) as int8:
the groups cannot cover it, and one precision per matrix keeps each product one kernel (the
fused decode layer types each product by its own weight, so a layer may mix the two).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import numpy as np

from ... import kernels

__all__ = ["PRECISIONS", "Linear", "make_linear", "read_linear", "fuse", "Mlp", "Experts", "ExpertStack", "LayerWeights",
           "MlaWeights", "q4_tensor", "held_bytes"]

PRECISIONS = ("f32", "bf16", "f16", "int8", "q4")
# Note: few rows. For a handful of activation rows (decode: one per sequence) OpenBLAS runs
# ``x @ W.T`` 1.4-3x slower than ``(W @ x.T).T`` (measured on the small and medium shapes, 1 and
# 2 threads: 2.8x at 2 rows, 2x at 8, 1.5x at 32, 1.1-1.2x at 64; bench/README.md), and an f32
# product of up to 63 rows was taken that way round. The numba matvec now takes every f32 product
# of up to `kernels.F32_MATVEC_ROWS` (64) rows, and since issue 36 every other f32 product too
# (kernels.matmul_float: the same tiles, blocked for prefill), since BLAS's order depends on the
# row count (docs/invariance.md).
# What ParamSource.read is asked for: the storage closest to the rank's format, so a 16-bit
# rank never holds a float32 copy of a tensor it can read as 16 bits.
_READ_DTYPE = {"f32": "float32", "bf16": "bfloat16", "f16": "float16", "int8": "float32", "q4": "float32"}


def q4_tensor(name: str, shape: tuple[int, ...]) -> bool:
    """Whether a checkpoint written as q4 (``convert --dtype q4``, ``init-model --dtype q4``) holds
    tensor ``name`` as q4 groups: the projections and LM head whose input width is a multiple of
    32; the embedding (a lookup: stored float, as the contract says), norms, biases and MoE
    routers stay float32."""
    last = name.rsplit("/", 1)[-1]
    return len(shape) == 2 and shape[1] % kernels.Q4_GROUP == 0 and last not in ("embed_tokens", "router")


class Linear:
    """``y = x @ W.T`` with ``W`` (out, in) stored as ``precision``."""

    def __init__(self, precision: str, data: np.ndarray, scale: np.ndarray | None = None, align: bool = True):
        if precision not in PRECISIONS:
            raise ValueError(f"Linear: precision {precision!r} is not one of {PRECISIONS}")
        if data.ndim != 2:
            raise ValueError(f"Linear: weight must be 2-D (out, in), got shape {data.shape}")
        data = np.ascontiguousarray(data)  # 64-byte aligned for the tiles' loads (kernels' alignment note)
        self.precision, self.data, self.scale = precision, kernels.aligned(data) if align else data, scale
        if precision != "f32":  # checked once here: decode calls the kernel unchecked (kernels.fused_matvec)
            kernels.check_weight(precision, self.data, scale)

    @property
    def shape(self) -> tuple[int, int]:
        n, k = self.data.shape
        return (n, 2 * k) if self.precision == "q4" else (n, k)  # (out, in): q4 holds two codes a byte

    @property
    def kind(self) -> str:
        """The storage as the decode kernels are typed on it: the precision, "q4f" for q4 with
        float32 scale / minimum pairs (a Q4_K file's) (`kernels.warm_up_decode_layer`)."""
        return "q4f" if self.precision == "q4" and self.scale.dtype == np.float32 else self.precision

    @property
    def kernel_data(self) -> np.ndarray:
        """The weight as the decode kernels take it (`kernels.decode_layer`): `kernels.kernel_weight`."""
        return kernels.kernel_weight(self.precision, self.data)

    @property
    def nbytes(self) -> int:
        return self.data.nbytes + (self.scale.nbytes if self.scale is not None else 0)

    def __call__(self, x: np.ndarray) -> np.ndarray:
        lead, c = x.shape[:-1], x.shape[-1]
        if c != self.shape[1]:  # (the decode kernel below reads x unchecked)
            raise ValueError(f"Linear: input has {c} features, the weight {self.shape} takes {self.shape[1]}")
        x2 = np.ascontiguousarray(x, dtype=np.float32).reshape(-1, c)  # (B*T, in): one GEMM, not B
        rows = x2.shape[0]
        # every row count takes kernels whose value for a row never depends on the others (the
        # invariance note in kernels/rowdot.py); q4 from Q4_GEMM_ROWS rows on a VNNI CPU the GEMM
        # (kernels/q4gemm.py), whose order decode's q4 kernel takes too (its decode note)
        if self.precision == "q4" and kernels.Q4_GEMM and rows >= kernels.Q4_GEMM_ROWS:
            y = kernels.fused_gemm_q4(x2, self.data, self.scale)
        elif self.precision == "f32":
            y = kernels.float_product(x2, self.data)
        else:
            y = kernels.fused_matvec(x2, self.data, self.precision, self.scale,
                                     np.empty((rows, self.data.shape[0]), np.float32))
        return y.reshape(*lead, self.data.shape[0])  # (..., out)

    def __getitem__(self, rows) -> np.ndarray:
        """float32 rows of W (an embedding lookup): ``table[ids]`` for ids of any shape."""
        if self.precision == "f32":
            return self.data[rows]
        ids = np.asarray(rows)
        return kernels.dequantize(self.data, self.precision, self.scale, ids).reshape(*ids.shape, -1)

    def rows(self, start: int, stop: int) -> "Linear":
        """Output rows start..stop-1 as a `Linear` viewing this one's memory (no copy)."""
        scale = None if self.scale is None else self.scale[start:stop]
        return Linear(self.precision, self.data[start:stop], scale, align=False)

    def to_f32(self) -> np.ndarray:
        """The float32 matrix this layer multiplies by (tests and references only)."""
        return self.data if self.precision == "f32" else kernels.dequantize(self.data, self.precision, self.scale)


def make_linear(w: np.ndarray, precision: str) -> Linear:
    """A `Linear` of ``w`` (out, in) in ``precision``, converting from whatever ``w`` is.

    ``w`` is float32, float16, or uint16 holding bfloat16 bit patterns (what
    ``ParamSource.read(..., dtype="bfloat16")`` returns)."""
    if precision not in PRECISIONS:
        raise ValueError(f"make_linear: precision {precision!r} is not one of {PRECISIONS}")
    if w.dtype == np.uint16 and precision == "bf16":
        return Linear("bf16", w)
    if w.dtype == np.float16 and precision == "f16":
        return Linear("f16", w.view(np.uint16))
    w32 = kernels.from_bf16(w) if w.dtype == np.uint16 else np.ascontiguousarray(w, dtype=np.float32)
    if precision == "f32":
        return Linear("f32", w32)
    if precision == "bf16":
        return Linear("bf16", kernels.to_bf16(w32))
    if precision == "f16":
        return Linear("f16", w32.astype(np.float16).view(np.uint16))
    if precision == "q4" and w32.ndim == 2 and w32.shape[1] % kernels.Q4_GROUP == 0:
        return Linear("q4", *kernels.quantize_q4(w32))
    return Linear("int8", *kernels.quantize_int8(w32))  # (q4 of a width groups cannot cover: the module note)


def read_linear(source, name: str, precision: str, **slicing) -> Linear:
    """Read tensor ``name`` (optionally a TP slice) straight into a `Linear` of ``precision``.

    f32 ranks call ``source.read`` exactly as before (a ParamSource without the ``dtype``
    keyword keeps working for them). A q4 rank takes a tensor the checkpoint holds in q4 groups
    as they are (``source.read_q4``, where the source has it), an int8 or q4 rank q8 groups of 16,
    32 or 64 (``source.read_q8``: a q4 rank holds a Q4_K_M file's Q6_K tensors as int8, the note on
    mixed parts in `fuse`); any other tensor is read as floats and quantized here."""
    if precision == "f32":
        return make_linear(source.read(name, **slicing), "f32")
    if precision == "q4" and hasattr(source, "read_q4"):
        held = source.read_q4(name, **slicing)  # None: stored as floats (or as q8 groups)
        if held is not None:
            return Linear("q4", *held)
    if precision in ("int8", "q4") and hasattr(source, "read_q8"):  # q8 groups (GGUF's Q8_0, Q6_K) as they are
        held = source.read_q8(name, **slicing)
        if held is not None:
            return Linear("int8", *held)
    return make_linear(source.read(name, dtype=_READ_DTYPE[precision], **slicing), precision)


def _held_form(precision: str, k: int, stored: tuple | None) -> tuple:
    """How `read_linear` holds a weight of ``k`` input columns stored as ``stored`` (H5ParamSource.
    stored): (format, scale / minimum bytes for q4 or block width for int8)."""
    if precision in ("f32", "bf16", "f16"):
        return (precision, 0)
    if precision == "q4" and stored and stored[0] == "q4" and stored[1] == kernels.Q4_GROUP:
        return ("q4", stored[2])
    if stored and stored[0] == "q8" and stored[1] in kernels.INT8_GROUPS:
        return ("int8", stored[1])
    if precision == "q4" and k % kernels.Q4_GROUP == 0:
        return ("q4", 2)  # quantized at load: float16 pairs
    return ("int8", kernels.INT8_BLOCK)


def _form_bytes(form: tuple, n: int, k: int) -> int:
    fmt, extra = form
    if fmt in ("f32", "bf16", "f16"):
        return n * k * (4 if fmt == "f32" else 2)
    if fmt == "q4":
        return n * (k // 2) + n * (k // kernels.Q4_GROUP) * 2 * extra
    return n * k + 4 * n * (kernels.int8_blocks(k) if extra == kernels.INT8_BLOCK else k // extra)


def _fused_bytes(precision: str, parts: list[tuple[int, int, tuple | None]]) -> int:
    """Resident bytes of ``parts`` ((n, k, stored) each) held as `fuse` holds them: mixed q4 /
    int8 parts all q4 (the int8 ones quantized with float16 pairs), mixed pairs all float32,
    mixed int8 block widths at the finest one."""
    forms = [_held_form(precision, k, st) for _, k, st in parts]
    fmts = {f for f, _ in forms}
    if len(fmts) > 1 and fmts <= {"q4", "int8"}:
        forms = [f if f[0] == "q4" else ("q4", 2) for f in forms]
    if len({f for f in forms}) > 1:  # one format now: float32 pairs, or the finest block
        widest = forms[0][0] == "q4"
        forms = [(forms[0][0], 4 if widest else min(e for _, e in forms))] * len(forms)
    return sum(_form_bytes(f, n, k) for f, (n, k, _) in zip(forms, parts))


_FUSED = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "gate_proj": "gate_up", "up_proj": "gate_up"}


def held_bytes(cfg, source, precision: str) -> int:
    """Resident weight bytes of the whole model (one stage, no TP) on a rank of ``precision``,
    from the checkpoint's storage (``source.stored``) without reading any data: what
    `DecoderStage.weight_bytes` then counts (tested). Linear weights as `read_linear` and `fuse`
    hold them, norms, biases and routers float32, tied embeddings once; latent attention adds
    its float32 copies of kv_b's halves (`DecoderStage._mla`)."""
    from .arch import expected_shapes

    total, groups = 0, {}
    for name, shape in expected_shapes(cfg).items():
        last = name.rsplit("/", 1)[-1]
        if len(shape) != 2 or last == "router":
            total += 4 * int(np.prod(shape))
            continue
        n, k = shape
        part = (n, k, source.stored(name))
        base = last.removeprefix("shared_")  # a MoE layer's shared experts fuse like a dense MLP
        key = _FUSED.get(base) if not (cfg.kv_lora_rank and base == "q_proj") else None
        if key:
            groups.setdefault((name[:-len(base)], key), []).append(part)
        else:
            total += _fused_bytes(precision, [part])
        if last == "kv_b_proj":
            total += 4 * n * k
    return total + sum(_fused_bytes(precision, parts) for parts in groups.values())


def fuse(parts: list[Linear]) -> Linear:
    """One `Linear` whose output rows are ``parts``' rows in order (q|k|v, gate|up), so a decode
    step reads them in one matvec and splits the output by columns (views).

    Note: fused projections. Decode at batch 1 is 113 matvec calls per token on the medium
    preset, and per-call Python and thread start-up is what limits 2 threads (bench/README.md);
    one product for q/k/v and one for gate/up make 4 calls per layer instead of 7. Every output
    element is the same dot product as before (rows are independent; int8's block scales
    concatenate with their rows), so results are bit-for-bit those of the separate matrices.
    Built once at load after TP sharding; the parts are dropped, so weight bytes do not grow."""
    if len({p.precision for p in parts}) > 1 and {p.precision for p in parts} <= {"q4", "int8"}:
        # Note: mixed parts. A q4 rank holds a checkpoint's q8 groups as int8 (Q4_K_M keeps attn_v in
        # Q6_K beside Q4_K q and k); fused with q4 parts they are re-quantized to q4 (one format per
        # product), while unfused ones (down_proj, the head: Q4_K_M's other Q6_K tensors) stay int8.
        parts = [p if p.precision == "q4" else make_linear(p.to_f32(), "q4") for p in parts]
    if len({p.precision for p in parts}) != 1 or len({p.shape[1] for p in parts}) != 1:
        raise ValueError(f"fuse: parts differ in precision or input width: "
                         f"{[(p.precision, p.shape) for p in parts]}")
    scales = [p.scale for p in parts]
    if parts[0].precision == "q4" and len({s.dtype for s in scales}) > 1:  # float16 pairs beside Q4_K's float32
        scales = [kernels.pairs_f32(s) for s in scales]
    if parts[0].precision == "int8" and len({s.shape[1] for s in scales}) > 1:
        # q8 groups of 32 / 16 beside blocks of 64 quantized at load (a partly q8 checkpoint): the
        # coarser blocks' scales repeated to the finest width, the same values (kernels.int8_block)
        k = parts[0].shape[1]
        fine = min(kernels.int8_block(k, s.shape[1]) for s in scales)
        scales = [np.repeat(s, kernels.int8_block(k, s.shape[1]) // fine, axis=1)[:, :k // fine] for s in scales]
    scale = None if parts[0].scale is None else np.concatenate(scales)
    data = kernels.aligned_empty((sum(p.data.shape[0] for p in parts), *parts[0].data.shape[1:]), parts[0].data.dtype)
    np.concatenate([p.data for p in parts], out=data)  # aligned already: `Linear` keeps it, no second copy
    return Linear(parts[0].precision, data, scale)


@dataclass
class Mlp:
    """A gated MLP's projections (``[out, in]`` like nn.Linear): one dense MLP or one expert.
    gate and up are held fused (`fuse`): ``gate_up(x)[..., :I]`` is gate, ``[..., I:]`` up."""

    gate_up: Linear  # (2I, C)
    down_proj: Linear  # (C, I)
    gate_up_bias: np.ndarray | None = None  # (2I,) GPT-OSS's experts
    down_bias: np.ndarray | None = None  # (C,)

    @classmethod
    def of(cls, gate_proj: Linear, up_proj: Linear, down_proj: Linear, gate_bias=None, up_bias=None,
           down_bias=None) -> "Mlp":
        bias = None if gate_bias is None else np.concatenate([gate_bias, up_bias]).astype(np.float32)
        return cls(fuse([gate_proj, up_proj]), down_proj, bias, down_bias)

    @property
    def width(self) -> int:
        return self.gate_up.shape[0] // 2  # I

    @property
    def gate_proj(self) -> Linear:  # views, for tests and references
        return self.gate_up.rows(0, self.width)

    @property
    def up_proj(self) -> Linear:
        return self.gate_up.rows(self.width, 2 * self.width)

    @property
    def nbytes(self) -> int:
        return self.gate_up.nbytes + self.down_proj.nbytes + sum(
            b.nbytes for b in (self.gate_up_bias, self.down_bias) if b is not None)


@dataclass
class ExpertStack:
    """Experts' gate/up and down matrices as (E, ...) stacks, the arrays `kernels.experts_decode`
    takes (one storage for all gate/ups, one for all downs); each expert's `Mlp` views its slice."""

    gate_up_fmt: str
    gate_up: np.ndarray  # (E, 2I, C), q4: (E, 2I, C/2) codes
    gate_up_scale: np.ndarray | None
    gate_up_bias: np.ndarray | None  # (E, 2I)
    down_fmt: str
    down: np.ndarray  # (E, C, I)
    down_scale: np.ndarray | None
    down_bias: np.ndarray | None  # (E, C)

    @classmethod
    def of(cls, experts: list[Mlp]) -> "ExpertStack | None":
        """The stack of ``experts``, their `Mlp`s rebound to views of it, or None when they differ
        in storage, shape or biases (a checkpoint's mix keeps them apart)."""
        return cls.gather(iter(experts), len(experts))[1]

    @classmethod
    def gather(cls, mlps: Iterator[Mlp], n: int) -> tuple[list[Mlp], "ExpertStack | None"]:
        """``n`` experts taken from ``mlps`` one at a time (a stage reads them so), each copied into
        its slot of a stack allocated from the first and rebound to views of it as it comes: a
        layer's experts are held once while they load, not as a list and a stack at once.
        The stack is None when they differ (those before the first odd one keep their views)."""
        got: list[Mlp] = []
        stack = None
        for m in mlps:
            if not got:
                stack = cls._empty(m, n)
            if stack is not None and not stack._put(len(got), m):
                stack = None
            got.append(m)
        if stack is not None and len(got) != n:
            stack = None
        if stack is not None:
            kernels.check_stack(stack.gate_up_fmt, stack.gate_up, stack.gate_up_scale, stack.gate_up_bias,
                                stack.down, stack.down_scale, stack.down_bias, stack.down_fmt)  # once: decode calls it unchecked
        return got, stack

    @classmethod
    def _empty(cls, m: Mlp, n: int) -> "ExpertStack":
        def like(a):
            return None if a is None else kernels.aligned_empty((n, *a.shape), a.dtype)

        return cls(m.gate_up.precision, like(m.gate_up.data), like(m.gate_up.scale), like(m.gate_up_bias),
                   m.down_proj.precision, like(m.down_proj.data), like(m.down_proj.scale), like(m.down_bias))

    def _put(self, e: int, m: Mlp) -> bool:
        """Copy expert ``m`` into slot ``e`` and rebind it to views there; False if it does not fit."""
        pairs = ((self.gate_up, m.gate_up.data), (self.gate_up_scale, m.gate_up.scale), (self.gate_up_bias, m.gate_up_bias),
                 (self.down, m.down_proj.data), (self.down_scale, m.down_proj.scale), (self.down_bias, m.down_bias))
        if (m.gate_up.precision, m.down_proj.precision) != (self.gate_up_fmt, self.down_fmt) or any(
                (a is None) != (b is None) or (a is not None and (a.shape[1:] != b.shape or a.dtype != b.dtype))
                for a, b in pairs):
            return False
        for a, b in pairs:
            if a is not None:
                a[e] = b
        # views, never copies (align=False): a slice that is not 64-byte aligned is read a little
        # slower by the per-expert path, where a copy would hold the expert twice
        m.gate_up = Linear(self.gate_up_fmt, self.gate_up[e], None if self.gate_up_scale is None else self.gate_up_scale[e],
                           align=False)
        m.down_proj = Linear(self.down_fmt, self.down[e], None if self.down_scale is None else self.down_scale[e],
                             align=False)
        m.gate_up_bias = None if self.gate_up_bias is None else self.gate_up_bias[e]
        m.down_bias = None if self.down_bias is None else self.down_bias[e]
        return True

    @property
    def rows(self) -> int:
        """Up to how many routed rows a step takes the kernel (a `Linear`'s decode matvec limit)."""
        return min(kernels.F32_MATVEC_ROWS if f == "f32" else kernels.matvec_rows(f)
                   for f in (self.gate_up_fmt, self.down_fmt))


@dataclass
class Experts:
    """This rank's experts of a MoE layer: the router (all E rows, replicated) and the experts
    ``first .. first + len(experts) - 1`` whole (expert parallelism under TP); held stacked for
    the decode kernel (`ExpertStack`) where they share one storage."""

    router: np.ndarray  # (E, C) float32
    first: int
    experts: list[Mlp]
    router_bias: np.ndarray | None = None  # (E,): GPT-OSS's logit bias, DeepSeek-V3's choice-only bias
    shared: Mlp | None = None  # DeepSeek's always-on experts, this rank's slice (sharded as a dense MLP)
    stack: ExpertStack | None = None  # the experts stacked (None: per expert, `moe.experts_forward`)
    shared_stack: ExpertStack | None = None  # the shared experts as a stack of one

    def __post_init__(self) -> None:
        if self.stack is None and self.experts:
            self.stack = ExpertStack.of(self.experts)
        if self.shared_stack is None and self.shared is not None:
            self.shared_stack = ExpertStack.of([self.shared])

    @property
    def nbytes(self) -> int:
        extra = sum(a.nbytes for a in (self.router_bias, self.shared) if a is not None)
        return self.router.nbytes + sum(e.nbytes for e in self.experts) + extra


@dataclass
class MlaWeights:
    """Multi-head latent attention's projections (DeepSeek-V2/V3), this rank's heads.

    q: ``q_a`` -> ``q_a_norm`` -> ``q_b`` (or one ``q``): (nh * (dn + dr), .) per head [nope | rope].
    ``kv_a`` (r + dr, C) makes the latent c (r, then ``kv_a_norm``) and the shared RoPE key (dr),
    replicated on every TP rank; ``kv_b`` (nh * (dn + dv), r) expands c to each head's [k_nope | v].
    ``uk`` (nh, dn, r) and ``uv`` (nh, dv, r) are kv_b's two halves per head as float32, the
    up-projections a decode step absorbs into q and o (`decoder.mla`)."""

    q: Linear  # q_proj (nh*(dn+dr), C) or q_b_proj (nh*(dn+dr), rq)
    kv_a: Linear  # (r + dr, C)
    kv_a_norm: np.ndarray  # (r,)
    kv_b: Linear  # (nh*(dn+dv), r)
    uk: np.ndarray  # (nh, dn, r) float32
    uv: np.ndarray  # (nh, dv, r) float32
    q_a: Linear | None = None  # (rq, C)
    q_a_norm: np.ndarray | None = None  # (rq,)

    @property
    def nbytes(self) -> int:
        arrays = (self.q, self.kv_a, self.kv_a_norm, self.kv_b, self.q_a, self.q_a_norm, self.uk, self.uv)
        return sum(a.nbytes for a in arrays if a is not None)


@dataclass
class LayerWeights:
    """One decoder layer's weights (this rank's shard): norms and biases as float32 arrays,
    projections as `Linear`; optional parts are None when the `Arch` has no such part."""

    input_layernorm: np.ndarray | None  # (C,), norm_offset already added; None without pre-norms (OLMo 2)
    qkv: Linear | None  # (nh*hs + 2*nkv*hs, C): q, k, v rows fused (`fuse`); None with MLA
    q_dim: int  # nh*hs: qkv's first q_dim rows are q, then k and v of (rows - q_dim) / 2 each
    o_proj: Linear  # (C, nh*hs)
    post_attention_layernorm: np.ndarray | None  # (C,) before the MLP
    mlp: Mlp | Experts
    mla: MlaWeights | None = None  # DeepSeek's latent attention instead of qkv
    o_bias: np.ndarray | None = None  # (C,) GPT-OSS, added after the TP sum
    sinks: np.ndarray | None = None  # (nh,) this rank's heads' sink logits (GPT-OSS)
    qkv_bias: np.ndarray | None = None  # (nh*hs + 2*nkv*hs,) q, k, v biases fused like the rows
    q_norm: np.ndarray | None = None  # (hs,)
    k_norm: np.ndarray | None = None
    attn_out_norm: np.ndarray | None = None  # (C,) Gemma 2
    mlp_out_norm: np.ndarray | None = None
    window: int = 0  # sliding window of this layer, 0: full
    local_rope: bool = False  # RoPE at the local base (Gemma 3's sliding layers)
    q_proj_norm: np.ndarray | None = None  # (nh*hs / tp,) this rank's slice of a whole-projection norm (OLMo 2)
    k_proj_norm: np.ndarray | None = None  # (nkv*hs / tp,) (a replicated kv head's whole slice)
    norm_group: int = 1  # TP ranks whose slices one whole-projection norm spans

    @classmethod
    def of(cls, q_proj: Linear, k_proj: Linear, v_proj: Linear, q_bias=None, k_bias=None, v_bias=None,
           **rest) -> "LayerWeights":
        """From separate q/k/v (and biases): fused here, the separate arrays not kept."""
        bias = None if q_bias is None else np.concatenate([q_bias, k_bias, v_bias]).astype(np.float32)
        return cls(qkv=fuse([q_proj, k_proj, v_proj]), q_dim=q_proj.shape[0], qkv_bias=bias, **rest)

    @property
    def kv_dim(self) -> int:
        return (self.qkv.shape[0] - self.q_dim) // 2  # nkv*hs

    @property
    def q_proj(self) -> Linear:  # views of qkv, for tests and references
        return self.qkv.rows(0, self.q_dim)

    @property
    def k_proj(self) -> Linear:
        return self.qkv.rows(self.q_dim, self.q_dim + self.kv_dim)

    @property
    def v_proj(self) -> Linear:
        return self.qkv.rows(self.q_dim + self.kv_dim, self.qkv.shape[0])

    @classmethod
    def latent(cls, mla: MlaWeights, **rest) -> "LayerWeights":
        """A layer with multi-head latent attention (no fused q/k/v)."""
        return cls(qkv=None, q_dim=0, mla=mla, **rest)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in vars(self).values() if a is not None and not isinstance(a, int))
