"""Replicas that outlive a dead rank (``[run] on_rank_failure = "continue"`` under ULFM).

`comm.replicas` shares the prompt rows through a fetch-and-add counter on rank 0 and ends the
job once every replica is done. Here the same, in rounds, so that rows a dead replica held can
go back to the pool and a replica that had finished can be woken to take them:

* `RefillCounter`: the counter's window also holds a list of *returned* rows. Positions
  ``[0, n)`` of the counter are the rows in order; position ``n + j`` is returned row ``j``
  (``-1``: a position a dead replica held, skipped). A replica claims ``chunk`` positions at a
  time and keeps a claim past the end until rank 0 fills it or ends the job.
* `RefillFeed`: a replica's stage 0 (tp 1): the rows of its claim that exist, [] when none do
  yet; it tells rank 0 every claim it takes (``took``), so rank 0 knows whose rows are whose.
* `RecoveringCollector` (rank 0): the rows, the claims, and the failures. When MPI reports a
  dead rank (ULFM: an ``ANY_SOURCE`` probe fails with ``MPI_ERR_PROC_FAILED``; a survivor of the
  broken replica says ``lost``), it acknowledges the failure, marks the dead rank's replica
  broken, prints one warning line, and returns to the pool every row that replica (or a claim
  nobody had reported yet) held and that is not written; it wakes (``more``) every replica that
  has finished its round while rows it can take exist, and ends the job (``end``, or ``shrink``
  once ranks were lost) when every row is written.
* `wait_for_round` (every other rank): after its round, ``done`` (or ``lost``) and wait for
  rank 0's word: ``more`` (another round), ``end`` or ``shrink``.

Note: no revoke of the world. The live replicas' hidden states and rows travel on it, and ULFM
lets point-to-point traffic between live ranks go on after a failure is acknowledged; a revoke
would stop them too. Only the broken replica stops (its survivors see their ring fail), and at
the end every live rank shrinks the world once (`ulfm.survivors`) for the stats and the finish
barrier. A row computed twice (a claim in flight at the failure) is written once: its bits
are the same on any replica (`comm.replicas`' second note).
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any, Callable

import numpy as np

from ..errors import DeadlineExpired
from ..lifecycle import ulfm
from ..lifecycle.faults import RankContext, _AllOf, wait
from ..tags import REPLICA_END as TAG_END, REPLICA_WORK as TAG_WORK
from .replicas import RowPost, SharedCounter

__all__ = ["RefillCounter", "RefillFeed", "RecoveringCollector", "wait_for_round", "refill_feed", "run_rounds", "lost_ranks", "say",
           "MORE", "END", "SHRINK"]

ALIVE, END, SHRINK, MORE = 0, 1, 2, 3  # rank 0's words to a waiting rank (ALIVE, END: `comm.replicas`)
_COUNT, _FILLED, _HEAD = 0, 1, 2  # window slots: the counter, how many rows were returned; then the list


class RefillCounter(SharedCounter):
    """The shared counter with room for returned rows (``cap`` of them). Collective to build."""

    def __init__(self, world: Any, ctx: RankContext, timeout_s: float, n: int, cap: int):
        super().__init__(world, ctx, timeout_s, words=_HEAD + cap)  # (post and take: the counter's)
        self.n, self.cap = n, cap

    def read(self, slot: int, count: int = 1) -> np.ndarray:
        from mpi4py import MPI

        out, none = np.zeros(count, np.int64), np.zeros(count, np.int64)
        req = self.win.Rget_accumulate([none, MPI.INT64_T], [out, MPI.INT64_T], 0, target=(slot, count, MPI.INT64_T),
                                       op=MPI.NO_OP)
        wait(req, self.timeout_s, self.ctx, lambda: "the returned prompts from rank 0", "rank 0")
        return out

    def filled(self) -> int:
        return int(self.read(_FILLED)[0])

    def returned(self, start: int, count: int) -> np.ndarray:
        return self.read(_HEAD + start, count)

    def append(self, at: int, rows: list[int]) -> None:
        """Rank 0: returned rows ``at..`` (the list first, then its length: a reader never sees a
        length past what is written)."""
        from mpi4py import MPI

        if at + len(rows) > self.cap:
            raise OverflowError(f"more than {self.cap} returned rows")
        data = np.array(rows, np.int64)
        self.win.Accumulate([data, MPI.INT64_T], 0, target=(_HEAD + at, len(rows), MPI.INT64_T), op=MPI.REPLACE)
        self.win.Flush(0)
        self.win.Accumulate([np.array([at + len(rows)], np.int64), MPI.INT64_T], 0, target=(_FILLED, 1, MPI.INT64_T),
                            op=MPI.REPLACE)
        self.win.Flush(0)

    def close(self, lost: bool) -> None:
        """Free the window; once ranks were lost it is left (freeing is collective over the dead)."""
        self.win.Unlock_all()
        if not lost:
            wait(self.world.Ibarrier(), self.timeout_s, self.ctx, lambda: "every rank to close the prompt counter",
                 "some rank")
            self.win.Free()


class RefillFeed:
    """A replica's stage 0 (tp 1): the rows of its claim that exist; [] while its claim is unfilled."""

    def __init__(self, counter: RefillCounter, items: list, chunk: int, on_took: Callable[[int, int], None]):
        self.counter, self.items, self.chunk, self.on_took = counter, items, max(1, chunk), on_took
        self.n = len(items)
        self.lo = self.hi = 0  # the claim's positions not handed out yet
        self.claim = counter.post(self.chunk)
        self.taken = 0

    @property
    def held(self) -> list[int] | None:
        return [self.lo, self.hi] if self.lo < self.hi else None

    def __call__(self) -> list:
        while True:
            if self.lo >= self.hi:
                claim = self.claim if self.claim is not None else self.counter.post(self.chunk)
                self.claim = None
                self.lo = self.counter.take(claim)
                self.hi = self.lo + self.chunk
                self.on_took(self.lo, self.hi)
                if self.hi < self.n:  # one claim ahead while the file lasts, as `ReplicaFeed`
                    self.claim = self.counter.post(self.chunk)
            upto = min(self.hi, self.n + (self.counter.filled() if self.hi > self.n else 0))
            if upto <= self.lo:
                return []
            first = [self.items[p] for p in range(self.lo, min(upto, self.n))]
            back = max(self.lo, self.n)
            more = [self.items[int(i)] for i in self.counter.returned(back - self.n, upto - back) if i >= 0] \
                if upto > back else []
            self.lo = upto
            if first or more:
                self.taken += len(first) + len(more)
                return first + more

    def close(self) -> None:
        if self.claim is not None:
            self.counter.take(self.claim)
            self.claim = None


