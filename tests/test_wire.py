"""Wire codecs against an independent reference: exact rounding in float64 (frexp/ldexp/rint),
and for f16 also numpy's own float16 cast. Pure: no MPI."""

import numpy as np
import pytest

from rlx_mpi.comm import wire
from rlx_mpi.errors import EXIT_BAD_INPUT, ConfigError

BF16_MAX = (2 - 2.0**-7) * 2.0**127
F16_MAX = 65504.0
# (significand bits incl. the implicit one, smallest normal exponent, largest finite)
FORMATS = {"bf16": (8, -126, BF16_MAX), "f16": (11, -14, F16_MAX)}


def round_ref(x: np.ndarray, p: int, emin: int, max_finite: float) -> np.ndarray:
    """x (float32) rounded to nearest even with a p-bit significand and gradual underflow
    below 2**emin, as float64; beyond max_finite after rounding -> ±Inf. NaN stays NaN."""
    x64 = x.astype(np.float64)
    out = x64.copy()
    fin = np.isfinite(x64) & (x64 != 0)
    _, e = np.frexp(x64[fin])  # x = f * 2**e, 0.5 <= |f| < 1: leading bit at 2**(e-1)
    ulp_exp = np.maximum(e - 1, emin) - (p - 1)
    y = np.ldexp(np.rint(np.ldexp(x64[fin], -ulp_exp)), ulp_exp)  # ldexp exact, rint ties to even
    y[np.abs(y) > max_finite] = np.inf * np.sign(y[np.abs(y) > max_finite])
    out[fin] = y
    return out


def bits(*u) -> np.ndarray:
    return np.array(u, dtype=np.uint32).view(np.float32)


def specials() -> np.ndarray:
    """±0, ±Inf, NaNs, f32 subnormals and extremes, and halfway cases of both formats."""
    one = 0x3F800000
    pos = bits(
        0, 0x7F800000, 1, 0x00400000, 0x007FFFFF, 0x00800000, 0x7F7FFFFF, 0x7F7F7FFF, 0x7F7F8000,
        # bf16 ties at 1.0: down to even, up to even, just above, just below
        one | 0x8000, one | 0x18000, one | 0x8001, one | 0x7FFF,
        # f16 ties at 1.0: the dropped 13 bits are exactly half
        one | 0x1000, one | 0x3000, one | 0x1001, one | 0x0FFF,
        # bf16 on an f32 subnormal: tie, round-to-even
        0x00008000, 0x00018000, 0x00010000,
    )
    f16 = np.array([F16_MAX, 65519.99, 65520.0, 65536.0, 2.0**-14, 2.0**-24, 1023 * 2.0**-24,
                    1023.5 * 2.0**-24, 2.0**-25, 3 * 2.0**-25, 2.0**-25 * 1.0000001, 2.0**-26,
                    5 * 2.0**-26, 1.0 + 2.0**-11, 2049.0, 2051.0], np.float32)
    vals = np.concatenate([pos, f16])
    return np.concatenate([vals, -vals])


NANS = bits(0x7FC00000, 0x7F800001, 0x7FFFFFFF, 0x7FBFFFFF, 0xFFC00000, 0xFF800001, 0xFFFFFFFF)


def roundtrip(name: str, x: np.ndarray) -> np.ndarray:
    codec = wire.get_codec(name)
    packed = codec.pack(x)
    return codec.unpack(packed, np.empty_like(x))


def assert_same_bits(got: np.ndarray, want64: np.ndarray) -> None:
    want = want64.astype(np.float32)  # exact: every reference value is representable
    bad = got.view(np.uint32) != want.view(np.uint32)
    assert not bad.any(), f"{bad.sum()} mismatches, e.g. {got[bad][:5]} vs {want[bad][:5]}"


@pytest.mark.parametrize("name", ["bf16", "f16"])
def test_specials_and_ties_match_exact_rounding(name):
    x = specials()
    with np.errstate(over="ignore"):
        assert_same_bits(roundtrip(name, x), round_ref(x, *FORMATS[name]))


@pytest.mark.parametrize("name", ["bf16", "f16"])
def test_random_bit_patterns_match_exact_rounding(name):
    x = np.random.default_rng(1).integers(0, 2**32, 1 << 20, dtype=np.uint64).astype(np.uint32).view(np.float32)
    got = roundtrip(name, x)
    nan = np.isnan(x)
    assert np.isnan(got[nan]).all()
    with np.errstate(over="ignore"):
        assert_same_bits(got[~nan], round_ref(x[~nan], *FORMATS[name]))


