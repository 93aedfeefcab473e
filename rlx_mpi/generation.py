"""``rlx-mpi generate``: a prompt file in, a completions file out, across the pipeline.

Note: the decode ring. Stage 0 owns the plan of the run (the `Scheduler`: which prompt sits
in which cache slot, what each group computes next). Prompts are cut into ``groups`` groups
of ``batch`` slots; a group's step is either a *prefill* of prompts that just took a slot
(positions 0..len-1, right-padded) or a *decode* of all its rows (one token each, at each
row's own position). A step travels stage 0 -> 1 -> ... -> last as a small int64 header
(kind, group, rows: slot, length/position, prompt key, token index) followed by the hidden
state; the last stage samples one token per row and sends the tokens back to stage 0 (with
tensor parallelism each TP rank talks to its counterpart, so every rank of the first stage
gets them). With ``groups`` >= stages, stage s works on group i while stage s-1 works on group
i+1. A row that ends (max_new_tokens, or the end-of-sequence id) frees its slot, and the next
prompt takes it at the group's next turn (continuous batching). Steps flow first-in first-out
through every stage, so stage 0 receives tokens in the order it issued the steps.

Stopping: stage 0 stops admitting prompts (all prompts done, or a stop signal agreed by the
first stage's TP ranks), drains the steps in flight, then sends a STOP header down the
pipeline; every rank leaves its loop after the same step. The hidden states move through the
`executor.Executor` (codec, buffer pool, timings), one step's actions at a time
(`schedule.decode_step_actions`; `schedule.decode_ring` writes the whole order out for
`schedule.simulate`); the headers, and the tokens whose receive stage 0 posts as soon as it
has sent a step, go over the same `transport.Link`. Every wait has the run's deadline and
names the rank waited for. Each step's send is waited before the stage takes the next step,
so hidden states past MPI's eager limit hand over synchronously (see the ring test).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from . import transport
from .executor import Executor, wire_codec
from .kv_cache import KvSpec
from .sampling import SamplingParams, prompt_key, sample
from .schedule import Action, decode_step_actions

__all__ = ["PREFILL", "DECODE", "STOP", "Seq", "Step", "Scheduler", "make_header", "read_header", "DecodeRing",
           "GenStats", "GenerateOptions", "GenerateResult", "generate", "kv_cost"]

log = logging.getLogger("rlx_mpi")

PREFILL, DECODE, STOP = 1, 2, 3
_HEAD, _ROW = 4, 4  # header: kind, group, rows, T; then per row: slot, length|position, key, token index
_TAG_HEADER, _TAG_HIDDEN = 7, 1000  # tokens return on the hidden tag, in the other direction


# -- the plan of the run (stage 0, pure) ---------------------------------------------------------


@dataclass
class Seq:
    """One prompt while it holds a cache slot."""

    index: int  # position in the prompt file
    id: str
    prompt: tuple[int, ...]
    slot: int
    key: int  # prompt_key(id): seeds its draws
    new: list[int] = field(default_factory=list)
    prefilled: bool = False
    start: float = 0.0  # perf_counter when it took the slot
    finish_reason: str | None = None

    @property
    def length(self) -> int:
        return len(self.prompt) + len(self.new)


@dataclass
class Step:
    """What one group computes next, as stage 0 issues it."""

    kind: int  # PREFILL | DECODE
    group: int
    rows: list[Seq]
    ids: np.ndarray  # (n, T) int64: stage 0's input
    header: np.ndarray  # int64 (_HEAD + _ROW * batch,)
    tokens: np.ndarray | None = None  # (n,) once sampled
    pending: Any = None  # the posted receive of the tokens (pipelines of 2+ stages)


def make_header(kind: int, group: int, T: int, slots, lengths, keys, index, size: int) -> np.ndarray:
    h = np.zeros(size, np.int64)
    n = len(slots)
    h[:_HEAD] = (kind, group, n, T)
    rows = h[_HEAD:_HEAD + _ROW * n].reshape(n, _ROW)
    rows[:, 0], rows[:, 1], rows[:, 2], rows[:, 3] = slots, lengths, keys, index
    return h


def read_header(h: np.ndarray) -> tuple[int, int, int, int, np.ndarray]:
    """(kind, group, n, T, rows (n, 4))."""
    kind, group, n, T = (int(v) for v in h[:_HEAD])
    return kind, group, n, T, h[_HEAD:_HEAD + _ROW * n].reshape(n, _ROW)


class Scheduler:
    """Which prompt takes which slot, and what each group computes next (continuous batching).

    ``prompts``: (index, id, tokens) in file order, not yet done. With ``recompute`` (kv_cache
    "none" on some stage) every step is a prefill of each row's whole sequence so far.
    """

    def __init__(self, prompts: list[tuple[int, str, tuple[int, ...]]], groups: int, batch: int,
                 max_new_tokens: int, eos_id: int | None, recompute: bool):
        self.queue = deque(prompts)
        self.groups, self.batch = groups, batch
        self.max_new_tokens, self.eos_id, self.recompute = max_new_tokens, eos_id, recompute
        self.rows: list[list[Seq | None]] = [[None] * batch for _ in range(groups)]
        self.stopping = False
        self.header_size = _HEAD + _ROW * batch

    def next_step(self, g: int) -> Step | None:
        """Group ``g``'s next step (admitting queued prompts into free slots), or None when idle."""
        if self.stopping:  # finish the steps in flight, start none
            return None
        rows = self.rows[g]
        for i, r in enumerate(rows):
            if r is None and self.queue:
                index, pid, tokens = self.queue.popleft()
                rows[i] = Seq(index, pid, tuple(tokens), g * self.batch + i, prompt_key(pid),
                              start=time.perf_counter())
        live = [r for r in rows if r is not None]
        fresh = [r for r in live if not r.prefilled]
        if self.recompute and live:
            return self._prefill(g, live)
        if fresh:  # new prompts first; the group's other rows wait one turn
            return self._prefill(g, fresh)
        if not live:
            return None
        ids = np.array([[r.new[-1]] for r in live], np.int64)  # (n, 1): the newest token
        header = make_header(DECODE, g, 1, [r.slot for r in live], [r.length - 1 for r in live],
                             [r.key for r in live], [len(r.new) for r in live], self.header_size)
        return Step(DECODE, g, live, ids, header)

    def _prefill(self, g: int, rows: list[Seq]) -> Step:
        seqs = [r.prompt + tuple(r.new) for r in rows]
        T = max(map(len, seqs))
        ids = np.zeros((len(rows), T), np.int64)  # right-padded; padding is never attended to
        for b, s in enumerate(seqs):
            ids[b, :len(s)] = s
        header = make_header(PREFILL, g, T, [r.slot for r in rows], [len(s) for s in seqs],
                             [r.key for r in rows], [len(r.new) for r in rows], self.header_size)
        return Step(PREFILL, g, rows, ids, header)

    def complete(self, step: Step, tokens: np.ndarray) -> list[Seq]:
        """Append each row's new token; return the rows that finished (their slots are free)."""
        done = []
        for r, t in zip(step.rows, tokens.tolist()):
            r.new.append(int(t))
            r.prefilled = True
            if self.eos_id is not None and t == self.eos_id:
                r.finish_reason = "stop"
            elif len(r.new) >= self.max_new_tokens:
                r.finish_reason = "length"
            if r.finish_reason:
                self.rows[step.group][r.slot - step.group * self.batch] = None
                done.append(r)
        return done

    @property
    def idle(self) -> bool:
        return not self.queue and all(r is None for g in self.rows for r in g)


