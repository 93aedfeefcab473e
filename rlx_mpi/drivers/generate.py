"""``rlx-mpi generate``: a prompt file in, a completions file out, across the pipeline.

`GenerateDriver` is the command on the shared start-up (`Cluster.start`): it resolves the
options (the job's ``[generate]`` under the flags), reads the prompts and opens the journal on
rank 0 (which fixes the cache's slots and longest sequence), plans with the KV cache priced
(`placement.kv_cost`), resets every stage's cache after the build, and runs the ring.

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

import logging
import time
from collections import deque
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable

import numpy as np

from . import JournalDriver, prefix_cache_on
from .. import rules, tags
from ..comm import transport
from ..errors import ConfigError
from ..comm.executor import Executor, wire_codec
from ..lifecycle.faults import check_output
from ..lifecycle.hooks import NO_HOOKS, TestHooks
from ..io.batch_io import format_result, is_batch, stop_text
from ..model.stage import caps_of
from ..engine.records import INDEX, KEY, LENGTH, Request, RowState, RowTable, StepHeader
from ..engine.ring import run_ring
from ..engine.sampling import SamplingParams, logprob_entries, logprobs, pack_sampled, sample_id, unpack_sampled
from ..comm.schedule import Action, decode_drain_actions, decode_step_actions
from ..engine.scheduler import DECODE, MIXED, STOP, Scheduler, Seq, Step, split_batch
from ..io.stats import GenerateResult, StageTiming, peak_rss_bytes

__all__ = ["GenerateDriver", "GenerateOptions", "DecodeRing", "GenStats", "GenerateResult", "lockstep_fold"]

log = logging.getLogger("rlx_mpi")

# Note: the prefix cache's pool holds as many positions as this many cache slots (2: a shared
# prefix of the longest prompt's length and room for the prompts' own blocks to churn, LRU);
# the planner prices it as that many more slots (`GenerateDriver.cost`).
PREFIX_POOL_ROWS = 2
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
                 with_logprobs: bool = False, hooks: TestHooks = NO_HOOKS):
        self.cx, self.params, self.header_size = cx, params, header_size
        own = per_key or {}  # prompt key -> a row's own sampling (batch requests' settings), every pending row
        # the live rows' state, born and freed by the headers' events (`records.RowTable`)
        self.rows = RowTable(lambda key: RowState(key, own.get(key)))
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
        kind, n, start = h.kind, h.n, h.start
        slots, lengths = h.slots.copy(), h.lengths.copy()
        t0 = time.perf_counter()
        if ops is not None:
            self.stage.block_ops(ops, before=True)
        if kind == DECODE:
            out = self.stage.decode(x, slots, lengths)
        elif kind == MIXED:  # decode rows and a prefill chunk in one step (the scheduler's MIXED note)
            out = self.stage.mixed(x, slots, lengths, h.n_decode, start)
        elif start:  # a later chunk (a Stage without ``start`` is never given one: see drive)
            out = self.stage.prefill(x, slots, lengths, start=start)
        else:
            out = self.stage.prefill(x, slots, lengths)
        if ops is not None:
            self.stage.block_ops(ops, before=False)
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


def _lockstep_broken(cx: Any, ring: DecodeRing, when: str) -> None:
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


# -- the command ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class GenerateOptions:
    """A resolved ``generate`` request: the job's [generate] section under the command-line flags."""

    prompts: Any  # Path
    out: Any  # Path
    max_new_tokens: int
    sampling: SamplingParams
    eos_id: int | None  # None: every one the checkpoint names (`tokenizer.eos_ids_beside`)
    batch: int
    groups: int  # 0: one per stage
    prefill_chunk: int  # positions per prefill step of a new group; 0: whole prompts
    sync_s: float
    progress_s: float = 10.0
    logprobs: int = 0  # top alternatives per token in each row's "logprobs"; 0: no "logprobs"
    eos_where: str = "generate --eos-id"  # where eos_id came from, for its error
    shard: tuple[int, int] | None = None  # --shard K/N: this job's part of the prompt file (`shards.py`)
    ignore_eos: bool = False  # --ignore-eos: every row runs to its max tokens (fixed-length benchmarks)
    prefix_cache: bool = True  # reuse cached prefix blocks (--no-prefix-cache: off; `block_pool`)
    kv_rows: int = 0  # the KV budget in full-length rows (--kv-rows; 0: groups x batch): the block cache's note

    @classmethod
    def resolve(cls, flags: Any, job: Any) -> "GenerateOptions":
        """The job's [generate] section under ``flags`` (the parsed command line), checked."""
        sec = job.generate
        pick = lambda flag, value: value if flag is None else flag  # noqa: E731
        prompts = flags.prompts or (str(sec.prompts) if sec.prompts else None)
        out = flags.out or (str(sec.out) if sec.out else None)
        if not prompts:
            raise ConfigError("generate --prompts", "no prompt file given", "pass --prompts FILE or set [generate] prompts")
        if not out:
            raise ConfigError("generate --out", "no output file given", "pass --out FILE or set [generate] out")
        for flag, value, low in (("--max-new-tokens", flags.max_new_tokens, 1), ("--top-k", flags.top_k, 0),
                                 ("--seed", flags.seed, 0), ("--eos-id", flags.eos_id, 0), ("--batch", flags.batch, 1),
                                 ("--groups", flags.groups, 0), ("--logprobs", flags.logprobs, 0),
                                 ("--prefill-chunk", flags.prefill_chunk, 0),
                                 ("--kv-rows", getattr(flags, "kv_rows", None), 0)):
            rules.int_at_least(value, low, f"generate {flag}")
        rules.at_most(flags.logprobs, rules.LOGPROBS_MAX, "generate --logprobs")
        from ..io.shards import parse_shard

        shard = parse_shard(getattr(flags, "shard", None), "generate --shard")
        seed = pick(flags.seed, sec.seed if sec.seed is not None else job.run.seed)
        sampling = SamplingParams(pick(flags.temperature, sec.temperature), pick(flags.top_k, sec.top_k),
                                  pick(flags.top_p, sec.top_p), seed).check("generate")
        return cls(prompts=Path(prompts), out=Path(out), max_new_tokens=pick(flags.max_new_tokens, sec.max_new_tokens),
                   sampling=sampling, eos_id=pick(flags.eos_id, sec.eos_id), batch=pick(flags.batch, sec.batch),
                   groups=pick(flags.groups, sec.groups), sync_s=sec.sync_s,
                   prefill_chunk=pick(flags.prefill_chunk, sec.prefill_chunk),
                   logprobs=pick(flags.logprobs, sec.logprobs), shard=shard,
                   ignore_eos=bool(getattr(flags, "ignore_eos", None) or sec.ignore_eos),
                   prefix_cache=pick(getattr(flags, "prefix_cache", None), sec.prefix_cache),
                   kv_rows=pick(getattr(flags, "kv_rows", None), sec.kv_rows),
                   eos_where="generate --eos-id" if flags.eos_id is not None else f"{job.path}: [generate] eos_id")