def test_hand_checked_values():
    """A few results worked out by hand, so the reference itself is checked."""
    x = bits(0x3F808000, 0x3F818000, 0x3F808001, 0x7F7FFFFF)
    assert (wire.get_codec("bf16").pack(x) == [0x3F80, 0x3F82, 0x3F81, 0x7F80]).all()
    y = np.array([1 + 2.0**-11, 1 + 3 * 2.0**-11, 65519.0, 65520.0, 3 * 2.0**-25, 2.0**-25], np.float32)
    h = wire.get_codec("f16").pack(y).view(np.uint16)
    assert h.tolist() == [0x3C00, 0x3C02, 0x7BFF, 0x7C00, 0x0002, 0x0000]


def test_f16_pack_matches_numpy_cast():
    x = np.random.default_rng(2).integers(0, 2**32, 1 << 20, dtype=np.uint64).astype(np.uint32).view(np.float32)
    x = np.concatenate([x, specials()])
    with np.errstate(over="ignore", invalid="ignore"):
        want = x.astype(np.float16)
    got = wire.get_codec("f16").pack(x)
    nan = np.isnan(x)
    assert (got.view(np.uint16)[~nan] == want.view(np.uint16)[~nan]).all()
    assert np.isnan(got[nan]).all()


@pytest.mark.parametrize("name", ["bf16", "f16"])
def test_nan_stays_nan_with_its_sign(name):
    got = roundtrip(name, NANS)
    assert np.isnan(got).all()
    assert (np.signbit(got) == np.signbit(NANS)).all()


def test_unpack_every_f16_and_bf16_pattern():
    allbits = np.arange(1 << 16, dtype=np.uint32)
    # f16: decode by the definition, in float64
    s, e, m = allbits >> 15, (allbits >> 10) & 0x1F, (allbits & 0x3FF).astype(np.float64)
    with np.errstate(invalid="ignore"):
        val = np.where(e == 0, m * 2.0**-24, (1 + m / 1024) * 2.0 ** (e.astype(np.float64) - 15))
        val = np.where(e == 31, np.where(m == 0, np.inf, np.nan), val) * np.where(s == 1, -1.0, 1.0)
    h = allbits.astype(np.uint16).view(np.float16)
    got = wire.get_codec("f16").unpack(h, np.empty(h.shape, np.float32))
    nan = np.isnan(val)
    assert np.isnan(got[nan]).all() and (np.signbit(got) == (s == 1)).all()
    assert_same_bits(got[~nan], val[~nan])
    # and every non-NaN pattern packs back to itself
    assert (wire.get_codec("f16").pack(got[~nan]).view(np.uint16) == allbits[~nan]).all()
    # bf16: the top half of the float32 bits
    b = allbits.astype(np.uint16)
    got = wire.get_codec("bf16").unpack(b, np.empty(b.shape, np.float32))
    assert (got.view(np.uint32) == allbits << 16).all()
    keep = ~np.isnan(got)
    assert (wire.get_codec("bf16").pack(got[keep]) == b[keep]).all()


@pytest.mark.parametrize("name", ["bf16", "f16"])
def test_rel_error_bound_holds_and_is_tight(name):
    codec = wire.get_codec(name)
    rng = np.random.default_rng(3)
    x = (rng.standard_normal(1 << 20) * np.exp(rng.uniform(-8, 8, 1 << 20))).astype(np.float32)
    if name == "f16":  # the bound is for the normal range of the wire format
        x = x[(np.abs(x) >= 2.0**-14) & (np.abs(x) <= F16_MAX)]
    rel = np.abs(roundtrip(name, x).astype(np.float64) - x) / np.abs(x)
    assert rel.max() <= codec.rel_error
    assert rel.max() > 0.99 * codec.rel_error  # the documented bound is the real one, not slack


