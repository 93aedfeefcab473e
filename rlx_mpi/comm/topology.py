"""Rank arithmetic of the replicas x stages x tp grid (pure), and the communicators built from it.

Worked example, 8 ranks on hosts ``[a, a, a, a, b, b, b, b]`` with tp = 2::

    grid  = [[0, 1], [2, 3], [4, 5], [6, 7]]     # 4 stages, 2 TP ranks each
    rank 5: stage 2, tp rank 1; receives from rank 3, sends to rank 7

With a round-robin launch (hosts ``[a, b, a, b]``, tp = 2) the TP groups still stay on one
host: ``[[0, 2], [1, 3]]``, so the per-layer all-reduce runs over shared memory and only
the hidden state between stages crosses the network.

Replicas (data parallelism) cut those TP groups into whole pipelines of equal length, a
replica's groups taken host by host so that it spans as few hosts as possible. 8 ranks on
hosts ``[a, b, a, b, a, b, a, b]`` (a round-robin launch), tp = 1, 2 replicas::

    replica_grids(hosts, 1, 2) = [[[0], [2], [4], [6]],     # replica 0: 4 stages, all on host a
                                  [[1], [3], [5], [7]]]     # replica 1: 4 stages, all on host b

so no hidden state crosses the network, and the replicas exchange only prompts and rows.
Replicas and stages are ordered by their lowest rank: world rank 0 is always stage 0, tp rank
0 of replica 0 (it reads the prompts and writes the output).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from .. import rules

__all__ = ["make_grid", "replica_grids", "locate", "Topology"]


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


def replica_grids(hosts: Sequence[str], tp: int, replicas: int) -> list[list[list[int]]]:
    """`make_grid`'s TP groups cut into ``replicas`` pipelines of equal stage count.

    Groups are taken host by host (hosts in order of their lowest rank, a host's groups in rank
    order; groups spanning hosts last), so a replica spans as few hosts as it can and a host's
    ranks serve as few replicas as they can. Within a replica stages are ordered by lowest rank,
    and replicas by their lowest rank.
    """
    groups = make_grid(hosts, tp)
    rules.replicas_divide(len(hosts), tp, replicas, "placement replicas")
    first_rank: dict[str, int] = {}
    for rank, host in enumerate(hosts):
        first_rank.setdefault(host, rank)

    def order(g: list[int]) -> tuple:
        on = {hosts[r] for r in g}
        return (1, 0, min(g)) if len(on) > 1 else (0, first_rank[hosts[g[0]]], min(g))

    ordered = sorted(groups, key=order)
    S = len(groups) // replicas
    cut = [sorted(ordered[i * S:(i + 1) * S], key=min) for i in range(replicas)]
    return sorted(cut, key=lambda rep: min(min(g) for g in rep))


def locate(grid: Sequence[Sequence[int]], rank: int) -> tuple[int, int]:
    """(stage, tp rank) of world ``rank`` in ``grid``."""
    for stage, group in enumerate(grid):
        if rank in group:
            return stage, list(group).index(rank)
    raise ValueError(f"rank {rank} is not in the grid {grid}")


@dataclass
class Topology:
    """One rank's view of the grid: its replica, its stage, its TP group, its pipeline neighbours.

    ``grid`` is this rank's replica's pipeline (world ranks), so a driver that moves hidden
    states between ``grid``'s stages works the same whatever the replica count."""

    grid: list[list[int]]
    rank: int
    stage: int
    tp_rank: int
    world: Any  # private duplicate of COMM_WORLD for point-to-point traffic
    tp_comm: Any  # the stage's TP group (COMM_SELF-like when tp = 1)
    replica: int = 0
    replicas: list[list[list[int]]] | None = None  # every replica's grid (None: one replica, ``grid``)
    replica_comm: Any = None  # this replica's ranks (None: one replica, the world is the replica)

    @property
    def n_replicas(self) -> int:
        return len(self.replicas) if self.replicas else 1

    @property
    def heads(self) -> list[int]:
        """Each replica's driving rank (stage 0, tp rank 0), in replica order."""
        return [rep[0][0] for rep in (self.replicas or [self.grid])]

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
    def build(cls, world: Any, grid: list[list[int]], replicas: list[list[list[int]]] | None = None) -> "Topology":
        """Split ``world`` (collective over it) into this rank's TP group; with ``replicas``
        (every replica's grid), ``grid`` is ignored and this rank's replica's is used."""
        reps = replicas or [grid]
        replica = next(i for i, rep in enumerate(reps) if any(world.rank in g for g in rep))
        grid = reps[replica]
        stage, tp_rank = locate(grid, world.rank)
        tp_comm = world.Split(color=replica * len(grid) + stage, key=tp_rank)
        replica_comm = world.Split(color=replica, key=world.rank) if len(reps) > 1 else None
        return cls(grid=grid, rank=world.rank, stage=stage, tp_rank=tp_rank, world=world, tp_comm=tp_comm,
                   replica=replica, replicas=reps if len(reps) > 1 else None, replica_comm=replica_comm)
