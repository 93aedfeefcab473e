"""A token bitmask applied to logits: the step of structured output that touches every vocabulary entry.

A grammar engine (llguidance, `engine.constraints`) writes, for each constrained row, one bit per
token id (32 to an int32 word, lowest bit first): 1 allowed, 0 not. `apply_bitmask` sets the
logits of the tokens not allowed to -inf, in place, for the rows given; the draw after it
(`engine.sampling`) then never picks one, and the log-probs it reports are those of the
constrained distribution.

Note: one pass. llguidance's numpy helper expands the mask to a (B, 32 W) array of bits and
indexes with it (five temporaries of the vocabulary's size per row). This kernel reads each word
once and skips a word whose 32 bits are all set (the common case is a few allowed tokens, or
all of them); a token id past the mask's width (a model whose vocabulary is padded beyond the
tokenizer's) is not allowed. `bench/bench_structured.py` measures it with the mask's fill.
"""

from __future__ import annotations

import numba
import numpy as np

from ._common import check_f32

__all__ = ["apply_bitmask"]


@numba.njit(cache=True)
def _apply_bitmask(logits, rows, mask):  # logits (B, V) f32; rows (m,) int64; mask (m, W) int32
    V = logits.shape[1]
    W = mask.shape[1]
    ninf = np.float32(-np.inf)
    for i in range(rows.shape[0]):
        row = logits[rows[i]]
        for w in range(W):
            word = mask[i, w]
            if word == -1:  # all 32 allowed
                continue
            base = w * 32
            for bit in range(32):
                v = base + bit
                if v >= V:
                    break
                if (word >> bit) & 1 == 0:
                    row[v] = ninf
        for v in range(W * 32, V):  # past the mask: not a token the grammar knows
            row[v] = ninf


def apply_bitmask(logits: np.ndarray, rows: np.ndarray, mask: np.ndarray) -> None:
    """Set ``logits[rows[i], v]`` to -inf wherever bit v of ``mask[i]`` is 0, in place.

    ``logits`` (B, V) C-contiguous float32; ``rows`` (m,) distinct row positions in [0, B);
    ``mask`` (m, W) int32, W = ceil(V' / 32) words for a vocabulary of V' <= 32 W tokens."""
    check_f32("apply_bitmask logits", logits)
    if logits.ndim != 2:
        raise ValueError(f"apply_bitmask: logits must be (B, V), got shape {logits.shape}")
    rows = np.ascontiguousarray(rows, dtype=np.int64)
    if mask.dtype != np.int32 or mask.ndim != 2 or not mask.flags.c_contiguous:
        raise TypeError(f"apply_bitmask: mask must be a C-contiguous (m, W) int32 array, got {mask.dtype} "
                        f"{mask.shape}")
    if rows.ndim != 1 or len(rows) != len(mask):
        raise ValueError(f"apply_bitmask: {len(rows)} rows for {len(mask)} masks")
    if len(rows) and not (0 <= rows.min() and rows.max() < len(logits)):
        raise ValueError(f"apply_bitmask: rows must be in [0, {len(logits)}), got {rows.min()}..{rows.max()}")
    if len(np.unique(rows)) != len(rows):
        raise ValueError("apply_bitmask: a row is given twice")
    _apply_bitmask(logits, rows, mask)