# -- running it on the ranks ---------------------------------------------------------------------


@dataclass
class GenStats:
    """What one rank measured during generation."""

    prefill_s: float = 0.0
    decode_s: float = 0.0
    sample_s: float = 0.0
    steps: int = 0
    tokens: int = 0  # rows x steps this rank computed


class DecodeRing:
    """One rank's part of the decode: stage 0 drives (`drive`), the other stages relay (`relay`)."""

    def __init__(self, cx: Any, params: SamplingParams, header_size: int):
        self.cx, self.params, self.header_size = cx, params, header_size
        topo, job = cx.topology, cx.job
        self.topo, self.stage, self.ctx = topo, cx.stage, cx.ctx
        timeout = job.run.timeout_s
        grace = max(1.0, 0.1 * timeout)
        # Staggered deadlines as in the forward: the rank next to a stuck one expires first. A
        # relay waits for the next header while the whole ring turns, so it gets the ring's time.
        self.link = transport.Link(cx.world, cx.ctx, timeout + topo.stage * grace,
                                   send_timeout_s=timeout + (topo.n_stages - 1 - topo.stage) * grace)
        self.ring = transport.Link(cx.world, cx.ctx, timeout + topo.n_stages * grace)
        codec = wire_codec(job)

        def rank_of(s: int) -> int:  # the matching TP rank of stage s
            return topo.grid[s][topo.tp_rank]

        what = lambda g: f"the hidden state of group {g}"  # noqa: E731
        self.ex = Executor(self.link, cx.ctx, rank_of=rank_of, codec=codec, what=what, record=False)
        self.hidden = cx.dims.hidden_size
        self.stats = GenStats()

    @property
    def n_stages(self) -> int:
        return self.topo.n_stages

    def _compute(self, header: np.ndarray, x: np.ndarray) -> np.ndarray:
        """This stage's part of a step; on the last stage the sampled tokens (n,) int64."""
        kind, _, n, T, rows = read_header(header)
        slots, lengths = rows[:, 0].copy(), rows[:, 1].copy()
        t0 = time.perf_counter()
        out = self.stage.prefill(x, slots, lengths) if kind == PREFILL else self.stage.decode(x, slots, lengths)
        t1 = time.perf_counter()
        st = self.stats
        st.steps += 1
        st.tokens += n
        if kind == PREFILL:
            st.prefill_s += t1 - t0
        else:
            st.decode_s += t1 - t0
        if not self.stage.last:
            return out
        tokens = sample(out, rows[:, 2], rows[:, 3], self.params)
        st.sample_s += time.perf_counter() - t1
        return tokens

    def _recv_spec(self, header: np.ndarray) -> Callable[[Action], tuple]:
        _, _, n, T, _ = read_header(header)
        return lambda a: ((n, T, self.hidden), np.float32)

    # -- stage 0 --------------------------------------------------------------------------------

    def drive(self, sched: Scheduler, on_done: Callable[[list[Seq]], None], stop_now: Callable[[], bool]) -> bool:
        """Stage 0: issue steps for every group, complete them as tokens return, until the
        prompts are done or a stop is requested. Returns True if it stopped early."""
        in_flight: deque[Step] = deque()
        stopped = False

        def issue(g: int) -> None:
            step = sched.next_step(g)
            if step is None:
                return
            self.ctx.microbatch = g

            def compute(_m, _x):
                out = self._compute(step.header, step.ids)
                if self.n_stages == 1:
                    step.tokens = out
                    return None
                self.link.send(step.header, self.topo.next, _TAG_HEADER, f"the step header of group {g}")
                return out

            self.ex.run(decode_step_actions(0, self.n_stages, g), compute, lambda a: None, tag_base=_TAG_HIDDEN)
            if self.n_stages > 1:  # post the receive of its tokens now: the last stage's send
                # then never depends on MPI buffering it (no cycle in the ring under rendezvous)
                step.pending = self.ring.irecv(np.empty(len(step.rows), np.int64), self.topo.grid[-1][self.topo.tp_rank],
                                               _TAG_HIDDEN + g, f"the sampled tokens of group {g}")
            in_flight.append(step)

        for g in range(sched.groups):
            issue(g)
        while in_flight:
            step = in_flight.popleft()
            if step.tokens is None:  # the ring: tokens from the last stage
                self.ctx.microbatch = step.group
                step.pending.wait()
                step.tokens = step.pending.buf
            on_done(sched.complete(step, step.tokens))
            if not sched.stopping and stop_now():
                sched.stopping = stopped = True
            issue(step.group)
        self.ctx.microbatch = None
        if self.n_stages > 1:
            stop = make_header(STOP, 0, 0, [], [], [], [], self.header_size)
            self.link.send(stop, self.topo.next, _TAG_HEADER, "the stop header")
        return stopped

    # -- stages 1.. -----------------------------------------------------------------------------

    def relay(self) -> None:
        """Stages after the first: take a header, compute the step, pass it on, until STOP."""
        header = np.zeros(self.header_size, np.int64)
        last = self.stage.last
        while True:
            self.ctx.microbatch = None
            self.link.recv(header, self.topo.prev, _TAG_HEADER, "the next step header")
            kind, g, n, T, _ = read_header(header)
            if kind == STOP:
                if not last:
                    self.link.send(header, self.topo.next, _TAG_HEADER, "the stop header")
                return
            self.ctx.microbatch = g
            hdr = header.copy()

            def compute(_m, x, hdr=hdr, g=g):
                out = self._compute(hdr, x)
                if not last:
                    self.link.send(hdr, self.topo.next, _TAG_HEADER, f"the step header of group {g}")
                return out

            # the last stage's send is the int64 tokens back to stage 0: the executor sends
            # non-float32 payloads raw (no codec)
            self.ex.run(decode_step_actions(self.topo.stage, self.n_stages, g), compute, self._recv_spec(hdr),
                        tag_base=_TAG_HIDDEN)


