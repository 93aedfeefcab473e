"""The decode ring over MPI: stage 0's pipe for `engine.ring.run_ring`, the relay of the other
stages, and what a stage computes of a step (`DecodeRing`).

Note: the decode ring. Stage 0 owns the plan of the run (the `scheduler.Scheduler`: which
prompt sits in which cache slot, what each group computes next). A step travels stage 0 -> 1 -> ... -> last as a small int64 header
(kind, group, rows: slot, length/position, prompt key, token index; with the prefix cache, its
block ops in a message after it: `scheduler`'s prefix-cache note) followed by the hidden
state; the last stage samples one token per row and sends the tokens back to stage 0 (with
tensor parallelism each TP rank talks to its counterpart, so every rank of the first stage
gets them). With ``groups`` >= stages, stage s works on group i while stage s-1 works on group
i+1. A row that ends (max_new_tokens, or any of the end-of-sequence ids) frees its slot, and the
next prompt takes it at the group's next turn (continuous batching). The last stage samples
only from finite logits: a NaN or Inf ends the job (exit 4) naming the prompts, which every
rank knows by their keys (the pending prompts are broadcast at start-up). With ``--logprobs
K`` it sends back `sampling.pack_sampled` rows (token, its log-prob, the top K ids and
log-probs, as int64) instead of the tokens alone, in the same message. Steps flow first-in first-out
through every stage, so stage 0 receives tokens in the order it issued the steps.

Stopping: stage 0 stops admitting prompts (all prompts done, or a stop signal agreed by the
first stage's TP ranks), drains the steps in flight, then sends a STOP header down the
pipeline; every rank leaves its loop after the same step. The hidden states move through the
`executor.Executor` (codec, buffer pool, timings), one step's actions at a time
(`schedule.decode_step_actions`; `schedule.decode_ring` writes the whole order out for
`schedule.simulate`); the headers, and the tokens whose receive stage 0 posts as soon as it
has sent a step, go over the same `transport.Link`. Every wait has the run's deadline and
names the rank waited for. A step's send is waited only before its group sends again (or at
the end), so a stage goes on to another group while a hidden state past MPI's eager limit
waits for its receiver (the decode-ring note in schedule.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Any, Callable

import numpy as np

from .. import tags
from ..comm import transport
from ..comm.executor import Executor, wire_codec
from ..comm.schedule import Action, decode_drain_actions, decode_step_actions
from ..engine.records import INDEX, KEY, LENGTH, RowState, RowTable, StepHeader
from ..engine.ring import run_ring
from ..engine.sampling import SamplingParams, logprobs, pack_sampled, unpack_sampled
from ..engine.scheduler import DECODE, MIXED, STOP, Scheduler, Seq, Step
from ..lifecycle.faults import check_output
from ..lifecycle.hooks import NO_HOOKS, TestHooks
from ..model.stage import run_step

__all__ = ["DecodeRing", "GenStats", "lockstep_fold", "lockstep_broken"]

_LOCKSTEP_MASK = (1 << 62) - 1  # a digest and its negation both fit an int64 (one MAX all-reduce gives both ends)


def lockstep_fold(digest: int, header: np.ndarray, tokens: np.ndarray) -> int:
    """The running digest of stage 0's steps: the previous digest, a step's header and its sampled
    tokens (62 bits of blake2b). Equal on the first stage's TP ranks while their schedulers agree.

    Note: TP lockstep. Each TP rank of stage 0 runs its own `Scheduler` and trusts the others to
    make the same steps from the same tokens. The check rides on the all-reduce the ranks already
    make every step to agree on a stop (``stop_now``): [stop, digest, -digest] under MAX gives
    the largest and the smallest digest at once, so a mismatch costs no extra message; the fold
    is one hash of ~100 bytes a step (``bench/bench_lockstep.py`` measures it against a step).
    """
    import hashlib

    h = hashlib.blake2b(digest.to_bytes(8, "little"), digest_size=8)
    h.update(np.ascontiguousarray(header).tobytes())
    h.update(np.ascontiguousarray(tokens).tobytes())
    return int.from_bytes(h.digest(), "little") & _LOCKSTEP_MASK

@dataclass
class GenStats:
    """The ring's running sums on one rank, copied into its `stats.StageTiming` at the end."""

    prefill_s: float = 0.0
    decode_s: float = 0.0
    sample_s: float = 0.0
    steps: int = 0
    tokens: int = 0  # rows x steps this rank computed


