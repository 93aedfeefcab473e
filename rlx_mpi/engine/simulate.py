"""A job before it is queued: generate's ring and score's rounds replayed under a clock.

`simulate_generate` runs each replica's `scheduler.Scheduler` through the real ring loop
(`ring.run_ring`: admission, groups, the prefix cache's hits from the prompts' tokens, chunked
prefill and MIXED steps) with a `ring.ClockPipe` as its pipe; `simulate_score` runs the rounds
(`rounds.run_rounds`) with a `rounds.RoundClock`. A step's price on each stage is
`model.cost.step_cost` under a measured `model.calibration.Calibration` (``plan --simulate
--calibration``), or without one the roofline `model.cost.Machine` (labelled as such). Pure: no
MPI and no numba kernels (tests/test_imports.py checks the imports).

Note: replicas. Each replica's loop runs in a thread of its own; the only thing replicas share
is the list of prompts (generate: `comm.replicas.ReplicaFeed`'s chunks, score: the rounds), and
a replica takes from it only when every other replica still running is waiting to take too and
its own clock is the earliest (`_TimeOrder`): the order the shared counter gives on the real
ranks, as if replicas ran apart on their own cores. Rank 0's collection of the other replicas'
rows is not priced.

Note: the first touch. A stage's first step writes its KV cache for the first time, and the whole
cache is faulted in then (`drivers.calibrate.measure_load`'s first-touch note): ``first_s[s]``
seconds, the stage's cache bytes at the calibration's ``touch_gbps``, are added to that step
(on the 2-core VM, 0.78 s of the medium 1-rank job's first 1,024 positions).

Note: what the model leaves out. Rows run to their max_new_tokens (no end-of-sequence id or stop
string: a simulated token is never one); start-up (MPI, reading the weights, compiling) is
`startup_s`, priced apart from the run; a rank's rates are the calibration's whatever the model
(a narrow model's fixed costs per weight weigh more than the medium preset's).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from ..model.calibration import Calibration, step_seconds
from ..model.cost import Machine, ModelCost, step_cost
from .records import Request, StepHeader
from .ring import ClockPipe, Event, contexts, run_ring
from .rounds import RoundClock, run_rounds
from .scheduler import DECODE, Scheduler

__all__ = ["Layout", "Prediction", "simulate_generate", "simulate_score", "ScoreMicrobatch"]


@dataclass(frozen=True)
class Layout:
    """Replicas x stages x tp: each stage's layer count and weight precision (every replica alike)."""

    replicas: int
    layers: tuple[int, ...]  # a stage's layers
    precisions: tuple[str, ...]  # a stage's weight precision
    tp: int = 1
    weight_scales: tuple[float, ...] = ()  # a stage's resident weight bytes over the f32 priced (roofline)

    @property
    def stages(self) -> int:
        return len(self.layers)

    @property
    def ranks(self) -> int:
        return self.replicas * self.stages * self.tp

    def name(self) -> str:
        return (f"{self.replicas} replicas x " if self.replicas > 1 else "") + \
            f"{self.stages} stage{'s' if self.stages != 1 else ''} x tp {self.tp}"


@dataclass
class Prediction:
    """What ``plan --simulate`` prints (and ``--json`` writes)."""

    command: str
    layout: str
    priced_by: str  # "calibration FILE" or "roofline (no calibration)"
    predicted_wall_s: float  # the run (first step to last row), start-up apart
    startup_s: float
    tokens: int  # generated (generate) or scored (score) tokens
    positions: int  # token positions computed (prompts' prefill, new tokens, score's padding)
    first_row_s: float  # the first finished row (generate) or round (score)
    steps: int
    busy: list[float]  # a stage's busy seconds (replica 0's stages; the replicas' mean)
    replica_walls: list[float] = field(default_factory=list)
    prefix_hits: int = 0  # prompt positions attached from the prefix cache
    finish_s: float = 0.0  # after the last row: outputs written, the finish barrier, MPI_Finalize, the exits

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.predicted_wall_s if self.predicted_wall_s > 0 else 0.0

    @property
    def job_s(self) -> float:
        return self.startup_s + self.predicted_wall_s + self.finish_s

    def to_json(self) -> dict:
        w = self.predicted_wall_s or 1.0
        return {"command": self.command, "layout": self.layout, "priced_by": self.priced_by,
                "predicted_wall_s": round(self.predicted_wall_s, 4), "startup_s": round(self.startup_s, 3),
                "finish_s": round(self.finish_s, 3), "job_s": round(self.job_s, 3), "tokens": self.tokens,
                "tokens_per_s": round(self.tokens_per_s, 2),
                "positions": self.positions, "first_row_s": round(self.first_row_s, 4), "steps": self.steps,
                "prefix_hits": self.prefix_hits, "replica_walls": [round(x, 4) for x in self.replica_walls],
                "stages": [{"stage": s, "busy_s": round(b, 4), "busy": round(min(1.0, b / w), 4),
                            "bubble": round(max(0.0, 1 - b / w), 4)}
                           for s, b in enumerate(self.busy)]}


