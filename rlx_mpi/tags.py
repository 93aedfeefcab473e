"""Every MPI point-to-point tag the package uses, in one table.

The MPI standard guarantees tags up to 32,767 (``MPI_TAG_UB`` may be larger, but need not be),
so every tag and every range here stays at or below it, and no two uses overlap: a message
can then never be taken by a receive meant for another, whatever phase a rank is in. A new
message kind takes a free number here, not a literal in its module (tests/test_tags.py
checks both).

Ranges are ``(first, size)``: a use adds an index below ``size`` (a microbatch, a group, a
clock probe round).
"""

from __future__ import annotations

__all__ = ["TAG_UB", "MICROBATCH", "CLOCK_PING", "CLOCK_STAMP", "REPLICA_LOGITS", "SCORE_LOGPROBS",
           "STEP_HEADER", "BLOCK_OPS", "GROUP_HIDDEN", "REPLICA_WORK", "REPLICA_END", "AGREE", "RANGES", "in_range"]

TAG_UB = 32_767  # the least MPI_TAG_UB the standard allows

# run and score: microbatch m's hidden state travels at tag m; run's logits to rank 0 at tag M
MICROBATCH = (0, 7_000)
# run's clock probe of round k (the trace's clock offsets): rank r -> 0 at 7000 + k, 0 -> r at 7100 + k
CLOCK_PING = (7_000, 100)
CLOCK_STAMP = (7_100, 100)
REPLICA_LOGITS = 9_001  # run: another replica's last stage -> rank 0
SCORE_LOGPROBS = 9_002  # score: the last stage -> rank 0, one message per round
STEP_HEADER = 10_001  # generate: a step header down the pipeline (and the stop header)
BLOCK_OPS = 10_002  # generate: a step's prefix-cache block ops, after its header
GROUP_HIDDEN = (11_000, 10_000)  # generate: group g's hidden states down, its sampled tokens back up
REPLICA_WORK = 31_001  # replicas: another replica -> rank 0 (rows, beat, done)
REPLICA_END = 31_002  # replicas: rank 0 -> a waiting rank
AGREE = 32_001  # faults.agree: a rank's flag of an agreed start-up step

RANGES = {"MICROBATCH": MICROBATCH, "CLOCK_PING": CLOCK_PING, "CLOCK_STAMP": CLOCK_STAMP,
          "REPLICA_LOGITS": (REPLICA_LOGITS, 1), "SCORE_LOGPROBS": (SCORE_LOGPROBS, 1),
          "STEP_HEADER": (STEP_HEADER, 1), "BLOCK_OPS": (BLOCK_OPS, 1), "GROUP_HIDDEN": GROUP_HIDDEN,
          "REPLICA_WORK": (REPLICA_WORK, 1), "REPLICA_END": (REPLICA_END, 1), "AGREE": (AGREE, 1)}


def in_range(rng: tuple[int, int], index: int, what: str) -> int:
    """The tag of ``index`` in ``rng``; an index past the range is an internal error, named."""
    first, size = rng
    if not 0 <= index < size:
        raise ValueError(f"{what}: index {index} is outside its tag range ({size} tags from {first})")
    return first + index
