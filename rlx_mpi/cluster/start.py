"""`Cluster`: the one start-up every MPI command shares, and what its driver may use.

    cx = Cluster.start("jobs/tiny.toml", driver)   # every rank; None when there is nothing to do
    result = cx.run(driver)                         # the command's work (faults abort the job)
    code = driver.report(cx, result)

`start` is: logging (``--log-dir``) -> the job file -> the finish deadline (`launch.py`) ->
the driver's options -> agreed output checks (before any compute) -> the driver's inputs
(which fix batch and seq) -> probe -> plan (the driver's cost) -> build -> the driver's
ready step. `run` installs the stop signals when the driver acts on them (``generate``) and
turns any fault into one report and an abort. Every rank runs the same calls in the same
order; start-up steps are agreed (`agree`: a bad input on any rank becomes the same
`AgreedFailure` on all). Drivers live in `rlx_mpi.drivers`; they read the cluster's public
attributes (``job``, ``world``, ``ctx``, ``family``, ``model_config``, ``dims``, ``stage``,
``topology``, ``assignment``, ``plan_``, ``batch``, ``seq``, ``outputs``, ``stop``) and never
assign them. The files every rank must read alike (the input ids, the checkpoint on every
host) are checked by `inputs.py`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np

from .. import rules
from ..comm import transport
from .caps import NodeCaps, mpi_versions_differ, own_affinity, probe_local
from ..model.checkpoint import H5ParamSource, read_header, stored_precision
from ..config import JobConfig, OnRankFailure, Precision, load_job
from ..errors import CheckpointError, ConfigError, FitError, InputError
from ..lifecycle.faults import STARTUP_SETTING, RankContext, agree, report_and_abort, wait
from .inputs import check_everywhere, digest, read_ids
from ..outputs import check_output
from ..lifecycle.supervisor import default_startup_timeout_s
from .placement import Assignment, plan_grid
from ..model.cost import ModelCost, with_held_scales
from ..families import get_family, load_plugins, require_preset
from ..model.stage import ModelDims, Stage, TensorParallel
from ..io.stats import ClusterRun
from ..comm.topology import Topology

__all__ = ["Cluster", "resolve_precision"]

log = logging.getLogger("rlx_mpi")


def _pin_threads(cpus: int | None) -> None:
    """Limit BLAS (and OpenMP) threads to this rank's share of the host's cores."""
    if not cpus:
        return
    from threadpoolctl import threadpool_limits

    threadpool_limits(limits=cpus)
    from .. import kernels

    kernels.set_threads(cpus)  # numba's prange kernels get the same share as BLAS


class Cluster:
    """A configured, probed, planned and built pipeline, as seen by one rank."""

    def __init__(self, job: JobConfig, *, comm: Any = None, debug: bool = False):
        from mpi4py import MPI

        self.job = job
        self.world = (comm or MPI.COMM_WORLD).Dup()
        self.ctx = RankContext(rank=self.world.rank, size=self.world.size, host=socket.gethostname(), debug=debug)
        self.ctx.extra["deadline_setting"] = "[run] startup_timeout_s"  # until the run starts (drive)
        self.family = None
        self.model_config: Any = None
        self.batch, self.seq = job.run.batch, job.run.seq
        self.caps: list[NodeCaps] = []  # every rank's on rank 0; this rank's elsewhere
        self.plan_: list[Assignment] = []
        self.topology: Topology | None = None
        self.stage: Stage | None = None
        self.build_ms = 0.0
        self.adapter_bytes = 0  # this rank's LoRA adapters (`build`)
        self.first_on_node = True  # the lowest rank of its node (probe)
        self._prepared = False
        self.phases: list[tuple[str, float, float]] = []  # start-up (name, perf_counter start, seconds) for the trace
        self.outputs: dict[str, Any] = {}  # flag -> outputs.Output, checked at start-up (rank 0)
        self.stop: Any = None  # signals.StopRequest while a driver that acts on stop signals runs

    # -- the shared start-up ---------------------------------------------------------------------

    @classmethod
    def start(cls, job_path: str | os.PathLike, driver: Any, *, debug: bool = False,
              log_dir: str | os.PathLike | None = None, comm: Any = None,
              adjust: Callable[[JobConfig, int], JobConfig] | None = None) -> "Cluster | None":
        """The start-up of every MPI command (see the module docstring); None when the driver
        has nothing to do (every prompt already complete). ``driver.plan_only`` stops after the plan.
        ``comm``: the survivors of a job that lost ranks, starting it again, and ``adjust`` the job
        for them (`cluster.restart`)."""
        from mpi4py import MPI

        from ..lifecycle.launch import set_finish_timeout
        from ..lifecycle.logdir import setup_logging
        from ..outputs import check_outputs

        started = time.perf_counter()
        if comm is None:  # (a restart: logging is set up, ULFM checked and the supervisor tolerant)
            setup_logging(MPI.COMM_WORLD, debug, log_dir, driver.command)
        cx = cls.from_path(job_path, debug=debug, comm=comm, adjust=adjust)
        set_finish_timeout(cx.job.run.timeout_s, cx.world.size)
        if cx.job.run.on_rank_failure is OnRankFailure.CONTINUE and comm is None:  # refused, one line, without ULFM
            from ..lifecycle import supervisor, ulfm

            cx.agree(lambda: ulfm.check(cx.world, f"{cx.job.path}: [run] on_rank_failure"),
                     "checking fault tolerance")
            supervisor.tolerate()
        cx.phases.append(("start", started, time.perf_counter() - started))
        cx.agree(lambda: driver.configure(cx), "reading the command's options")

        def outputs() -> list:  # before any compute: a bad output path must not cost the run
            return check_outputs(*driver.outputs(cx)) if cx.is_root else []

        cx.outputs = {o.flag: o for o in cx.agree(outputs, "checking the output paths")}
        with cx.phase("load inputs"):
            shape = driver.load(cx)
        if shape is None:
            return None
        cx.batch, cx.seq = shape
        with cx.phase("probe"):
            cx.probe()
        with cx.phase("plan"):
            cx.plan(driver.cost(cx))
        driver.check_plan(cx)
        if driver.plan_only:
            return cx
        with cx.phase("build"):
            cx.build(decode=driver.decodes, adapters=getattr(driver, "uses_adapters", False))
        driver.ready(cx)
        return cx

    def run(self, driver: Any, *, restart: bool = False) -> Any:
        """The driver's work (`driver.drive`) under the run's deadlines; the stop signals are
        caught meanwhile when ``driver.stop_signals`` (``cx.stop``). Any exception on any rank is
        reported once and aborts the job. ``restart`` (under ``on_rank_failure = "continue"``): a
        death the layout cannot carry raises `ulfm.Restart` on every survivor instead, for the
        caller to start the job again on them (`cluster.restart`)."""
        from ..lifecycle import faults

        self.ctx.extra["deadline_setting"] = "[run] timeout_s"
        if driver.stop_signals:
            from ..lifecycle.signals import StopRequest

            self.stop = StopRequest().install()
        finished = False
        tolerant = self.job.run.on_rank_failure is OnRankFailure.CONTINUE
        if tolerant:
            from ..lifecycle import ulfm

            faults.set_watch(ulfm.watch(self.world, self.refilled(driver), self.ctx.describe()))
        try:
            result = driver.drive(self)
            finished = True
            return result
        except Exception as e:
            info = sys.exc_info()
            if tolerant:  # a failure not survived: start again on the survivors, or requeue
                faults.set_watch(None)
                if restart and (dead := ulfm.restartable(self.world, e, self.refilled(driver))):
                    raise ulfm.Restart(self.world, dead, e) from e
                if ulfm.is_failure(e):
                    from ..lifecycle import supervisor

                    info = (ulfm.Requeue, ulfm.requeue(self.ctx.describe(), self.world, e), info[2])
                    supervisor.exiting(ulfm.Requeue.exit_code)  # (the launcher's kill after the abort keeps it)
                    ulfm.end_if_alone(self.world, info[1])
            report_and_abort(self.world, self.ctx, info)
            raise
        finally:
            faults.set_watch(None)
            if self.stop is not None:
                self.stop.restore(finished)  # finished: a stop signal from now on is ignored (restore's note)

    def refilled(self, driver: Any) -> list[list[int]] | None:
        """Each replica's ranks when they outlive a dead rank (`comm.recovery`: a driver that
        ``refills``, replicas, tp 1), else None: any death then ends the layout (`ulfm.deadly`)."""
        topo = self.topology
        if not getattr(driver, "refills", False) or topo is None or topo.n_replicas < 2 or topo.tp != 1:
            return None
        return [[x for g in rep for x in g] for rep in topo.replicas]

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Record a start-up phase (perf_counter start, seconds) for the trace."""
        t0 = time.perf_counter()
        yield
        self.phases.append((name, t0, time.perf_counter() - t0))

    # -- start-up (agreed) ---------------------------------------------------------------------

    @classmethod
    def from_path(cls, path: str | os.PathLike, *, comm: Any = None, debug: bool = False,
                  adjust: Callable[[JobConfig, int], JobConfig] | None = None) -> "Cluster":
        """Load and check the job file on every rank; a bad file fails all ranks alike. ``adjust``:
        the job for the ranks of ``comm`` (the survivors of a restart: `restart.job_on_survivors`)."""
        from mpi4py import MPI

        world = comm or MPI.COMM_WORLD
        ctx = RankContext(rank=world.rank, size=world.size, host=socket.gethostname(), debug=debug)

        def load() -> JobConfig:
            job = load_job(path)
            if adjust is not None:
                job = adjust(job, world.size)
            job.check_world(world.size)
            return job

        # the job's own start-up deadline is not known until its file is read
        return cls(agree(world, ctx, default_startup_timeout_s(), load, "reading the job file",
                         "RLX_MPI_STARTUP_TIMEOUT_S"), comm=comm, debug=debug)

    def agree(self, fn, what: str = "start-up", setting: str = STARTUP_SETTING):
        """``fn()`` on every rank as one agreed step under ``[run] startup_timeout_s``: if it raises
        on any rank, every rank raises the same `AgreedFailure` (see `faults.agree`); ``setting``
        is what a deadline's message tells the user to raise."""
        return agree(self.world, self.ctx, self.job.run.startup_timeout_s, fn, what, setting)

    @property
    def is_root(self) -> bool:
        return self.world.rank == 0

    def prepare(self) -> None:
        """Make sure the checkpoint exists (rank 0 creates a preset's), then read its config."""
        if self._prepared:
            return
        ckpt = self.job.model.checkpoint
        created: list[bool] = []

        def create() -> None:
            if self.is_root and not ckpt.exists() and self.job.model.preset:
                preset = self.job.model.preset
                family, cfg = require_preset(preset, f"{self.job.path}: [model] preset")
                try:
                    ckpt.parent.mkdir(parents=True, exist_ok=True)
                except OSError as e:
                    raise ConfigError(f"{self.job.path}: [model] checkpoint",
                                      f"cannot create folder {ckpt.parent} ({os.strerror(e.errno or 0).lower()})",
                                      "choose a writable folder for the preset checkpoint") from None
                check_output(f"{self.job.path}: [model] checkpoint", ckpt, {"the job file": self.job.path},
                             stream_ok=False)
                log.info("checkpoint %s not found: creating it from preset %r (seed %d)", ckpt, preset,
                         self.job.model.init_seed)
                family.init_random(ckpt, cfg, seed=self.job.model.init_seed)
                created.append(True)

        self.agree(create, "creating the preset checkpoint")
        self.agree(lambda: check_everywhere(self.world, self.ctx, ckpt, self.job.run.startup_timeout_s,
                                              bool(created)), "checking every rank sees the checkpoint")

        def header() -> None:
            load_plugins(self.job.model.plugins, f"{self.job.path}: [model] plugins")
            family_name, config_json = read_header(ckpt)
            self._digests = {"job": digest(Path(self.job.path).read_bytes()),
                             "ckpt": digest(f"{family_name}|{config_json}|{ckpt.stat().st_size}".encode())}
            family = get_family(family_name)
            if family is None:
                raise CheckpointError(str(ckpt), f"model family {family_name!r} is not registered",
                                      "import the package that registers it (rlx_mpi.register_family)")
            cfg = family.load_config(config_json, str(ckpt))
            family.check_tp(cfg, self.job.placement.tp, f"{self.job.path}: [placement] tp")
            self.job.check_layers(family.cost(cfg, 1, 1).n_layers, self.world.size)
            self.family, self.model_config = family, cfg
            # precision "auto" made concrete before the plan, the build and the run identity read it
            self.job, note = resolve_precision(self.job, family)
            if note:  # (every rank's own log; rank 0's on the terminal)
                log.info("%s", note)

        self.agree(header, "reading the checkpoint header")
        self._agree_inputs_match()
        self._prepared = True

    def _agree_inputs_match(self) -> None:
        """Every rank must see the same job file and checkpoint (a stale node-local copy would
        otherwise fail later as a garbled message or a wrong result): compare digests."""
        rows = transport.gather_json(self.world, self._digests, 0, self.job.run.startup_timeout_s, self.ctx,
                                     "the job file and checkpoint digests")

        def same() -> None:
            if not rows:
                return
            for key, what in (("job", f"{self.job.path}"), ("ckpt", f"{self.job.model.checkpoint}")):
                differ = [r for r, row in enumerate(rows) if row[key] != rows[0][key]]
                if differ:
                    kind = "job file" if key == "job" else "checkpoint (header or size)"
                    raise ConfigError(what, f"ranks {differ} see a different {kind} than rank 0",
                                      "a stale node-local copy? give every node the same file (a shared "
                                      "filesystem, or copy it again)")

        self.agree(same, "comparing the job file and checkpoint across ranks")

    def probe(self) -> list[NodeCaps]:
        """Every rank probes itself and pins its BLAS threads; rank 0 gathers all (agreed)."""
        self.prepare()
        local = self.world.Split_type(_shared_type())
        affinity = gather_local_affinity(local, self.job.run.startup_timeout_s, self.ctx)
        mine = self.agree(lambda: probe_local(self.world.rank, local.rank, local.size,
                                               self.job.model.checkpoint, self.job.placement.measure_gflops,
                                               affinity),
                           "probing this rank")
        self.first_on_node = local.rank == 0
        local.Free()
        _pin_threads(mine.cpus)
        gathered = transport.gather_json(self.world, mine.to_dict(), 0, self.job.run.startup_timeout_s,
                                         self.ctx, "the probe")
        self.caps = [NodeCaps.from_dict(d) for d in gathered] if gathered else [mine]
        if gathered and (warning := mpi_versions_differ(self.caps)):
            log.warning("%s", warning)

        def readable() -> None:
            bad = [c.rank for c in self.caps if c.ckpt_readable is False]
            if bad:
                hosts = sorted({self.caps[r].host for r in bad})
                raise CheckpointError(str(self.job.model.checkpoint), f"not readable on ranks {bad} (hosts {hosts})",
                                      "put the checkpoint on a filesystem every node mounts")

        self.agree(readable, "checking the checkpoint is readable")
        return self.caps

    @property
    def dims(self) -> ModelDims:
        """The model's vocabulary, hidden width, positions and layers (the family's `dims`)."""
        self.prepare()
        return self.family.dims(self.model_config)

    def cost(self) -> ModelCost:
        self.prepare()
        return self.family.cost(self.model_config, self.batch, self.seq)

    def held_prices(self, cost: "ModelCost | Callable[[int], ModelCost]",
                    precision: list[str]) -> "ModelCost | Callable[[int], ModelCost]":
        """``cost`` with each precision's resident bytes measured from the checkpoint's storage
        (`placement.with_held_scales`), where the family can (`held_bytes`) and the file exists."""
        held = getattr(self.family, "held_bytes", None)
        ckpt = self.job.model.checkpoint
        if held is None or not Path(ckpt).is_file():
            return cost
        measured = {p: held(self.model_config, ckpt, p) for p in dict.fromkeys(precision)}
        if callable(cost):
            return lambda stages: with_held_scales(cost(stages), measured.__getitem__, precision)
        return with_held_scales(cost, measured.__getitem__, precision)

    def plan(self, cost: "ModelCost | Callable[[int], ModelCost] | None" = None) -> list[Assignment]:
        """Rank 0 plans placement from the gathered caps and broadcasts it (agreed); ``cost`` may be
        a function of the stage count (`placement.plan_grid`). ``plan_`` holds every replica's stages."""
        if not self.caps:
            self.probe()
        cost = cost or self.cost()
        p = self.job.placement

        def make_plan() -> list[Assignment]:
            if not self.is_root:
                return []
            devices = {o.device for o in (self.job.override_for(r) for r in range(len(self.caps)))}
            precision = [self.job.precision_for(r).value for r in range(len(self.caps))]
            held = self.held_prices(cost, precision)
            try:
                grid = plan_grid(held, self.caps, p.policy, int(p.reserve_ram_gb * 1e9), tp=p.tp,
                                 replicas=p.replicas, manual=p.manual or None, device=",".join(sorted(devices)),
                                 precision=precision, where=f"{self.job.path}: [placement] replicas")
                if len(grid.replicas) > 1 or p.replicas == "auto":
                    log.info("%s", grid.why)
                return grid.flat
            except FitError as e:  # --mem-gb is a flag of `plan`, not of a run
                raise FitError(e.where, e.what, (e.fix or "").replace("raise --mem-gb, ", "")) from None

        plan = self.agree(make_plan, "planning")
        doc = transport.bcast_json(self.world, [a.to_dict() for a in plan], 0, self.job.run.startup_timeout_s,
                                   self.ctx, "the plan")
        self.plan_ = [Assignment.from_dict(d) for d in doc]
        reps: list[list[list[int]]] = []
        for a in self.plan_:
            if a.replica == len(reps):
                reps.append([])
            reps[a.replica].append(list(a.ranks))
        self.topology = Topology.build(self.world, reps[0], replicas=reps)
        mine = self.assignment
        self.ctx.stage, self.ctx.layers, self.ctx.tp_rank = mine.stage, mine.layers, self.topology.tp_rank
        self.ctx.extra["tp"] = self.topology.tp
        return self.plan_

    @property
    def assignment(self) -> Assignment:
        """This rank's stage (of its replica)."""
        return next(a for a in self.plan_ if self.world.rank in a.ranks)

    def build(self, decode: bool = False, adapters: bool = False) -> Stage:
        """Each rank loads only its layers and its tensor-parallel shard (agreed); ``decode``:
        the work will decode token by token (`warm_up`); ``adapters``: the driver's rows may name
        the job's LoRA adapters, loaded beside the weights (each rank its layers' and shard's)."""
        if not self.plan_:
            self.plan()
        a, topo = self.assignment, self.topology
        t0 = time.perf_counter()  # build_ms counts the wait for the node's compile too
        self.warm_up(decode)

        def load() -> Stage:
            expect = self.family.expected_shapes(self.model_config)
            with H5ParamSource(self.job.model.checkpoint, expect, self.job.model.check_finite) as src:
                tp = TensorParallel(rank=topo.tp_rank, size=topo.tp, comm=topo.tp_comm if topo.tp > 1 else None,
                                    timeout_s=self.job.run.timeout_s)
                stage = self.family.build_stage(self.model_config, src, a.layers, a.first, a.last, tp, self.ctx,
                                                **self._precision_kwargs())
            if self.job.adapters and not adapters and self.is_root:
                log.warning("%s: [adapters] are not applied by this command (generate applies them; its rows are "
                            "the base model's here)", self.job.path)
            if adapters and self.job.adapters:
                if not getattr(stage, "caps", None) or not stage.caps.adapters:
                    raise ConfigError(f"{self.job.path}: [adapters]", f"model family {self.family.name!r} does not "
                                      "run LoRA adapters", "merge each adapter into the base model and convert that")
                from ..families.hf.peft import check_base_family

                for n, p in self.job.adapters:  # (a local base model of another family: refused by name)
                    check_base_family(Path(p), n, tuple(getattr(self.family, "hf_model_types", ())), self.family.name)
                self.adapter_bytes = stage.load_adapters([(n, str(p)) for n, p in self.job.adapters])
            self.build_ms = (time.perf_counter() - t0) * 1e3
            return stage

        self.stage = self.agree(load, "loading the weights")
        log.debug("[rank %d stage %d] built layers %s in %.1f ms", self.world.rank, a.stage, a.layers, self.build_ms)
        return self.stage

    def warm_up(self, decode: bool = False) -> None:
        """The first rank of each node loads or compiles the family's kernels while the others
        wait (agreed); the others then load them from numba's cache as they build.

        Note: cold start. Before, every rank compiled every kernel at once on a fresh install
        (numba's cache empty): on a node of c cores and r > c ranks that took about r / c times
        one compile, and r processes wrote the same cache files. Now one rank per node compiles
        and the rest load. Measured on the 2-core VM from an empty cache: the quick start (4
        ranks, ``run jobs/tiny.toml``) 39.3 -> 22.9 s, ``generate jobs/generate.toml`` (4 ranks)
        57.3 -> 32.4 s; with the cache filled, 3.3 -> 3.2 s and 4.1 -> 3.8 s (the first rank's
        loading is one more step before the build). A family without ``warm_up`` is built as
        before."""
        warm = getattr(self.family, "warm_up", None)
        if warm is None:
            return
        precision = self.job.precision_for(self.world.rank).value

        def first() -> None:
            if self.first_on_node:
                warm(self.model_config, precision, self.topology.tp, decode)

        from ..kernels._fresh import cache_note

        note = cache_note(Path(__file__).parent.parent / "kernels")
        if note and self.is_root:
            log.warning("%s", note)
        self.agree(first, "compiling the kernels (the first rank of each node)",
                   f"{STARTUP_SETTING}; " + (note or "the first job after an install compiles numba's kernels (15-40 "
                                             "s): run `rlx-mpi compile-kernels` once after installing and later jobs "
                                             "load them"))

    def _precision_kwargs(self) -> dict:
        """``precision=`` for build_stage; omitted at f32 so families without it keep working."""
        precision = self.job.precision_for(self.world.rank).value
        if precision == "f32":
            return {}
        known = tuple(getattr(self.family, "precisions", ("f32",)))  # (declared: `ModelFamily.precisions`)
        if precision not in known:
            only = "float32 stages only" if known == ("f32",) else f"stages of {', '.join(known)} only"
            raise ConfigError(f"{self.job.path}: precision", f"rank {self.world.rank} asks for {precision} but model "
                              f"family {self.family.name!r} builds {only}", 'use precision = "f32"')
        return {"precision": precision}

    def load_inputs(self, path: str | os.PathLike | None) -> np.ndarray | None:
        """Rank 0 reads (or draws from the job's seed) the input ids and checks them (agreed)."""
        self.prepare()

        def load() -> np.ndarray | None:
            if not self.is_root:
                return None
            if path is None:  # drawn in the forward, after the planner has checked the batch fits
                self._check_seq(self.job.run.seq, f"{self.job.path}: [run] seq")
                return None
            where = str(path)
            ids = read_ids(Path(path), where, lambda shape: self._check_seq(shape[1], where))
            self.family.check_inputs(self.model_config, ids, where)
            rules.microbatches_fit(self.job.run.microbatches, ids.shape[0], where, InputError)
            return ids.astype(np.int64)

        ids = self.agree(load, "reading the input ids")
        shape = transport.bcast_json(self.world, list(ids.shape) if ids is not None else
                                     [self.job.run.batch, self.job.run.seq], 0,
                                     self.job.run.startup_timeout_s, self.ctx, "the input shape")
        self.batch, self.seq = shape
        return ids

    def _check_seq(self, seq: int, where: str) -> None:
        rules.seq_fits(seq, self.dims.max_positions, where)

    def random_ids(self, batch: int, seq: int) -> np.ndarray:
        """Input ids drawn from ``[run] seed``: the same on every launch of the job."""
        return np.random.default_rng(self.job.run.seed).integers(0, self.dims.vocab_size, (batch, seq))

    # -- the run (faults abort) ----------------------------------------------------------------

    def close(self) -> None:
        if self.topology is not None and self.topology.tp_comm is not None:
            self.topology.tp_comm.Free()
        if self.topology is not None and self.topology.replica_comm is not None:
            self.topology.replica_comm.Free()
        self.world.Free()


