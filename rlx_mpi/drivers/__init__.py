"""One module per MPI command's work, each a driver of the shared start-up (`Cluster.start`).

A driver says what differs between commands; everything else (logging, the job file, probe,
plan, build, deadlines, faults, stop signals, the finish barrier) is common. Its members, in
the order `Cluster.start` and `Cluster.run` call them on every rank:

    command        "run" | "generate" | ...: names the per-rank logs
    stop_signals   True: SIGTERM/SIGINT/SIGUSR1 set ``cx.stop`` instead of ending the rank
    plan_only      True: stop after the plan (no build, no weights read)
    decodes        True: the work decodes token by token (the kernels generation adds are
                   compiled at start-up with the others: `Cluster.build`'s cold-start note)
    configure(cx)  resolve the command's options against ``cx.job`` (agreed)
    outputs(cx)    ([(flag, path | None)], {description: input path}): checked on rank 0 before
                   any compute (`outputs.check_outputs`); ``cx.outputs`` maps flag -> Output
    load(cx)       read the work (input ids, prompts); return (batch, seq) for the planner, or
                   None when there is nothing to do
    cost(cx)       the `ModelCost` the planner places (``cx.cost()``, or with the KV cache priced)
    check_plan(cx) refuse a plan the command cannot run (agreed)
    ready(cx)      after the build (generate: allocate the KV cache)
    drive(cx)      the work; its result on rank 0 (faults abort the job)
    report(cx, r)  print and write the result; return the exit code

`run.py` is the GPipe forward of ``rlx-mpi run``; `generate.py` the decode ring of ``rlx-mpi
generate``; `score.py` the teacher-forced forward of ``rlx-mpi score``. `Driver` gives the
members most commands leave as they are.

The other commands' bodies are one function each, beside them (`cli.py` only parses and
dispatches): `probe.py` (``rlx-mpi probe``: MPI, but no shared start-up), `plan.py` (``rlx-mpi
plan``, no MPI), `convert.py` (``rlx-mpi convert`` and ``init-model``, no MPI).
"""

from __future__ import annotations

from typing import Any

__all__ = ["Driver", "JournalDriver", "forward_window", "prefix_cache_on", "stages_before_plan", "stage_timing",
           "gather_stats", "end_replicas"]


def stages_before_plan(cx: Any) -> int:
    """The stage count a driver sizes its work for before the plan exists (groups, rounds): the
    ranks over tp over the replicas the job names (under ``replicas = "auto"`` one replica, and the
    driver sizes it again once planned, in ``check_plan``)."""
    p = cx.job.placement
    return cx.world.size // p.tp // (p.replicas if p.replicas != "auto" else 1)


def stage_timing(cx: Any, stats: Any, *, recv_wait_s: float = 0.0, bytes_sent: int | None = None,
                 wall_s: float | None = None, **extra: Any) -> Any:
    """This rank's `StageTiming` row from its executor's ``stats`` (`executor.ExecStats`), what
    every command's table shows; ``recv_wait_s`` adds waits outside the executor (a ring's or the
    last stage's link), ``extra`` the command's own columns (generate's prefill / decode time)."""
    from ..io.stats import StageTiming, peak_rss_bytes

    a, topo, job = cx.assignment, cx.topology, cx.job
    return StageTiming(
        rank=cx.world.rank, host=cx.ctx.host, stage=a.stage, tp_rank=topo.tp_rank, tp_ranks=a.ranks,
        layers=a.layers, device=job.override_for(cx.world.rank).device, build_ms=cx.build_ms,
        forward_ms=stats.compute_s * 1e3, recv_wait_ms=(stats.recv_wait_s + recv_wait_s) * 1e3,
        send_ms=stats.send_wait_s * 1e3, bytes_sent=stats.bytes_sent if bytes_sent is None else bytes_sent,
        est_bytes=a.est_bytes, weight_bytes=cx.stage.weight_bytes, peak_rss_bytes=peak_rss_bytes(),
        pack_ms=stats.pack_s * 1e3, unpack_ms=stats.unpack_s * 1e3,
        wall_ms=(stats.wall_s if wall_s is None else wall_s) * 1e3, precision=job.precision_for(cx.world.rank).value,
        replica=topo.replica if topo.n_replicas > 1 else None, **extra)


def gather_stats(cx: Any, mine: dict, what: str) -> list | None:
    """Every rank's ``mine`` on rank 0 (None elsewhere), under the run's deadline staggered by the
    stage count (a rank still finishing its last step is waited for)."""
    from ..comm import transport

    timeout = cx.job.run.timeout_s
    grace = max(1.0, 0.1 * timeout)
    return transport.gather_json(cx.world, mine, 0, timeout + (cx.topology.n_stages + 1) * grace, cx.ctx, what)


