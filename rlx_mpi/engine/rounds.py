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

__all__ = ["Microbatch", "plan_rounds", "where_of", "run_rounds", "RoundClock"]


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


# -- score's rounds: which lines each microbatch of a round holds (pure: every rank computes the same)


@dataclass(frozen=True)
class Microbatch:
    """Lines of one forward: positions in the pending list, right-padded to ``length``."""

    lines: tuple[int, ...]
    length: int


MIN_ROUNDS = 8  # a file is cut into at least this many rounds where microbatches stay >= MIN_TOKENS
MIN_TOKENS = 256


def plan_rounds(lengths: list[int], budget: int, per_round: int) -> list[list[Microbatch]]:
    """Cut lines (their token counts, in file order) into rounds of microbatches.

    A round takes lines in order while they hold at most ``per_round * budget`` tokens (at
    least one line), sorts them longest first and packs each microbatch while rows x its
    first (longest) line's length stays within ``budget`` (and within the round's tokens /
    ``per_round``, so a short round still fills the pipeline). Pure: every rank computes the same.

    Note: a file of a few budgets' tokens is still cut into `MIN_ROUNDS` rounds (microbatches
    of at least `MIN_TOKENS`): replicas share a file round by round, and 64 lines of ~72
    tokens made 2 rounds (55 and 9 lines) at the default budget, so 2 replicas ran 1.12x one.
    The cut depends on the file alone, never on the replica count: a line's microbatch, and so
    its log-probs' last bits, are the same however many replicas share the job.
    """
    if budget < 1 or per_round < 1:
        raise ValueError(f"budget and per_round must be >= 1, got {budget}, {per_round}")
    rounds, i, n = [], 0, len(lengths)
    limit = per_round * budget
    limit = min(limit, max(-(-sum(lengths) // MIN_ROUNDS), per_round * min(budget, MIN_TOKENS)))
    while i < n:
        j, total = i, 0
        while j < n and (j == i or total + lengths[j] <= limit):
            total += lengths[j]
            j += 1
        order = sorted(range(i, j), key=lambda k: (-lengths[k], k))
        # a short round (the file's end, a small file) is still cut into per_round microbatches
        # where it can be, so that every stage of the pipeline gets work
        cap = min(budget, max(lengths[order[0]], -(-sum(lengths[k] for k in order) // per_round)))
        mbs, k = [], 0
        while k < len(order):
            longest = lengths[order[k]]
            rows = max(1, cap // longest)
            take = tuple(order[k:k + rows])
            mbs.append(Microbatch(take, longest))
            k += len(take)
        rounds.append(mbs)
        i = j
    return rounds


def where_of(mbs: list[Microbatch], pending: list) -> dict[int, tuple[int, int]]:
    """Where each line's log-probs sit in a round's flat array (microbatch, then row order)."""
    where, n = {}, 0
    for mb in mbs:
        for k in mb.lines:
            s, ln = pending[k][3], len(pending[k][2])
            where[k] = (n, n + ln - s)
            n += ln - s
    return where