def _pricer(cost: ModelCost, layout: Layout, cal: Calibration | None, machine: Machine, every: bool = False
            ) -> Callable[[Sequence[tuple[int, int]], int], float]:
    """seconds(contexts, stage) of one rank of the stage (`model.calibration.step_seconds`)."""
    last = layout.stages - 1
    vocab = cost.head_flops_per_token / 2 / cost.hidden_size if cost.hidden_size else 0

    def price(ctx: Sequence[tuple[int, int]], s: int) -> float:
        scale = layout.weight_scales[s] if layout.weight_scales else 1.0
        sc = step_cost(cost, layout.layers[s], ctx, last=s == last, weight_scale=scale, every=every)
        if cal is None:
            return sc.seconds(machine, layout.tp)
        t = step_seconds(sc, cal, layout.precisions[s], layout.tp, send=layout.stages > 1)
        if every and s == last and cal.read_gbps:  # score: log-softmax over the vocab of every position
            t += sc.positions * vocab * 12.0 / (cal.read_gbps * 1e9)
        return t

    return price


class _TimeOrder:
    """Replicas take from what they share in the order of their clocks (the module's replicas note)."""

    def __init__(self, n: int):
        self.n, self.cond, self.waiting, self.done = n, threading.Condition(), {}, set()

    def turn(self, r: int, t: float) -> None:
        with self.cond:
            self.waiting[r] = t
            self.cond.notify_all()
            self.cond.wait_for(lambda: len(self.waiting) + len(self.done) == self.n
                               and min(self.waiting, key=lambda k: (self.waiting[k], k)) == r)
            del self.waiting[r]

    def finish(self, r: int) -> None:
        with self.cond:
            self.done.add(r)
            self.cond.notify_all()


def _run_replicas(n: int, body: Callable[[int, _TimeOrder], None]) -> None:
    order = _TimeOrder(n)
    errors: list[BaseException] = []

    def run(r: int) -> None:
        try:
            body(r, order)
        except BaseException as e:  # (re-raised below, on the caller's thread)
            errors.append(e)
        finally:
            order.finish(r)

    if n == 1:
        run(0)
    else:
        threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    if errors:
        raise errors[0]


def _busy(events: Sequence[Event], stages: int) -> list[float]:
    out = [0.0] * stages
    for e in events:
        out[e.stage] += e.end - e.start
    return out