class DecodeRing:
    """One rank's part of the decode: stage 0 drives (`drive`), the other stages relay (`relay`)."""

    def __init__(self, cx: Any, params: SamplingParams, header_size: int, *, k_logprobs: int = 0,
                 names: dict[int, str] | None = None, per_key: dict[int, SamplingParams] | None = None,
                 with_logprobs: bool = False, hooks: TestHooks = NO_HOOKS, constraints: dict | None = None,
                 masks: Any = None, adapters: dict[int, int] | None = None):
        self.cx, self.params, self.header_size = cx, params, header_size
        own = per_key or {}  # prompt key -> a row's own sampling (batch requests' settings), every pending row
        grammar = constraints or {}  # prompt key -> its constraint (structured output); masks: the last stage's

        def make(key: int) -> RowState:
            c = grammar.get(key) if masks is not None else None
            return RowState(key, own.get(key), None if c is None else masks.g.matcher(c))

        # the live rows' state, born and freed by the headers' events (`records.RowTable`)
        self.rows = RowTable(make, masks)
        self.adapters = adapters or {}  # prompt key -> its LoRA adapter's index in the job (none: the base model)
        self.k = k_logprobs  # top alternatives per token
        # False: tokens alone travel back; True: `pack_sampled` rows of 2 + 2K (K may be 0)
        self.lp = with_logprobs or k_logprobs > 0
        self.names = names or {}  # prompt key -> how an error names the prompt
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
        self.lockstep = 0  # stage 0: `lockstep_fold` of every completed step
        self.hooks = hooks
        self._diverge = hooks.diverge_step(cx.world.rank)

    @property
    def n_stages(self) -> int:
        return self.topo.n_stages

    def _compute(self, header: np.ndarray, x: np.ndarray, ops: np.ndarray | None = None) -> np.ndarray:
        """This stage's part of a step; on the last stage the sampled tokens (n,) int64. ``ops``: the
        step's prefix-cache block ops (attaches before it, saves after: `kv_cache.copy_blocks`)."""
        h = StepHeader(header)
        self.rows.on_header(h)  # (every stage: the rows admitted in this step, those ended before it)
        kind, n = h.kind, h.n
        t0 = time.perf_counter()
        batch = h.batch(ops)  # (the record: `model.stage.StepBatch`)
        if self.adapters:  # each row's adapter, a column of the step (every stage knows every row's)
            batch = replace(batch, adapters=np.array([self.adapters.get(k, -1) for k in batch.keys.tolist()], np.int64))
        out = run_step(self.stage, x, batch)
        t1 = time.perf_counter()
        st = self.stats
        st.steps += 1
        st.tokens += n
        if kind == DECODE:
            st.decode_s += t1 - t0
        else:  # (a MIXED step is counted as prefill: its chunk is most of its work)
            st.prefill_s += t1 - t0
        if not self.stage.last:
            self._check_hidden(out, header)
            return out
        self._check_logits(out, h.rows)
        tokens = self.rows.sample(out, h, self.params)  # (each row's processor, then its own draw)
        if self.lp:
            tokens = pack_sampled(tokens, *logprobs(out, tokens, self.k))
        st.sample_s += time.perf_counter() - t1
        return tokens

    def _row_name(self, row: np.ndarray) -> str:
        key = int(row[KEY])
        return f"new token {int(row[INDEX])} of prompt {self.names.get(key, f'key {key}')}"

    def _check_logits(self, logits: np.ndarray, rows: np.ndarray) -> None:
        """Nothing is sampled from a non-finite logit: the job ends (exit 4) naming the prompts.

        Every TP rank of the last stage holds the same logits; the first reports (the others'
        tokens go to ranks that write nothing, and the abort ends them).
        """
        if self.topo.tp_rank == 0:
            check_output(logits, self.topo.stage, self.ctx,
                         lambda: ((self._row_name(r), logits[b]) for b, r in enumerate(rows)), "logits")

    def _check_hidden(self, out: np.ndarray, header: np.ndarray) -> None:
        """A stage before the last checks its hidden state before sending it (`faults.check_output`):
        each row's real tokens, by the step's layout (the scheduler's header)."""
        if self.topo.tp_rank != 0:
            return
        h = StepHeader(header)
        kind, n, T, rows = h.kind, h.n, h.T, h.rows

        def parts():
            if kind == DECODE:  # (n, 1, C)
                return ((self._row_name(r), out[b]) for b, r in enumerate(rows))
            start = h.start
            if kind == MIXED:  # (1, nd + rows x T, C): the decode rows' tokens, then each chunk
                nd = h.n_decode
                views = [out[0, b] for b in range(nd)]
                views += [out[0, nd + j * T:nd + j * T + min(T, int(rows[nd + j, LENGTH]) - start)] for j in range(n - nd)]
                return zip((self._row_name(r) for r in rows), views)
            return ((self._row_name(r), out[b, :min(T, int(r[LENGTH]) - start)]) for b, r in enumerate(rows))

        check_output(out, self.topo.stage, self.ctx, parts, "hidden state")

    def _recv_spec(self, header: np.ndarray) -> Callable[[Action], tuple]:
        h = StepHeader(header)
        kind, n, T = h.kind, h.n, h.T
        if kind == MIXED:  # the token rows back to back: decode rows, then each row's chunk
            nd = h.n_decode
            return lambda a: ((1, nd + (n - nd) * T, self.hidden), np.float32)
        return lambda a: ((n, T, self.hidden), np.float32)

    def _step_actions(self, g: int) -> list[Action]:
        """Group g's step on this stage; its previous send, if still in flight, is waited before it
        sends again (the schedule note on the decode ring)."""
        return decode_step_actions(self.topo.stage, self.n_stages, g, self.ex.open_sends.get(g))

    def _drain(self) -> None:
        """Wait on the hidden-state (or token) sends still in flight, before the STOP header."""
        self.ex.run(decode_drain_actions(self.topo.stage, self.n_stages, self.ex.open_sends), lambda m, x: None,
                    lambda a: None, tag_base=tags.GROUP_HIDDEN[0], keep_sends=True)

    # -- stage 0 --------------------------------------------------------------------------------

    def drive(self, sched: Scheduler, on_done: Callable[[list[Seq]], None], stop_now: Callable[[], bool]) -> bool:
        """Stage 0: the pure ring loop (`engine.ring.run_ring`) with this rank as its pipe, until
        the prompts are done or a stop is requested. Returns True if it stopped early."""
        stopped = run_ring(sched, self, on_done, stop_now)
        self.ctx.microbatch = None
        return stopped

    # the pipe of `run_ring` (`engine.ring.Pipe`): stage 0's part of a step, and its moves over MPI

    def issue(self, step: Step) -> None:
        g = step.group
        self.ctx.microbatch = g
        if self.hooks.step_delay_s:
            time.sleep(self.hooks.step_delay_s)

        def compute(_m, _x):
            out = self._compute(step.header, step.ids, step.ops)
            if self.n_stages == 1:
                step.tokens = out
                return None
            self.link.send(step.header, self.topo.next, tags.STEP_HEADER, f"the step header of group {g}")
            if step.ops is not None:
                self.link.send(step.ops, self.topo.next, tags.BLOCK_OPS, f"the block ops of group {g}")
            return out

        self.ex.run(self._step_actions(g), compute, lambda a: None, tag_base=tags.GROUP_HIDDEN[0], keep_sends=True)
        if self.n_stages > 1:  # post the receive of its tokens now: the last stage's send
            # then never depends on MPI buffering it (no cycle in the ring under rendezvous)
            shape = (len(step.rows), 2 + 2 * self.k) if self.lp else (len(step.rows),)
            step.pending = self.ring.irecv(np.empty(shape, np.int64), self.topo.grid[-1][self.topo.tp_rank],
                                           tags.in_range(tags.GROUP_HIDDEN, g, "a group's tokens"),
                                           f"the sampled tokens of group {g}")  # the hidden tag, upstream

    def tokens(self, step: Step) -> tuple[np.ndarray, tuple | None]:
        if step.tokens is None:  # the ring: tokens from the last stage
            self.ctx.microbatch = step.group
            step.pending.wait()
            step.tokens = step.pending.buf
        if self.topo.tp > 1:  # the TP lockstep digest (one scheduler alone has nothing to agree with)
            if self._diverge is not None and self.stats.steps >= self._diverge:  # a test's forced mismatch
                step.tokens, self._diverge = step.tokens.copy(), None
                step.tokens.flat[0] ^= 1
            self.lockstep = lockstep_fold(self.lockstep, step.header, step.tokens)
        if self.lp:
            tokens, *lps = unpack_sampled(step.tokens)
            return tokens, tuple(lps)
        return step.tokens, None

    def close(self, stop_header: np.ndarray) -> None:
        self.rows.on_header(StepHeader(stop_header))  # (the rows ended since the last step: no state is left)
        if self.n_stages > 1:
            self._drain()
            self.link.send(stop_header, self.topo.next, tags.STEP_HEADER, "the stop header")

    # -- stages 1.. -----------------------------------------------------------------------------

    def relay(self) -> None:
        """Stages after the first: take a header, compute the step, pass it on, until STOP."""
        header = np.zeros(self.header_size, np.int64)
        last = self.stage.last
        while True:
            self.ctx.microbatch = None
            self.link.recv(header, self.topo.prev, tags.STEP_HEADER, "the next step header")
            h = StepHeader(header)
            kind, g = h.kind, h.group
            if kind == STOP:
                self.rows.on_header(h)
                self._drain()
                if not last:
                    self.link.send(header, self.topo.next, tags.STEP_HEADER, "the stop header")
                return
            self.ctx.microbatch = g
            hdr = header.copy()
            ops = None
            if h.n_ops:  # the prefix cache's copies, in a message of their own after the header
                ops = self.link.recv(np.empty((h.n_ops, 4), np.int64), self.topo.prev, tags.BLOCK_OPS,
                                     f"the block ops of group {g}")

            def compute(_m, x, hdr=hdr, g=g, ops=ops):
                out = self._compute(hdr, x, ops)
                if not last:
                    self.link.send(hdr, self.topo.next, tags.STEP_HEADER, f"the step header of group {g}")
                    if ops is not None:
                        self.link.send(ops, self.topo.next, tags.BLOCK_OPS, f"the block ops of group {g}")
                return out

            # the last stage's send is the int64 tokens back to stage 0: the executor sends
            # non-float32 payloads raw (no codec)
            self.ex.run(self._step_actions(g), compute, self._recv_spec(hdr), tag_base=tags.GROUP_HIDDEN[0], keep_sends=True)


def lockstep_broken(cx: Any, ring: DecodeRing, when: str) -> None:
    """The first stage's TP ranks made different steps: name which rank has which digest and end
    the job (exit 4) from the stage's first TP rank (the others are ended by its abort)."""
    from ..errors import RankFault
    from ..lifecycle.faults import wait

    topo = cx.topology
    mine = np.array([cx.world.rank, ring.lockstep], np.int64)
    every = np.empty((topo.tp, 2), np.int64)
    wait(topo.tp_comm.Iallgather(mine, every), cx.job.run.timeout_s, cx.ctx,
         lambda: "the step digests of the first stage's tensor-parallel ranks", "a tensor-parallel rank")
    if topo.tp_rank != 0:
        return
    groups: dict[int, list[int]] = {}
    for r, d in every.tolist():
        groups.setdefault(d, []).append(r)
    said = "; ".join(f"world rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))} {d:016x}"
                     for d, rs in groups.items())
    raise RankFault(cx.ctx.describe(), f"the tensor-parallel ranks of stage 0 left lockstep {when} (their digests "
                    f"of the steps and sampled tokens differ: {said})", "their schedulers made different steps: a "
                    "broken node or a bug (please report it); rerun the same command to resume from the rows written")