class RecoveringCollector:
    """World rank 0 under ``continue``: rows, claims, failures, rounds (the module's list)."""

    def __init__(self, world: Any, ctx: RankContext, timeout_s: float, replicas: list[list[int]],
                 counter: RefillCounter, items: list, on_rows: Callable[[int, dict], None],
                 key: Callable[[Any], Any], stages: int = 1, noun: str = "prompt row"):
        # replicas: each replica's world ranks, its sending rank (stage 0, tp 0) first
        self.world, self.ctx, self.timeout_s = world, ctx, timeout_s
        # key(item): what names an item's output (a row: (index, sample); score: the round); `fresh` keeps them
        self.replicas, self.counter, self.items, self.on_rows, self.key = replicas, counter, items, on_rows, key
        self.seen: set = set()
        self.replica_of = {r: i for i, rep in enumerate(replicas) for r in rep}
        self.noun = noun  # what a counter position is, for the warning (a prompt row; score: a round)
        self.n = len(items)
        self.returned: list[int] = []  # rank 0's copy of the window's list
        self.claims: dict[int, list[tuple[int, int]]] = {i: [] for i in range(len(replicas))}
        self.held: dict[int, list[int] | None] = {}  # a waiting replica's unfilled claim
        self.dead: set[int] = set()
        self.broken: set[int] = set()
        self.skip: set[int] = set()  # positions past the filled ones that a broken replica held
        self.settled: set[int] = set()  # positions whose rows went back to the pool (or were skipped)
        self.waiting: set[int] = set()  # ranks (not 0) done with this round (or out, once broken)
        self.heard = {rep[0]: time.monotonic() for rep in replicas}
        self.period = max(0.05, timeout_s / 4)
        # a silent replica is named after its own ranks' deadlines (the ring's, staggered by stage:
        # `decode_ring`), so that the rank next to a stuck one names it first
        self.silence_s = timeout_s + (stages + 2) * max(1.0, 0.1 * timeout_s)
        self.pinged = time.monotonic()
        self.pings: list[tuple[Any, np.ndarray]] = []
        self.warnings: list[str] = []
        self.lost_at: list[dict] = []  # {"ranks", "noticed": time.time()} per failure (the --json stats)

    # -- messages ----------------------------------------------------------------------------------

    def poll(self) -> None:
        from mpi4py import MPI

        status = MPI.Status()
        while True:
            try:
                msg = self.world.Improbe(MPI.ANY_SOURCE, TAG_WORK, status)
                if msg is None:
                    break
                src = status.Get_source()
                buf = np.empty(status.Get_count(MPI.BYTE), np.uint8)
                msg.Recv(buf)  # (a large message whose sender died after the probe fails here: its rows are redone)
            except MPI.Exception as e:
                if not ulfm.is_failure(e):
                    raise
                self.failed(ulfm.failed_ranks(self.world))
                continue
            doc = json.loads(buf.tobytes())
            self.heard[src] = time.monotonic()
            kind = doc["kind"]
            if kind == "rows":
                self.on_rows(src, doc)
            elif kind == "took":
                self.took(self.replica_of[src], doc["lo"], doc["hi"])
            elif kind == "done":
                self.waiting.add(src)
                if "held" in doc:
                    self.held[self.replica_of[src]] = doc["held"]
            elif kind == "lost":
                self.waiting.add(src)
                self.failed(doc["dead"])
        self._ping(ALIVE)

    def fresh(self, *key: Any) -> bool:
        """Not written yet (and from now on written): a row computed twice is written once."""
        key = key[0] if len(key) == 1 else key
        if key in self.seen:
            return False
        self.seen.add(key)
        return True

    def written(self, item: Any) -> bool:
        return self.key(item) in self.seen

    def took(self, replica: int, lo: int, hi: int) -> None:
        self.claims[replica].append((lo, hi))

    def _ping(self, value: int, ranks: Any = None, force: bool = False) -> None:
        now = time.monotonic()
        if ranks is None:
            if not force and now - self.pinged < self.period:
                return
            self.pinged, ranks = now, self.waiting
        for r in ranks:
            buf = np.array([value], np.int64)
            self.pings.append((self.world.Isend(buf, dest=r, tag=TAG_END), buf))
        self.pings = [(q, b) for q, b in self.pings if not q.Test()]

    # -- failures ----------------------------------------------------------------------------------

    def failed(self, dead: list[int]) -> None:
        """Ranks found dead: their replicas broken, one warning line, their rows back to the pool."""
        new = sorted(set(dead) - self.dead)
        if not new:
            return
        self.dead.update(new)
        of = sorted({self.replica_of[r] for r in new})
        hit = [i for i in of if i not in self.broken]
        self.broken.update(hit)
        for i in hit:
            self.heard.pop(self.replicas[i][0], None)
        lost = self._lost()
        self._refill(lost)
        left = [i for i in range(len(self.replicas)) if i not in self.broken]
        line = (f"rlx-mpi: warning: rank{'s' if len(new) > 1 else ''} {', '.join(map(str, new))} died (replica"
                f"{'s' if len(of) > 1 else ''} {', '.join(map(str, of))}{'' if hit else ', stopped before'}); "
                f"{len(lost)} unfinished {self.noun}{'s' if len(lost) != 1 else ''} go"
                f"{'es' if len(lost) == 1 else ''} back to the pool; replica{'s' if len(left) != 1 else ''} "
                f"{', '.join(map(str, left)) or 'none'} left")
        self.warnings.append(line)
        self.lost_at.append({"ranks": new, "replicas": hit, "rows": len(lost), "noticed": time.time()})
        if left:  # (none left: the job starts again on the survivors, and that line says so: `cluster.restart`)
            sys.stderr.write(line + "\n")
            sys.stderr.flush()

    def _owner(self, p: int) -> int | None:
        for i, spans in self.claims.items():
            if any(lo <= p < hi for lo, hi in spans):
                return i
        return None

    def _lost(self) -> list[int]:
        """Rows (indices into ``items``) held by a broken replica or by a claim nobody reported yet,
        not written; and the positions past the filled ones such a replica held (`skip`)."""
        count = int(self.counter.read(_COUNT)[0])
        filled = self.n + len(self.returned)
        lost = []
        for p in range(count):
            owner = self._owner(p)
            if p in self.settled or (owner is not None and owner not in self.broken):
                continue
            self.settled.add(p)
            if p >= filled:
                self.skip.add(p)
                continue
            item = p if p < self.n else self.returned[p - self.n]
            if item >= 0 and not self.written(self.items[item]) and item not in lost:
                lost.append(item)
        return sorted(lost)

    def _refill(self, lost: list[int]) -> None:
        if not lost:
            return
        out, at = [], self.n + len(self.returned)
        todo = list(lost)
        while todo:
            if at in self.skip:
                out.append(-1)
            else:
                out.append(todo.pop(0))
            at += 1
        self.counter.append(len(self.returned), out)
        self.returned += out

    # -- rounds ------------------------------------------------------------------------------------

    def complete(self) -> bool:
        return all(self.written(r) for r in self.items)

    def _has_work(self, held: list[int] | None) -> bool:
        """Could a replica holding ``held`` find rows if woken?"""
        filled = self.n + len(self.returned)
        if int(self.counter.read(_COUNT)[0]) < filled:  # positions filled and not claimed yet
            return True
        if held is None:
            return False
        lo, hi = held
        return any((p < self.n or self.returned[p - self.n] >= 0) for p in range(lo, min(hi, filled)))

    def wait_round(self, own_held: list[int] | None, stopping: bool = False) -> int:
        """Rank 0 after its own round: MORE (its replica goes again) or END / SHRINK (every rank told).
        ``stopping`` (a stop signal): no more rounds; the end once every live rank is done."""
        own = self.replicas[0]
        nap = 1e-4
        while True:
            self.poll()
            live = [r for r in range(1, self.world.size) if r not in self.dead]
            if (stopping or self.complete()) and all(r in self.waiting for r in live):
                word = SHRINK if self.dead else END
                self._ping(word, live)
                wait(_AllOf([q for q, _ in self.pings]), self.timeout_s, self.ctx, lambda: "every rank to take the end",
                     "some rank")
                return word
            if len(self.broken) == len(self.replicas) and not self.complete():
                raise ulfm.Requeue(self.ctx.describe(), f"every replica lost a rank (ranks {', '.join(map(str, sorted(self.dead)))} "
                                   "died): no replica is left to finish the prompts", "the rows finished are in the output; "
                                   "rerun the same command to resume (exit code 75: requeue)")
            for i, rep in enumerate(self.replicas if not stopping else ()):
                if i in self.broken or not all(r in self.waiting for r in rep if r != 0):
                    continue
                if self._has_work(own_held if i == 0 else self.held.get(i)):
                    mates = [r for r in rep if r != 0]
                    self.waiting.difference_update(mates)
                    self._ping(MORE, mates)
                    if i == 0:
                        return MORE
                    self.heard[rep[0]] = time.monotonic()
            self._check_silence()
            time.sleep(nap)
            nap = min(nap * 2, 1e-3)

    def _check_silence(self) -> None:
        now = time.monotonic()
        for i, rep in enumerate(self.replicas):
            voice = rep[0]
            if i == 0 or i in self.broken or voice in self.waiting:
                continue
            if now - self.heard.get(voice, now) > self.silence_s:
                raise DeadlineExpired(self.ctx.describe(), f"heard nothing from rank {voice} (another replica) for "
                                      f"{self.silence_s:.1f} s", f"rank {voice} is stuck, see its output above; if it is "
                                      "only slow, raise [run] timeout_s")