# -- the batch job -------------------------------------------------------------------------------


@dataclass(frozen=True)
class GenerateOptions:
    """A resolved ``generate`` request: the job's [generate] section under the command-line flags."""

    prompts: Any  # Path
    out: Any  # Path
    max_new_tokens: int
    sampling: SamplingParams
    eos_id: int | None
    batch: int
    groups: int  # 0: one per stage
    sync_s: float
    progress_s: float = 10.0


@dataclass
class GenerateResult:
    """What rank 0 reports at the end."""

    rows: list[dict]  # per-rank stats
    total: int
    done_before: int
    done_now: int
    new_tokens: int
    wall_s: float
    stopped_by: str | None  # a signal name when stopped early

    def to_dict(self) -> dict:
        from dataclasses import asdict

        return asdict(self)

    def table(self) -> str:
        head = ("stage", "rank", "tp", "layers", "kv", "prefill_ms", "decode_ms", "sample_ms", "recv_wait_ms",
                "send_ms", "kv_MB", "weights_MB", "peak_rss_MB")
        lines = [head]
        for r in sorted(self.rows, key=lambda r: (r["stage"], r["tp_rank"])):
            tp = ",".join(map(str, r["tp_ranks"])) if len(r["tp_ranks"]) > 1 else "-"
            lines.append((str(r["stage"]), str(r["rank"]), tp, f"{r['layers'][0]}:{r['layers'][1]}", r["kv"],
                          f"{r['prefill_s'] * 1e3:.1f}", f"{r['decode_s'] * 1e3:.1f}", f"{r['sample_s'] * 1e3:.1f}",
                          f"{r['recv_wait_s'] * 1e3:.1f}", f"{r['send_wait_s'] * 1e3:.1f}",
                          f"{r['kv_bytes'] / 1e6:.2f}", f"{r['weight_bytes'] / 1e6:.2f}",
                          f"{r['peak_rss_bytes'] / 1e6:.2f}"))
        widths = [max(len(x[i]) for x in lines) for i in range(len(head))]
        out = ["  ".join(c.rjust(w) if i != 4 else c.ljust(w) for i, (c, w) in enumerate(zip(x, widths)))
               for x in lines]
        rate = self.new_tokens / self.wall_s if self.wall_s > 0 else float("nan")
        out.append(f"{self.done_now} prompts completed in {self.wall_s:.2f} s ({self.done_before} done before, "
                   f"{self.total} in total): {self.new_tokens} new tokens, {rate:.1f} tokens/s")
        return "\n".join(out)


