"""Runs one rank's list of actions (`schedule.py`) over a `transport.Link`: the hot path.

The executor knows nothing about pipelines or models. A schedule says, per action, which
microbatch, which buffer slot and which peer stage; compute is a callback; a codec (`wire.py`)
sits between the stage's float32 output and the bytes on the wire. So the GPipe forward and
a decode ring (last stage -> first stage carrying sampled tokens) are two schedules of one loop.

    ex = Executor(link, ctx, rank_of=lambda stage: world_rank, codec=get_codec("bf16", where))
    stats = ex.run(actions, compute, recv_spec)
        actions    list[schedule.Action] of this rank, in order
        compute    (m, x) -> out | None: x is microbatch m's received input (float32 after unpack,
                   or the raw dtype without codec), None when this rank receives nothing for m;
                   out is what a later POST_SEND of m sends (None if never sent)
        recv_spec  (action) -> (shape, dtype): what a POST_RECV of action.microbatch receives
        codec_for  optional (peer stage) -> Codec | None, per link (default: the executor's codec
                   for float32 payloads; None sends/receives the raw array, e.g. int64 tokens)
        tag_base   added to the microbatch for the MPI tag (successive runs on one link)
    ex.spans       [(name, cat, start_s, dur_s, args)], start_s from ``ex.origin`` (perf_counter);
                   cat is one of trace.CATEGORIES: compute, pack, unpack, send_wait, recv_wait
    ex.stats       ExecStats: seconds in compute/pack/unpack/recv_wait/send_wait, wall, bytes

Buffers: a small pool keyed by (direction, slot), grown to the largest shape seen and viewed
for smaller microbatches, so steady state allocates nothing. With the f32 codec a send is the
output array itself (no copy; kept alive until its wait) and a receive lands in the pool slot
that compute reads. Every wait goes through `Pending.wait` (faults.wait), with the link's
staggered deadlines and the named-rank messages of the reliability work.

The drivers use it: `drivers/run.py` (the GPipe forward of ``rlx-mpi run``) and
`drivers/generate.py` (the decode ring).
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import numpy as np

from . import transport
from ..errors import RankFault
from ..lifecycle.faults import RankContext
from .schedule import COMPUTE, POST_RECV, POST_SEND, WAIT_RECV, WAIT_SEND, Action

__all__ = ["Executor", "ExecStats", "wire_codec", "wire_codec_by_name", "wire_error_bound"]

log = logging.getLogger("rlx_mpi")

SpanTuple = tuple  # (name, cat, start_s, dur_s, args)


@dataclass
class ExecStats:
    """Seconds this rank spent in each kind of work during `Executor.run` calls."""

    compute_s: float = 0.0
    pack_s: float = 0.0
    unpack_s: float = 0.0
    recv_wait_s: float = 0.0
    send_wait_s: float = 0.0
    wall_s: float = 0.0  # first action to last, summed over runs
    bytes_sent: int = 0

    def to_dict(self) -> dict:
        return asdict(self)


def _hidden(m: int) -> str:
    return f"the hidden state of microbatch {m}"


class Executor:
    """One rank's action interpreter: posts, waits, packs, computes; records timings."""

    def __init__(self, link: transport.Link, ctx: RankContext, *, rank_of: Callable[[int], int],
                 codec: Any = None, what: Callable[[int], str] = _hidden, record: bool = True):
        self.link, self.ctx, self.rank_of, self.codec, self.what = link, ctx, rank_of, codec, what
        self.record = record
        self.stats = ExecStats()
        self.spans: list[SpanTuple] = []
        self.origin = time.perf_counter()
        self._pool: dict[tuple[str, int], np.ndarray] = {}
        self._open_sends: dict = {}  # slot -> (microbatch, Pending): sends a keep_sends run left posted

    @property
    def open_sends(self) -> dict[int, int]:
        """Send slot -> microbatch of the sends still posted (see ``keep_sends``)."""
        return {slot: m for slot, (m, _) in self._open_sends.items()}

    # -- buffers ------------------------------------------------------------------------------

    def _buffer(self, key: tuple[str, int], shape: tuple[int, ...], dtype: Any) -> np.ndarray:
        """A C-contiguous view of the pool buffer ``key``, grown when too small."""
        n = int(np.prod(shape))
        flat = self._pool.get(key)
        if flat is None or flat.dtype != dtype or flat.size < n:
            flat = self._pool[key] = np.empty(n, dtype=dtype)
        return flat[:n].reshape(shape)

    def _in_pool(self, a: np.ndarray) -> bool:
        return any(np.may_share_memory(a, b) for b in self._pool.values())

    def _span(self, cat: str, t0: float, t1: float, m: int) -> None:
        """One span of category ``cat`` (trace.CATEGORIES) named like the grid: F3, pack 3..."""
        if self.record:
            name = f"F{m}" if cat == COMPUTE else f"{cat} {m}"
            self.spans.append((name, cat, t0 - self.origin, t1 - t0, {"microbatch": m}))

    # -- the loop -----------------------------------------------------------------------------

    def run(self, actions: list[Action], compute: Callable[[int, np.ndarray | None], np.ndarray | None],
            recv_spec: Callable[[Action], tuple[tuple[int, ...], Any]], *,
            codec_for: Callable[[int], Any] | None = None, tag_base: int = 0, keep_sends: bool = False) -> ExecStats:
        """Run ``actions`` in order; see the module docstring for the callbacks. ``keep_sends``:
        sends may stay posted when the list ends, for a later run to wait on (the decode ring's
        steps: `schedule.decode_step_actions`); their outputs stay alive until then."""
        run = _Run(compute, recv_spec, codec_for, tag_base, sends=self._open_sends if keep_sends else {})
        steps = {POST_RECV: self._post_recv, WAIT_RECV: self._wait_recv, COMPUTE: self._compute,
                 POST_SEND: self._post_send, WAIT_SEND: self._wait_send}
        start = time.perf_counter()
        for a in actions:
            self.ctx.microbatch = a.microbatch
            steps[a.kind](a, run)
        self.ctx.microbatch = None
        self.stats.wall_s += time.perf_counter() - start
        if run.recvs or (run.sends and not keep_sends):
            raise RankFault(self.ctx.describe(), f"the schedule ended with receives {sorted(run.recvs)} and sends "
                            f"{sorted(run.sends)} still posted", "this is a bug in the schedule, please report it")
        return self.stats

    def _post_recv(self, a: Action, run: "_Run") -> None:
        shape, dtype = run.recv_spec(a)
        shape = tuple(shape)
        codec = self._codec(a.peer, dtype, run.codec_for)
        buf = self._buffer(("r", a.slot), shape, np.dtype(codec.wire_dtype if codec is not None else dtype))
        pending = self.link.irecv(buf, self.rank_of(a.peer), run.tag_base + a.microbatch, self.what(a.microbatch))
        run.recvs[a.slot] = (a.microbatch, pending, codec, shape)

    def _wait_recv(self, a: Action, run: "_Run") -> None:
        m = a.microbatch
        posted, pending, codec, shape = run.recvs.pop(a.slot)
        _same(posted, m, a)
        t0 = time.perf_counter()
        pending.wait()
        t1 = time.perf_counter()
        self.stats.recv_wait_s += t1 - t0
        self._span("recv_wait", t0, t1, m)
        x = pending.buf
        if codec is not None and np.dtype(codec.wire_dtype) != np.float32:  # f32 is used where it landed
            x = codec.unpack(pending.buf, self._buffer(("u", a.slot), shape, np.float32))
            t2 = time.perf_counter()
            self.stats.unpack_s += t2 - t1
            self._span("unpack", t1, t2, m)
        run.inputs[a.slot] = x

    def _compute(self, a: Action, run: "_Run") -> None:
        m = a.microbatch
        x = run.inputs.pop(a.slot, None)  # the slot's received data, whatever microbatch it came as
        t0 = time.perf_counter()
        out = run.compute(m, x)
        t1 = time.perf_counter()
        self.stats.compute_s += t1 - t0
        self._span(COMPUTE, t0, t1, m)
        if out is not None:
            if self._in_pool(out):  # an alias of a pool buffer, posted again before this is sent
                out = out.copy()
            run.outputs[m] = out

    def _post_send(self, a: Action, run: "_Run") -> None:
        m = a.microbatch
        out = run.outputs.pop(m, None)
        if out is None:
            raise RankFault(self.ctx.describe(), f"the schedule sends microbatch {m} but compute returned nothing "
                            "for it", "this is a bug in the schedule or the stage, please report it")
        if a.slot in run.sends:
            raise RankFault(self.ctx.describe(), f"send slot {a.slot} still in flight with microbatch "
                            f"{run.sends[a.slot][0]}", "this is a bug in the schedule, please report it")
        codec = self._codec(a.peer, out.dtype, run.codec_for)
        t0 = time.perf_counter()
        if codec is None:
            wire = np.ascontiguousarray(out)
        else:  # f32: the output itself (kept alive in run.sends until waited); else the slot's buffer
            src = np.ascontiguousarray(out, dtype=np.float32)
            same = np.dtype(codec.wire_dtype) == np.float32
            wire = codec.pack(src, None if same else self._buffer(("s", a.slot), src.shape, codec.wire_dtype))
        t1 = time.perf_counter()
        if wire is not out:
            self.stats.pack_s += t1 - t0
            self._span("pack", t0, t1, m)
        run.sends[a.slot] = (m, self.link.isend(wire, self.rank_of(a.peer), run.tag_base + m, self.what(m)))
        self.stats.bytes_sent += wire.nbytes

    def _wait_send(self, a: Action, run: "_Run") -> None:
        posted, pending = run.sends.pop(a.slot)
        _same(posted, a.microbatch, a)
        t0 = time.perf_counter()
        pending.wait()
        t1 = time.perf_counter()
        self.stats.send_wait_s += t1 - t0
        self._span("send_wait", t0, t1, a.microbatch)

    def _codec(self, peer: int | None, dtype: Any, codec_for: Callable[[int], Any] | None) -> Any:
        if codec_for is not None:
            return codec_for(peer)
        return self.codec if np.dtype(dtype) == np.float32 else None


