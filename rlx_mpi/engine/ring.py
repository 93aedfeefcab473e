"""The decode ring's order as a pure loop: which step stage 0 issues when, and when it completes.

`run_ring` is stage 0's loop of ``generate`` without MPI: it asks the `scheduler.Scheduler` for
each group's next step, hands it to a `Pipe`, takes the oldest step's tokens back from the pipe,
completes it, and offers every group a turn. The MPI driver (`drivers.decode_ring.DecodeRing`)
is one pipe: it computes stage 0's part and moves headers, hidden states and tokens over MPI.
`ClockPipe` is another: it runs the same loop under a simulated clock, each stage busy for the
step's price (`model.cost.step_cost`), so the loop's order and a job's timeline can be replayed
and printed without MPI (the ground a ``plan --simulate`` stands on).

Note: the order. Steps complete in the order they were issued (the ring is FIFO: every stage runs
the steps in issue order, so the last stage's tokens come back in that order too). After each
completion the completed group takes its next step first, then every other group is offered a
turn (a parked group whose chunk rode in that step may now decode: the scheduler's riding note).
A stop request is asked after each completion; once it says yes no new step is issued and the
steps in flight are drained. The STOP header (with the keys of the rows that ended since the last
header: the row lifecycle) closes the pipe.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Protocol, Sequence

import numpy as np

from ..model.cost import Machine, ModelCost, step_cost
from .records import StepHeader
from .scheduler import DECODE, MIXED, Scheduler, Seq, Step

__all__ = ["Pipe", "run_ring", "ClockPipe", "Event", "grid", "contexts", "priced"]


class Pipe(Protocol):
    """Where stage 0's steps go: computed and moved (MPI), or priced under a clock (`ClockPipe`)."""

    def issue(self, step: Step) -> None:
        """Start ``step`` down the stages (stage 0's own part may run here)."""

    def tokens(self, step: Step) -> tuple[np.ndarray, tuple | None]:
        """Wait for the oldest issued ``step``'s sampled tokens (n,) and their log-probs (or None)."""

    def close(self, stop_header: np.ndarray) -> None:
        """Drain what is in flight and pass the STOP header on."""


def run_ring(sched: Scheduler, pipe: Pipe, on_done: Callable[[list[Seq]], None],
             stop_now: Callable[[], bool]) -> bool:
    """Stage 0's loop (the order note): every group's steps until the prompts are done or a stop
    is requested. Returns True if it stopped early."""
    in_flight: deque[Step] = deque()
    stopped = False

    def issue(g: int) -> None:
        step = sched.next_step(g)
        if step is not None:
            pipe.issue(step)
            in_flight.append(step)

    for g in range(sched.groups):
        issue(g)
    while in_flight:
        step = in_flight.popleft()
        tokens, lps = pipe.tokens(step)
        on_done(sched.complete(step, tokens, lps))
        if not sched.stopping and stop_now():
            sched.stopping = stopped = True
        issue(step.group)
        for g in range(sched.groups):  # (None for a group in flight)
            issue(g)
    pipe.close(sched.stop_header())
    return stopped


@dataclass
class Event:
    """One step's pass through one stage under the clock."""

    stage: int
    group: int
    kind: int
    rows: int
    positions: int  # token positions computed (decode rows + prefill positions)
    start: float
    end: float


@dataclass
class ClockPipe:
    """A pipeline of ``stages`` under a simulated clock: stage s is busy ``price(step, s)``
    seconds per step, steps run in issue order on every stage, a stage starts a step once it is
    free and the step has left the stage before it (plus ``hop_s`` per hop, and once more for
    the tokens' way back to stage 0). ``token_of(seq)`` gives each row's next token (the model's
    stand-in). `events` is the timeline; `now` the clock at stage 0."""

    stages: int
    price: Callable[[StepHeader, int], float]
    token_of: Callable[[Seq], int] = lambda seq: 0
    hop_s: float = 0.0
    now: float = 0.0
    events: list[Event] = field(default_factory=list)
    _free: list[float] = field(default_factory=list)
    _done_at: dict[int, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._free = [0.0] * self.stages

    def issue(self, step: Step) -> None:
        h = StepHeader(step.header)
        ready = self.now
        for s in range(self.stages):
            start = max(ready, self._free[s])
            end = start + self.price(h, s)
            self._free[s] = end
            self.events.append(Event(s, h.group, h.kind, h.n, _positions(h), start, end))
            ready = end + self.hop_s
        self._done_at[id(step)] = ready
        if self.stages > 0:
            self.now = max(self.now, self.events[-self.stages].end)  # stage 0 issues once its part is done

    def tokens(self, step: Step) -> tuple[np.ndarray, None]:
        self.now = max(self.now, self._done_at.pop(id(step)))
        return np.array([self.token_of(r) for r in step.rows], np.int64), None

    def close(self, stop_header: np.ndarray) -> None:
        self.now = max([self.now, *self._free])

    def busy(self) -> list[float]:
        """Each stage's busy fraction of the whole run."""
        span = max((e.end for e in self.events), default=0.0) or 1.0
        out = [0.0] * self.stages
        for e in self.events:
            out[e.stage] += e.end - e.start
        return [b / span for b in out]


def _positions(h: StepHeader) -> int:
    return sum(t for t, _ in contexts(h))


def contexts(h: StepHeader) -> list[tuple[int, int]]:
    """Each row of a step as `model.cost.step_cost` takes it: ``(positions, start)``: a decode row
    ``(1, its position)``, a prefill row the chunk's real positions (``(min(T, length - start),
    start)``: a right-padded row computes its padding too, priced here as it is not)."""
    lengths = h.lengths.tolist()
    nd = h.n if h.kind == DECODE else h.n_decode if h.kind == MIXED else 0
    out = [(1, int(p)) for p in lengths[:nd]]
    out += [(max(1, min(h.T, int(n) - h.start)), h.start) for n in lengths[nd:]]
    return out


def priced(cost: ModelCost, layers: Sequence[int], machine: Machine, tp: int = 1,
           weight_scale: float = 1.0) -> Callable[[StepHeader, int], float]:
    """`ClockPipe`'s price of a step on stage s, whose layers are ``layers[s]`` (`model.cost`)."""
    last = len(layers) - 1

    def price(h: StepHeader, s: int) -> float:
        return step_cost(cost, layers[s], contexts(h), last=s == last, weight_scale=weight_scale).seconds(machine, tp)

    return price


def grid(events: Sequence[Event], stages: int, width: int = 60) -> str:
    """The timeline as text: one line per stage, a character per slice (the group's digit, '.' idle)."""
    span = max((e.end for e in events), default=0.0)
    if span <= 0:
        return "\n".join(f"stage {s} |" for s in range(stages))
    lines = []
    for s in range(stages):
        row = ["."] * width
        for e in events:
            if e.stage == s:
                for i in range(int(e.start / span * width), max(int(e.start / span * width) + 1,
                                                                 int(e.end / span * width))):
                    row[min(i, width - 1)] = str(e.group % 10)
        lines.append(f"stage {s} |{''.join(row)}|")
    return "\n".join(lines)