def kv_cost(cost: Any, specs: list[KvSpec], max_seq: int) -> Any:
    """The family's `ModelCost` for (slots, max_seq) with its KV term cut to what the policies keep.

    The family prices K and V of every layer for batch x seq tokens; ``none`` keeps no
    positions and ``window:W`` keeps W, so the planner (and the fit check) see the real cache.
    The largest policy of any rank counts, as one layer's bytes are the same on every stage.
    """
    import dataclasses

    kept = max(s.cache_len(max_seq) for s in specs)
    return dataclasses.replace(cost, kv_bytes_per_layer=cost.kv_bytes_per_layer * kept // max_seq)


def generate(cx: Any, opts: GenerateOptions, *, argv_inputs: tuple = ()) -> GenerateResult | None:
    """The whole ``generate`` job on every rank of a `Cluster` (start-up included).

    Rank 0 reads the prompts and opens the journal (an agreed step), every rank learns the
    pending prompts, plans with their KV bytes, builds, and runs the decode ring. Returns the
    `GenerateResult` on rank 0 (None elsewhere); ``result.stopped_by`` is set when a stop
    signal ended it early (the caller exits with the requeue code).
    """
    import sys

    from .faults import report_and_abort

    state = _start(cx, opts, argv_inputs)
    if state is None:
        return None
    try:
        return _run(cx, opts, *state)
    except Exception:
        report_and_abort(cx.world, cx.ctx, sys.exc_info())
        raise


def _start(cx: Any, opts: GenerateOptions, inputs: tuple):
    """Agreed start-up: prompts + journal on rank 0, then probe, plan (with KV bytes), build."""
    from .journal import Journal
    from .prompts import load_tokenizer, read_prompts

    cx.prepare()
    dims, job = cx.dims, cx.job
    holder: dict = {}

    def load() -> dict | None:
        if not cx.is_root:
            return None
        tokenizer = load_tokenizer(job.model.checkpoint)
        prompts = read_prompts(opts.prompts, vocab_size=dims.vocab_size, max_positions=dims.max_positions,
                               max_new_tokens=opts.max_new_tokens, tokenizer=tokenizer)
        journal = Journal(opts.out, prompts, inputs=(opts.prompts, job.path, job.model.checkpoint, *inputs),
                          sync_s=opts.sync_s)
        holder.update(journal=journal, tokenizer=tokenizer, prompts=prompts)
        eos = opts.eos_id if opts.eos_id is not None else (tokenizer.eos_token_id if tokenizer else None)
        pending = [[p.index, p.id, list(p.tokens)] for p in journal.pending]
        longest = max((len(p[2]) for p in pending), default=1)
        return {"pending": pending, "total": len(prompts), "eos": eos, "max_seq": longest + opts.max_new_tokens}

    doc = cx._agree(load)
    doc = transport.bcast_json(cx.world, doc, 0, job.run.startup_timeout_s, cx.ctx, "the prompts")
    if not doc["pending"]:
        if cx.is_root:
            holder["journal"].close()
            log.info("all %d prompts of %s are already in %s", doc["total"], opts.prompts, opts.out)
            return None
        return None
    tp = job.placement.tp
    n_stages = cx.world.size // tp
    groups = opts.groups or n_stages
    slots = groups * opts.batch
    cx.batch, cx.seq = slots, doc["max_seq"]
    cx.probe()
    # The planner sees the KV cache: the family's cost counts K and V of every layer for
    # batch x seq tokens; scale that to what the policy keeps (none: 0, window: W positions).
    cx.plan(kv_cost(cx.cost(), [job.kv_for(r) for r in range(cx.world.size)], cx.seq))

    def same_kv() -> None:
        from .errors import ConfigError

        for a in cx.plan_:
            specs = {str(job.kv_for(r)) for r in a.ranks}
            if len(specs) > 1:
                raise ConfigError(f"{job.path}: [[rank]] kv_cache", f"the ranks {list(a.ranks)} of stage {a.stage} "
                                  f"have different kv_cache settings {sorted(specs)}",
                                  "give every rank of a tensor-parallel stage the same kv_cache")

    cx._agree(same_kv)
    cx.build()
    kv = job.kv_for(cx.world.rank)
    def reset() -> int:
        try:
            return cx.stage.reset(slots, cx.seq, kv)
        except NotImplementedError as e:
            from .errors import ConfigError

            raise ConfigError(f"{job.model.checkpoint}: family {cx.family.name!r}", str(e),
                              "generate needs a family whose Stage implements reset, prefill and decode") from None

    kv_bytes = cx._agree(reset)
    recompute = any(job.kv_for(r).recompute for r in range(cx.world.size))
    return doc, holder, groups, kv, kv_bytes, recompute


def _run(cx: Any, opts: GenerateOptions, doc: dict, holder: dict, groups: int, kv: KvSpec, kv_bytes: int,
         recompute: bool) -> GenerateResult | None:
    from .cluster import peak_rss_bytes
    from .faults import wait
    from .progress import Progress
    from .signals import StopRequest

    topo, job = cx.topology, cx.job
    timeout = job.run.timeout_s
    sched = Scheduler([(i, pid, tuple(t)) for i, pid, t in doc["pending"]], groups, opts.batch,
                      opts.max_new_tokens, doc["eos"], recompute)
    ring = DecodeRing(cx, opts.sampling, sched.header_size)
    stop = StopRequest().install()
    journal, tokenizer = holder.get("journal"), holder.get("tokenizer")
    texts = {p.index: p.text for p in holder.get("prompts", [])}
    done_before = doc["total"] - len(doc["pending"])
    progress = Progress(doc["total"], done_before, interval_s=opts.progress_s) if cx.is_root else None
    counts = {"done": 0, "tokens": 0}

    def on_done(rows: list[Seq]) -> None:
        now = time.perf_counter()
        new = sum(len(r.new) for r in rows)
        for r in rows:
            counts["done"] += 1
            counts["tokens"] += len(r.new)
            if journal is None:
                continue
            row = {"id": r.id, "tokens": r.new}
            if tokenizer is not None and texts.get(r.index) is not None:
                row["text"] = tokenizer.decode(r.new)
            row.update(finish_reason=r.finish_reason, prompt_tokens=len(r.prompt), new_tokens=len(r.new),
                       ms=round((now - r.start) * 1e3, 1))
            journal.complete(r.index, row)
        if journal is not None:
            journal.flush()
            progress.update(done_before + counts["done"], new)

    def stop_now() -> bool:
        flag = np.array([1 if stop.requested else 0], np.int32)
        if topo.tp > 1:  # the first stage's ranks must stop after the same step
            from .collectives import ReduceKind, all_reduce

            all_reduce(flag, ReduceKind.MAX, comm=topo.tp_comm, timeout_s=timeout, ctx=cx.ctx)
        return bool(flag[0])

    wait(cx.world.Ibarrier(), timeout, cx.ctx, lambda: "every rank to start generating", "some rank")
    t0 = time.perf_counter()
    try:
        stopped = ring.drive(sched, on_done, stop_now) if topo.stage == 0 else ring.relay()
    finally:
        stop.restore()
    wall = time.perf_counter() - t0
    if journal is not None:
        journal.close()
        progress.finish()
    a = cx.assignment
    st, ex = ring.stats, ring.ex.stats
    mine = {"rank": cx.world.rank, "stage": a.stage, "tp_rank": topo.tp_rank, "tp_ranks": list(a.ranks),
            "layers": [a.layers.start, a.layers.stop], "kv": str(kv), "prefill_s": st.prefill_s,
            "decode_s": st.decode_s, "sample_s": st.sample_s,
            "recv_wait_s": ex.recv_wait_s + ring.ring.recv_wait_s,
            "send_wait_s": ex.send_wait_s, "kv_bytes": kv_bytes, "weight_bytes": cx.stage.weight_bytes,
            "peak_rss_bytes": peak_rss_bytes(), "stopped": bool(stopped) if topo.stage == 0 else False,
            "signal": stop.signal_name}
    grace = max(1.0, 0.1 * timeout)
    rows = transport.gather_json(cx.world, mine, 0, timeout + (topo.n_stages + 1) * grace, cx.ctx,
                                 "the generation stats")
    stopped_by = None
    if rows is not None and rows[0]["stopped"]:
        stopped_by = next((r["signal"] for r in rows if r["signal"]), None) or "a stop request"
    stopped_by = transport.bcast_json(cx.world, stopped_by, 0, timeout, cx.ctx, "the end of the run")
    return GenerateResult(rows=rows or [], total=doc["total"], done_before=done_before, done_now=counts["done"],
                          new_tokens=counts["tokens"], wall_s=wall, stopped_by=stopped_by)
