"""The checkpoint's quantized groups (the quant contract, shared with the q4 precision) and the
GGML block types they hold exactly: each decoder turns a tensor's raw blocks into `QuantGroups`
without a second quantization (``QUANT_CONTRACT``); `converter` picks which tensors keep them."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["QuantGroups", "QUANT_CONTRACT", "EXACT_TYPES", "quant_groups"]


@dataclass(frozen=True)
class QuantGroups:
    """A linear weight (N, K) as the checkpoint's quantized groups (quant contract):
    ``w[n, k] = scale[n, k // G] * code[n, k] + minimum[n, k // G]`` in float32.

    ``quant`` "q4": ``codes`` uint8 (N, K // 2), byte j of a row holding column 2j in its low
    nibble and 2j + 1 in its high one, codes 0..15, and a ``minimum``; "q8": ``codes`` int8
    (N, K), no minimum. ``scale`` / ``minimum``: float16 or float32, (N, K // G)."""

    quant: str
    codes: np.ndarray
    scale: np.ndarray
    minimum: np.ndarray | None
    group_size: int

    @property
    def shape(self) -> tuple[int, int]:
        n, width = self.codes.shape
        return n, width * (2 if self.quant == "q4" else 1)

    @property
    def nbytes(self) -> int:
        return self.codes.nbytes + self.scale.nbytes + (0 if self.minimum is None else self.minimum.nbytes)

    def __getitem__(self, rows: slice) -> "QuantGroups":
        """Rows ``[a:b]`` (a fused tensor's part), or any index array of rows (a permutation)."""
        pick = (lambda a: None if a is None else np.ascontiguousarray(a[rows]))
        return QuantGroups(self.quant, pick(self.codes), pick(self.scale), pick(self.minimum), self.group_size)

    def unpack(self) -> np.ndarray:
        """The codes, one per column: uint8 0..15 (q4) or int8 (q8), (N, K)."""
        if self.quant == "q8":
            return self.codes
        out = np.empty(self.shape, np.uint8)
        out[:, 0::2] = self.codes & 0x0F
        out[:, 1::2] = self.codes >> 4
        return out

    def dequantize(self) -> np.ndarray:
        """The float32 weight, computed as the contract says (scale * code + minimum)."""
        n, k = self.shape
        g = self.group_size
        codes = self.unpack().astype(np.float32).reshape(n, k // g, g)
        w = self.scale.astype(np.float32)[:, :, None] * codes
        if self.minimum is not None:
            w = w + self.minimum.astype(np.float32)[:, :, None]
        return w.reshape(n, k)

    def write_h5(self, parent, name: str) -> None:
        """Write as the h5py group ``name`` under ``parent`` (`checkpoint.write_checkpoint`)."""
        group = parent.create_group(name)
        group.attrs["quant"] = self.quant
        group.attrs["shape"] = np.asarray(self.shape, np.int64)
        group.attrs["group_size"] = self.group_size
        group.create_dataset("codes", data=self.codes)
        group.create_dataset("scale", data=self.scale)
        if self.minimum is not None:
            group.create_dataset("minimum", data=self.minimum)


def _f16(raw: np.ndarray) -> np.ndarray:
    """Little-endian float16 from a (..., 2) uint8 view."""
    return np.ascontiguousarray(raw).view("<f2")[..., 0]


def _narrow(*arrays: np.ndarray) -> list[np.ndarray]:
    """float16 when every value is exactly a float16 (Q4_0's -8 d overflows only past 8188),
    else float32 for all (scale and minimum share one dtype)."""
    with np.errstate(over="ignore"):
        narrow = [a.astype(np.float16) for a in arrays]
    if all(np.array_equal(n.astype(np.float32), a.astype(np.float32)) for n, a in zip(narrow, arrays)):
        return narrow
    return [a.astype(np.float32) for a in arrays]


def _pack_q4(codes: np.ndarray) -> np.ndarray:
    """(N, K) codes 0..15 -> (N, K // 2) bytes: column 2j low nibble, 2j + 1 high."""
    return (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)


def _nibbles32(qs: np.ndarray) -> np.ndarray:
    """ggml's 32-value nibble block (16 bytes: value j < 16 in byte j's low nibble, value 16 + j
    in its high one) -> (..., 32) codes in column order."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _q4_0(raw: np.ndarray) -> QuantGroups:  # block: d f16, 16 bytes of nibbles; w = d (q - 8)
    n = raw.shape[0]
    b = raw.reshape(n, -1, 18)
    d = _f16(b[..., 0:2]).astype(np.float32)
    codes = _nibbles32(b[..., 2:]).reshape(n, -1)
    scale, minimum = _narrow(d, -8.0 * d)
    return QuantGroups("q4", _pack_q4(codes), scale, minimum, 32)


def _q4_1(raw: np.ndarray) -> QuantGroups:  # block: d, m f16, 16 bytes of nibbles; w = d q + m
    n = raw.shape[0]
    b = raw.reshape(n, -1, 20)
    d, m = _f16(b[..., 0:2]), _f16(b[..., 2:4])
    codes = _nibbles32(b[..., 4:]).reshape(n, -1)
    return QuantGroups("q4", _pack_q4(codes), d.copy(), m.copy(), 32)


def _q8_0(raw: np.ndarray) -> QuantGroups:  # block: d f16, 32 int8; w = d q
    n = raw.shape[0]
    b = raw.reshape(n, -1, 34)
    codes = np.ascontiguousarray(b[..., 2:]).view(np.int8).reshape(n, -1)
    return QuantGroups("q8", codes, _f16(b[..., 0:2]).copy(), None, 32)


def _k_scales(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K's 12 bytes -> 8 six-bit scales and 8 six-bit mins (ggml's get_scale_min_k4)."""
    s = s.astype(np.uint8)
    sc = np.concatenate([s[..., 0:4] & 63, (s[..., 8:12] & 0x0F) | ((s[..., 0:4] >> 6) << 4)], axis=-1)
    mn = np.concatenate([s[..., 4:8] & 63, (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)], axis=-1)
    return sc, mn


def _q4_k(raw: np.ndarray) -> QuantGroups:
    """Super-block of 256: d, dmin f16, 12 bytes of 6-bit scales/mins, 128 bytes of nibbles
    (chunk c of 32 bytes: group 2c in the low nibbles, 2c + 1 in the high); w = d sc q - dmin mn."""
    n = raw.shape[0]
    b = raw.reshape(n, -1, 144)
    d, dmin = _f16(b[..., 0:2]).astype(np.float32), _f16(b[..., 2:4]).astype(np.float32)
    sc, mn = _k_scales(b[..., 4:16])
    qs = b[..., 16:].reshape(n, -1, 4, 1, 32)
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=-2).reshape(n, -1)  # (chunk, low|high, 32)
    # exact in float32: an f16 (11-bit significand) times a 6-bit integer
    scale = (d[..., None] * sc.astype(np.float32)).reshape(n, -1)
    minimum = -(dmin[..., None] * mn.astype(np.float32)).reshape(n, -1)
    return QuantGroups("q4", _pack_q4(codes), scale, minimum, 32)


def _q6_k(raw: np.ndarray) -> QuantGroups:
    """Super-block of 256: 128 bytes low nibbles, 64 bytes high 2-bit pairs, 16 int8 scales, d
    f16; value e = 128 h + r: low = (ql[64 h + r % 64] >> 4 (r // 64)) & 15, high =
    (qh[32 h + r % 32] >> 2 (r // 32)) & 3, code = low | high << 4 - 32, scale d * sc[e // 16]."""
    n = raw.shape[0]
    b = raw.reshape(n, -1, 210)
    ql = b[..., :128].reshape(n, -1, 2, 1, 64)
    qh = b[..., 128:192].reshape(n, -1, 2, 1, 32)
    low = ((ql >> np.array([0, 4], np.uint8).reshape(2, 1)) & 0x0F).reshape(n, -1, 2, 128)
    high = ((qh >> np.array([0, 2, 4, 6], np.uint8).reshape(4, 1)) & 0x03).reshape(n, -1, 2, 128)
    codes = ((low | (high << 4)).astype(np.int16) - 32).astype(np.int8).reshape(n, -1)
    sc = np.ascontiguousarray(b[..., 192:208]).view(np.int8).astype(np.float32)
    d = _f16(b[..., 208:210]).astype(np.float32)
    return QuantGroups("q8", codes, (d[..., None] * sc).reshape(n, -1), None, 16)


def _q5_0(raw: np.ndarray) -> QuantGroups:
    """Block: d f16, 32 high bits (uint32, bit j for value j), 16 bytes of low nibbles;
    w = d (q - 16), q - 16 in [-16, 15]: an int8 group of 32 with scale d, exactly."""
    n = raw.shape[0]
    b = raw.reshape(n, -1, 22)
    high = (np.ascontiguousarray(b[..., 2:6]).view("<u4") >> np.arange(32, dtype=np.uint32)) & 1
    codes = ((_nibbles32(b[..., 6:]) | (high.astype(np.uint8) << 4)).astype(np.int16) - 16).astype(np.int8)
    return QuantGroups("q8", codes.reshape(n, -1), _f16(b[..., 0:2]).copy(), None, 32)


def _q3_k(raw: np.ndarray) -> QuantGroups:
    """Super-block of 256: 32 bytes of high bits (hmask), 64 bytes of 2-bit lows, 12 bytes of
    6-bit scales, d f16; value e = 128 h + 32 s + l: low (qs[32 h + l] >> 2 s) & 3, high bit
    (hmask[l] >> (e // 32)) & 1, q = low - 4 (1 - high) in [-4, 3], scale d (sc - 32) per 16:
    int8 groups of 16, exact (an f16 times a 6-bit integer)."""
    n = raw.shape[0]
    b = raw.reshape(n, -1, 110)
    hmask, qs, sc = b[..., :32], b[..., 32:96], b[..., 96:108]
    low = ((qs.reshape(n, -1, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(4, 1)) & 3).reshape(n, -1, 256)
    high = ((hmask.reshape(n, -1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(8, 1)) & 1).reshape(n, -1, 256)
    codes = (low.astype(np.int8) - ((high ^ 1) << 2).astype(np.int8)).reshape(n, -1)
    lo = (sc[..., 0:8, None] >> np.array([0, 4], np.uint8)).swapaxes(-1, -2).reshape(n, -1, 16) & 0x0F
    hi = (sc[..., 8:12, None] >> np.array([0, 2, 4, 6], np.uint8)).swapaxes(-1, -2).reshape(n, -1, 16) & 0x03
    scales = ((lo | (hi << 4)).astype(np.int16) - 32).astype(np.float32)
    d = _f16(b[..., 108:110]).astype(np.float32)
    return QuantGroups("q8", codes, (d[..., None] * scales).reshape(n, -1), None, 16)


# GGML type name -> its exact groups; the contract's "no second quantization" list (Q5_0 and
# Q3_K have no minimum: their codes fit int8 groups as they are, 8 bits where they used 5 or 3.4)
QUANT_CONTRACT = {"Q4_0": _q4_0, "Q4_1": _q4_1, "Q4_K": _q4_k, "Q8_0": _q8_0, "Q6_K": _q6_k, "Q5_0": _q5_0,
                  "Q3_K": _q3_k}
EXACT_TYPES = tuple(QUANT_CONTRACT)
_FLOAT_TYPES = ("F32", "F16", "BF16", "F64")


def quant_groups(type_name: str, raw: np.ndarray) -> QuantGroups:
    """The groups of a 2-D tensor of GGML type ``type_name`` from its raw bytes (N, bytes per row)."""
    return QUANT_CONTRACT[type_name](np.ascontiguousarray(raw, dtype=np.uint8))