def simulate_generate(requests: Sequence[Request], cost: ModelCost, layout: Layout, *, batch: int, groups: int,
                      max_new_tokens: int, prefill_chunk: int, mixed: bool = True, pool: Callable[[], Any] = None,
                      paged: bool = False, cal: Calibration | None = None, machine: Machine = Machine(),
                      startup_s: float = 0.0, priced_by: str = "", first_s: Sequence[float] = ()) -> Prediction:
    """``generate`` of ``requests`` on ``layout`` (the module note); ``pool()`` makes a replica's
    prefix-cache `block_pool.BlockPool` (None: off); ``first_s``: a stage's first step's extra
    seconds (the first-touch note; none: 0)."""
    price = _pricer(cost, layout, cal, machine)
    items = list(requests)
    shared = {"next": 0}
    pipes: dict[int, ClockPipe] = {}
    stats = {"first": None, "tokens": 0, "steps": 0, "hits": 0, "positions": 0}
    lock = threading.Lock()

    def body(r: int, order: _TimeOrder) -> None:
        touched: set[int] = set()  # this replica's stages past their first step

        def step_s(h: StepHeader, s: int) -> float:
            first = first_s[s] if s < len(first_s) and s not in touched else 0.0
            touched.add(s)
            return price(contexts(h), s) + first

        pipe = ClockPipe(layout.stages, step_s, token_of=lambda seq: 7)
        pipes[r] = pipe

        def feed() -> list:
            order.turn(r, pipe.now)
            start = shared["next"]
            shared["next"] = start + batch
            return items[start:start + batch]

        sched = Scheduler([] if layout.replicas > 1 else items, groups, batch, max_new_tokens, frozenset(), False,
                          prefill_chunk=prefill_chunk, mixed=mixed and bool(prefill_chunk), stages=layout.stages,
                          feed=feed if layout.replicas > 1 else None, pool=pool() if pool else None, paged=paged)

        def on_done(rows: list) -> None:
            with lock:
                if rows and (stats["first"] is None or pipe.now < stats["first"]):
                    stats["first"] = pipe.now
                stats["tokens"] += sum(len(x.new) for x in rows)

        run_ring(sched, pipe, on_done, lambda: False)
        with lock:
            stats["steps"] += sum(1 for e in pipe.events if e.stage == 0)
            stats["positions"] += sum(e.positions for e in pipe.events if e.stage == 0)
            stats["hits"] += sched.reused

    _run_replicas(layout.replicas, body)
    walls = [pipes[r].now for r in range(layout.replicas)]
    busy = [sum(b) / layout.replicas for b in zip(*(_busy(pipes[r].events, layout.stages)
                                                   for r in range(layout.replicas)))]
    return Prediction("generate", layout.name(), priced_by, max(walls), startup_s, stats["tokens"],
                      stats["positions"], stats["first"] or 0.0, stats["steps"], busy, walls, stats["hits"])


@dataclass(frozen=True)
class ScoreMicrobatch:
    """One forward of score: ``rows`` lines of ``width`` computed positions from ``start``."""

    rows: int
    width: int
    start: int = 0


def simulate_score(rounds: Sequence[Sequence[ScoreMicrobatch]], scored: Sequence[int], cost: ModelCost,
                   layout: Layout, *, cal: Calibration | None = None, machine: Machine = Machine(),
                   startup_s: float = 0.0, priced_by: str = "") -> Prediction:
    """``score`` of ``rounds`` (each its microbatches; ``scored[r]`` the round's scored tokens)."""
    price = _pricer(cost, layout, cal, machine, every=True)
    sync = cal.allreduce_s(16, layout.stages * layout.tp) if cal is not None and layout.stages * layout.tp > 1 else 0.0
    clocks: dict[int, RoundClock] = {}
    shared = {"next": 0}
    stats = {"first": None, "tokens": 0, "positions": 0, "steps": 0}
    lock = threading.Lock()

    def body(r: int, order: _TimeOrder) -> None:
        clock = RoundClock(layout.stages, lambda mb, s: price([(mb.width, mb.start)] * mb.rows, s), sync_s=sync)
        clocks[r] = clock

        def claim() -> tuple[bool, int]:
            order.turn(r, clock.now)
            nxt = shared["next"]
            shared["next"] += 1
            return False, nxt

        def one(i: int) -> None:
            clock.run(rounds[i], rows=lambda mb: mb.rows, positions=lambda mb: mb.rows * mb.width)
            with lock:
                if stats["first"] is None or clock.now < stats["first"]:
                    stats["first"] = clock.now
                stats["tokens"] += scored[i]
                stats["positions"] += sum(mb.rows * mb.width for mb in rounds[i])
                stats["steps"] += len(rounds[i])

        run_rounds(len(rounds), one, lambda: False, claim if layout.replicas > 1 else None)

    _run_replicas(layout.replicas, body)
    walls = [clocks[r].now for r in range(layout.replicas)]
    busy = [sum(b) / layout.replicas for b in zip(*(_busy(clocks[r].events, layout.stages)
                                                   for r in range(layout.replicas)))]
    return Prediction("score", layout.name(), priced_by, max(walls), startup_s, stats["tokens"], stats["positions"],
                      stats["first"] or 0.0, stats["steps"], busy, walls)
