"""numba kernels of a forward, by concern (BLAS does the large matmuls).

- ``elementwise``: rms_norm, silu_mul_ / swiglu, rope and the vectorisable exp behind them
- ``attention``: a query's attention (one arithmetic, read in place from a slot row or a paged row's
  blocks) and prefill's blocked attention (`attend`, `attend_workspace_bytes`), a reference softmax
- ``attention_cache``: decode attention read in place from a KV cache, slot rows or a block table
  (`attend_cache`; `decode_attention` adds RoPE and the cache write)
- ``matvec``: every float32 / bf16 / f16 product, decode's on the rank's numba threads, prefill's on its
  team, each element in one order whatever the rows (rowdot's invariance note)
- ``lowp``: bf16 / f16 / int8 / q4 weights, their decode matvecs (bf16's is matvec's) and prefill tiles
- ``quant``: resident block formats (q4: 4-bit codes, a scale and minimum per 32) and their matvecs
- ``decode_layer``: a dense SwiGLU layer's decode step in one call of the kernels above
- ``experts``: a MoE layer's chosen experts at decode in one call, each row alone in its product
- ``lora``: LoRA's low-rank products, each row's adapter after the base product (`lora_add_`)
- ``bits``: float32 <-> bf16 / f16 bit patterns, shared with the wire codecs (rlx_mpi.wire)
- ``rowdot``: the decode matvecs' dot products as LLVM vector IR (prefetch, 2-row tiles)
- ``llvm_ir``: the LLVM-IR building blocks of rowdot's, quant's and q4gemm's intrinsics (target features, lane sums)
- ``q4gemm``: prefill's q4 products (16 rows and more) on AVX-512 VNNI: int8 activations x 4-bit codes
- ``blocks``: a prefill chunk's copies through a paged row's block table (gather before, scatter after)
- ``isa``: the arithmetic this process's products use (amx | avx512 | avx2 | generic), AMX's Linux permission
- ``_fresh``: drops the numba caches when any kernel source changed (numba keys each on its own file)

The ``_`` kernels are ``@numba.njit(cache=True)`` with no validation and no allocation; the
public wrappers check dtype, shape and contiguity, allocate, and say what to pass. The decode
matvecs run on numba's pool, sized by `set_threads`; the rest run serial on the calling thread
(the threads note in _common.py says why), except a prefill's attention, which gives its kv heads
to the rank's threads (`run_parts`, the team note there).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ._fresh import drop_stale

drop_stale(Path(__file__).parent)  # before any cached kernel loads (the note in _fresh.py)

from ._common import aligned, aligned_empty, set_threads

from .attention import _row_max, attend, attend_workspace_bytes, causal_softmax_
from .attention_cache import attend_cache, check_cache_rows, decode_attention
from .elementwise import _exp, rms_norm, rope, silu_mul_, swiglu
from .lowp import (INT8_BLOCK, INT8_GROUPS, int8_block, matvec_rows, WEIGHT_FORMATS, check_weight, dequant_matmul, dequantize,
                   fused_matvec, from_bf16, int8_blocks, kernel_weight, quantize_int8, to_bf16)
from .matvec import F32_MATVEC_ROWS, _matvec_float, float_product, matmul_float, matvec_f32
from .quant import GROUP as Q4_GROUP, VNNI, dequantize_q4, pairs_f32, q4_nbytes, quantize_q4
from .q4gemm import Q4_GEMM, Q4_GEMM_ROWS, fused_gemm_q4, gemm_q4, matvec_q4
from ._common import pool_threads
from .blocks import gather_blocks, scatter_blocks
from .lora import lora_add_, warm_up as warm_up_lora
from .decode_layer import FORMATS as DECODE_LAYER_FORMATS, decode_layer, warm_up as warm_up_decode_layer
from .experts import (ACTIVATIONS as EXPERT_ACTIVATIONS, check_stack, experts_decode, fused_experts, lone_rows,
                      route as route_experts, warm_up as warm_up_experts)

__all__ = ["lora_add_", "warm_up_lora", "rms_norm", "silu_mul_", "swiglu", "rope", "attend", "attend_cache", "decode_attention", "check_cache_rows", "attend_workspace_bytes", "causal_softmax_",
           "matvec_f32", "float_product", "matmul_float", "F32_MATVEC_ROWS", "dequant_matmul", "fused_matvec", "kernel_weight", "check_weight", "dequantize", "to_bf16",
           "from_bf16", "quantize_int8", "int8_blocks", "INT8_BLOCK", "WEIGHT_FORMATS", "matvec_rows", "set_threads", "pool_threads", "aligned", "aligned_empty", "decode_layer", "DECODE_LAYER_FORMATS", "warm_up_decode_layer", "warm_up",
           "warm_up_lowp", "experts_decode", "lone_rows", "route_experts", "fused_experts", "check_stack", "warm_up_experts",
           "EXPERT_ACTIVATIONS",
           "INT8_GROUPS", "int8_block", "Q4_GROUP", "VNNI", "pairs_f32", "quantize_q4", "dequantize_q4", "matvec_q4", "q4_nbytes",
           "gemm_q4", "fused_gemm_q4", "Q4_GEMM", "Q4_GEMM_ROWS", "gather_blocks", "scatter_blocks"]


def warm_up() -> None:
    """Load (or compile) the float32 forward's kernels now, at build time, not inside the first
    timed forward (`causal_softmax_` is for tests and benches: compiled on first use)."""
    rms_norm(np.ones((1, 2), np.float32), np.ones(2, np.float32), 1e-6)
    silu_mul_(np.ones((1, 2), np.float32), np.ones((1, 2), np.float32))
    swiglu(np.ones((1, 4), np.float32))
    x = np.ones((1, 2, 1, 2), np.float32)
    rope(x, np.ones((1, 2), np.float32), np.ones((1, 2), np.float32))
    for t in (1, 9):  # the decode path and the blocked path
        q, kv = np.ones((1, 2, t, 2), np.float32), np.ones((1, 1, 9, 2), np.float32)
        attend(q, kv, kv)
    attend_cache(np.ones((1, 2, 1, 2), np.float32), kv, kv, np.zeros(1, np.int64), np.full(1, 8))
    for norm in (None, np.ones(2, np.float32)):
        decode_attention(np.ones((1, 8), np.float32), 4, np.ones((1, 2), np.float32), np.ones((1, 2), np.float32),
                         kv.copy(), kv.copy(), np.zeros(1, np.int64), np.full(1, 3), q_norm=norm, k_norm=norm)
        decode_attention(np.ones((1, 8), np.float32), 4, np.ones((1, 2), np.float32), np.ones((1, 2), np.float32),
                         kv.copy(), kv.copy(), np.zeros(1, np.int64), np.full(1, 3), q_norm=norm, k_norm=norm,
                         table=np.zeros((1, 3), np.int32), size=3)  # a paged cache (attention_cache's paged-rows note)
    pool, table, kv4 = np.zeros((1, 6, 2), np.float32), np.zeros((1, 2), np.int32), np.ones((1, 1, 2, 2), np.float32)
    scatter_blocks(pool, table, np.zeros(1, np.int64), 3, 1, np.full(1, 2), kv4)  # a paged prefill chunk
    gather_blocks(pool, table, np.zeros(1, np.int64), 3, 1, kv4)
    matvec_f32(np.ones((1, 2), np.float32), np.ones((3, 2), np.float32))
    matmul_float(np.ones((F32_MATVEC_ROWS + 1, 2), np.float32), np.ones((9, 2), np.float32))  # prefill's tiles


def warm_up_lowp() -> None:
    """Load (or compile) the low-precision kernels at build time."""
    x = np.ones((1, 4), np.float32)
    w = np.ones((2, 4), np.float32)
    q, s = quantize_int8(w)
    b = to_bf16(w)
    x32, w32 = np.ones((1, 32), np.float32), np.ones((2, 32), np.float32)
    c4, sm4 = quantize_q4(w32)
    for fmt, xx, ww, sc in (("bf16", x, b, None), ("f16", x, w.astype(np.float16).view(np.uint16), None),
                            ("int8", x, q, s), ("q4", x32, c4, sm4), ("q4", x32, c4, np.zeros((2, 2), np.float32))):
        dequant_matmul(xx, ww, fmt, sc)  # the fused kernel (q4: f16 pairs, then float32 pairs as Q4_K's)
        if fmt in ("bf16", "f16"):  # prefill's tiles (matmul_float)
            dequant_matmul(np.ones((F32_MATVEC_ROWS + 1, xx.shape[1]), np.float32), ww, fmt, sc)
        dequant_matmul(xx, ww, fmt, sc, fused=False)  # the tiles
        if fmt == "q4" and Q4_GEMM:
            gemm_q4(xx, ww, sc)  # prefill's product (f16 pairs, then float32 ones)

