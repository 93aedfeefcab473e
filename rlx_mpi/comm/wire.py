"""Wire formats for hidden states between pipeline stages: f32 as is, or packed to bf16 / f16.

A `Codec` packs a C-contiguous float32 block into a contiguous wire buffer before a send and
unpacks a received wire buffer into a preallocated float32 array. ``f32`` is zero copy: the
array's own buffer goes on the wire. ``bf16`` and ``f16`` halve the bytes on the wire.

Error bound (``Codec.rel_error``), for every x in the normal range of the wire format
(2**-126 <= |x| <= 3.39e38 = (2 - 2**-7) * 2**127 for bf16, 2**-14 <= |x| <= 65504 for f16)::

    |unpack(pack(x)) - x| <= rel_error * |x|      f32: 0   bf16: 2**-8   f16: 2**-11

i.e. half a unit in the last place of an 8-bit (bf16) or 11-bit (f16) significand, as round to
nearest even gives; the bound is reached (the tests check both). Outside that range: bf16
keeps float32's exponent range, so only f32 subnormals lose relative precision (absolute
error <= 2**-134) and only |x| >= (2 - 2**-8) * 2**127 overflows to ±Inf; f16 underflows
gradually below 2**-14 (absolute error <= 2**-25; |x| <= 2**-25 becomes ±0) and overflows to
±Inf from 65520 up. NaN stays NaN (quiet; sign and top payload bits kept), ±Inf and ±0 are
kept exactly. Every result is bit for bit what round to nearest even gives: pack checked
against numpy over all 2**32 float32 bit patterns (bench/check_wire_exhaustive.py; the tests
check 2**20 random ones and the special cases), unpack over all 2**16 in the tests.

Note: the kernels (rlx_mpi/kernels/bits.py, one copy shared with the weight formats) work on
the float32 *bit patterns* (a uint32 view) in integer arithmetic, because numba 0.6x has no
float16 type in nopython mode, and are written as selects, not branches, so LLVM vectorises
them; only f16's subnormals use exact float32 arithmetic. They run on the calling thread.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..errors import ConfigError
from ..kernels.bits import pack_bf16, pack_f16, unpack_bf16, unpack_f16
from ..rules import WIRE_FORMATS  # named once, where the job file is checked without numba

__all__ = ["WIRE_FORMATS", "Codec", "get_codec", "warm_up"]


# --- validating wrappers (the kernels: flat 1-D views, no validation, in kernels/bits.py) ----

def _check(arg: str, a, dtype: np.dtype, shape=None) -> None:
    """Raise ValueError naming ``arg`` unless ``a`` is a C-contiguous ``dtype`` array of ``shape``."""
    if not isinstance(a, np.ndarray):
        raise ValueError(f"{arg}: expected a numpy array, got {type(a).__name__}")
    if a.dtype != dtype:
        raise ValueError(f"{arg}: expected dtype {dtype}, got {a.dtype}; "
                         f"pass np.ascontiguousarray({arg}, dtype=np.{dtype})")
    if not a.flags.c_contiguous:
        raise ValueError(f"{arg}: expected a C-contiguous array, got a strided view of shape {a.shape}; "
                         f"pass np.ascontiguousarray({arg})")
    if shape is not None and a.shape != tuple(shape):
        raise ValueError(f"{arg}: expected shape {tuple(shape)}, got {a.shape}")


def _check_writable(arg: str, a: np.ndarray) -> None:
    if not a.flags.writeable:
        raise ValueError(f"{arg}: the array is read-only; pass a writable buffer")


_F32 = np.dtype(np.float32)


@dataclass(frozen=True)
class Codec:
    """One wire format: how a float32 block travels between stages."""

    name: str  # "f32" | "bf16" | "f16"
    wire_dtype: np.dtype  # float32 | uint16 (bf16 bits) | float16
    rel_error: float  # bound on |unpack(pack(x)) - x| / |x| for x normal in the wire format
    _pack: object = field(default=None, repr=False, compare=False)
    _unpack: object = field(default=None, repr=False, compare=False)

    @property
    def itemsize(self) -> int:
        """Bytes per element on the wire."""
        return self.wire_dtype.itemsize

    def wire_buffer(self, shape) -> np.ndarray:
        """A new C-contiguous wire buffer for a float32 block of ``shape``."""
        return np.empty(shape, dtype=self.wire_dtype)

    def pack(self, src: np.ndarray, dst: np.ndarray | None = None) -> np.ndarray:
        """``src`` (C-contiguous float32) in wire format: f32 returns ``src`` itself (no copy,
        ``dst`` ignored); bf16/f16 write into ``dst`` (allocated when None) and return it."""
        _check("src", src, _F32)
        if self._pack is None:
            return src
        if dst is None:
            dst = self.wire_buffer(src.shape)
        _check("dst", dst, self.wire_dtype, src.shape)
        _check_writable("dst", dst)
        self._pack(src.reshape(-1), dst.reshape(-1).view(np.uint16))
        return dst

    def unpack(self, src: np.ndarray, dst: np.ndarray) -> np.ndarray:
        """Wire buffer ``src`` into the preallocated float32 ``dst`` of the same shape; returns ``dst``."""
        _check("dst", dst, _F32)
        _check("src", src, self.wire_dtype, dst.shape)
        if src is dst:
            return dst
        _check_writable("dst", dst)
        if self._unpack is None:
            np.copyto(dst, src)
        else:
            self._unpack(src.reshape(-1).view(np.uint16), dst.reshape(-1).view(np.uint32))
        return dst


_CODECS = {
    "f32": Codec("f32", np.dtype(np.float32), 0.0),
    "bf16": Codec("bf16", np.dtype(np.uint16), 2.0**-8, pack_bf16, unpack_bf16),
    "f16": Codec("f16", np.dtype(np.float16), 2.0**-11, pack_f16, unpack_f16),
}


def get_codec(name: str, where: str = "wire") -> Codec:
    """The codec called ``name``; ConfigError naming ``where`` for an unknown name."""
    codec = _CODECS.get(name) if isinstance(name, str) else None
    if codec is None:
        raise ConfigError(where, f"unknown wire format {name!r}",
                          f"use one of {', '.join(repr(n) for n in WIRE_FORMATS)}")
    return codec


def warm_up() -> None:
    """Load (or compile) every kernel now, at build time, not inside the first timed send."""
    x = np.zeros(1, np.float32)
    for name in WIRE_FORMATS:
        codec = _CODECS[name]
        codec.unpack(codec.pack(x), np.empty_like(x))
