"""Score's order of rounds as a pure loop: which round a replica runs next, and when it stops.

`run_rounds` is every rank's loop of ``score`` without MPI: it takes the next round (the next
index, or with replicas the one its stage 0 claimed from the shared counter, agreed with a stop
request in one all-reduce), runs it, and asks for a stop after each round. The MPI driver
(`drivers.score.ScoreDriver.drive`) gives it a round that is a GPipe forward over the executor;
`RoundClock` gives it one priced under a simulated clock (each stage busy for a microbatch's
`model.cost.step_cost`), so ``plan --simulate`` replays the same order (`engine.simulate`).

Note: the order. Rounds never overlap: every rank of a replica agrees on the stop (and, with
replicas, on the claimed round) between two rounds, so a round starts when the one before it has
left the last stage and its log-probs have reached rank 0. Inside a round the microbatches run
fill-drain: stage s starts microbatch m once it has finished m - 1 and stage s - 1 has sent m.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

from .ring import Event

__all__ = ["run_rounds", "RoundClock"]


def run_rounds(n_rounds: int, run: Callable[[int], None], stop_now: Callable[[], bool],
               claim: Callable[[], tuple[bool, int]] | None = None) -> tuple[bool, int]:
    """Run rounds ``0..n_rounds-1`` in order, or with ``claim`` (replicas: ``() -> (stop wanted,
    the round this replica claimed)``, a claim >= n_rounds meaning none left) the claimed ones.
    ``stop_now`` is asked after each round but the last (without replicas; with them the stop
    rides in the claim). Returns (stopped early, rounds run)."""
    done, r = 0, -1
    while True:
        if claim is not None:
            want_stop, r = claim()
            if want_stop and done:
                return True, done
        else:
            r += 1
        if r >= n_rounds:
            return False, done
        run(r)
        done += 1
        if claim is None and r + 1 < n_rounds and stop_now():
            return True, done


@dataclass
class RoundClock:
    """One replica's rounds under a simulated clock: ``price(microbatch, stage)`` seconds per
    stage, ``hop_s`` per hop between stages and once more for the log-probs' way to rank 0,
    ``sync_s`` for the agreement between rounds. `events` is the timeline; `now` the clock."""

    stages: int
    price: Callable[[object, int], float]
    hop_s: float = 0.0
    sync_s: float = 0.0
    now: float = 0.0
    events: list[Event] = field(default_factory=list)

    def run(self, microbatches: Sequence, rows: Callable[[object], int] = lambda mb: 1,
            positions: Callable[[object], int] = lambda mb: 0) -> float:
        """One round's fill-drain forward from `now`; returns (and moves `now` to) its end."""
        free = [self.now] * self.stages
        out = self.now
        for m, mb in enumerate(microbatches):
            ready = self.now
            for s in range(self.stages):
                start = max(ready, free[s])
                end = start + self.price(mb, s)
                free[s] = end
                self.events.append(Event(s, m, 0, rows(mb), positions(mb), start, end))
                ready = end + self.hop_s
            out = max(out, ready)
        self.now = out + self.sync_s
        return self.now
