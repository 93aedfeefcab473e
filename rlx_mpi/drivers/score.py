"""``rlx-mpi score``: teacher-forced log-likelihood of a prompt file, across the pipeline.

`ScoreDriver` is the command on the shared start-up (`Cluster.start`). Rank 0 reads the
prompt file (`scoring.read_score_prompts`: every bad line named ``FILE:LINE``, every line
checked against the model's positions, before any compute) and opens the journal (the same
resumable, ordered output as ``generate``, its sidecar identity `RunIdentity.for_score`);
every rank learns the lines still to do and cuts them, all alike, into rounds of microbatches
(`plan_rounds`). A round is one GPipe forward (`schedule.forward_schedule` through the
`executor.Executor`, as ``run``): stage 0 embeds each microbatch's right-padded ids, the
hidden states travel down the pipeline, and the last stage turns each microbatch's logits
(B, T, V) into the log-probs of its scored tokens (`scoring.gather_logprobs`, per line, from
a view of the logits: no (N, V) copy). Only those float32 log-probs travel back to rank 0, once
per round, which writes the round's rows through the journal. Causal attention means the
padding after a line changes none of its logits.

Note: the prefix cache (on unless ``--no-prefix-cache`` / ``[score] prefix_cache = false``;
docs/prefix-cache.md). Lines that begin with the same context (a few-shot evaluation) compute it
once: every rank plans a round's microbatches alike (`admission.plan_reuse`, generate's admission
path: lookup, waiting on promised blocks, ATTACH/SAVE ops), each microbatch attaches its lines'
cached blocks into cache slots (`Stage.block_ops`) and prefills the rest with every position's
logits (``prefill(..., every=True)``); nothing travels but the hidden states of the new
positions. The rounds are `plan_rounds`' (the file's alone), and a row's log-probs are the same
bits whatever it attached (tests/test_score_prefix_mpi.py). Without it (or under a windowed
``kv_cache``) nothing is kept between microbatches (`Stage.forward`, no KV cache).

Note: rounds and microbatches. ``--batch`` (``[score] batch``) is a token budget per
microbatch (rows x padded length, default `DEFAULT_TOKENS`): the last stage holds one
microbatch's logits, budget x vocab x 4 bytes. A round takes the next lines in file order until they hold `per_round` budgets of
tokens, sorts them longest first (less padding) and packs them; a line longer than the budget
is a microbatch of its own. `per_round` is ``[run] microbatches``, at least twice the stages,
so the pipeline's fill-drain bubble is at most (p-1)/(3p-1). Between rounds every rank
agrees on a stop request (an all-reduce): SIGTERM/SIGINT/SIGUSR1 finish the round, write its
rows and exit 75; a rerun resumes after the last whole row.

Note: non-finite values. Each stage's first TP rank checks its output of every microbatch
before sending it (`faults.check_output`, the rule ``run`` and ``generate`` share); a NaN or
Inf ends the job with exit 4 naming the stage that made it and the lines affected, before any
row of that round is written (earlier rounds' rows are finite and stay). Under ``kv_cache =
"window:W"`` the forward attends through the window (`drivers.forward_window`): the model
``generate`` runs.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from . import (JournalDriver, end_replicas, forward_window, gather_stats, prefix_cache_on, stage_timing,
               stages_before_plan)
from .. import rules, tags
from ..comm import transport
from ..config import OnRankFailure, ScoreSection
from ..errors import ConfigError, RankFault
from ..comm.executor import Executor, wire_codec
from ..lifecycle.faults import check_output, wait
from ..comm.schedule import Action, forward_schedule
from ..engine.rounds import (MIN_ROUNDS, MIN_TOKENS, Microbatch, plan_rounds,  # noqa: F401  (their home is engine)
                             run_rounds, where_of as _where)
from ..io.stats import ClusterRun, StageTiming

__all__ = ["ScoreDriver", "ScoreOptions", "ScoreResult", "Microbatch", "plan_rounds", "DEFAULT_TOKENS"]

log = logging.getLogger("rlx_mpi")

DEFAULT_TOKENS = ScoreSection.batch  # --batch: padded tokens per microbatch
# Note: the prefix cache's slots. A microbatch of lines that attached a shared context computes
# only their suffixes, so it takes more rows than the budget's of whole lines; each row needs a
# cache slot of the longest line's positions. The slots are this many budgets of whole lines (at
# least the plan's rows, at most REUSE_ROWS_MAX rows): KV for 4 x 2048 positions by default, priced
# by the planner (`ScoreDriver.cost`). Not measured against other factors yet.
REUSE_BUDGETS, REUSE_ROWS_MAX = 4, 64


@dataclass(frozen=True)
class ScoreOptions:
    """A resolved ``score`` request: the job's [score] section under the command-line flags."""

    prompts: Path
    out: Path
    batch: int  # padded tokens per microbatch
    sync_s: float = 2.0
    progress_s: float = 10.0
    shard: tuple[int, int] | None = None  # --shard K/N: this job's part of the prompt file (`shards.py`)
    prefix_cache: bool = True  # reuse the cached blocks of a shared context (--no-prefix-cache: off; `admission`)

    @classmethod
    def resolve(cls, flags: Any, job: Any) -> "ScoreOptions":
        """The job's [score] section under ``flags`` (the parsed command line), checked."""
        sec = job.score
        prompts = flags.prompts or (str(sec.prompts) if sec.prompts else None)
        out = flags.out or (str(sec.out) if sec.out else None)
        if not prompts:
            raise ConfigError("score --prompts", "no prompt file given", "pass --prompts FILE or set [score] prompts")
        if not out:
            raise ConfigError("score --out", "no output file given", "pass --out FILE or set [score] out")
        rules.int_at_least(flags.batch, 1, "score --batch")
        rules.at_most(flags.batch, 2**31, "score --batch")
        from ..io.shards import parse_shard

        return cls(prompts=Path(prompts), out=Path(out), batch=sec.batch if flags.batch is None else flags.batch,
                   sync_s=sec.sync_s, shard=parse_shard(getattr(flags, "shard", None), "score --shard"),
                   prefix_cache=sec.prefix_cache if getattr(flags, "prefix_cache", None) is None else flags.prefix_cache)


