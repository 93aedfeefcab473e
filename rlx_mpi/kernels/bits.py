"""float32 <-> bf16 / f16 bit patterns: the one copy the weight formats and the wire codecs share.

bf16 is the top half of a float32 (decoding is a shift); f16 is IEEE binary16, decoded and
rounded with integer operations because numba has no float16 type in nopython mode. Encoding
rounds to nearest even; NaN stays NaN (quiet, sign and top payload bits kept), +-Inf and +-0
are kept exactly (checked against numpy over every f16/bf16 pattern and 2**20 random float32
ones in tests/test_wire.py; over all 2**32 in bench/check_wire_exhaustive.py).

Note: the loops work on a uint32 view in integer arithmetic written as selects, not branches,
so LLVM vectorises them; every intermediate is wrapped in _U (uint32) because numba widens
small integers to 64 bits and 64-bit lanes made these loops 1.5-2x slower (measured). Only
f16's subnormals use exact float32 arithmetic. They run on the calling thread.
"""

from __future__ import annotations

import numba
import numpy as np
from numba.core import types
from numba.extending import intrinsic

__all__ = ["as_f32", "bits_of_f32", "f16_exact", "f16_bits", "pack_bf16", "unpack_bf16", "pack_f16", "unpack_f16"]

_U = np.uint32


@intrinsic
def as_f32(typingctx, bits):
    """Reinterpret the low 32 bits of an integer as float32 (an LLVM register bitcast: lets a
    decode sit inside a dot). A wider integer (numba widens uint32 arithmetic) is cast first."""
    if not isinstance(bits, types.Integer):
        return None
    return types.float32(types.uint32), lambda ctx, builder, sig, args: builder.bitcast(
        args[0], ctx.get_value_type(types.float32))


@intrinsic
def bits_of_f32(typingctx, x):
    """Reinterpret a float32 as uint32."""
    if x != types.float32:
        return None
    return types.uint32(types.float32), lambda ctx, builder, sig, args: builder.bitcast(
        args[0], ctx.get_value_type(types.uint32))


_F16_TO_F32 = np.float32(2.0 ** 112)  # rebias a half's exponent (15) to a float's (127); renormalises subnormals


@numba.njit(cache=True, inline="always")
def f16_exact(bits):  # any float16 bits (uint16, or int16 read from the same bytes) -> float32
    h = _U(_U(bits) & _U(0xFFFF))
    sign = _U(_U(h & _U(0x8000)) << _U(16))
    inf_nan = as_f32(_U(sign | _U(0x7F800000) | _U(_U(h & _U(0x3FF)) << _U(13))))  # payload kept
    # finite: exponent and mantissa moved into float32's places, one multiply rebiases the
    # exponent and renormalises subnormals
    finite = as_f32(_U(sign | _U(_U(h & _U(0x7FFF)) << _U(13)))) * _F16_TO_F32
    return inf_nan if _U(h & _U(0x7C00)) == _U(0x7C00) else finite


@numba.njit(cache=True)
def pack_bf16(src, dst):  # src (N,) float32, dst (N,) uint16 = bf16 bits
    bits = src.view(np.uint32)
    for i in range(src.size):
        b = bits[i]
        # round to nearest even on the top 16 bits: add 0x7fff plus the lowest kept bit
        r = _U(_U(_U(b + _U(0x7FFF)) + _U(_U(b >> _U(16)) & _U(1))) >> _U(16))
        # a NaN could round into Inf (or wrap to -0): keep its top bits, set the quiet bit
        q = _U(_U(b >> _U(16)) | _U(0x40))
        nan = _U(b & _U(0x7FFFFFFF)) > _U(0x7F800000)
        dst[i] = np.uint16(q if nan else r)


@numba.njit(cache=True)
def unpack_bf16(src, dst):  # src (N,) uint16 = bf16 bits, dst (N,) uint32 = float32 bits
    for i in range(src.size):
        dst[i] = _U(_U(src[i]) << _U(16))


@numba.njit(cache=True, inline="always")
def f16_bits(x):  # one float32 -> IEEE half bits (uint32), numpy's astype(float16): to nearest even
    b = bits_of_f32(x)
    sign = _U(_U(b >> _U(16)) & _U(0x8000))
    a = _U(b & _U(0x7FFFFFFF))  # |x| bits
    # normal half: rebias the exponent 127 -> 15, round the 13 dropped bits to nearest
    # even (a carry into the exponent is right, up to 65520.. -> 0x7c00 = Inf)
    normal = _U(_U(_U(a - _U(0x38000000)) + _U(_U(0xFFF) + _U(_U(a >> _U(13)) & _U(1)))) >> _U(13))
    # subnormal half (|x| < 2**-14): |x| * 2**24 < 1024 is exact in float32 and rint rounds
    # it to nearest even, in vector instructions (2x faster than integer shifts, measured)
    small = np.abs(x) if a < _U(0x38800000) else np.float32(0.0)
    h = normal if a >= _U(0x38800000) else _U(np.int32(np.rint(small * np.float32(16777216.0))))
    h = _U(0x7C00) if a >= _U(0x47800000) else h  # from 65536 (and Inf): Inf
    # NaN: quiet, keep the top payload bits
    h = _U(_U(0x7E00) | _U(_U(a >> _U(13)) & _U(0x3FF))) if a > _U(0x7F800000) else h
    return _U(h | sign)


@numba.njit(cache=True)
def pack_f16(src, dst):  # src (N,) float32, dst (N,) uint16 = IEEE half bits
    for i in range(src.size):
        dst[i] = np.uint16(f16_bits(src[i]))


@numba.njit(cache=True)
def unpack_f16(src, dst):  # src (N,) uint16 = IEEE half bits, dst (N,) uint32 = float32 bits
    for i in range(src.size):
        h = _U(src[i])
        sign = _U(_U(h & _U(0x8000)) << _U(16))
        o = _U(_U(h & _U(0x7FFF)) << _U(13))  # exponent and mantissa in float32's places
        e = _U(o & _U(0x0F800000))
        o = _U(o + _U(0x38000000))  # rebias the exponent 15 -> 127
        o = _U(o + _U(0x38000000)) if e == _U(0x0F800000) else o  # Inf/NaN: exponent 255, payload kept
        # +-0 and subnormals m * 2**-24: read as the float 2**-14 * (1 + m/1024) and subtract
        # 2**-14, exact in float32 (selects and a bitcast vectorise; a loop or gather 2x slower)
        sub = bits_of_f32(as_f32(_U(o + _U(0x00800000))) - np.float32(2.0**-14))
        o = sub if e == _U(0) else o
        dst[i] = _U(o | sign)
