"""``rlx-mpi run``: one forward of a batch of input ids over the pipeline (GPipe).

`RunDriver` is the command on the shared start-up (`Cluster.start`): its outputs (``--out``,
``--json``, ``--trace``) are checked before anything is computed, its input ids are read (or
drawn from ``[run] seed``) on rank 0, and `forward` runs on the built cluster: broadcast the
ids, cut the batch into microbatches (the first ones one row larger when uneven), run the
GPipe schedule (`schedule.forward_schedule`) through the `executor.Executor`, route the logits
to rank 0 and gather every rank's `stats.StageTiming` (and with ``--trace`` its spans, on rank
0's clock: `clock_offset`) there. `trace_document` turns the gathered spans into Chrome Trace
Event JSON (`trace.py`).
"""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from . import Driver, forward_window, gather_stats, stage_timing
from .. import tags
from ..comm import transport
from ..errors import RankFault
from ..comm.executor import Executor, wire_codec
from ..lifecycle.faults import RankContext, check_output, wait
from ..comm.schedule import Action, forward_schedule
from ..io.stats import ClusterRun, StageTiming

__all__ = ["RunDriver", "drive", "forward", "microbatch_bounds", "clock_offset", "trace_document"]

log = logging.getLogger("rlx_mpi")



class RunDriver(Driver):
    """The ``run`` command as a driver of the shared start-up (see `rlx_mpi.drivers`)."""

    command = "run"
    stop_signals = False  # a signal ends a run as it would any program

    def __init__(self, job: str, *, input_ids: str | None = None, out: str | None = None, json: str | None = None,
                 trace: str | None = None, plan_only: bool = False):
        self.job, self.input_ids, self.out, self.json, self.trace = job, input_ids, out, json, trace
        self.plan_only = plan_only
        self.ids: np.ndarray | None = None

    def configure(self, cx: Any) -> None:
        pass

    def outputs(self, cx: Any) -> tuple[list, dict]:
        inputs = {"the job file": self.job, "the checkpoint": cx.job.model.checkpoint, "the input ids": self.input_ids}
        return [("--out", self.out), ("--json", self.json), ("--trace", self.trace)], inputs

    def load(self, cx: Any) -> tuple[int, int]:
        self.ids = cx.load_inputs(self.input_ids)
        return cx.batch, cx.seq

    def cost(self, cx: Any) -> Any:
        """The forward's cost as a function of the stage count: with replicas, each forwards its
        part of the batch (the largest, ceil(batch / replicas) rows)."""
        cx.prepare()
        groups = cx.world.size // cx.job.placement.tp
        return lambda stages: cx.family.cost(cx.model_config, -(-cx.batch // max(1, groups // stages)), cx.seq)

    def check_plan(self, cx: Any) -> None:
        """Replicas split the batch: each needs a row at least (agreed)."""
        n = cx.topology.n_replicas

        def rows() -> None:
            if cx.batch < n:
                from ..errors import ConfigError

                raise ConfigError(f"{cx.job.path}: [placement] replicas", f"{n} replicas share a batch of "
                                  f"{cx.batch} rows", f"give a batch of at least {n} rows, or fewer replicas")

        cx.agree(rows, "checking the batch covers the replicas")

    def drive(self, cx: Any) -> ClusterRun | None:
        if self.plan_only:
            if cx.is_root:
                from ..cluster.placement import format_plan

                print(format_plan(cx.plan_, cx.cost()))
            return None
        return forward(cx, self.ids, trace=bool(self.trace))

    def report(self, cx: Any, run: ClusterRun | None) -> int:
        """Rank 0 prints the table and writes the outputs checked at start-up."""
        if run is None:
            return 0
        from ..lifecycle.logdir import job_id
        from ..outputs import write_output

        run.job_id = job_id()  # the table and the JSON name the Slurm job
        print(run.table())
        sys.stdout.flush()
        checked = cx.outputs
        if self.trace:
            from ..io.trace import save_trace

            doc = trace_document(run)
            write_output(checked["--trace"], lambda tmp: save_trace(doc, tmp))
        if self.json:
            write_output(checked["--json"], lambda tmp: tmp.write_text(run.to_json()))
        if self.out:
            import h5py

            def write(tmp):
                with h5py.File(tmp, "w", locking=False) as f:
                    f.create_dataset("logits", data=run.output)
                    f.attrs["stats"] = run.to_json()
                    f.attrs["job"] = str(Path(self.job).resolve())

            write_output(checked["--out"], write, run.output.nbytes)
        return 0


def drive(cx: Any, ids: np.ndarray | None = None, *, trace: bool = False):
    """One forward of ``ids`` [batch, seq] (given on rank 0) through a started `Cluster`, for
    callers that step through the start-up themselves (bench/_drive.py, docs/api.md): `forward`
    under `Cluster.run`'s fault handling. `ClusterRun` on rank 0, None on the other ranks."""
    if cx.stage is None:
        cx.build()
    driver = RunDriver("", trace="-" if trace else None)
    driver.ids = ids
    return cx.run(driver)


def microbatch_bounds(batch: int, microbatches: int) -> list[tuple[int, int]]:
    """Row ranges of the microbatches: near-equal, the first ones one row larger when uneven."""
    base, extra = divmod(batch, microbatches)
    bounds, a = [], 0
    for m in range(microbatches):
        b = a + base + (1 if m < extra else 0)
        bounds.append((a, b))
        a = b
    return bounds


def forward(cx: Any, ids: np.ndarray | None, *, trace: bool = False):
    """One forward of ``ids`` through a built `Cluster`; `ClusterRun` on rank 0, else None."""
    job, topo, stage, a = cx.job, cx.topology, cx.stage, cx.assignment
    timeout = job.run.timeout_s
    if cx.is_root and ids is None:
        ids = cx.random_ids(cx.batch, cx.seq)
    ids = transport.bcast_array(cx.world, ids, 0, timeout, cx.ctx, "the input ids")
    window = forward_window(cx, "run")  # [run] kv_cache = "window:W": the model generate runs
    whole, seq = ids.shape
    # replicas split the batch: replica r forwards rows parts[r] (near-equal, contiguous) and its
    # last stage sends their logits to rank 0, which puts the batch back together
    parts = microbatch_bounds(whole, topo.n_replicas) if whole >= topo.n_replicas else None
    if parts is None:
        raise RankFault(cx.ctx.describe(), f"a batch of {whole} for {topo.n_replicas} replicas",
                        "RunDriver.check_plan should have refused this; please report it")
    lo_r, hi_r = parts[topo.replica]
    ids = ids[lo_r:hi_r]
    batch = hi_r - lo_r
    M = min(job.run.microbatches, batch) if topo.n_replicas > 1 else job.run.microbatches
    if M > batch:
        raise RankFault(cx.ctx.describe(), f"{M} microbatches for a batch of {batch}",
                        "load_inputs should have refused this; please report it")
    bounds = microbatch_bounds(batch, M)
    # Note: a stuck stage stalls every stage after it (waiting to receive) and, once buffers
    # fill, every stage before it (waiting to send). Deadlines are staggered so the rank
    # next to the stuck one expires first and the job names the right rank: receives wait
    # longer the later the stage, sends the earlier, and rank 0's wait for the logits,
    # which needs the whole pipeline, longest.
    grace = max(1.0, 0.1 * timeout)
    link = transport.Link(cx.world, cx.ctx, timeout + topo.stage * grace,
                          send_timeout_s=timeout + (topo.n_stages - 1 - topo.stage) * grace)
    codec = wire_codec(job)
    hidden_shape, _ = _spec(cx, 1, seq, last=False)
    logits_shape, _ = _spec(cx, batch, seq, last=True)
    logits = np.empty(logits_shape, dtype=np.float32) if a.last and topo.tp_rank == 0 else None

    def rank_of(s: int) -> int:  # the matching TP rank of stage s
        return topo.prev if s < topo.stage else topo.next

    def recv_spec(act: Action):
        lo, hi = bounds[act.microbatch]
        return (hi - lo,) + tuple(hidden_shape[1:]), np.float32

    def compute(m: int, x: np.ndarray | None) -> np.ndarray:
        lo, hi = bounds[m]
        x = ids[lo:hi] if a.first else x
        out = stage.forward(x, window=window) if window else stage.forward(x)
        want = (hi - lo,) + tuple((logits_shape if a.last else hidden_shape)[1:])
        if out.shape != want or out.dtype != np.float32:
            raise RankFault(cx.ctx.describe(), f"the stage returned {out.dtype} {out.shape} for microbatch {m}, expected "
                            f"float32 {want} from {type(cx.family).__name__}.output_spec",
                            "the model family's forward and output_spec disagree: fix the plug-in")
        if topo.tp_rank == 0:  # the first stage with NaN/Inf names itself and the rows (exit 4)
            check_output(out, a.stage, cx.ctx, lambda: ((f"row {lo_r + lo + b} of the batch (microbatch {m})", out[b])
                                                        for b in range(hi - lo)), "logits" if a.last else "output")
        if logits is not None:
            logits[lo:hi] = out
        return out

    ex = Executor(link, cx.ctx, rank_of=rank_of, codec=codec, record=trace)
    actions = forward_schedule(topo.stage, topo.n_stages, M)
    # The trace's clock: rank 0's perf_counter, each rank's offset to it measured by ping-pong
    # (a barrier alone was off by several ms on a loaded host: a rank descheduled on leaving it).
    offset = clock_offset(cx.world, cx.ctx, timeout) if trace else 0.0
    wait(cx.world.Ibarrier(), timeout, cx.ctx, lambda: "every rank to start the forward", "some rank")
    sync = time.perf_counter()
    ex.origin = sync
    ex.run(actions, compute, recv_spec)

    # The logits travel from the last stage to rank 0, outside the per-stage counters.
    final = transport.Link(cx.world, cx.ctx, timeout + topo.n_stages * grace)
    if cx.is_root and logits is None:
        logits = np.empty(logits_shape, dtype=np.float32)
        final.recv(logits, topo.output_rank, M, "the logits")
    elif logits is not None and not cx.is_root:
        final.send(logits, 0, M if topo.replica == 0 else tags.REPLICA_LOGITS, "the logits")
    if cx.is_root and topo.n_replicas > 1:  # the other replicas' rows, in batch order
        rows_logits = [logits]
        for r in range(1, topo.n_replicas):
            lo, hi = parts[r]
            part = np.empty((hi - lo,) + tuple(logits_shape[1:]), dtype=np.float32)
            final.recv(part, topo.replicas[r][-1][0], tags.REPLICA_LOGITS, f"the logits of replica {r}")
            rows_logits.append(part)
        logits = np.concatenate(rows_logits)
    total_ms = (time.perf_counter() - sync) * 1e3

    timing = stage_timing(cx, ex.stats, bytes_sent=link.bytes_sent)
    doc: dict = {"timing": timing.to_dict()}
    if trace:  # start-up phases (Cluster.start records them) too; all on rank 0's clock, from its sync
        phases = [(name, "startup", t0 - sync, dur, {}) for name, t0, dur in cx.phases]
        sync0 = transport.bcast_json(cx.world, sync, 0, timeout, cx.ctx, "the trace's clock origin")
        shift = sync + offset - sync0  # local time t is t + offset on rank 0's clock
        doc["spans"] = [[n, c, start + shift, dur, args] for n, c, start, dur, args in phases + ex.spans]
    rows = gather_stats(cx, doc, "the stage timings")
    if not cx.is_root:
        return None
    run = ClusterRun(timings=[StageTiming.from_dict(r["timing"]) for r in rows], total_forward_ms=total_ms,
                     tokens=whole * seq, microbatches=M, output=logits)
    run.wire = codec.name
    if trace:
        run.spans = {r["timing"]["rank"]: r["spans"] for r in rows}
    return run


def clock_offset(comm: Any, ctx: RankContext, timeout_s: float, rounds: int = 8) -> float:
    """Seconds to add to this rank's perf_counter to read rank 0's (0.0 on rank 0).

    Cristian's algorithm: each rank in turn sends rank 0 an empty message and gets back rank
    0's clock T; offset = T - midpoint of the round trip, from the fastest of ``rounds``
    (error <= half that round trip: tens of microseconds on one host, even when loaded).
    """
    stamp, empty = np.zeros(1, np.float64), np.zeros(0, np.uint8)
    best_rtt, offset = float("inf"), 0.0
    for r in range(1, comm.size):
        if comm.rank not in (0, r):
            continue
        for k in range(rounds):
            if comm.rank == 0:
                wait(comm.Irecv(empty, source=r, tag=tags.in_range(tags.CLOCK_PING, k, "a clock probe")), timeout_s, ctx,
                     lambda: f"rank {r}'s clock probe", f"rank {r}")
                stamp[0] = time.perf_counter()
                wait(comm.Isend(stamp, dest=r, tag=tags.in_range(tags.CLOCK_STAMP, k, "a clock stamp")), timeout_s, ctx,
                     lambda: f"rank {r} to take rank 0's clock", f"rank {r}")
            else:
                t1 = time.perf_counter()
                wait(comm.Isend(empty, dest=0, tag=tags.in_range(tags.CLOCK_PING, k, "a clock probe")), timeout_s, ctx, lambda: "rank 0 to take a clock probe",
                     "rank 0")
                wait(comm.Irecv(stamp, source=0, tag=tags.in_range(tags.CLOCK_STAMP, k, "a clock stamp")), timeout_s, ctx, lambda: "rank 0's clock", "rank 0")
                t2 = time.perf_counter()
                if t2 - t1 < best_rtt:
                    best_rtt, offset = t2 - t1, float(stamp[0]) - (t1 + t2) / 2
    return offset


def _spec(cx: Any, batch: int, seq: int, last: bool) -> tuple[tuple[int, ...], np.dtype]:
    """The family's `output_spec`: the one place that fixes what a stage hands on."""
    shape, dtype = cx.family.output_spec(cx.model_config, batch, seq, last)
    if np.dtype(dtype) != np.float32:
        raise RankFault(cx.ctx.describe(), f"{type(cx.family).__name__}.output_spec gives dtype {dtype}",
                        "stages hand on float32 (the [run] wire codec chooses the bytes on the wire)")
    return tuple(shape), np.dtype(np.float32)


def trace_document(run: Any) -> dict:
    """A `ClusterRun` gathered with ``trace=True`` as a Chrome Trace Event object (trace.py):
    one lane per rank, start-up phases and the forward's spans on the barrier-aligned clock."""
    from ..io.trace import Span, chrome_trace

    spans = [Span(int(rank), name, cat, start, dur, args)
             for rank, items in run.spans.items() for name, cat, start, dur, args in items]
    lanes = [{"rank": t.rank, "host": t.host, "stage": t.stage, "tp_rank": t.tp_rank, "layers": f"{t.layers.start}:"
              f"{t.layers.stop}"} for t in run.timings]
    meta = {"n_stages": run.n_stages, "microbatches": run.microbatches, "wire": run.wire,
            "measured_bubble": run.bubble, "ideal_bubble": run.ideal_bubble, "tokens": run.tokens}
    return chrome_trace(spans, lanes, meta)