def wait_for_round(world: Any, ctx: RankContext, timeout_s: float) -> int:
    """A rank other than 0 after its round: rank 0's word (MORE, END or SHRINK); keep-alives restart
    the deadline."""
    buf = np.zeros(1, np.int64)
    while True:
        req = world.Irecv(buf, source=0, tag=TAG_END)
        wait(req, timeout_s, ctx, lambda: "rank 0 to end the job (the other replicas to finish)", "rank 0")
        if buf[0] != ALIVE:
            return int(buf[0])


def refill_feed(cx: Any, items: list, chunk: int, on_took: Callable[[int, int], None]) -> tuple:
    """The counter (every rank) and the feed (stage 0, else None) of ``items`` in ``chunk`` claims."""
    counter = RefillCounter(cx.world, cx.ctx, cx.job.run.timeout_s, len(items), cap=4 * len(items) + 64)
    return counter, RefillFeed(counter, items, chunk, on_took) if cx.topology.stage == 0 else None


def run_rounds(cx: Any, one_round: Callable[[], bool], again: Callable[[], None], feed: RefillFeed | None,
               collector: RecoveringCollector | None, post: RowPost | None) -> tuple[bool, bool]:
    """A replica's rounds (``generate``): ``one_round()`` (its ring: True if a stop signal ended it);
    when it ends, report and wait for rank 0's word: ``again()`` and another round, or the end. A
    rank whose round fails because a rank of its replica died stops and says so (``lost``); the
    others go on. Returns (stopped by a signal, ranks were lost: the world must shrink)."""
    timeout = cx.job.run.timeout_s
    post = post or (RowPost(cx.world, cx.ctx, timeout) if not cx.is_root else None)
    out, stopped = False, False
    while True:
        try:
            stopped = one_round()
        except Exception as e:  # (an MPI error: ULFM's word that a rank this one waited for is dead)
            dead = lost_ranks(cx, e)
            if dead is None or 0 in dead:
                raise
            out = True
            if collector is not None:
                collector.failed(dead)
            else:
                say(post, "lost", dead=dead)
        if collector is not None:
            word = collector.wait_round(None if out or feed is None else feed.held,
                                        stopped or (cx.stop is not None and cx.stop.requested))
        else:
            if not out:
                say(post, "done", **({"held": feed.held} if feed is not None else {}))
            word = wait_for_round(cx.world, cx.ctx, timeout)
        if word != MORE:
            return stopped, word == SHRINK
        again()


def lost_ranks(cx: Any, exc: BaseException) -> list[int] | None:
    """The dead ranks when ``exc`` means this rank's replica lost one, else None (a fault to report).

    ULFM's own error (a peer this rank waited for died), or a deadline that expired while a rank of
    this replica is dead: with 3 or more stages, a stage not next to the dead rank waits for a live
    one that stopped, and learns of the death only at its deadline."""
    if ulfm.is_failure(exc):
        return ulfm.failed_ranks(cx.world)
    if isinstance(exc, DeadlineExpired):
        dead = ulfm.failed_ranks(cx.world)
        topo = cx.topology
        mine = {x for g in (topo.replicas[topo.replica] if topo.replicas else topo.grid) for x in g}
        return dead if mine & set(dead) else None
    return None


def say(post: RowPost, kind: str, **doc: Any) -> None:
    """A message to rank 0 that must have left before this rank waits (``done``, ``lost``)."""
    post._send({"kind": kind, **doc})
    wait(_AllOf([r for r, _ in post.sent]), post.timeout_s, post.ctx, lambda: "rank 0 to take the rows", "rank 0")
    post.sent.clear()
