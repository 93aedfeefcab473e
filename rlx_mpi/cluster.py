"""The seed's `Cluster` over one MPI launch: config -> probe -> plan -> build -> drive.

Every rank runs the same calls in the same order. Start-up steps are agreed (a bad input on
any rank becomes the same `AgreedFailure` on all); a fault in `drive` aborts the job.

    cx = Cluster.from_path("jobs/tiny.toml")   # every rank
    cx.probe(); cx.plan(); cx.build()
    run = cx.drive()                           # ClusterRun on rank 0, None elsewhere
    if run: print(run.table())
"""

from __future__ import annotations

import importlib
import logging
import os
import resource
import socket
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from . import transport
from .caps import NodeCaps, probe_local
from .checkpoint import H5ParamSource, read_header
from .config import JobConfig, load_job
from .errors import CheckpointError, ConfigError, InputError
from .faults import RankContext, agree, report_and_abort
from .placement import Assignment, ModelCost, plan_placement
from .stage import Stage, TensorParallel, get_family
from .stats import ClusterRun
from .topology import Topology, make_grid

__all__ = ["Cluster", "peak_rss_bytes"]

log = logging.getLogger("rlx_mpi")


def peak_rss_bytes() -> int:
    """High-water mark of this process's resident memory (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _pin_threads(cpus: int | None) -> None:
    """Limit BLAS (and OpenMP) threads to this rank's share of the host's cores."""
    if not cpus:
        return
    from threadpoolctl import threadpool_limits

    threadpool_limits(limits=cpus)


class Cluster:
    """A configured, probed, planned and built pipeline, as seen by one rank."""

    def __init__(self, job: JobConfig, *, comm: Any = None, debug: bool = False):
        from mpi4py import MPI

        self.job = job
        self.world = (comm or MPI.COMM_WORLD).Dup()
        self.ctx = RankContext(rank=self.world.rank, size=self.world.size, host=socket.gethostname(), debug=debug)
        self.family = None
        self.model_config: Any = None
        self.batch, self.seq = job.run.batch, job.run.seq
        self.caps: list[NodeCaps] = []  # every rank's on rank 0; this rank's elsewhere
        self.plan_: list[Assignment] = []
        self.topology: Topology | None = None
        self.stage: Stage | None = None
        self.build_ms = 0.0
        self._prepared = False
        self.phases: list[tuple[str, float, float]] = []  # start-up (name, perf_counter start, seconds) for the trace

    # -- start-up (agreed) ---------------------------------------------------------------------

    @classmethod
    def from_path(cls, path: str | os.PathLike, *, comm: Any = None, debug: bool = False) -> "Cluster":
        """Load and check the job file on every rank; a bad file fails all ranks alike."""
        from mpi4py import MPI

        world = comm or MPI.COMM_WORLD
        ctx = RankContext(rank=world.rank, size=world.size, host=socket.gethostname(), debug=debug)

        def load() -> JobConfig:
            job = load_job(path)
            job.check_world(world.size)
            return job

        return cls(agree(world, ctx, 600.0, load), comm=comm, debug=debug)

    def _agree(self, fn):
        return agree(self.world, self.ctx, self.job.run.startup_timeout_s, fn)

    @property
    def is_root(self) -> bool:
        return self.world.rank == 0

    def prepare(self) -> None:
        """Make sure the checkpoint exists (rank 0 creates a preset's), then read its config."""
        if self._prepared:
            return
        ckpt = self.job.model.checkpoint

        def create() -> None:
            if self.is_root and not ckpt.exists() and self.job.model.preset:
                from .llama import PRESETS
                from .llama.init import init_random

                preset = self.job.model.preset
                if preset not in PRESETS:
                    raise ConfigError(f"{self.job.path}: [model] preset", f"got {preset!r}",
                                      f"expected one of {sorted(PRESETS)}")
                ckpt.parent.mkdir(parents=True, exist_ok=True)
                log.info("checkpoint %s not found: creating it from preset %r (seed %d)", ckpt, preset,
                         self.job.model.init_seed)
                init_random(ckpt, PRESETS[preset], self.job.model.init_seed)

        self._agree(create)

        def header() -> None:
            for module in self.job.model.plugins:
                try:
                    importlib.import_module(module)
                except ImportError as e:
                    raise ConfigError(f"{self.job.path}: [model] plugins", f"cannot import {module!r} ({e})",
                                      "install the module or fix PYTHONPATH on every node") from None
            family_name, config_json = read_header(ckpt)
            family = get_family(family_name)
            if family is None:
                raise CheckpointError(str(ckpt), f"model family {family_name!r} is not registered",
                                      "import the package that registers it (rlx_mpi.register_family)")
            cfg = family.load_config(config_json, str(ckpt))
            family.check_tp(cfg, self.job.placement.tp, f"{self.job.path}: [placement] tp")
            self.job.check_layers(family.cost(cfg, 1, 1).n_layers, self.world.size)
            self.family, self.model_config = family, cfg

        self._agree(header)
        self._prepared = True

    def probe(self) -> list[NodeCaps]:
        """Every rank probes itself and pins its BLAS threads; rank 0 gathers all (agreed)."""
        self.prepare()
        local = self.world.Split_type(_shared_type())
        mine = self._agree(lambda: probe_local(self.world.rank, local.rank, local.size,
                                               self.job.model.checkpoint, self.job.placement.measure_gflops))
        local.Free()
        _pin_threads(mine.cpus)
        gathered = transport.gather_json(self.world, mine.to_dict(), 0, self.job.run.startup_timeout_s,
                                         self.ctx, "the probe")
        self.caps = [NodeCaps.from_dict(d) for d in gathered] if gathered else [mine]

        def readable() -> None:
            bad = [c.rank for c in self.caps if c.ckpt_readable is False]
            if bad:
                hosts = sorted({self.caps[r].host for r in bad})
                raise CheckpointError(str(self.job.model.checkpoint), f"not readable on ranks {bad} (hosts {hosts})",
                                      "put the checkpoint on a filesystem every node mounts")

        self._agree(readable)
        return self.caps

    def cost(self) -> ModelCost:
        self.prepare()
        return self.family.cost(self.model_config, self.batch, self.seq)

    def plan(self, cost: ModelCost | None = None) -> list[Assignment]:
        """Rank 0 plans placement from the gathered caps and broadcasts it (agreed)."""
        if not self.caps:
            self.probe()
        cost = cost or self.cost()
        p = self.job.placement

        def make_plan() -> list[Assignment]:
            if not self.is_root:
                return []
            grid = make_grid([c.host for c in self.caps], p.tp)
            devices = {self.job.override_for(g[0]).device for g in grid}
            return plan_placement(cost, self.caps, p.policy, int(p.reserve_ram_gb * 1e9), grid=grid,
                                  manual=p.manual or None, device=",".join(sorted(devices)))

        plan = self._agree(make_plan)
        doc = transport.bcast_json(self.world, [a.to_dict() for a in plan], 0, self.job.run.startup_timeout_s,
                                   self.ctx, "the plan")
        self.plan_ = [Assignment.from_dict(d) for d in doc]
        self.topology = Topology.build(self.world, [list(a.ranks) for a in self.plan_])
        mine = self.plan_[self.topology.stage]
        self.ctx.stage, self.ctx.layers, self.ctx.tp_rank = mine.stage, mine.layers, self.topology.tp_rank
        self.ctx.extra["tp"] = self.topology.tp
        return self.plan_

    @property
    def assignment(self) -> Assignment:
        return self.plan_[self.topology.stage]

    def build(self) -> Stage:
        """Each rank loads only its layers and its tensor-parallel shard (agreed)."""
        if not self.plan_:
            self.plan()
        a, topo = self.assignment, self.topology

        def load() -> Stage:
            t0 = time.perf_counter()
            expect = self.family.expected_shapes(self.model_config)
            with H5ParamSource(self.job.model.checkpoint, expect, self.job.model.check_finite) as src:
                tp = TensorParallel(rank=topo.tp_rank, size=topo.tp, comm=topo.tp_comm if topo.tp > 1 else None,
                                    timeout_s=self.job.run.timeout_s)
                stage = self.family.build_stage(self.model_config, src, a.layers, a.first, a.last, tp, self.ctx)
            self.build_ms = (time.perf_counter() - t0) * 1e3
            return stage

        self.stage = self._agree(load)
        log.debug("[rank %d stage %d] built layers %s in %.1f ms", self.world.rank, a.stage, a.layers, self.build_ms)
        return self.stage

    def load_inputs(self, path: str | os.PathLike | None) -> np.ndarray | None:
        """Rank 0 reads (or draws from the job's seed) the input ids and checks them (agreed)."""
        self.prepare()

        def load() -> np.ndarray | None:
            if not self.is_root:
                return None
            if path is None:
                ids = self._random_ids(self.job.run.batch, self.job.run.seq)
                self.family.check_inputs(self.model_config, ids, f"{self.job.path}: [run] batch, seq")
                return ids
            where = str(path)
            if not Path(path).is_file():
                raise InputError(where, "input ids file not found", "give an integer .npy of shape [batch, seq]")
            try:
                ids = np.load(path, allow_pickle=False)
            except (ValueError, OSError, EOFError) as e:
                raise InputError(where, f"not a readable .npy array ({e})",
                                 "save the ids with np.save(path, ids) as an integer array") from None
            self.family.check_inputs(self.model_config, ids, where)
            mb = self.job.run.microbatches
            if ids.shape[0] < mb:  # uneven splits are fine (the last microbatches one row smaller)
                raise InputError(where, f"batch {ids.shape[0]} is smaller than [run] microbatches = {mb}",
                                 "lower microbatches to at most the number of sequences")
            return ids.astype(np.int64)

        ids = self._agree(load)
        shape = transport.bcast_json(self.world, list(ids.shape) if ids is not None else None, 0,
                                     self.job.run.startup_timeout_s, self.ctx, "the input shape")
        self.batch, self.seq = shape
        return ids

    def _random_ids(self, batch: int, seq: int) -> np.ndarray:
        """Input ids drawn from ``[run] seed``: the same on every launch of the job."""
        return np.random.default_rng(self.job.run.seed).integers(0, self.model_config.vocab_size, (batch, seq))

    # -- the run (faults abort) ----------------------------------------------------------------

    def drive(self, ids: np.ndarray | None = None, *, trace: bool = False) -> ClusterRun | None:
        """One forward of ``ids`` [batch, seq] (given on rank 0) through the stages.

        Returns the `ClusterRun` with logits on rank 0 and None on the other ranks. Any
        exception or expired deadline on any rank is reported once and aborts the job. The run
        loop is `executor.forward`; ``trace`` also gathers every rank's spans on rank 0.
        """
        try:
            return self._drive(ids, trace)
        except Exception:
            report_and_abort(self.world, self.ctx, sys.exc_info())
            raise

    def _drive(self, ids: np.ndarray | None, trace: bool = False) -> ClusterRun | None:
        if self.stage is None:
            self.build()
        from .executor import forward

        return forward(self, ids, trace=trace)

    def close(self) -> None:
        if self.topology is not None and self.topology.tp_comm is not None:
            self.topology.tp_comm.Free()
        self.world.Free()


def _shared_type() -> int:
    from mpi4py import MPI

    return MPI.COMM_TYPE_SHARED
