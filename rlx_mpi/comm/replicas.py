"""Data-parallel replicas working through one prompt list: who takes what, who writes, the end.

A job of R replicas (`topology.replica_grids`) runs R independent pipelines over one world.
Every rank knows the pending prompts (broadcast at start-up); what the replicas share is:

* `SharedCounter`: a fetch-and-add counter held by world rank 0 (MPI one-sided). A replica
  takes the next chunk of pending prompts (``generate``: one group's slots) or the next round
  (``score``) when it frees capacity, so a replica on a slow node, or with long prompts, takes
  less and holds no one back (dynamic, as a work queue; no rank serves requests);
* `RowPost` / `Collector`: every other replica sends its finished rows (small JSON messages,
  never pickle) to world rank 0, the one writer, whose `Journal` keeps the file in prompt
  order exactly as with one replica, and resumes it on any replica count;
* the end: a rank whose part is over says so (``done``) and waits for rank 0's ``end``; rank
  0 says ``end`` once every other rank is done. Every wait has a deadline: the ranks that wait
  hear from rank 0 (a keep-alive) at least every ``timeout_s / 4``, and rank 0 hears from each
  running replica as often (its rows, or a ``beat``), so a silent replica is named by rank.

Note: one writer rather than per-replica journals merged at the end. The rows already go to
one process in prompt order for one replica; sending them on costs one small message per
finished step of another replica (a few hundred bytes a row), and the file is complete and
ordered at every moment, so a job stopped or failing mid-way resumes from it with any replica
count (the journal's identity records no layout). Per-replica files would need a merge after
every stop and would lose a replica's rows whose earlier prompts another replica held.

Note: rows are identical to one replica's. Sampling is keyed by (seed, prompt key, token
index), never by slot, batch or replica, and a row's logits do not depend on the rows beside
it (the kernels' rule), so which replica, slot or chunk a prompt lands in changes no token.
"""

from __future__ import annotations

import json
import time
from typing import Any, Callable

import numpy as np

from ..errors import DeadlineExpired
from ..lifecycle.faults import RankContext, wait
from ..tags import REPLICA_END as TAG_END, REPLICA_WORK as TAG_WORK  # (the registry: rlx_mpi/tags.py)

__all__ = ["SharedCounter", "ReplicaFeed", "RowPost", "Collector", "wait_for_end", "TAG_WORK", "TAG_END"]

_ALIVE, _END = 0, 1


class SharedCounter:
    """A fetch-and-add int64 on world rank 0; `post` claims ``n`` ahead, `take` waits for the claim.

    Collective to build and to `close` (every rank of ``world``)."""

    def __init__(self, world: Any, ctx: RankContext, timeout_s: float, words: int = 1):
        from mpi4py import MPI

        self.world, self.ctx, self.timeout_s = world, ctx, timeout_s
        # the counter is word 0 (``words`` > 1: room for more, `recovery.RefillCounter`'s list)
        self.win = MPI.Win.Allocate(8 * words if world.rank == 0 else 0, 8, comm=world)
        if world.rank == 0:
            np.frombuffer(self.win.tomemory(), np.int64)[:] = 0
        wait(world.Ibarrier(), timeout_s, ctx, lambda: "every rank to open the prompt counter", "some rank")
        self.win.Lock_all()

    def post(self, n: int) -> tuple[Any, np.ndarray]:
        """Claim the next ``n`` (non-blocking); `take` returns where the claim starts."""
        from mpi4py import MPI

        add, old = np.array([n], np.int64), np.zeros(1, np.int64)
        req = self.win.Rget_accumulate([add, MPI.INT64_T], [old, MPI.INT64_T], 0, op=MPI.SUM)
        return req, old

    def take(self, claim: tuple[Any, np.ndarray]) -> int:
        req, old = claim
        wait(req, self.timeout_s, self.ctx, lambda: "the next prompts from the counter on rank 0", "rank 0")
        return int(old[0])

    def close(self) -> None:
        self.win.Unlock_all()
        wait(self.world.Ibarrier(), self.timeout_s, self.ctx, lambda: "every rank to close the prompt counter",
             "some rank")
        self.win.Free()