@dataclass
class _Run:
    """The state of one `Executor.run`: callbacks and what is posted or computed per slot."""

    compute: Callable[[int, np.ndarray | None], np.ndarray | None]
    recv_spec: Callable[[Action], tuple[tuple[int, ...], Any]]
    codec_for: Callable[[int], Any] | None
    tag_base: int
    recvs: dict = field(default_factory=dict)  # slot -> (microbatch, Pending, codec, f32 shape)
    inputs: dict = field(default_factory=dict)  # slot -> received input, unpacked
    sends: dict = field(default_factory=dict)  # slot -> (microbatch, Pending)
    outputs: dict = field(default_factory=dict)  # microbatch -> output not yet packed


def _same(posted: int, m: int, a: Action) -> None:
    if posted != m:
        raise ValueError(f"action {a}: slot {a.slot} holds microbatch {posted}, not {m} (a schedule bug)")


def wire_error_bound(codec: Any, hops: int) -> float:
    """Documented bound on ``max|logits - logits_f32| / max|logits_f32|`` with ``codec`` on
    ``hops`` stage boundaries: 4 x the codec's per-element bound per hop.

    Each hop rounds every hidden-state element by at most ``codec.rel_error`` (wire.py); the
    layers after it carry that relative perturbation to the logits with a gain that RMSNorm
    keeps O(1): measured 0.2-0.4 per hop on the random tiny and small presets (tests/
    test_executor_mpi.py, bench/README.md). 4 leaves headroom for other weights; it is an
    empirical bound, not a theorem: a model with large activation outliers may exceed it.
    """
    return 4.0 * codec.rel_error * max(hops, 0)


def wire_codec(job: Any) -> Any:
    """The job's ``[run] wire`` codec."""
    return wire_codec_by_name(job.run.wire, f"{job.path}: [run] wire")


def wire_codec_by_name(name: str, where: str = "wire") -> Any:
    """The codec ``name`` from `wire.py`, its kernels loaded (not compiled inside a timed send)."""
    from .wire import get_codec, warm_up

    codec = get_codec(name, where)
    warm_up()
    return codec
