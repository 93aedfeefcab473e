"""Rank arithmetic of the stages x tp grid (pure), and the communicators built from it.

Worked example, 8 ranks on hosts ``[a, a, a, a, b, b, b, b]`` with tp = 2::

    grid  = [[0, 1], [2, 3], [4, 5], [6, 7]]     # 4 stages, 2 TP ranks each
    rank 5: stage 2, tp rank 1; receives from rank 3, sends to rank 7

With a round-robin launch (hosts ``[a, b, a, b]``, tp = 2) the TP groups still stay on one
host: ``[[0, 2], [1, 3]]``, so the per-layer all-reduce runs over shared memory and only
the hidden state between stages crosses the network.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from . import rules

__all__ = ["make_grid", "locate", "Topology"]


def make_grid(hosts: Sequence[str], tp: int) -> list[list[int]]:
    """Split world ranks into stages of ``tp`` ranks, preferring ranks that share a host.

    ``hosts[r]`` is rank r's host. Each host's ranks are grouped in rank order; ranks left over
    on hosts whose count ``tp`` does not divide are grouped across hosts in rank order. Stages
    are ordered by their lowest rank.
    """
    n = len(hosts)
    rules.tp_divides_ranks(n, tp, "placement tp")
    by_host: dict[str, list[int]] = {}
    for rank, host in enumerate(hosts):
        by_host.setdefault(host, []).append(rank)
    groups, leftover = [], []
    for ranks in by_host.values():
        whole = len(ranks) - len(ranks) % tp
        groups += [ranks[i:i + tp] for i in range(0, whole, tp)]
        leftover += ranks[whole:]
    leftover.sort()
    groups += [leftover[i:i + tp] for i in range(0, len(leftover), tp)]
    return sorted(groups, key=min)


def locate(grid: Sequence[Sequence[int]], rank: int) -> tuple[int, int]:
    """(stage, tp rank) of world ``rank`` in ``grid``."""
    for stage, group in enumerate(grid):
        if rank in group:
            return stage, list(group).index(rank)
    raise ValueError(f"rank {rank} is not in the grid {grid}")


@dataclass
class Topology:
    """One rank's view of the grid: its stage, its TP group, its pipeline neighbours."""

    grid: list[list[int]]
    rank: int
    stage: int
    tp_rank: int
    world: Any  # private duplicate of COMM_WORLD for point-to-point traffic
    tp_comm: Any  # the stage's TP group (COMM_SELF-like when tp = 1)

    @property
    def n_stages(self) -> int:
        return len(self.grid)

    @property
    def tp(self) -> int:
        return len(self.grid[0])

    @property
    def prev(self) -> int | None:
        """World rank this rank receives hidden states from (same tp rank, previous stage)."""
        return self.grid[self.stage - 1][self.tp_rank] if self.stage > 0 else None

    @property
    def next(self) -> int | None:
        """World rank this rank sends hidden states to (same tp rank, next stage)."""
        return self.grid[self.stage + 1][self.tp_rank] if self.stage + 1 < self.n_stages else None

    @property
    def output_rank(self) -> int:
        """The rank that holds the final logits: tp rank 0 of the last stage."""
        return self.grid[-1][0]

    @classmethod
    def build(cls, world: Any, grid: list[list[int]]) -> "Topology":
        """Split ``world`` (collective over it) into this rank's TP group."""
        stage, tp_rank = locate(grid, world.rank)
        tp_comm = world.Split(color=stage, key=tp_rank)
        return cls(grid=grid, rank=world.rank, stage=stage, tp_rank=tp_rank, world=world, tp_comm=tp_comm)