def _requests(p: Any, opts: GenerateOptions) -> list[Request]:
    """A pending prompt's rows, one `records.Request` per sample (the scheduler's per-row note);
    a prompt without settings of its own is one row of the job's."""
    s = p.settings
    tokens = tuple(p.tokens)
    if s is None:
        return [Request(p.index, p.id, tokens)]
    limit = p.request["max_new_tokens"] if p.request else (s.max_tokens or opts.max_new_tokens)
    q = s.params(opts.sampling)
    own = q if q != opts.sampling else None  # (rows that sample as the job does keep the batched path)
    return [Request(p.index, p.id, tokens, j, sample_id(p.id, j), limit, tuple(s.stop), own) for j in range(s.n)]


class GenerateDriver(JournalDriver):
    """The ``generate`` command as a driver of the shared start-up (see `rlx_mpi.drivers`).

    Rank 0 reads the prompts and opens the journal (an agreed step), every rank learns the
    pending prompts, plans with their KV bytes, builds, resets its cache and runs the decode
    ring. `report` exits with the requeue code when a stop signal ended it early.
    """

    command = "generate"
    decodes = True

    def __init__(self, flags: Any, *, argv_inputs: tuple = (), hooks: TestHooks = NO_HOOKS):
        self.flags, self.argv_inputs, self.hooks = flags, argv_inputs, hooks
        self.opts: GenerateOptions | None = None
        self.doc: dict = {}
        self.holder: dict = {}  # rank 0: journal, tokenizer, prompts
        self.groups = 0
        self.kv_bytes = 0
        self.prefix_blocks = 0  # blocks of the prefix cache's pool on every stage (0: off)
        self.paged = False  # the full layers' rows take the pool's blocks through block tables (`_paged`)

    def configure(self, cx: Any) -> None:
        self.opts = GenerateOptions.resolve(self.flags, cx.job)

    def load(self, cx: Any) -> tuple[int, int] | None:
        """Prompts and journal on rank 0; (cache slots, longest sequence), None when all are done."""
        from ..io.batch_io import read_requests
        from ..io.identity import RunIdentity, beside_settings, unplaced_settings
        from ..io.journal import Journal
        from ..io.tokenizer import eos_ids_beside, load_tokenizer

        cx.prepare()
        dims, job, opts = cx.dims, cx.job, self.opts

        def load() -> dict | None:
            if not cx.is_root:
                return None
            rules.token_in_vocab(opts.eos_id, dims.vocab_size, opts.eos_where, f"give an id in [0, {dims.vocab_size}), "
                                 "or leave it unset to stop at the checkpoint's own (generation_config.json)")
            rules.at_most(opts.logprobs, dims.vocab_size, "generate --logprobs")
            eos = sorted({opts.eos_id} if opts.eos_id is not None else set(eos_ids_beside(job.model.checkpoint)))
            if opts.ignore_eos:
                eos = []
            tokenizer = load_tokenizer(job.model.checkpoint)
            from ..io.shards import select

            prompts = read_requests(opts.prompts, vocab_size=dims.vocab_size, max_positions=dims.max_positions,
                                    max_new_tokens=opts.max_new_tokens, tokenizer=tokenizer)
            prompts, shard = select(prompts, opts.shard, str(opts.prompts))
            sampled = any(p.settings and not p.settings.params(opts.sampling).greedy for p in prompts)
            identity = RunIdentity.for_generate(job.model.checkpoint, opts.sampling, opts.max_new_tokens,
                                                eos_ids=eos, logprobs=opts.logprobs, sampled=sampled)
            identity = identity.with_settings(**beside_settings(tokenizer))  # (+ the layout's: `settle`)
            journal = Journal(opts.out, prompts, inputs=(opts.prompts, job.path, job.model.checkpoint,
                                                         *self.argv_inputs), sync_s=opts.sync_s, identity=identity,
                              shard=shard, settle=True, adopt=bool(getattr(self.flags, "adopt_output", False)))
            self.holder.update(journal=journal, tokenizer=tokenizer, prompts=prompts)
            if not journal.pending:  # nothing to place or compute: check what can be known without a plan
                journal.check_done(**unplaced_settings(job, "generate"))
            rows = [r for p in journal.pending if p.error is None for r in _requests(p, opts)]
            longest = max((len(r.tokens) + (r.max_new_tokens or opts.max_new_tokens) for r in rows), default=1)
            pending = [r.to_wire() for r in rows]  # (plain JSON: the broadcast below)
            failed = [p.index for p in journal.pending if p.error is not None]
            return {"pending": pending, "total": len(prompts), "eos": eos, "max_seq": longest,
                    "first": shard["lines"][0] if shard else 0,  # (a shard's prompts are renumbered from 0)
                    "failed_now": failed, "failed": sum(p.error is not None for p in prompts),
                    "logprobs": any(p.settings and p.settings.logprobs for p in journal.pending),
                    "top_logprobs": max((p.settings.top_logprobs for p in journal.pending if p.settings), default=0),
                    "stops": any(p.settings and p.settings.stop for p in journal.pending)}

        doc = cx.agree(load, "reading the prompts")
        self.doc = doc = transport.bcast_json(cx.world, doc, 0, job.run.startup_timeout_s, cx.ctx, "the prompts")
        if not doc["pending"]:
            if cx.is_root:
                journal = self.holder["journal"]
                if doc["failed_now"]:  # only failed requests were left: no plan, so what is known without one
                    journal.settle(**unplaced_settings(job, "generate"))
                failed = self._write_failed(doc["failed_now"])
                self.holder["journal"].close()
                if not failed:
                    log.info("all %d prompts of %s are already in %s", doc["total"], opts.prompts, opts.out)
            return None
        replicas = job.placement.replicas
        n_stages = cx.world.size // job.placement.tp // (replicas if replicas != "auto" else 1)
        self.groups = opts.groups or n_stages  # (under replicas = "auto": set again once planned, check_plan)
        return self.groups * opts.batch, doc["max_seq"]

    def cost(self, cx: Any) -> Any:
        """The family's cost with the KV term cut to what the ranks' policies keep, as a function of
        the stage count (one group of slots per stage by default: `placement.plan_grid`)."""
        from ..model.cost import kv_cost

        specs = [cx.job.kv_for(r) for r in range(cx.world.size)]
        cx.prepare()
        family, cfg, opts = cx.family, cx.model_config, self.opts
        extra = PREFIX_POOL_ROWS if self._prefix_cache_on(cx) else 0  # the pool: as many positions as that many slots
        rows = opts.kv_rows if opts.kv_rows and self._paged(cx) else 0  # (a paged cache: the budget, not the slots)
        return lambda stages: kv_cost(family.cost(cfg, (rows or (opts.groups or stages) * opts.batch) + extra, cx.seq),
                                      specs, cx.seq)

    def _paged(self, cx: Any) -> bool:
        """Do the stages' full-attention layers read through block tables (`kv_cache`'s block-table
        note)? With the prefix cache, when every rank keeps full caches (a job's ``window:W`` keeps
        rings, bounded anyway) and the model has no sliding-window layers: their rings would copy
        blocks into a pool with the block ids of the whole budget (unpriced memory), so such a model
        keeps its slots (`DecoderStage.reset_prefix` pages its full layers all the same when asked).
        The same answer on every rank."""
        cfg = cx.model_config
        window, layers = getattr(cfg, "window", None), getattr(cfg, "num_hidden_layers", 0)
        return (self._prefix_cache_on(cx) and all(cx.job.kv_for(r).policy == "full" for r in range(cx.world.size))
                and not (callable(window) and any(window(n) for n in range(layers))))

    def _prefix_cache_on(self, cx: Any) -> bool:
        """Does this job keep a prefix cache? (`drivers.prefix_cache_on`, the rule score shares)"""
        return prefix_cache_on(cx, self.opts.prefix_cache)

    def _prefix_pool(self) -> Any:
        """Stage 0's bookkeeping of the pool (None: off)."""
        from ..engine.block_pool import BLOCK_SIZE, BlockPool

        return BlockPool(self.prefix_blocks, BLOCK_SIZE) if self.prefix_blocks else None

    def check_plan(self, cx: Any) -> None:
        job = cx.job
        self.groups = self.opts.groups or cx.topology.n_stages
        # fewer rows than slots: spread them so that every stage has a group (`scheduler.split_batch`)
        batch = split_batch(len(self.doc["pending"]), self.groups * cx.topology.n_replicas, self.opts.batch)
        if batch != self.opts.batch:
            if cx.is_root:
                log.info("%d rows for %d groups of %d: %d per group, so that every stage has one",
                         len(self.doc["pending"]), self.groups * cx.topology.n_replicas, self.opts.batch, batch)
            self.opts = replace(self.opts, batch=batch)

        def same_kv() -> None:
            for a in cx.plan_:
                specs = {str(job.kv_for(r)) for r in a.ranks}
                if len(specs) > 1:
                    raise ConfigError(f"{job.path}: [[rank]] kv_cache", f"the ranks {list(a.ranks)} of stage "
                                      f"{a.stage} have different kv_cache settings {sorted(specs)}",
                                      "give every rank of a tensor-parallel stage the same kv_cache")

        cx.agree(same_kv, "checking the kv_cache settings")
        self.settle(cx)

    def ready(self, cx: Any) -> None:
        """Allocate every stage's KV cache (agreed: a family without generation is one line)."""
        job = cx.job
        kv = job.kv_for(cx.world.rank)

        def reset() -> int:
            try:
                return cx.stage.reset(self.groups * self.opts.batch, cx.seq, kv)
            except NotImplementedError as e:
                raise ConfigError(f"{job.model.checkpoint}: family {cx.family.name!r}", str(e),
                                  "generate needs a family whose Stage implements reset, prefill and decode") from None

        self.kv_bytes = cx.agree(reset, "allocating the KV cache")
        caps = caps_of(cx.stage)
        if self._prefix_cache_on(cx) and caps.prefix_cache:
            from ..engine.block_pool import BLOCK_SIZE

            # paged: one pool holds every row's blocks, sized from the KV budget (the rows' slots' positions
            # or --kv-rows', and the prefix pool's), so rows take blocks by what they use (the block-cache note)
            paged = self._paged(cx) and caps.paged and caps.chunked_prefill  # (stage 0 then keeps the pool)
            rows = PREFIX_POOL_ROWS + ((self.opts.kv_rows or self.groups * self.opts.batch) if paged else 0)
            blocks = -(-rows * cx.seq // BLOCK_SIZE)

            def pool() -> int:
                got = cx.stage.reset_prefix(blocks, BLOCK_SIZE, paged=True) if paged else \
                    cx.stage.reset_prefix(blocks, BLOCK_SIZE)
                if not got:
                    raise RuntimeError("the prefix cache's pool was not allocated where the job said it would be")
                return got

            got = cx.agree(pool, "allocating the prefix cache")
            self.kv_bytes = got if paged else self.kv_bytes + got  # (paged: the whole cache, slots replaced)
            self.prefix_blocks, self.paged = blocks, paged

    def drive(self, cx: Any) -> GenerateResult | None:
        """The decode ring on every rank; the `GenerateResult` on rank 0 (None elsewhere).

        With replicas (`rlx_mpi.replicas`), each replica's stage 0 takes chunks of the pending
        prompts from the shared counter as its slots free, its finished rows go to rank 0 (the
        one writer), and every rank waits for rank 0's end before the stats are gathered."""
        from ..lifecycle.faults import wait
        from ..lifecycle.progress import Progress
        from ..comm.replicas import Collector, ReplicaFeed, RowPost, SharedCounter, wait_for_end

        opts, doc, holder, stop = self.opts, self.doc, self.holder, cx.stop
        topo, job = cx.topology, cx.job
        kv = job.kv_for(cx.world.rank)
        recompute = any(job.kv_for(r).recompute for r in range(cx.world.size))
        timeout = job.run.timeout_s
        # a stage that does not declare chunked prefill (`model.stage.StageCaps`) prefills whole
        # prompts and never gets a MIXED step
        caps = caps_of(cx.stage)
        chunk_ok = caps.chunked_prefill
        chunk = opts.prefill_chunk if chunk_ok else 0
        items = [Request.from_wire(d) for d in doc["pending"]]
        shared = topo.n_replicas > 1
        wait(cx.world.Ibarrier(), timeout, cx.ctx, lambda: "every rank to start generating", "some rank")
        counter = SharedCounter(cx.world, cx.ctx, timeout) if shared else None
        feed = (ReplicaFeed(counter, items, opts.batch, leader=topo.tp_rank == 0, tp_comm=topo.tp_comm, tp=topo.tp,
                            ctx=cx.ctx, timeout_s=timeout) if shared and topo.stage == 0 else None)
        decode = None
        if doc["stops"] and topo.stage == 0:  # stop strings end rows on stage 0, which decodes them
            from ..io.tokenizer import load_tokenizer

            decode = (holder.get("tokenizer") or load_tokenizer(job.model.checkpoint)).decode
        sched = Scheduler([] if feed else items, self.groups, opts.batch,
                          opts.max_new_tokens, frozenset(doc["eos"]), recompute, prefill_chunk=chunk,
                          mixed=chunk_ok, stages=topo.n_stages, feed=feed,
                          decode=decode, pool=self._prefix_pool() if topo.stage == 0 and chunk_ok else None,
                          paged=self.paged)
        names = {r.key: f"{r.id!r} (prompt {doc.get('first', 0) + r.index + 1} of {opts.prompts.name})"
                 for r in items}
        per_key = {r.key: r.sampling for r in items if r.sampling is not None}
        k = min(max(opts.logprobs, doc["top_logprobs"]), cx.dims.vocab_size)  # (a request's top_logprobs too)
        ring = DecodeRing(cx, opts.sampling, sched.header_size, k_logprobs=k, names=names, per_key=per_key,
                          with_logprobs=doc["logprobs"], hooks=self.hooks)
        journal, tokenizer = holder.get("journal"), holder.get("tokenizer")
        prompt_of = {p.index: p for p in holder.get("prompts", [])}
        texts = {i: p.text for i, p in prompt_of.items()}
        samples: dict[int, dict[int, dict]] = {}  # rank 0: a batch request's finished samples, until all n are
        # (requests, not rows: a request of n > 1 is n rows; its failed lines are written below)
        done_before = doc["total"] - len({r.index for r in items}) - len(doc["failed_now"])
        progress = Progress(doc["total"], done_before, interval_s=opts.progress_s) if cx.is_root else None
        counts = {"done": 0, "tokens": 0}
        per_replica = {r: {"rows": 0, "tokens": 0} for r in range(topo.n_replicas)}
        replica_of = {rank: r for r, rep in enumerate(topo.replicas or [topo.grid]) for g in rep for rank in g}
        driving = topo.stage == 0 and topo.tp_rank == 0
        post = RowPost(cx.world, cx.ctx, timeout) if shared and not cx.is_root else None

        def write(index: int, row: dict) -> None:
            """Rank 0: one finished row into the journal (its text decoded here: the tokenizer is rank 0's);
            a batch request's once all its samples are in, as one OpenAI output line."""
            p = prompt_of[index]
            if is_batch(p):
                got = samples.setdefault(index, {})
                got[row.pop("sample", 0)] = row
                if len(got) < p.settings.n:
                    return
                row = format_result(p, [got[j] for j in range(p.settings.n)], tokenizer)
                del samples[index]
            elif tokenizer is not None and texts.get(index) is not None:
                text = tokenizer.decode(row["tokens"])
                if p.settings and p.settings.stop and row["finish_reason"] == "stop":
                    text = stop_text(text, p.settings.stop)  # (as OpenAI: the stop string is not in it)
                row = {"id": row["id"], "tokens": row["tokens"], "text": text,
                       **{k: v for k, v in row.items() if k not in ("id", "tokens")}}
            journal.complete(index, row)
            counts["done"] += 1

        def taken(replica: int, rows: list, new: int) -> None:
            counts["tokens"] += new
            per_replica[replica]["rows"] += len(rows)
            per_replica[replica]["tokens"] += new
            if journal is not None:
                journal.flush()
                progress.update(done_before + counts["done"], new)

        def on_done(rows: list[Seq]) -> None:
            now = time.perf_counter()
            out = []
            for r in rows if journal is not None or (post is not None and driving) else ():  # (rows only where kept)
                row = {"id": r.id, "tokens": r.new, "finish_reason": r.finish_reason, "prompt_tokens": len(r.prompt),
                       "new_tokens": len(r.new), "ms": round((now - r.start) * 1e3, 1)}
                if ring.lp:
                    row["logprobs"] = logprob_entries(r.new, *zip(*r.logprobs))
                if r.sample:  # (a batch request's sample j > 0; 0 is implied)
                    row["sample"] = r.sample
                out.append((r.index, row))
            if journal is not None:
                for index, row in out:
                    write(index, row)
            elif post is not None and driving and out:  # another replica's rows go to the writer
                post.rows([[index, row] for index, row in out])
            taken(topo.replica, rows, sum(len(r.new) for r in rows))

        def on_rows(src: int, msg: dict) -> None:
            rows = msg["rows"]
            for index, row in rows:
                write(index, row)
            taken(replica_of[src], rows, sum(len(row["tokens"]) for _, row in rows))

        collector = (Collector(cx.world, cx.ctx, timeout, {rep[0][0]: [x for g in rep for x in g]
                                                           for rep in topo.replicas[1:]}, on_rows)
                     if shared and cx.is_root else None)

        hold = [self.hooks.hold_polls if journal is not None else 0]

        def stop_now(final: bool = False) -> bool:
            if hold[0] and journal.done:  # a test's hold: rank 0 waits for the stop once a row is written
                for _ in range(hold[0]):
                    if stop.requested:
                        break
                    if collector is not None:
                        collector.poll()
                    time.sleep(0.01)
                hold[0] = 0
            if collector is not None:
                collector.poll()
            elif post is not None and driving:
                post.beat()
            flag = np.array([1 if stop.requested else 0, ring.lockstep, -ring.lockstep], np.int64)
            if topo.tp > 1:  # the first stage's ranks must stop after the same step, in lockstep
                from ..comm.collectives import ReduceKind, all_reduce

                all_reduce(flag, ReduceKind.MAX, comm=topo.tp_comm, timeout_s=timeout, ctx=cx.ctx)
                if flag[1] != -flag[2]:
                    _lockstep_broken(cx, ring, "after the last step" if final else f"at step {ring.stats.steps}")
            return bool(flag[0])

        if cx.is_root:  # requests that cannot run: their error lines, in order with the others
            counts["done"] += self._write_failed(doc["failed_now"])
        t0 = time.perf_counter()
        stopped = ring.drive(sched, on_done, stop_now) if topo.stage == 0 else ring.relay()
        if topo.stage == 0 and topo.tp > 1:  # the steps drained after the last check
            stop_now(final=True)
        mine_wall = time.perf_counter() - t0
        if shared:
            if feed is not None:
                feed.close()
            if collector is not None:
                collector.finish()
            else:
                post.done()
                wait_for_end(cx.world, cx.ctx, timeout)
            counter.close()
        wall = time.perf_counter() - t0
        if journal is not None:
            journal.close()
            progress.finish()
        a = cx.assignment
        st, ex = ring.stats, ring.ex.stats
        timing = StageTiming(
            rank=cx.world.rank, host=cx.ctx.host, stage=a.stage, tp_rank=topo.tp_rank, tp_ranks=a.ranks,
            layers=a.layers, device=job.override_for(cx.world.rank).device, build_ms=cx.build_ms,
            forward_ms=ex.compute_s * 1e3, recv_wait_ms=(ex.recv_wait_s + ring.ring.recv_wait_s) * 1e3,
            send_ms=ex.send_wait_s * 1e3, bytes_sent=ex.bytes_sent, est_bytes=a.est_bytes,
            weight_bytes=cx.stage.weight_bytes, peak_rss_bytes=peak_rss_bytes(), pack_ms=ex.pack_s * 1e3,
            unpack_ms=ex.unpack_s * 1e3, wall_ms=mine_wall * 1e3, precision=job.precision_for(cx.world.rank).value,
            kv=str(kv), kv_bytes=self.kv_bytes, prefill_ms=st.prefill_s * 1e3, decode_ms=st.decode_s * 1e3,
            sample_ms=st.sample_s * 1e3, replica=topo.replica if shared else None)
        mine = {"timing": timing.to_dict(), "stopped": bool(stopped) if topo.stage == 0 else False,
                "signal": stop.signal_name,
                "prefix": [sched.reused, sched.prompt_tokens] if driving and sched.pool is not None else None,
                "peak": sched.peak_rows if driving else 0}
        grace = max(1.0, 0.1 * timeout)
        rows = transport.gather_json(cx.world, mine, 0, timeout + (topo.n_stages + 1) * grace, cx.ctx,
                                     "the generation stats")
        stopped_by = None
        if rows is not None and any(r["stopped"] for r in rows):
            stopped_by = next((r["signal"] for r in rows if r["signal"]), None) or "a stop request"
        stopped_by = transport.bcast_json(cx.world, stopped_by, 0, timeout, cx.ctx, "the end of the run")
        timings = [StageTiming.from_dict(r["timing"]) for r in rows or []]
        replicas = None
        if shared and rows is not None:
            walls = {}
            for t in timings:
                if t.stage == 0 and t.tp_rank == 0:
                    walls[t.replica] = t.wall_ms / 1e3
            replicas = [{"replica": r, "rows": c["rows"], "tokens": c["tokens"], "wall_s": round(walls.get(r, 0.0), 3),
                         "tokens_per_s": round(c["tokens"] / walls[r], 1) if walls.get(r) else None}
                        for r, c in per_replica.items()]
        hits = [r["prefix"] for r in rows or [] if r["prefix"] is not None]  # (each replica's stage 0)
        return GenerateResult(timings=timings, total=doc["total"], done_before=done_before, done_now=counts["done"],
                              new_tokens=counts["tokens"], wall_s=wall, stopped_by=stopped_by,
                              prefill_steps=sched.prefill_steps, token_gap_ms=sched.token_gaps_ms(), replicas=replicas,
                              prefix_hits=[sum(h[0] for h in hits), sum(h[1] for h in hits)] if hits else None,
                              rows_at_once=sum(r["peak"] for r in rows or []))

    def _write_failed(self, indices: list[int]) -> int:
        """Rank 0: the output lines of the requests that cannot run (`batch_io`'s per-line errors)."""
        prompts, journal = self.holder["prompts"], self.holder["journal"]
        for i in indices:
            journal.complete(i, format_result(prompts[i], [], self.holder["tokenizer"]))
        return len(indices)

    def report(self, cx: Any, result: GenerateResult | None) -> int:
        """Rank 0 prints the table and writes --json; 75 (requeue) when stopped by a signal."""
        import json
        import sys

        from ..io.journal import REQUEUE_EXIT
        from ..outputs import write_output

        if result is None:
            return self._failed_exit(cx.is_root)
        if cx.is_root:
            print(result.table())
            sys.stdout.flush()
            if "--json" in cx.outputs:
                write_output(cx.outputs["--json"], lambda tmp: tmp.write_text(json.dumps(result.to_dict(), indent=2)))
        if result.stopped_by:
            if cx.is_root:
                print(f"rlx-mpi: stopped by {result.stopped_by} after the current step: "
                      f"{result.done_before + result.done_now} of {result.total} prompts are in {self.opts.out}; "
                      f"run the same command again to resume (exit code {REQUEUE_EXIT})", file=sys.stderr)
            return REQUEUE_EXIT
        return self._failed_exit(cx.is_root)

    def nothing_to_do(self) -> int:
        """The exit code when every prompt was already done (`load` returned None)."""
        return self._failed_exit("journal" in self.holder)  # (rank 0 holds the journal)

    def _failed_exit(self, is_root: bool) -> int:
        """`batch_io.EXIT_SOME_FAILED` (every rank) when some requests of the file failed: the
        last line says how many and where their errors are; 0 otherwise."""
        import sys

        from ..io.batch_io import EXIT_SOME_FAILED

        failed = self.doc.get("failed", 0)
        if not failed:
            return 0
        if is_root:
            print(f"rlx-mpi: {failed} of {self.doc['total']} requests of {self.opts.prompts} failed; each has its "
                  f"error in its line of {self.opts.out} (\"error\" is not null); the others are complete "
                  f"(exit code {EXIT_SOME_FAILED})", file=sys.stderr)
        return EXIT_SOME_FAILED