@dataclass
class ScoreResult:
    """What rank 0 reports: the forward's per-rank table and this run's counts."""

    run: ClusterRun
    total: int  # lines in the prompt file
    done_before: int
    done_now: int
    scored_tokens: int  # scored by this run
    padded_tokens: int  # positions computed, padding included
    rounds: int
    stopped_by: str | None
    replicas: list[dict] | None = None  # per replica: rows, rounds, tokens, wall_s, tokens_per_s (None: one)
    prefix_hits: list[int] | None = None  # [line positions attached from the prefix cache, all of them] (None: off)

    def to_dict(self) -> dict:
        d = {k: v for k, v in asdict(self).items()
             if k != "run" and not (k in ("replicas", "prefix_hits") and v is None)}
        return {**d, **self.run.to_dict()}


class ScoreDriver(JournalDriver):
    """The ``score`` command as a driver of the shared start-up (see `rlx_mpi.drivers`)."""

    Options = ScoreOptions
    command = "score"

    def __init__(self, flags: Any, *, argv_inputs: tuple = (), hooks: Any = None):
        self.flags, self.argv_inputs, self.hooks = flags, argv_inputs, hooks  # (hooks: tests only, `lifecycle.hooks`)
        self.opts: ScoreOptions | None = None
        self.doc: dict = {}
        self.holder: dict = {}  # rank 0: journal, prompts
        self.rounds: list[list[Microbatch]] = []
        self.stopped = False
        self.reuse_rows = 0  # the prefix cache's slots: rows of a microbatch at most (0: off)
        self.prefix_blocks = 0  # blocks of its pool on every stage

    def load(self, cx: Any) -> tuple[int, int] | None:
        """Prompts and journal on rank 0; the rounds on every rank; None when all are done."""
        from ..io.identity import RunIdentity, beside_settings, unplaced_settings
        from ..io.journal import Journal
        from ..io.tokenizer import load_tokenizer
        from ..io.scoring import read_score_prompts

        cx.prepare()
        dims, job, opts = cx.dims, cx.job, self.opts

        def load() -> dict:  # (rank 0: `read_work`)
            tokenizer = load_tokenizer(job.model.checkpoint)
            from ..io.shards import select

            prompts = read_score_prompts(opts.prompts, vocab_size=dims.vocab_size, max_positions=dims.max_positions,
                                         tokenizer=tokenizer)
            prompts, shard = select(prompts, opts.shard, str(opts.prompts))
            journal = Journal(opts.out, prompts, inputs=(opts.prompts, job.path, job.model.checkpoint,
                                                         *self.argv_inputs), sync_s=opts.sync_s,
                              identity=RunIdentity.for_score(job.model.checkpoint).with_settings(
                                  **beside_settings(tokenizer)), shard=shard, settle=True,
                              adopt=bool(getattr(self.flags, "adopt_output", False)))
            self.holder.update(journal=journal, prompts=prompts)
            if not journal.pending:  # nothing to place or compute: check what can be known without a plan
                journal.check_done(**unplaced_settings(job, "score"))
            pending = [[p.index, p.id, list(p.tokens), p.start] for p in journal.pending]
            return {"pending": pending, "total": len(prompts), "first": shard["lines"][0] if shard else 0}

        doc = self.read_work(cx, load)
        if not doc["pending"]:
            if cx.is_root:
                self.holder["journal"].close()
                log.info("all %d lines of %s are already in %s", doc["total"], opts.prompts, opts.out)
            return None
        self.rounds = self._rounds(cx, stages_before_plan(cx))  # (replicas = "auto": again in check_plan)
        rows = max(len(mb.lines) for r in self.rounds for mb in r)
        longest = max(mb.length for r in self.rounds for mb in r)
        self.reuse_rows = min(max(rows, REUSE_BUDGETS * opts.batch // longest), REUSE_ROWS_MAX)
        return rows, longest  # the planner prices one microbatch at most this shape

    def cost(self, cx: Any) -> Any:
        """Without the prefix cache, one microbatch's activations (`Driver.cost`); with it, also the
        slots a microbatch's rows attach into and the pool, priced as generate prices its cache."""
        if not self._reuse(cx):
            return cx.cost()
        from ..model.cost import kv_cost

        from ..engine.block_pool import PREFIX_POOL_ROWS

        specs = [cx.job.kv_for(r) for r in range(cx.world.size)]
        return kv_cost(cx.family.cost(cx.model_config, max(cx.batch, self.reuse_rows + PREFIX_POOL_ROWS), cx.seq),
                       specs, cx.seq)

    def _reuse(self, cx: Any) -> bool:
        """Does this job reuse shared contexts? `drivers.prefix_cache_on`, and only under kv_cache
        "full": the windowed forward (`forward_window`) is the path a windowed job's numbers come from."""
        cx.prepare()
        return prefix_cache_on(cx, self.opts.prefix_cache) and all(
            cx.job.kv_for(r).policy == "full" for r in range(cx.world.size))

    def ready(self, cx: Any) -> None:
        """With the prefix cache: every stage's slots and pool (agreed; a stage without them: off)."""
        from mpi4py import MPI

        from ..model.stage import caps_of

        self.prefix_blocks = 0
        if not self._reuse(cx):  # (the job's answer: the same on every rank)
            return
        # off on every rank if any stage does not declare it (every rank plans the microbatches alike)
        caps = caps_of(cx.stage)
        able = np.array([caps.prefix_cache and caps.score_every], np.int32)
        wait(cx.world.Iallreduce(MPI.IN_PLACE, able, op=MPI.MIN), cx.job.run.startup_timeout_s, cx.ctx,
             lambda: "every rank to say whether its stage keeps a prefix cache", "some rank")
        if not able[0]:
            return
        from ..engine.block_pool import BLOCK_SIZE

        from ..engine.block_pool import PREFIX_POOL_ROWS

        blocks = -(-PREFIX_POOL_ROWS * cx.seq // BLOCK_SIZE)

        def reset() -> int:
            got = cx.stage.reset(self.reuse_rows, cx.seq, cx.job.kv_for(cx.world.rank))
            pool = cx.stage.reset_prefix(blocks, BLOCK_SIZE)
            if not pool:
                raise RuntimeError("the prefix cache's pool was not allocated where the job said it would be")
            return got + pool

        cx.agree(reset, "allocating the prefix cache")
        self.prefix_blocks = blocks

    def _rounds(self, cx: Any, n_stages: int) -> list[list[Microbatch]]:
        per_round = max(cx.job.run.microbatches, 2 * n_stages)
        return plan_rounds([len(p[2]) for p in self.doc["pending"]], self.opts.batch, per_round)

    def check_plan(self, cx: Any) -> None:
        if cx.job.placement.replicas == "auto":
            self.rounds = self._rounds(cx, cx.topology.n_stages)
        self.settle(cx)

    def drive(self, cx: Any) -> ScoreResult | None:
        """Every round's forward on every rank; the `ScoreResult` on rank 0 (None elsewhere)."""
        from ..lifecycle.progress import Progress
        from ..io.scoring import gather_logprobs, score_row

        job, topo, stage, a, stop = cx.job, cx.topology, cx.stage, cx.assignment, cx.stop
        timeout = job.run.timeout_s
        window = forward_window(cx, "score")  # [run] kv_cache = "window:W": the model generate runs
        doc, pending = self.doc, self.doc["pending"]
        journal, prompts = self.holder.get("journal"), self.holder.get("prompts")
        done_before = doc["total"] - len(pending)
        progress = Progress(doc["total"], done_before, interval_s=self.opts.progress_s, label="score") \
            if journal is not None else None
        grace = max(1.0, 0.1 * timeout)  # staggered deadlines: see drivers/run.py's forward
        link = transport.Link(cx.world, cx.ctx, timeout + topo.stage * grace,
                              send_timeout_s=timeout + (topo.n_stages - 1 - topo.stage) * grace)
        final = transport.Link(cx.world, cx.ctx, timeout + topo.n_stages * grace)
        ex = Executor(link, cx.ctx, rank_of=lambda s: topo.prev if s < topo.stage else topo.next,
                      codec=wire_codec(job), record=False)
        keeps = a.last and topo.tp_rank == 0  # computes the log-probs
        checks = topo.tp_rank == 0  # names a non-finite output (one line, not one per TP rank)
        H = cx.dims.hidden_size
        counts = {"done": 0, "scored": 0, "padded": 0, "tokens": 0, "microbatches": 0, "reused": 0}
        pool = None  # the prefix cache's bookkeeping, the same on every rank of a replica (`admission`)
        if self.prefix_blocks:
            from ..engine.block_pool import BLOCK_SIZE, BlockPool

            pool = BlockPool(self.prefix_blocks, BLOCK_SIZE)
        per_round = max(job.run.microbatches, 2 * topo.n_stages)

        def line_name(k: int) -> str:
            index, pid = pending[k][0], pending[k][1]
            return f"line {pid!r} (line {doc.get('first', 0) + index + 1} of the prompt file)"

        def check(out: np.ndarray, mb: Microbatch, m: int, what: str, start: int = 0) -> None:
            """`faults.check_output` of a microbatch: each line's real tokens (not its padding); its
            positions from ``start`` (after an attached prefix)."""
            check_output(out, a.stage, cx.ctx, lambda: ((line_name(k), out[b, :len(pending[k][2]) - start])
                                                        for b, k in enumerate(mb.lines)),
                         what, "; no row of this round is written")

        def ids_of(mb: Microbatch) -> np.ndarray:
            ids = np.zeros((len(mb.lines), mb.length), np.int64)  # right-padded with id 0
            for b, k in enumerate(mb.lines):
                t = pending[k][2]
                ids[b, :len(t)] = t
            return ids

        def reuse_plan(lines: list[int]) -> list[tuple[Microbatch, int, np.ndarray]]:
            """The round's microbatches under the prefix cache (`admission.plan_reuse`): each as a
            Microbatch (length = start + width), its first computed position and its block ops."""
            from ..engine.admission import plan_reuse

            plan = plan_reuse([(k, tuple(pending[k][2]), pending[k][3]) for k in lines], pool, self.opts.batch,
                              per_round, self.reuse_rows, MIN_TOKENS)
            counts["reused"] += sum(r.start * len(r.lines) for r in plan)
            return [(Microbatch(r.lines, r.start + r.width), r.start, np.array(r.ops, np.int64).reshape(-1, 4))
                    for r in plan]

        def run_round(mbs: list[Microbatch]) -> tuple[np.ndarray | None, dict[int, tuple[int, int]]]:
            where = _where(mbs, pending)  # (the file's plan: the same layout whatever the prefix cache did)
            n = max((hi for _, hi in where.values()), default=0)
            # (microbatch, first computed position, block ops): the positions before it attached
            plan = reuse_plan(sorted(where)) if pool is not None else [(mb, 0, None) for mb in mbs]
            counts["padded"] += sum(len(mb.lines) * (mb.length - start) for mb, start, _ in plan)
            counts["microbatches"] += len(plan)
            lps = np.empty(n, np.float32) if keeps or (cx.is_root and topo.replica == 0) else None
            recv = None
            if cx.is_root and not keeps:  # posted first: the last stage's send never waits on buffering
                recv = final.irecv(lps, topo.output_rank, tags.SCORE_LOGPROBS, "the log-probs of a round")

            def recv_spec(act: Action):
                mb, start, _ = plan[act.microbatch]
                return (len(mb.lines), mb.length - start, H), np.float32

            def compute(m: int, x: np.ndarray | None) -> np.ndarray | None:
                mb, start, ops = plan[m]
                ids = ids_of(mb) if a.first or keeps else None
                x = np.ascontiguousarray(ids[:, start:]) if a.first else x
                if ops is None:
                    out = stage.forward(x, window=window) if window else stage.forward(x)
                else:  # the prefix cache: attach, prefill the rest (saving its blocks), every position's logits
                    if len(ops):
                        stage.block_ops(ops, before=True)
                    lengths = np.array([len(pending[k][2]) for k in mb.lines], np.int64)
                    out = stage.prefill(x, np.arange(len(mb.lines)), lengths, start=start, every=True)
                    if len(ops):
                        stage.block_ops(ops, before=False)
                want = (len(mb.lines), mb.length - start) + ((cx.dims.vocab_size,) if a.last else (H,))
                if out.shape != want or out.dtype != np.float32:
                    raise RankFault(cx.ctx.describe(), f"the stage returned {out.dtype} {out.shape} for microbatch "
                                    f"{m}, expected float32 {want}", "the model family's forward disagrees with "
                                    "its dims: fix the plug-in")
                if checks and not a.last:
                    check(out, mb, m, "hidden state", start)
                if not a.last:
                    return out
                if keeps:
                    for b, k in enumerate(mb.lines):
                        s, ln = pending[k][3], len(pending[k][2])
                        view = out[b, s - 1 - start:ln - 1 - start]  # position t-1 predicts token t: a view, no copy
                        if not np.isfinite(view).all():
                            check(out[b:b + 1, s - 1 - start:ln - 1 - start], Microbatch((k,), ln), m, "logits")
                        lo, hi = where[k]
                        lps[lo:hi] = gather_logprobs(view, ids[b, s:ln])
                return None

            ex.run(forward_schedule(topo.stage, topo.n_stages, len(plan)), compute, recv_spec)
            if recv is not None:
                recv.wait()
            elif keeps and not cx.is_root and topo.replica == 0:  # (another replica's go as rows: `RowPost`)
                final.send(lps, 0, tags.SCORE_LOGPROBS, "the log-probs of a round")
            return lps, where

        def stop_now(claimed: int = -1) -> tuple[bool, int]:
            """Every rank of the replica leaves after the same round (and, with replicas, learns the
            round its stage 0 claimed: the largest of the claim and everyone's -1)."""
            from mpi4py import MPI

            flag = np.array([1 if stop is not None and stop.requested else 0, claimed], np.int64)
            comm = topo.replica_comm or cx.world
            if comm.size > 1:
                req = comm.Iallreduce(MPI.IN_PLACE, flag, op=MPI.MAX)
                wait(req, timeout + (topo.n_stages + 1) * grace, cx.ctx, lambda: "every rank to finish the round",
                     "some rank")
            return bool(flag[0]), int(flag[1])

        def write(k_lines: list[int], lps: np.ndarray, where: dict, replica: int = 0, r: int = -1) -> None:
            """Rank 0: a round's rows into the journal, in file order."""
            if refill and not collector.fresh(r):  # (a round computed twice is written once)
                return
            for k in k_lines:
                lo, hi = where[k]
                index = pending[k][0]
                journal.complete(index, score_row(prompts[index], lps[lo:hi]))
                counts["scored"] += hi - lo
            journal.flush()
            counts["done"] += len(k_lines)
            per_replica[replica] += len(k_lines)
            progress.update(done_before + counts["done"], sum(len(pending[k][2]) for k in k_lines))

        shared = topo.n_replicas > 1
        # on_rank_failure = "continue": replicas outlive a dead rank (`comm.recovery`; tp 1: one head per stage 0)
        refill = shared and topo.tp == 1 and job.run.on_rank_failure is OnRankFailure.CONTINUE
        per_replica = [0] * topo.n_replicas
        if self.hooks is not None:
            self.hooks.arm_kill(cx.world.rank)
        wait(cx.world.Ibarrier(), timeout, cx.ctx, lambda: "every rank to start scoring", "some rank")
        post = collector = counter = claim = feed = None
        if shared:
            from ..comm.replicas import Collector, RowPost, SharedCounter

            heads = topo.stage == 0 and topo.tp_rank == 0  # claims the rounds of its replica
            if refill:
                from ..comm.recovery import RecoveringCollector, RefillCounter, RefillFeed

                counter = RefillCounter(cx.world, cx.ctx, timeout, len(self.rounds), cap=4 * len(self.rounds) + 64)
                feed = RefillFeed(counter, list(range(len(self.rounds))), 1, lambda lo, hi: took(lo, hi)) \
                    if heads else None
            else:
                counter = SharedCounter(cx.world, cx.ctx, timeout)
                claim = counter.post(1) if heads else None
            if keeps and topo.replica > 0:  # (replica 0's log-probs reach rank 0 as without replicas)
                post = RowPost(cx.world, cx.ctx, timeout)

            def on_rows(src: int, msg: dict) -> None:
                mbs = self.rounds[msg["round"]]
                where = _where(mbs, pending)
                write(sorted(where), np.asarray(msg["lps"], np.float32), where, msg["replica"], msg["round"])

            if cx.is_root and refill:
                collector = RecoveringCollector(cx.world, cx.ctx, timeout, [[x for g in rep for x in g]
                                                                            for rep in topo.replicas],
                                                counter, list(range(len(self.rounds))), on_rows, lambda r: r,
                                                stages=topo.n_stages, noun="round")
            elif cx.is_root:
                collector = Collector(cx.world, cx.ctx, timeout, {rep[-1][0]: [x for g in rep for x in g]
                                                                  for rep in topo.replicas[1:]}, on_rows)
        notes = (post or RowPost(cx.world, cx.ctx, timeout)) if refill and not cx.is_root else None

        def took(lo: int, hi: int) -> None:  # (refill: every claim, so rank 0 knows whose rounds are whose)
            if collector is not None:
                collector.took(topo.replica, lo, hi)
            else:
                notes._send({"kind": "took", "lo": lo, "hi": hi})

        def pass_end(lost: bool, stopping: bool = False) -> int:
            """Refill: this replica's pass is over: rank 0's word (another pass, or the end)."""
            from ..comm.recovery import say, wait_for_round

            if collector is not None:
                return collector.wait_round(None if lost or feed is None else feed.held,
                                            stopping or (stop is not None and stop.requested))
            if not lost:
                say(notes, "done", **({"held": feed.held} if feed is not None else {}))
            return wait_for_round(cx.world, cx.ctx, timeout)

        def claim_next() -> tuple[bool, int]:
            """Replicas: the next round, claimed by the replica's stage 0 (one claim ahead), agreed with the stop."""
            nonlocal claim
            nxt = -1
            if feed is not None:  # (refill: the feed's next round; none now: the pass ends, `comm.recovery`)
                got = feed()
                nxt = got[0] if got else len(self.rounds)
            elif claim is not None:
                nxt = counter.take(claim)
                claim = counter.post(1) if nxt + 1 < len(self.rounds) else None
            elif topo.stage == 0 and topo.tp_rank == 0:
                nxt = len(self.rounds)
            if collector is not None:
                collector.poll()
            elif post is not None:
                post.beat()
            return stop_now(nxt)

        def one_round(r: int) -> None:
            lps, where = run_round(self.rounds[r])
            lines = sorted(where)  # pending positions of this round, in file order
            counts["tokens"] += sum(len(pending[k][2]) for k in lines)
            if journal is not None:
                write(lines, lps, where, r=r)
            elif post is not None:
                post.rows([], round=r, replica=topo.replica, lps=lps.tolist())

        t0 = time.perf_counter()  # the order of rounds: `engine.rounds.run_rounds` (pure; `RoundClock` prices it)
        word = None  # refill: rank 0's last word (`comm.recovery`)
        if refill:  # passes of rounds until rank 0's end; a dead rank of this replica ends its passes
            from ..comm.recovery import MORE, lost_ranks, say

            stopped, done_rounds = False, 0
            while word is None or word == MORE:
                try:
                    stopped, done = run_rounds(len(self.rounds), one_round, lambda: stop_now()[0], claim_next)
                    done_rounds += done
                    word = pass_end(False, stopping=stopped)
                except Exception as e:
                    dead = lost_ranks(cx, e)
                    if dead is None or 0 in dead:
                        raise
                    log.info("replica %d stops (%s): rank(s) %s died", topo.replica, e, dead)
                    collector.failed(dead) if collector is not None else say(notes, "lost", dead=dead)
                    word = pass_end(True)
        else:
            stopped, done_rounds = run_rounds(len(self.rounds), one_round, lambda: stop_now()[0],
                                              claim_next if shared else None)
        mine_wall = time.perf_counter() - t0
        lost = False
        if refill:
            from ..comm.recovery import SHRINK

            if feed is not None:
                feed.close()
            lost = word == SHRINK
            counter.close(lost)
        elif shared:
            if claim is not None:
                counter.take(claim)
            end_replicas(cx, counter, collector, post)
        wall = time.perf_counter() - t0
        self.stopped = stopped  # agreed by every rank (stop_now)
        if journal is not None:
            journal.close()
            progress.finish()
        timing = stage_timing(cx, ex.stats, recv_wait_s=final.recv_wait_s, bytes_sent=link.bytes_sent + final.bytes_sent)
        mine = {"timing": timing.to_dict(), "signal": stop.signal_name if stop is not None else None,
                "stopped": stopped, "rounds": done_rounds, "tokens": counts["tokens"], "padded": counts["padded"],
                "wall_s": mine_wall, "keeps": keeps, "microbatches": counts["microbatches"], "reused": counts["reused"]}
        if lost:  # every live rank: the stats and the end on the survivors (`lifecycle.ulfm`)
            from ..lifecycle.ulfm import shrink

            cx.world = shrink(cx.world)
        rows = gather_stats(cx, mine, "the score stats")
        stopped = transport.bcast_json(cx.world, any(x["stopped"] for x in rows) if rows else None, 0, timeout,
                                       cx.ctx, "the end of the run") if shared else stopped
        self.stopped = stopped
        if not cx.is_root:
            return None
        stopped_by = (next((r["signal"] for r in rows if r["signal"]), None) or "a stop request") if stopped else None
        replicas = None
        if shared:  # the job's totals are every replica's (each replica's keeping rank counted its rounds)
            kept = [x for x in rows if x["keeps"]]
            done_rounds = sum(x["rounds"] for x in kept)
            counts["tokens"], counts["padded"] = sum(x["tokens"] for x in kept), sum(x["padded"] for x in kept)
            counts["microbatches"] = sum(x["microbatches"] for x in kept)
            replicas = [{"replica": x["timing"]["replica"], "rows": per_replica[x["timing"]["replica"]],
                         "rounds": x["rounds"], "tokens": x["tokens"], "wall_s": round(x["wall_s"], 3),
                         "tokens_per_s": round(x["tokens"] / x["wall_s"], 1) if x["wall_s"] > 0 else None}
                        for x in sorted(kept, key=lambda x: x["timing"]["replica"])]
        kept = [x for x in rows if x["keeps"]]  # (each replica's: the prefix cache's hits)
        hits = [sum(x["reused"] for x in kept), sum(x["tokens"] for x in kept)] if self.prefix_blocks else None
        run = ClusterRun(timings=[StageTiming.from_dict(r["timing"]) for r in rows], total_forward_ms=wall * 1e3,
                         tokens=counts["tokens"], microbatches=counts["microbatches"])
        run.wire = job.run.wire
        return ScoreResult(run=run, total=doc["total"], done_before=done_before, done_now=counts["done"],
                           scored_tokens=counts["scored"], padded_tokens=counts["padded"], rounds=done_rounds,
                           stopped_by=stopped_by, replicas=replicas, prefix_hits=hits)

    def report(self, cx: Any, result: ScoreResult | None) -> int:
        """Rank 0 prints the table and the file's summary, writes --json; 75 when stopped by a signal."""
        from ..io.journal import REQUEUE_EXIT
        from ..outputs import write_output

        if not cx.is_root:
            return REQUEUE_EXIT if self.stopped else 0
        print(result.run.table())
        for r in result.replicas or []:
            print(f"replica {r['replica']}: {r['rows']} lines in {r['rounds']} rounds, {r['tokens']} tokens in "
                  f"{r['wall_s']:.2f} s ({r['tokens_per_s'] or 0.0:.1f} tokens/s)")
        computed = result.run.tokens - (result.prefix_hits[0] if result.prefix_hits else 0)  # (not attached)
        pad = 1 - computed / result.padded_tokens if result.padded_tokens else 0.0
        print(f"{result.done_now} lines scored in {result.rounds} round{'s' if result.rounds != 1 else ''} "
              f"({result.done_before} done before, {result.total} in total): {result.scored_tokens} scored tokens; "
              f"{result.padded_tokens} positions computed, {100 * pad:.1f}% of them padding"
              + (f"; prefix cache: {result.prefix_hits[0]} of {result.prefix_hits[1]} line tokens reused "
                 f"({100 * result.prefix_hits[0] / result.prefix_hits[1] if result.prefix_hits[1] else 0:.1f}%)"
                 if result.prefix_hits is not None else ""))
        summary = self.summary_line()
        if "--json" in cx.outputs:
            doc = {**result.to_dict(), "summary": asdict(self.summary())}
            write_output(cx.outputs["--json"], lambda tmp: tmp.write_text(json.dumps(doc, indent=2)))
        print(summary)
        sys.stdout.flush()
        if result.stopped_by:
            print(f"rlx-mpi: stopped by {result.stopped_by} after the current round: "
                  f"{result.done_before + result.done_now} of {result.total} lines are in {self.opts.out}; "
                  f"run the same command again to resume (exit code {REQUEUE_EXIT})", file=sys.stderr)
            return REQUEUE_EXIT
        return 0

    def summary(self):
        from ..io.scoring import read_summary

        return read_summary(self.opts.out)

    def summary_line(self) -> str:
        """``score: <summary of every row of --out>`` (rank 0, after the journal is closed)."""
        if not self.opts.out.exists():
            return f"score: no rows in {self.opts.out}"
        return f"score: {self.opts.out}: {self.summary().line()}"
