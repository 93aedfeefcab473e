"""``rlx-mpi generate``: a prompt file in, a completions file out, across the pipeline.

`GenerateDriver` is the command on the shared start-up (`Cluster.start`): it resolves the
options (the job's ``[generate]`` under the flags), reads the prompts and opens the journal on
rank 0 (which fixes the cache's slots and longest sequence), plans with the KV cache priced
(`placement.kv_cost`), resets every stage's cache after the build, and runs the ring.

The ring itself: `engine.ring.run_ring` (the order, pure) with `decode_ring.DecodeRing` as its
pipe over MPI (the decode ring's note there).
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from . import JournalDriver, end_replicas, gather_stats, prefix_cache_on, stage_timing, stages_before_plan
from .decode_ring import DecodeRing, lockstep_broken
from .. import rules
from ..comm import transport
from ..config import OnRankFailure
from ..lifecycle.ulfm import shrink as ulfm_shrink
from ..errors import ConfigError
from ..lifecycle.hooks import NO_HOOKS, TestHooks
from ..io.batch_io import format_result, is_batch, stop_text
from ..io.structured import grammars_for, job_constraint, last_stage_masks
from ..model.stage import caps_of
from ..engine.block_pool import PREFIX_POOL_ROWS
from ..engine.records import Request
from ..engine.sampling import SamplingParams, logprob_entries
from ..engine.scheduler import Scheduler, Seq, split_batch
from ..io.stats import GenerateResult, StageTiming

__all__ = ["GenerateDriver", "GenerateOptions", "GenerateResult"]

log = logging.getLogger("rlx_mpi")



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
    structured: Any = None  # --structured: the `constraints.Constraint` of every row that gives none of its own
    structured_where: str = "generate --structured"

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
                   **job_constraint(getattr(flags, "structured", None), sec.structured, job.path),
                   eos_where="generate --eos-id" if flags.eos_id is not None else f"{job.path}: [generate] eos_id")


class GenerateDriver(JournalDriver):
    """The ``generate`` command as a driver of the shared start-up (see `rlx_mpi.drivers`).

    Rank 0 reads the prompts and opens the journal (an agreed step), every rank learns the
    pending prompts, plans with their KV bytes, builds, resets its cache and runs the decode
    ring. `report` exits with the requeue code when a stop signal ended it early.
    """

    Options = GenerateOptions
    command = "generate"
    decodes = True
    uses_adapters = True  # rows may name the job's LoRA adapters (`Cluster.build` loads them)

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
        super().configure(cx)
        cx.job = cx.job.with_adapters(getattr(self.flags, "adapter", None))  # --adapter NAME=DIR
        if cx.job.adapters:  # each one's adapter_config.json now: a bad one is one line before any plan
            from ..families.hf.peft import read_adapter_config

            for name, path in cx.job.adapters:
                read_adapter_config(Path(path), name)

    def load(self, cx: Any) -> tuple[int, int] | None:
        """Prompts and journal on rank 0; (cache slots, longest sequence), None when all are done."""
        from ..io.batch_io import read_requests
        from ..io.identity import RunIdentity, beside_settings, unplaced_settings
        from ..io.journal import Journal
        from ..io.tokenizer import eos_ids_beside, load_tokenizer

        cx.prepare()
        dims, job, opts = cx.dims, cx.job, self.opts

        def load() -> dict:  # (rank 0: `read_work`)
            rules.token_in_vocab(opts.eos_id, dims.vocab_size, opts.eos_where, f"give an id in [0, {dims.vocab_size}), "
                                 "or leave it unset to stop at the checkpoint's own (generation_config.json)")
            rules.at_most(opts.logprobs, dims.vocab_size, "generate --logprobs")
            eos = sorted({opts.eos_id} if opts.eos_id is not None else set(eos_ids_beside(job.model.checkpoint)))
            if opts.ignore_eos:
                eos = []
            tokenizer = load_tokenizer(job.model.checkpoint)
            from ..io.shards import select

            grammars: list = []  # (built on the first constraint: llguidance and the tokenizer, once)

            def check_constraint(c: Any, where: str) -> str | None:
                if not grammars:
                    grammars.append(grammars_for(tokenizer, dims.vocab_size, eos, where, opts.ignore_eos))
                return grammars[0].check(c)

            if opts.structured is not None:
                bad = check_constraint(opts.structured, opts.structured_where)
                if bad:
                    raise ConfigError(opts.structured_where, f"its {opts.structured.kind} constraint cannot run: {bad}",
                                      "fix the schema / grammar (docs/structured-output.md lists what is supported)")
            prompts = read_requests(opts.prompts, vocab_size=dims.vocab_size, max_positions=dims.max_positions,
                                    max_new_tokens=opts.max_new_tokens, tokenizer=tokenizer,
                                    check_constraint=check_constraint, adapters=tuple(n for n, _ in job.adapters),
                                    base_names=job.model.base_names)
            prompts, shard = select(prompts, opts.shard, str(opts.prompts))
            sampled = any(p.settings and not p.settings.params(opts.sampling).greedy for p in prompts)
            identity = RunIdentity.for_generate(job.model.checkpoint, opts.sampling, opts.max_new_tokens,
                                                eos_ids=eos, logprobs=opts.logprobs, sampled=sampled)
            identity = identity.with_settings(**beside_settings(tokenizer))  # (+ the layout's: `settle`)
            if job.adapters:  # each adapter's files: another adapter under the same name is another run
                from ..families.hf.peft import adapter_digest

                identity = identity.with_settings(adapters={n: adapter_digest(p, n) for n, p in job.adapters})
            if opts.structured is not None:  # (a row's own constraint is in its digest)
                identity = identity.with_settings(structured=opts.structured.to_json())
            journal = Journal(opts.out, prompts, inputs=(opts.prompts, job.path, job.model.checkpoint,
                                                         *self.argv_inputs), sync_s=opts.sync_s, identity=identity,
                              shard=shard, settle=True, adopt=bool(getattr(self.flags, "adopt_output", False)))
            self.holder.update(journal=journal, tokenizer=tokenizer, prompts=prompts)
            if not journal.pending:  # nothing to place or compute: check what can be known without a plan
                journal.check_done(**unplaced_settings(job, "generate"))
            rows = [r for p in journal.pending if p.error is None for r in Request.rows_of(p, opts.max_new_tokens, opts.sampling, opts.structured)]
            longest = max((len(r.tokens) + (r.max_new_tokens or opts.max_new_tokens) for r in rows), default=1)
            table: dict[str, int] = {}  # each distinct constraint once (a schema shared by many rows)
            constraints = []
            for r in rows:
                if r.constraint is not None and r.constraint.key not in table:
                    table[r.constraint.key] = len(constraints)
                    constraints.append(r.constraint.to_json())
            pending = [r.to_wire(table) for r in rows]  # (plain JSON: the broadcast below)
            failed = [p.index for p in journal.pending if p.error is not None]
            return {"pending": pending, "constraints": constraints, "total": len(prompts), "eos": eos, "max_seq": longest,
                    "first": shard["lines"][0] if shard else 0,  # (a shard's prompts are renumbered from 0)
                    "failed_now": failed, "failed": sum(p.error is not None for p in prompts),
                    "logprobs": any(p.settings and p.settings.logprobs for p in journal.pending),
                    "top_logprobs": max((p.settings.top_logprobs for p in journal.pending if p.settings), default=0),
                    "stops": any(p.settings and p.settings.stop for p in journal.pending)}

        doc = self.read_work(cx, load)
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
        self.groups = opts.groups or stages_before_plan(cx)  # (replicas = "auto": set again in check_plan)
        return self.groups * opts.batch, doc["max_seq"]

    def cost(self, cx: Any) -> Any:
        """The family's cost with the KV term cut to what the ranks' policies keep, as a function of
        the stage count (one group of slots per stage by default: `placement.plan_grid`), the
        layers balanced on a decode step of the slots (`ModelCost.planned_step`)."""
        from ..model.cost import decoding, kv_cost, with_adapters

        specs = [cx.job.kv_for(r) for r in range(cx.world.size)]
        cx.prepare()
        family, cfg, opts = cx.family, cx.model_config, self.opts
        extra = PREFIX_POOL_ROWS if self._prefix_cache_on(cx) else 0  # the pool: as many positions as that many slots
        rows = opts.kv_rows if opts.kv_rows and self._paged(cx) else 0  # (a paged cache: the budget, not the slots)
        adapters = 0
        if cx.job.adapters:  # the job's LoRA adapters, as the stages stack them (`decoder.lora`)
            from ..families.hf.peft import stacked_layer_bytes

            adapters = stacked_layer_bytes(list(cx.job.adapters), cfg)
        return lambda stages: decoding(with_adapters(kv_cost(family.cost(cfg, (rows or (opts.groups or stages) * opts.batch)
                                                                         + extra, cx.seq), specs, cx.seq), adapters))

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
        from ..comm.replicas import Collector, ReplicaFeed, RowPost, SharedCounter

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
        from ..engine.constraints import Constraint

        table = [Constraint.from_json(c) for c in doc.get("constraints", [])]
        items = [Request.from_wire(d, table) for d in doc["pending"]]
        shared = topo.n_replicas > 1
        wait(cx.world.Ibarrier(), timeout, cx.ctx, lambda: "every rank to start generating", "some rank")
        # on_rank_failure = "continue": replicas outlive a dead rank (`comm.recovery`; tp 1: one leader per stage 0)
        refill = shared and topo.tp == 1 and job.run.on_rank_failure is OnRankFailure.CONTINUE
        self.hooks.arm_kill(cx.world.rank)
        if refill:
            from ..comm.recovery import refill_feed

            counter, feed = refill_feed(cx, items, opts.batch, lambda lo, hi: took(lo, hi))
        else:
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
        constraints = {r.key: r.constraint for r in items if r.constraint is not None}
        masks = None
        if constraints:  # (every rank knows: the rows were broadcast) the last stage compiles, agreed
            masks = cx.agree(lambda: last_stage_masks(job.model.checkpoint, cx.dims.vocab_size, doc["eos"],
                                                      str(opts.prompts), opts.ignore_eos, constraints.values())
                             if cx.stage.last else None, "compiling the structured-output grammars")
        index = {n: i for i, (n, _) in enumerate(job.adapters)}  # the job's order: the stages' stacks'
        adapters = {r.key: index[r.adapter] for r in items if r.adapter is not None}
        ring = DecodeRing(cx, opts.sampling, sched.header_size, k_logprobs=k, names=names, per_key=per_key,
                          with_logprobs=doc["logprobs"], hooks=self.hooks, constraints=constraints, masks=masks,
                          adapters=adapters)
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
                if refill:  # (out follows rows here)
                    pairs = [(r, o) for r, o in zip(rows, out) if collector.fresh(o[0], o[1].get("sample", 0))]
                    rows, out = [r for r, _ in pairs], [o for _, o in pairs]
                for index, row in out:
                    write(index, row)
            elif post is not None and driving and out:  # another replica's rows go to the writer
                post.rows([[index, row] for index, row in out])
            taken(topo.replica, rows, sum(len(r.new) for r in rows))

        def on_rows(src: int, msg: dict) -> None:
            rows = msg["rows"]
            if refill:
                rows = [(i, row) for i, row in rows if collector.fresh(i, row.get("sample", 0))]
            for index, row in rows:
                write(index, row)
            taken(replica_of[src], rows, sum(len(row["tokens"]) for _, row in rows))

        if refill and cx.is_root:
            from ..comm.recovery import RecoveringCollector

            collector = RecoveringCollector(cx.world, cx.ctx, timeout, [[x for g in rep for x in g] for rep in topo.replicas],
                                            counter, items, on_rows, lambda r: (r.index, r.sample), stages=topo.n_stages)
        else:
            collector = (Collector(cx.world, cx.ctx, timeout, {rep[0][0]: [x for g in rep for x in g]
                                                               for rep in topo.replicas[1:]}, on_rows)
                         if shared and cx.is_root else None)

        def took(lo: int, hi: int) -> None:  # (refill: every claim, so rank 0 knows whose rows are whose)
            if collector is not None:
                collector.took(topo.replica, lo, hi)
            else:
                post._send({"kind": "took", "lo": lo, "hi": hi})

        hold = [self.hooks.hold_polls if driving else 0]

        def held() -> bool:  # a test's hold begins: on rank 0 once a row is written, elsewhere at its own first
            return journal.done if journal is not None else per_replica[topo.replica]["rows"] > 0

        def stop_now(final: bool = False) -> bool:
            if hold[0] and held():  # (each replica then waits for the stop: none can finish the file first)
                for _ in range(hold[0]):
                    if stop.requested:
                        break
                    if collector is not None:
                        collector.poll()
                    elif post is not None:
                        post.beat()
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
                    lockstep_broken(cx, ring, "after the last step" if final else f"at step {ring.stats.steps}")
            return bool(flag[0])

        if cx.is_root:  # requests that cannot run: their error lines, in order with the others
            counts["done"] += self._write_failed(doc["failed_now"])
        t0 = time.perf_counter()
        lost = False
        if refill:
            from ..comm.recovery import run_rounds

            def again() -> None:  # (another round: stage 0 asks its feed again)
                sched.feed = feed

            stopped, lost = run_rounds(cx, lambda: ring.drive(sched, on_done, stop_now) if topo.stage == 0 else ring.relay(),
                                       again, feed, collector, post)
        else:
            stopped = ring.drive(sched, on_done, stop_now) if topo.stage == 0 else ring.relay()
        if topo.stage == 0 and topo.tp > 1:  # the steps drained after the last check
            stop_now(final=True)
        mine_wall = time.perf_counter() - t0
        if shared:
            if feed is not None:
                feed.close()
            counter.close(lost) if refill else end_replicas(cx, counter, collector, post)
        wall = time.perf_counter() - t0
        if journal is not None:
            journal.close()
            progress.finish()
        st = ring.stats
        timing = stage_timing(cx, ring.ex.stats, recv_wait_s=ring.ring.recv_wait_s, wall_s=mine_wall, kv=str(kv),
                              kv_bytes=self.kv_bytes, prefill_ms=st.prefill_s * 1e3, decode_ms=st.decode_s * 1e3,
                              sample_ms=st.sample_s * 1e3)
        mine = {"timing": timing.to_dict(), "stopped": bool(stopped) if topo.stage == 0 else False,
                "signal": stop.signal_name,
                "prefix": [sched.reused, sched.prompt_tokens] if driving and sched.pool is not None else None,
                "peak": sched.peak_rows if driving else 0}
        if lost:  # every live rank: the stats and the end on the survivors (`lifecycle.ulfm`)
            cx.world = ulfm_shrink(cx.world)
        rows = gather_stats(cx, mine, "the generation stats")
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