class ReplicaFeed:
    """Stage 0 of one replica: the next ``chunk`` of ``items`` each call, [] once all are taken.

    The replica's driving rank (stage 0, tp rank 0) claims from the counter, one claim ahead so
    the wait is hidden behind a step; the other TP ranks of stage 0 learn the claim by an
    all-reduce over their TP group (every one of them calls at the same point of the same
    schedule)."""

    def __init__(self, counter: SharedCounter, items: list, chunk: int, *, leader: bool, tp_comm: Any = None,
                 tp: int = 1, ctx: RankContext | None = None, timeout_s: float = 60.0):
        self.counter, self.items, self.chunk = counter, items, max(1, chunk)
        self.leader, self.tp_comm, self.tp, self.ctx, self.timeout_s = leader, tp_comm, tp, ctx, timeout_s
        self.claim = counter.post(self.chunk) if leader else None
        self.taken = 0  # items this replica took

    def next_start(self) -> int:
        """Where this replica's next chunk starts (>= len(items): none left)."""
        start = -1
        if self.leader and self.claim is None:  # the last claim ran past the end: none left
            start = len(self.items)
        elif self.leader:
            start = self.counter.take(self.claim)
            self.claim = self.counter.post(self.chunk) if start + self.chunk < len(self.items) else None
        if self.tp > 1:
            from .collectives import ReduceKind, all_reduce

            buf = np.array([start], np.int64)
            all_reduce(buf, ReduceKind.MAX, comm=self.tp_comm, timeout_s=self.timeout_s, ctx=self.ctx)
            start = int(buf[0])
        return start

    def __call__(self) -> list:
        start = self.next_start()
        part = self.items[start:start + self.chunk] if 0 <= start < len(self.items) else []
        self.taken += len(part)
        return part

    def close(self) -> None:
        """Finish a claim still posted (the counter's epoch must end with none open)."""
        if self.claim is not None:
            self.counter.take(self.claim)
            self.claim = None


class RowPost:
    """Another replica's messages to rank 0: rows, a beat when quiet, and done. Sends are
    non-blocking and finished (under the deadline) as they complete or at `done`."""

    def __init__(self, world: Any, ctx: RankContext, timeout_s: float):
        self.world, self.ctx, self.timeout_s = world, ctx, timeout_s
        self.sent: list[tuple[Any, np.ndarray]] = []
        self.last = time.monotonic()
        self.period = max(0.05, timeout_s / 4)

    def _send(self, doc: dict) -> None:
        data = np.frombuffer(json.dumps(doc, separators=(",", ":")).encode(), np.uint8).copy()
        self.sent.append((self.world.Isend(data, dest=0, tag=TAG_WORK), data))
        self.sent = [(r, d) for r, d in self.sent if not r.Test()]
        self.last = time.monotonic()

    def rows(self, rows: list, **extra: Any) -> None:
        self._send({"kind": "rows", "rows": rows, **extra})

    def beat(self) -> None:
        """Tell rank 0 this replica is alive, if nothing went to it for a while."""
        if time.monotonic() - self.last >= self.period:
            self._send({"kind": "beat"})

    def done(self, **summary: Any) -> None:
        self._send({"kind": "done", **summary})
        from ..lifecycle.faults import _AllOf

        wait(_AllOf([r for r, _ in self.sent]), self.timeout_s, self.ctx, lambda: "rank 0 to take the rows", "rank 0")
        self.sent.clear()