@pytest.mark.parametrize("name", wire.WIRE_FORMATS)
@pytest.mark.parametrize("shape", [(0,), (1,), (3,), (1023,), (2, 3, 5), (4, 1, 7), (2, 513)])
def test_shapes(name, shape):
    codec = wire.get_codec(name)
    x = np.random.default_rng(4).standard_normal(shape).astype(np.float32)
    x0 = x.copy()
    packed = codec.pack(x)
    assert packed.shape == shape and packed.dtype == codec.wire_dtype and packed.flags.c_contiguous
    assert packed.nbytes == x.size * codec.itemsize
    out = codec.unpack(packed, np.full(shape, np.nan, np.float32))
    assert (x == x0).all()  # src untouched
    np.testing.assert_allclose(out, x, rtol=codec.rel_error, atol=2.0**-24)
    # into a preallocated wire buffer as well
    buf = codec.wire_buffer(shape)
    assert codec.pack(x, buf) is (x if name == "f32" else buf)


def test_f32_is_zero_copy():
    codec = wire.get_codec("f32")
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    assert codec.pack(x) is x
    assert codec.pack(x, np.empty_like(x)) is x
    assert codec.unpack(x, x) is x
    dst = np.empty_like(x)
    assert codec.unpack(x, dst) is dst and (dst == x).all()
    assert codec.rel_error == 0.0 and codec.wire_dtype == np.float32


def test_wire_dtypes_and_bounds():
    assert wire.WIRE_FORMATS == ("f32", "bf16", "f16")
    assert [wire.get_codec(n).wire_dtype for n in wire.WIRE_FORMATS] == [np.float32, np.uint16, np.float16]
    assert wire.get_codec("bf16").rel_error == 2.0**-8 and wire.get_codec("f16").rel_error == 2.0**-11


@pytest.mark.parametrize("name", wire.WIRE_FORMATS)
def test_bad_arrays_rejected_with_the_argument_named(name):
    codec = wire.get_codec(name)
    x = np.zeros((4, 6), np.float32)
    with pytest.raises(ValueError, match=r"src: expected dtype float32, got float64"):
        codec.pack(np.zeros(3))
    with pytest.raises(ValueError, match=r"src: expected a C-contiguous array"):
        codec.pack(x[:, ::2])
    with pytest.raises(ValueError, match=r"src: expected a numpy array, got list"):
        codec.pack([1.0, 2.0])
    with pytest.raises(ValueError, match=r"dst: expected dtype float32"):
        codec.unpack(codec.pack(x), np.zeros((4, 6), np.float64))
    with pytest.raises(ValueError, match=r"src: expected shape \(4, 5\), got \(4, 6\)"):
        codec.unpack(codec.pack(x), np.zeros((4, 5), np.float32))
    with pytest.raises(ValueError, match=r"dst: expected a C-contiguous array"):
        codec.unpack(codec.pack(x[:, :3].copy()), x[:, ::2])
    ro = np.zeros((4, 6), np.float32)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match=r"dst: the array is read-only"):
        codec.unpack(codec.wire_buffer((4, 6)), ro)
    if name != "f32":
        with pytest.raises(ValueError, match=rf"dst: expected dtype {codec.wire_dtype}, got float32"):
            codec.pack(x, np.zeros((4, 6), np.float32))
        with pytest.raises(ValueError, match=r"dst: expected shape \(4, 6\), got \(24,\)"):
            codec.pack(x, codec.wire_buffer(24))
        with pytest.raises(ValueError, match=r"src: expected dtype"):
            codec.unpack(np.zeros((4, 6), np.float32), x)
        ro_wire = codec.wire_buffer((4, 6))
        ro_wire.flags.writeable = False
        with pytest.raises(ValueError, match=r"dst: the array is read-only"):
            codec.pack(x, ro_wire)


def test_unknown_format_is_a_config_error():
    with pytest.raises(ConfigError) as err:
        wire.get_codec("fp8", where="job.toml: [run] wire")
    assert err.value.exit_code == EXIT_BAD_INPUT
    line = err.value.line()
    assert line.startswith("job.toml: [run] wire: unknown wire format 'fp8'")
    assert "'f32', 'bf16', 'f16'" in line
    with pytest.raises(ConfigError, match="unknown wire format 16"):
        wire.get_codec(16)


def test_warm_up():
    """After warm_up every codec's kernels are compiled (or loaded from cache) for the f32 <->
    wire types, so the first timed send compiles nothing."""
    wire.warm_up()
    kernels = [k for name in wire.WIRE_FORMATS for k in (wire._CODECS[name]._pack, wire._CODECS[name]._unpack)
               if k is not None]
    assert kernels, "the half codecs have numba kernels"
    assert all(k.signatures for k in kernels), [k for k in kernels if not k.signatures]
