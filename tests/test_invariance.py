"""The kernels' side of issue 36 (no MPI): a row's product, and a query's attention, are the same
bits whatever the rows beside it, the row count's path (decode's matvec, prefill's tiles), the
weight-row chunks a thread owns and the rank's thread count (the invariance notes in
kernels/rowdot.py and kernels/attention.py). Against numpy for the values themselves, see
test_kernels.py and test_precision.py; tests/test_invariance_mpi.py runs the CLI matrix."""

import numpy as np
import pytest

from rlx_mpi import kernels
from rlx_mpi.families.decoder.weights import make_linear

ROW_COUNTS = (1, 2, 3, 4, 5, 7, 8, 31, 64, 65, 97, 128, 129, 200)  # every tile's remainder, both paths


@pytest.mark.parametrize("precision", ["f32", "bf16", "f16", "int8", "q4"])
@pytest.mark.parametrize("k", [96, 1056])  # whole steps; steps and a tail (1056 = 33 x 32)
def test_a_rows_product_never_depends_on_the_rows_beside_it_or_the_threads(precision, k):
    """Row r of ``Linear(x)`` equals ``Linear(x[r:r+1])`` for every row count from 1 to 200 (both
    sides of F32_MATVEC_ROWS, matvec_rows and q4's Q4_GEMM_ROWS) at 1 and 2 threads."""
    rng = np.random.default_rng(k)
    lin = make_linear(rng.standard_normal((70, k)).astype(np.float32), precision)
    x = rng.standard_normal((max(ROW_COUNTS), k)).astype(np.float32)
    before = kernels.pool_threads()
    try:
        alone = None
        for threads in (1, 2):
            kernels.set_threads(threads)
            if alone is None:
                alone = np.concatenate([lin(x[r:r + 1]) for r in range(max(ROW_COUNTS))])
            for rows in ROW_COUNTS:
                assert (lin(x[:rows]) == alone[:rows]).all(), (threads, rows)
    finally:
        kernels.set_threads(before)