def end_replicas(cx: Any, counter: Any, collector: Any, post: Any) -> None:
    """The replicas' wind-down once this rank's work is done: rank 0's collector takes the other
    replicas' last rows and tells them the end; another rank says it is done and waits for that
    end; then the shared counter is freed (`comm.replicas`)."""
    from ..comm.replicas import RowPost, wait_for_end

    timeout = cx.job.run.timeout_s
    if collector is not None:
        collector.finish()
    else:
        (post or RowPost(cx.world, cx.ctx, timeout)).done()
        wait_for_end(cx.world, cx.ctx, timeout)
    counter.close()


def forward_window(cx: Any, command: str) -> int:
    """The ``kv_cache = "window:W"`` of this rank as a window for ``stage.forward(x, window=W)``
    (0: full attention), so that ``run`` and ``score`` compute the model ``generate`` does under
    the same job file; a family whose forward takes no window is refused (agreed), never ignored."""
    kv = cx.job.kv_for(cx.world.rank)
    window = kv.window if kv.policy == "window" else 0

    def check() -> None:
        from ..errors import ConfigError
        from ..model.stage import caps_of

        if window and not caps_of(cx.stage).forward_window:
            raise ConfigError(f"{cx.job.path}: [run] kv_cache", f"{kv} is a sliding-window model, and family "
                              f"{cx.family.name!r} cannot apply a window in its forward ({command} would "
                              "compute another model than generate)", 'use kv_cache = "full" for this family')

    cx.agree(check, "checking the kv_cache window")
    return window


def prefix_cache_on(cx: Any, wanted: bool) -> bool:
    """Does this job keep a prefix cache (``generate`` and ``score``)? The same answer on every rank,
    from the job alone: on unless turned off (``wanted``), without recompute and without a window
    (the job's or a layer's) shorter than a block (`kv_cache.prefix_cacheable`), for a family whose
    Stage copies blocks (`DecoderStage.reset_prefix`)."""
    if not wanted or not getattr(cx.family, "prefix_cache", False):
        return False
    from ..engine.block_pool import BLOCK_SIZE

    job, cfg = cx.job, cx.model_config
    if any(job.kv_for(r).policy == "none" or 0 < job.kv_for(r).window < BLOCK_SIZE for r in range(cx.world.size)):
        return False
    window = getattr(cfg, "window", None)
    layers = getattr(cfg, "num_hidden_layers", 0)
    return not (callable(window) and any(0 < (window(n) or 0) < BLOCK_SIZE for n in range(layers)))


class Driver:
    """Defaults of the driver members above; a command overrides what differs."""

    command = ""
    stop_signals = False
    plan_only = False
    decodes = False

    def cost(self, cx: Any) -> Any:
        return cx.cost()

    def check_plan(self, cx: Any) -> None:
        pass

    def ready(self, cx: Any) -> None:
        pass


class JournalDriver(Driver):
    """A command that reads a prompt file and writes a resumable output file (generate, score):
    ``self.opts`` has ``prompts`` and ``out``; ``self.flags`` has ``json``."""

    stop_signals = True  # finish the step or round, write what is complete, exit 75
    refills = True  # replicas (tp 1) outlive a dead rank under on_rank_failure = "continue" (`comm.recovery`)
    Options: Any = None  # the command's options record: ``Options.resolve(flags, job)``

    def configure(self, cx: Any) -> None:
        self.opts = self.Options.resolve(self.flags, cx.job)

    def read_work(self, cx: Any, load: Any) -> dict:
        """``load()`` on rank 0 (it reads the prompt file and opens the journal) as one agreed step,
        its document broadcast to every rank as plain JSON: ``self.doc``."""
        from ..comm import transport

        doc = cx.agree(lambda: load() if cx.is_root else None, "reading the prompts")
        self.doc = transport.bcast_json(cx.world, doc, 0, cx.job.run.startup_timeout_s, cx.ctx, "the prompts")
        return self.doc

    def outputs(self, cx: Any) -> tuple[list, dict]:
        o = self.opts
        inputs = {"the job file": cx.job.path, "the checkpoint": cx.job.model.checkpoint,
                  "the prompt file": o.prompts, "the output file": o.out}
        return [("--json", self.flags.json)], inputs

    def settle(self, cx: Any) -> None:
        """Once placed, rank 0's journal learns the settings stated per rank or acting at the stage
        cuts (`identity.layout_settings`) and decides on the rows already there (agreed), before
        any compute: a resume made another way is refused naming the setting."""
        from ..io.identity import layout_settings

        def settle() -> None:
            journal = self.holder.get("journal")
            if journal is not None:
                journal.settle(**layout_settings(cx.job, cx.plan_, self.command, cx.caps))

        cx.agree(settle, "checking the rows already in the output")