def resolve_precision(job: JobConfig, family: Any) -> tuple[JobConfig, str | None]:
    """``job`` with its "auto" precisions made the checkpoint's stored format
    (`checkpoint.stored_precision`), and the line that says so (None when the job asks for no
    auto). A stored format the family does not build (its declared ``precisions``) runs at f32."""
    if not job.asks_auto:
        return job, None
    ckpt = job.model.checkpoint
    stored, _how = stored_precision(ckpt)
    known = tuple(getattr(family, "precisions", ("f32",)))
    if stored in known:
        return job.resolve_precision(Precision(stored)), \
            f"precision auto -> {stored} (the checkpoint's stored format: {ckpt})"
    return job.resolve_precision(Precision.F32), \
        (f"precision auto -> f32 (the checkpoint {ckpt} stores {stored}, which model family "
         f"{getattr(family, 'name', '?')!r} does not build)")


def _shared_type() -> int:
    from mpi4py import MPI

    return MPI.COMM_TYPE_SHARED


def gather_local_affinity(local: Any, timeout_s: float, ctx: Any) -> list[frozenset[int]] | None:
    """Every rank of the host's affinity (``local`` is its shared-memory communicator), raw bytes."""
    own = own_affinity()
    width = max(1024, os.cpu_count() or 0)  # one host: the same on every local rank
    mask = np.zeros(width, dtype=np.uint8)
    if own is not None:
        mask[[c for c in own if c < width]] = 1
    everyone = np.empty((local.size, width), dtype=np.uint8)
    wait(local.Iallgather(mask, everyone), timeout_s, ctx, lambda: "the CPU affinity of the ranks on this host",
         "another rank on this host")
    if own is None:
        return None
    return [frozenset(np.flatnonzero(row).tolist()) for row in everyone]
