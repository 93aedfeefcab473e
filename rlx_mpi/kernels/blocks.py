"""Copies through a block table (`rlx_mpi.kv_cache`'s block-table note), for a prefill chunk of
paged rows: `gather_blocks` lays out what the chunk's queries attend to, the positions before it
read from the row's blocks in order and the chunk's own keys after them, and `scatter_blocks`
writes the chunk's real positions into the row's blocks.

A pool is one kv head's blocks after another: (nkv, blocks x size, width); position p of cache
row s is column table[s, p // size] * size + p % size. The copies move whole runs of a block's
positions, so they are the slices a slot row's `np.concatenate` copied, in the same order: the
attention that reads them sums the same values alike (tests/test_paged.py).

Note: measured (medium, 128 prompts sharing a 1,024-token prefix + 32 own tokens, --batch 64,
16 new, 1 rank, 2 threads). numpy's fancy indexing of the same copies (``pool[:, cols]`` with
cols (B, start), then a transpose and a concatenate) took 11-13 s of the job's 40 s wall (py-spy):
an element-wise gather of 64-float rows, then two more copies of the result. These kernels copy
once, a block's run at a time.
"""

from __future__ import annotations

import numba
import numpy as np

from ._common import ERR

__all__ = ["gather_blocks", "scatter_blocks"]


@numba.njit(cache=True, nogil=True, error_model=ERR)
def _gather_run(pool, trow, size, start, chunk, out):
    """One row and kv head: out[:start] <- positions 0..start-1 (pool (blocks x size, width), trow
    the row's table), out[start:start + T] <- chunk (T, width)."""
    p = 0
    while p < start:
        n = min(size - p % size, start - p)  # the rest of p's block, within 0..start-1
        col = trow[p // size] * size + p % size
        out[p:p + n, :] = pool[col:col + n, :]
        p += n
    out[start:start + chunk.shape[0], :] = chunk


@numba.njit(cache=True, nogil=True, error_model=ERR)
def _gather(pool, table, slots, size, start, chunk, out):
    """out[b, h, :start] <- row slots[b]'s positions 0..start-1 of kv head h; out[b, h, start:] <- chunk[b, h]."""
    B, nkv, _, _ = chunk.shape
    for b in range(B):
        for h in range(nkv):
            _gather_run(pool[h], table[slots[b]], size, start, chunk[b, h], out[b, h])


@numba.njit(cache=True, nogil=True, error_model=ERR)
def _scatter(pool, table, slots, size, start, counts, chunk):
    """Row slots[b]'s positions start..start+counts[b]-1 of kv head h <- chunk[b, h, :counts[b]]."""
    B, nkv, _, _ = chunk.shape
    for b in range(B):
        s = slots[b]
        for h in range(nkv):
            t = 0
            while t < counts[b]:
                p = start + t
                n = min(size - p % size, counts[b] - t)
                col = table[s, p // size] * size + p % size
                pool[h, col:col + n, :] = chunk[b, h, t:t + n, :]
                t += n


def _check(pool: np.ndarray, table: np.ndarray, slots: np.ndarray, size: int, chunk: np.ndarray) -> np.ndarray:
    if pool.dtype != np.float32 or pool.ndim != 3:
        raise TypeError(f"blocks: the pool must be float32 (nkv, positions, width), got {pool.dtype} {pool.shape}")
    if chunk.dtype != np.float32 or chunk.ndim != 4 or chunk.shape[1] != pool.shape[0] or chunk.shape[3] != pool.shape[2]:
        raise ValueError(f"blocks: the chunk must be float32 (B, {pool.shape[0]}, T, {pool.shape[2]}), "
                         f"got {chunk.dtype} {chunk.shape}")
    if table.dtype != np.int32 or table.ndim != 2 or size < 1 or pool.shape[1] % size:
        raise ValueError(f"blocks: need an int32 (rows, blocks) table and a size dividing the pool's "
                         f"{pool.shape[1]} positions, got {table.dtype} {table.shape}, size {size}")
    slots = np.ascontiguousarray(slots, np.int64)
    if slots.shape != (chunk.shape[0],) or (len(slots) and not 0 <= slots.min() <= slots.max() < len(table)):
        raise ValueError(f"blocks: need one cache row in 0..{len(table) - 1} per chunk row, got {slots.tolist()}")
    return slots


def gather_blocks(pool: np.ndarray, table: np.ndarray, slots: np.ndarray, size: int, start: int,
                  chunk: np.ndarray) -> np.ndarray:
    """(B, nkv, start + T, width): row b's positions 0..start-1 from the blocks of cache row
    slots[b] (pool (nkv, blocks x size, width), table (rows, max blocks) int32), then chunk[b]
    (B, nkv, T, width)."""
    slots = _check(pool, table, slots, size, chunk)
    if not 0 <= start <= size * table.shape[1]:
        raise ValueError(f"gather_blocks: start {start} is outside the table's 0..{size * table.shape[1]} positions")
    B, nkv, T, width = chunk.shape
    out = np.empty((B, nkv, start + T, width), np.float32)
    _gather(pool, table, slots, size, start, chunk, out)
    return out


def scatter_blocks(pool: np.ndarray, table: np.ndarray, slots: np.ndarray, size: int, start: int,
                   counts: np.ndarray, chunk: np.ndarray) -> None:
    """Write chunk[b, :, :counts[b]] (chunk (B, nkv, T, width)) at positions start.. of cache row
    slots[b]'s blocks in ``pool``; a count <= 0 writes nothing."""
    slots = _check(pool, table, slots, size, chunk)
    counts = np.clip(np.ascontiguousarray(counts, np.int64), 0, chunk.shape[2])
    if counts.shape != slots.shape or (len(counts) and start + counts.max() > size * table.shape[1]):
        raise ValueError(f"scatter_blocks: need one count per row within the table's {size * table.shape[1]} "
                         f"positions from {start}, got {counts.tolist()}")
    _scatter(pool, table, slots, size, start, counts, chunk)