class Collector:
    """World rank 0: takes the other replicas' messages (`poll`, called once per step of its own
    replica), keeps the waiting ranks alive, and at `finish` waits for every rank to be done."""

    def __init__(self, world: Any, ctx: RankContext, timeout_s: float, voices: dict[int, list[int]],
                 on_rows: Callable[[int, dict], None]):
        # voices: each other replica's sending rank -> that replica's ranks (its silence names it);
        # the ranks of rank 0's own replica are done soon after rank 0 is (`finish`)
        self.world, self.ctx, self.timeout_s, self.on_rows = world, ctx, timeout_s, on_rows
        self.voices = voices
        self.heard = {v: time.monotonic() for v in voices}
        self.done: dict[int, dict] = {}  # rank -> its done summary
        self.waiting: list[int] = []
        self.period = max(0.05, timeout_s / 4)
        self.pinged = time.monotonic()
        self.pings: list[tuple[Any, np.ndarray]] = []

    def poll(self) -> None:
        from mpi4py import MPI

        status = MPI.Status()
        while (msg := self.world.Improbe(MPI.ANY_SOURCE, TAG_WORK, status)) is not None:
            src = status.Get_source()
            buf = np.empty(status.Get_count(MPI.BYTE), np.uint8)
            msg.Recv(buf)
            doc = json.loads(buf.tobytes())
            self.heard[src] = time.monotonic()
            if doc["kind"] == "rows":
                self.on_rows(src, doc)
            elif doc["kind"] == "done":
                self.done[src] = doc
                self.waiting.append(src)
        self._ping(_ALIVE)

    def _ping(self, value: int, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self.pinged < self.period:
            return
        self.pinged = now
        for r in self.waiting:
            buf = np.array([value], np.int64)
            self.pings.append((self.world.Isend(buf, dest=r, tag=TAG_END), buf))
        self.pings = [(q, b) for q, b in self.pings if not q.Test()]

    def _silent(self, since: float) -> int | None:
        """A rank not done whose replica has been silent past the deadline, or None (``since``:
        when rank 0's own part ended)."""
        now = time.monotonic()
        theirs = set()
        for voice, ranks in self.voices.items():
            theirs.update(ranks)
            if voice in self.done:
                late = [r for r in ranks if r not in self.done]
                if late and now - self.heard[voice] > self.timeout_s:
                    return late[0]
            elif now - self.heard[voice] > self.timeout_s:
                return voice
        own = [r for r in range(1, self.world.size) if r not in theirs and r not in self.done]
        return own[0] if own and now - since > self.timeout_s else None

    def finish(self) -> dict[int, dict]:
        """Wait until every other rank is done (rank 0's own part is over), then tell them all to end."""
        from ..lifecycle.faults import _AllOf

        others = self.world.size - 1
        for v in self.heard:  # rank 0's own part may have taken long: count silence from now
            self.heard[v] = max(self.heard[v], time.monotonic() - self.period)
        nap, since = 1e-4, time.monotonic()
        while len(self.done) < others:
            before = len(self.done)
            self.poll()
            if (bad := self._silent(since)) is not None:
                raise DeadlineExpired(self.ctx.describe(), f"heard nothing from rank {bad} (another replica) for "
                                      f"{self.timeout_s:.1f} s", f"rank {bad} is stuck or dead, see its output above; "
                                      "if it is only slow, raise [run] timeout_s")
            if len(self.done) == before:
                time.sleep(nap)
                nap = min(nap * 2, 1e-3)
        self.waiting = [r for r in range(1, self.world.size)]
        self._ping(_END, force=True)
        wait(_AllOf([q for q, _ in self.pings]), self.timeout_s, self.ctx, lambda: "every rank to take the end",
             "some rank")
        return self.done


def wait_for_end(world: Any, ctx: RankContext, timeout_s: float) -> None:
    """A rank other than 0 whose part is over: wait for rank 0's end (its keep-alives restart the
    deadline: another replica may still be working for a long time)."""
    buf = np.zeros(1, np.int64)
    while True:
        req = world.Irecv(buf, source=0, tag=TAG_END)
        wait(req, timeout_s, ctx, lambda: "rank 0 to end the job (the other replicas to finish)", "rank 0")
        if buf[0] == _END:
            return