@pytest.mark.parametrize("block", [64, 32, 16])  # int8's own blocks; a checkpoint's Q8_0 and Q6_K groups
def test_int8_tiles_give_each_row_its_lone_row_bits(block):
    """`_matvec_int8` of R rows (the ROWS x I8_TILE_W tile, ROWS-row groups, lone rows, the
    activation quantisation split over the pool from _ACT_BLOCK rows) equals each row alone, bit for
    bit, on 1 and 2 threads, with N not a whole number of tiles in any chunk; and float64 numpy of
    the dequantised weights within the int16 activations' rounding."""
    from rlx_mpi.kernels import lowp

    rng = np.random.default_rng(block)
    n, k = 71, 7 * block if block != 64 else 1056  # 1056: 16 blocks and a short last one
    nb = -(-k // block)
    q = rng.integers(-127, 128, (n, k)).astype(np.int8)
    s = (rng.random((n, nb)) * 0.02 + 0.001).astype(np.float32)
    x = rng.standard_normal((150, k)).astype(np.float32)
    before = kernels.pool_threads()
    try:
        kernels.set_threads(1)
        alone = np.empty((150, n), np.float32)
        for r in range(150):
            lowp._matvec_int8(x[r:r + 1], q, s, alone[r:r + 1], 1)
        wf = q.astype(np.float64) * np.repeat(s.astype(np.float64), block, axis=1)[:, :k]
        want = x.astype(np.float64) @ wf.T
        assert np.abs(alone - want).max() < 1e-4 * np.abs(want).max()
        for threads in (1, 2):
            kernels.set_threads(threads)
            for rows in (4, 5, 12, 63, 64, 65, 150):
                for chunks in (1, 3, 8):
                    got = np.empty((rows, n), np.float32)
                    lowp._matvec_int8(x[:rows], q, s, got, chunks)
                    assert (got == alone[:rows]).all(), (block, threads, rows, chunks)
    finally:
        kernels.set_threads(before)


@pytest.mark.parametrize("fmt", ["f32", "bf16", "f16"])
@pytest.mark.parametrize("k", [1061, 3301])  # 3301: column blocks (matvec.py's column blocks note), bf16's too
def test_prefill_panels_give_each_row_its_decode_matvec_bits(monkeypatch, fmt, k):
    """Prefill's product (`matmul_float`: rowdot's panels, PANEL_ROWS x PANEL_W, the sums stored as
    vectors; matvec.py's panel note) of R rows equals decode's matvec of each row alone, bit for
    bit, for R around and far past the panel's rows, K past the weight block's reach and not a
    whole number of steps (a tail), N not a whole number of panels nor of BLOCK_ROWS, split over 1
    and 2 parts of the weight rows (threads) against decode on 1 and 2 threads. Against float64
    numpy too, so that equal-but-wrong cannot pass."""
    from rlx_mpi.kernels import matvec
    from rlx_mpi.kernels.rowdot import PANEL_ROWS, PANEL_W, STEP

    rng = np.random.default_rng(36)
    n = 70  # 1061 = 33 steps of 32 + 5 (AVX2: 66 of 16 + 5), 3301 = 103 + 5; 70 = 23 panels of 3 + 1, one block + 6
    assert k % STEP and n % PANEL_W and n > matvec.BLOCK_ROWS
    w32 = rng.standard_normal((n, k)).astype(np.float32)
    if fmt == "bf16":
        stored = kernels.to_bf16(w32)
    elif fmt == "f16":
        stored = w32.astype(np.float16).view(np.int16)
    else:
        stored = w32
    x = rng.standard_normal((300, k)).astype(np.float32)
    before = kernels.pool_threads()
    try:
        alone = {}
        for threads in (1, 2):
            kernels.set_threads(threads)
            alone[threads] = np.empty((300, n), np.float32)
            for r in range(300):
                matvec._matvec_float(x[r:r + 1], stored, alone[threads][r:r + 1], min(n, 4 * threads))
        assert (alone[1] == alone[2]).all()
        wf = w32.astype(np.float16).astype(np.float64) if fmt == "f16" else (
            kernels.from_bf16(stored).astype(np.float64) if fmt == "bf16" else w32.astype(np.float64))
        want = x.astype(np.float64) @ wf.T
        bound = 0.05 if fmt == "bf16" else 1e-3  # (bf16 on an AVX512-BF16 CPU rounds the activations)
        assert np.abs(alone[1] - want).max() < bound * np.abs(want).max()
        for parts in (1, 2):
            monkeypatch.setattr(matvec, "pool_threads", lambda: parts)
            for rows in (1, 4, 6, 7, PANEL_ROWS, PANEL_ROWS + 1, 16, 33, 128, 300):
                got = kernels.matmul_float(x[:rows], stored)
                assert (got == alone[1][:rows]).all(), (fmt, parts, rows)
    finally:
        kernels.set_threads(before)


def test_decode_attention_of_a_row_is_the_same_alone_beside_others_and_on_the_pool():
    """`attend_cache` of a row (one query per head over its cache row) is the same bits alone, in
    a step of 5 rows at other positions, on the calling thread and on numba's pool."""
    from rlx_mpi.kernels.attention import _NO_SINKS
    from rlx_mpi.kernels.attention_cache import _NO_TABLE, _attend_cache, _attend_cache_par

    rng = np.random.default_rng(9)
    nh, nkv, L, hs = 4, 2, 50, 40
    ck = rng.standard_normal((6, nkv, L, hs)).astype(np.float32)
    cv = rng.standard_normal((6, nkv, L, hs)).astype(np.float32)
    q = rng.standard_normal((5, nh, hs)).astype(np.float32)
    slots, pos = np.array([3, 0, 5, 1, 2]), np.array([49, 7, 20, 0, 33])
    outs = []
    for kernel in (_attend_cache, _attend_cache_par):
        y = np.empty((5, nh, hs), np.float32)
        kernel(q, ck, cv, _NO_TABLE, 0, slots, pos, 0, np.float32(hs ** -0.5), np.float32(0.0), _NO_SINKS, y)
        outs.append(y)
        for b in range(5):
            one = np.empty((1, nh, hs), np.float32)
            kernel(q[b:b + 1], ck, cv, _NO_TABLE, 0, slots[b:b + 1], pos[b:b + 1], 0, np.float32(hs ** -0.5),
                   np.float32(0.0), _NO_SINKS, one)
            assert (one[0] == y[b]).all(), (kernel, b)
    assert (outs[0] == outs[1]).all()


@pytest.mark.parametrize("window, softcap, sinks", [(0, 0.0, False), (5, 0.0, False), (0, 3.0, True)])
def test_prefill_attention_of_a_query_is_the_same_in_any_chunk(window, softcap, sinks):
    """A prefill query's output is the same bits in one chunk of 37 positions, in chunks of 16
    (keys before the chunk read as a chunked prefill reads them) and beside a padded second row."""
    rng = np.random.default_rng(10)
    nh, nkv, T, hs = 4, 2, 37, 24
    q = rng.standard_normal((1, nh, T, hs)).astype(np.float32) * 2
    k = rng.standard_normal((1, nkv, T, hs)).astype(np.float32) * 2
    v = rng.standard_normal((1, nkv, T, hs)).astype(np.float32)
    s = rng.standard_normal(nh).astype(np.float32) if sinks else None
    whole = kernels.attend(q, k, v, None, window, softcap=softcap, sinks=s)
    for t0 in range(0, T, 16):
        t1 = min(T, t0 + 16)
        part = kernels.attend(np.ascontiguousarray(q[:, :, t0:t1]), k[:, :, :t1], v[:, :, :t1],
                              np.arange(t0, t1)[None], window, softcap=softcap, sinks=s)
        assert (part == whole[:, t0:t1]).all(), t0
    pad = np.concatenate([q, rng.standard_normal(q.shape).astype(np.float32)])
    kk = np.concatenate([k, rng.standard_normal(k.shape).astype(np.float32)])
    vv = np.concatenate([v, rng.standard_normal(v.shape).astype(np.float32)])
    assert (kernels.attend(pad, kk, vv, None, window, softcap=softcap, sinks=s)[:1] == whole).all()
