"""``rlx-mpi probe --calibrate OUT.json``: the rates ``plan --simulate`` prices steps with.

Every launched rank measures at once (so that the rates hold what the ranks of a host share:
cores, memory bandwidth), on its share of the host's cores as a job pins it: the real layers
(a middle stage of medium-preset layers, at least 80 MB, built by the decoder family at each precision, from
random weights made in memory: its decode steps of 1..64 rows and its prefills of 8..1024
positions, so the product kernels, the fused decode layer, norms, RoPE and the calls are all in
the rate, as seconds per layer weight), the attention kernels by context length (a prefill
chunk's `kernels.attend` and a decode row's `kernels.attend_cache`), the ring's bookkeeping a row (`engine.ring.run_ring` on a pipe that returns at once), a streaming
read; then ranks 0 and 1 ping-pong through `comm.transport.Link` and every rank all-reduces
through `comm.collectives.all_reduce` by message size. Rank 0 writes the median over ranks of
each rate (`model.calibration.Calibration`, one file per allocation type).

The start-up is measured too, first, while this process is as fresh as a job's
(`measure_startup`): the launch (the launcher's start to here: the interpreter, the imports,
MPI_Init), the family's ``warm_up`` at each precision (numba's cache loaded, or the kernels
compiled on a fresh install), and the load of weights from an HDF5 checkpoint through the job's
reader (`model.checkpoint.H5ParamSource`) into a stage, from a file written beside the
calibration (``--calibrate`` beside the checkpoints times their file system; the file is just
written, so its pages are in memory as a rerun's are: a first read from a parallel file system
can be slower).
"""

from __future__ import annotations

import json
import math
import os
import socket
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

__all__ = ["calibrate", "measure_local", "measure_startup", "measure_load", "launch_age"]

PRECISIONS = ("f32", "bf16", "f16", "int8", "q4")
PROBE_BYTES = 80e6  # the probe stage's f32 weights at least (2 medium layers: 93 MB), past a last-level cache:
# 2 layers of the small preset (23 MB) decoded 1.6x faster a layer than its 8 (the cache held them)
LOAD_BYTES = 400e6  # the load's file a rank (f32 layers), near a stage's size: see measure_load's note
REST_S = 3.0  # idle before the load's clock starts, as a job starts on a node at rest (measure_load's note)
TOUCH_BYTES = 128e6  # fresh memory written at the load's start: the KV cache's first touch (measure_load's last note)
REST_ALONE_S = 15.0  # idle before the alone pass's load, after both ranks' loads freed their temporaries (the note)
DECODE_ROWS = (1, 2, 4, 8, 16, 32, 64)
PREFILL_POSITIONS = (8, 16, 32, 64, 128, 256, 512, 1024)  # (a long prompt's forward: measure_local's note)
CHUNK, CONTEXT = 32, 32
ROUNDS = 8  # rounds of every precision's every call (the median is kept: measure_local's note)
TIMED_MIN_S = 0.05  # an attention probe's timings add up to this at least (`_timed`'s note)
DECODE_REPS = 3  # a decode call's timings a round (1-30 ms each: one hiccup moved a median of 5)
ATT_HEADS, ATT_KV, ATT_DIM = 16, 8, 64
PREFILL_CONTEXTS = (32, 128, 512, 1024)
DECODE_CONTEXTS = (32, 128, 512, 1024, 2048)
MESSAGE_BYTES = (8, 4096, 65536, 1 << 20, 8 << 20)


def _timed(fn: Callable[[], Any], reps: int, min_s: float = 0.0) -> float:
    """The median of ``reps`` timings after one warm call, and more until they add up to
    ``min_s`` (at most 400): a burst of another user's work moves one timing, not the rate (the
    least of them was 30-40 % faster than a job's steps under load).

    Note: a call of 0.1 ms. 3 timings of the alone pass's decode attention at 32 positions
    (~0.07 ms a call) read 0.26 GFLOP/s where every other point of the curve read 14-35: two of
    the three met a stall of a few ms (the host's; one other calibration of 13 read 4.5 at 1,024
    positions), and the 1-rank short jobs, whose rows attend to 32-64 positions, were predicted
    1.5x (f32) and 2.5x (q4) long (`bench/results/simulate_2026-12-07_fresh_t`).
    `TIMED_MIN_S` of timings makes a stall one timing of hundreds."""
    fn()
    out: list[float] = []
    spent = 0.0
    while len(out) < reps or (spent < min_s and len(out) < 400):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
        spent += out[-1]
    return statistics.median(out)


class _RandomSource:
    """A `model.stage.ParamSource` of random tensors made on read (the probe layer's weights)."""

    def __init__(self, cfg: Any):
        from ..families.decoder.arch import expected_shapes

        self.shapes, self.cfg = expected_shapes(cfg), cfg

    def shape(self, name: str) -> tuple[int, ...]:
        return self.shapes[name]

    def read(self, name: str, *, axis: int | None = None, part: int = 0, parts: int = 1,
             dtype: str = "float32") -> np.ndarray:
        from .. import kernels

        shape = self.shapes[name]
        rng = np.random.default_rng(abs(hash(name)) % 2**32)
        if len(shape) == 1:
            w = 1.0 + 0.1 * rng.standard_normal(shape, dtype=np.float32)
        else:
            w = shape[1] ** -0.5 * rng.standard_normal(shape, dtype=np.float32)
        if axis is not None:
            w = np.ascontiguousarray(np.array_split(w, parts, axis=axis)[part])
        return kernels.to_bf16(w) if dtype == "bfloat16" else w.astype(np.float16) if dtype == "float16" else w


def probe_layer_weights(preset: str = "medium") -> float:
    """Weights of one layer of the probe model (the medium preset's)."""
    from ..families import require_preset

    family, cfg = require_preset(preset, "probe --calibrate")
    return family.cost(cfg, 1, 1).dense_flops_per_token / 2


_LAUNCHERS = ("mpiexec", "mpiexec.hydra", "mpirun", "hydra_pmi_proxy", "prterun", "prted", "orterun", "srun",
              "slurmstepd")


def _started(pid: int | str) -> tuple[float, int, str] | None:
    """(start in seconds since boot, parent pid, name) of a process, from /proc (None elsewhere)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    name, rest = stat[stat.index("(") + 1:stat.rindex(")")], stat[stat.rindex(")") + 2:].split()
    return int(rest[19]) / os.sysconf("SC_CLK_TCK"), int(rest[1]), name  # (fields 22 and 4 of proc(5))


def launch_age() -> float:
    """Seconds since the job was launched: since the start of the oldest launcher among this
    process's ancestors (mpiexec, its proxy, srun's step daemon), else of this process; 0 where
    /proc is missing."""
    me = _started("self")
    if me is None:
        return 0.0
    first, parent = me[0], me[1]
    for _ in range(8):  # (a launcher is a few parents up at most)
        up = _started(parent)
        if up is None or up[2].split("/")[-1] not in _LAUNCHERS:
            break
        first, parent = min(first, up[0]), up[1]
    return max(0.0, time.clock_gettime(time.CLOCK_BOOTTIME) - first)


def measure_startup(folder: Path, rank: int, precisions, preset: str = "medium",
                    sync: Callable[[], None] | None = None, hold: list | None = None) -> dict:
    """This rank's start-up (the module note): ``launch_s``, ``warm_s`` by precision (in the
    order given: the first also loads the kernels every precision shares) and ``load_gbps``
    (`measure_load`, after the kernels' first build, as a job's load comes after its warm-up;
    ``hold`` keeps its stage, so that a later pass builds in fresh memory too)."""
    from ..families import require_preset

    import dataclasses

    launch = launch_age()
    family, cfg = require_preset(preset, "probe --calibrate")
    small = dataclasses.replace(require_preset("small", "probe --calibrate")[1], num_hidden_layers=1)
    warm = {}
    for p in precisions:  # the family's kernels, then a first (tiny) stage built at p: what a job's
        t0 = time.perf_counter()  # first build calls once (the converters, the packers) beside the kernels
        family.warm_up(cfg, p, 1, True)
        family.build_stage(small, _RandomSource(small), range(1), False, False, precision=p)
        warm[p] = time.perf_counter() - t0
    return {"launch_s": launch, "warm_s": warm} | measure_load(folder, rank, preset, sync, hold)


def measure_load(folder: Path, rank: int, preset: str = "medium", sync: Callable[[], None] | None = None,
                 hold: list | None = None, rest: float = REST_S) -> dict:
    """``load_gbps``: GB a second of f32 weights read from an HDF5 file (written in ``folder``
    first, removed after) through the job's reader and made resident in a stage of ``LOAD_BYTES``
    of layers; ``touch_gbps``: of ``TOUCH_BYTES`` of fresh memory written once, just before;
    ``sync``: a barrier before the clock starts, so that every rank reads at once, as a job's do
    (unsynchronised, a rank read while its neighbour still wrote: 2 replicas' loads of 0.89 GB
    each took 2.8 s where that rate said 1.7); ``hold``: the stage is appended there, not freed;
    ``rest``: seconds idle before the clock (the note's rest).

    Note: the size and the memory. A job builds its stage once, into memory the process never
    had: every page is faulted in as the reader and the fusing of q/k/v and gate/up fill it. On
    the 2-core AMD VM, a first build of medium layers from a file in the page cache read 2.3 GB/s
    at 93 MB (the earlier probe's size), 0.60 at 300 MB, 0.44 at 900 MB and 0.43 at 1.8 GB, and
    the medium job's own 0.89 GB stage 0.50 (0.95 s in h5py's reads, 0.73 s fusing); a second
    build of 300 MB in the same process, into the first's freed memory, 3.6. So the probe loads
    400 MB, and a pass after another (the alone pass) holds the first's stage (``hold``) rather
    than build into its memory: the earlier 93 MB probe, freed between passes, priced the medium
    job's load at 4.2 GB/s alone, 0.2 s where it took 1.5.

    The rest. On that VM (Firecracker) a page freed goes back to the host within ~1 s (virtio-
    balloon free page reporting), and faulting it in again costs ~2.7 s a GB: 400 MB of fresh
    memory took 1.1-1.3 s after 1-30 s idle, 0.03-0.1 s right after another process freed it.
    A job starts on a node at rest, so its build faults in memory the host took back (the medium
    job's 0.89 GB stage: 2.8 s, 0.32 GB/s). Making the probe's tensors frees 400 MB just before
    the clock: without ``REST_S`` idle first, the alone pass (one rank's short fsync) built into
    that memory at 0.71 GB/s and priced the job's start-up 2 s short; the shared pass, after a
    barrier behind both ranks' fsyncs, read 0.33. Where freed memory stays (bare metal), the rest
    changes nothing.

    How long the host takes it back grows with how much was freed (a second VM, 2026-12-07):
    0.9 GB touched after 3 GB freed took 0.07 s 3 s later, 0.18 s at 6 s, 1.4 s at 12 s and
    2.5-2.8 s from 20 s on. So the alone pass, which follows both ranks' loads (their readers' and fusings'
    temporaries freed), waits ``REST_ALONE_S``: after 3 s it read 0.29-0.77 GB/s over six
    calibrations, where a 1-rank job's cold build of 0.89 GB read 0.30-0.35 (0.52-0.70 s, 1.3-1.7
    GB/s, right after 3 GB freed).

    The first touch. A job's first step writes its KV cache, which `reset` allocated and nothing
    had written: numpy asks huge pages (2 MB) of every array from 4 MB, and a step's rows write a
    block of every head's region, so the whole cache is faulted in at once. On the VM, the medium
    1-rank job's first prefill chunk took 2.1-2.2 s against 1.35-1.6 for the next three, 0.78 s
    of it in the 409 MB cache's first writes (`kernels.blocks._scatter`: 12 ms at the next
    step), and gen-pp2-shared's stages 0.3 and 0.25 s more than at 206 and 160 MB; the simulator
    did not price it and ran 0.71-0.96x on that case over runs M-V. Written right after the build,
    256 MB read 15 GB/s (the build's freed temporaries), which the job's cache, larger, is not:
    so ``touch_gbps`` is taken after the rest, before the build (the array is kept until the
    build is done, which then faults in fresh memory as before)."""
    import dataclasses

    from ..families import require_preset
    from ..families.decoder.family import random_tensors
    from ..model.checkpoint import H5ParamSource, write_checkpoint

    family, cfg = require_preset(preset, "probe --calibrate")
    layers = max(2, math.ceil(LOAD_BYTES / (4 * probe_layer_weights(preset))))
    cfg = dataclasses.replace(cfg, num_hidden_layers=layers)
    with tempfile.TemporaryDirectory(prefix=".rlx-calibrate-", dir=folder) as tmp:
        path = Path(tmp) / f"rank{rank}.h5"  # the layers alone (~400 MB a rank: no embedding, no head)
        write_checkpoint(path, family.name, cfg.to_json(),
                         ((n, t) for n, t in random_tensors(cfg, rank) if n.startswith("layers/")))
        fd = os.open(path, os.O_RDONLY)
        try:  # on disk before the clock starts: the write-back of the fresh file must not slow the read
            os.fsync(fd)
        finally:
            os.close(fd)
        time.sleep(rest)  # (the note: memory freed just before, given back to the host)
        if sync is not None:
            sync()
        t0 = time.perf_counter()
        fresh = np.empty(int(TOUCH_BYTES) // 4, np.float32)
        fresh.fill(1.0)  # (the note's first touch)
        touch = fresh.nbytes / (time.perf_counter() - t0) / 1e9
        if sync is not None:
            sync()
        t0 = time.perf_counter()
        with H5ParamSource(path, family.expected_shapes(cfg)) as src:
            stage = family.build_stage(cfg, src, range(layers), False, False)
            read = src.bytes_read
        took = time.perf_counter() - t0
        if hold is not None:
            hold.append(stage)
        del stage, fresh
    return {"load_gbps": read / took / 1e9, "touch_gbps": touch}


ALONE_KEYS = ("layer_decode", "layer_prefill", "attention_prefill", "attention_decode", "convert")


def measure_local(precisions=PRECISIONS, quick: bool = False, preset: str = "medium", rounds: int = ROUNDS,
                  sync: Callable[[], None] | None = None) -> dict:
    """This rank's rates (the module note), as `Calibration`'s JSON keys; ``preset``: the probe
    layers' shape (tests take the small preset's, to price a small model); ``sync``: a barrier of
    the ranks measuring at once, before each build and each timed call, so that every rank runs
    the same call at the same moment, as a job's ranks do (the note's lock-step).

    Note: the positions and the rounds, measured on the 2-core AMD VM (a fresh one, 2026-12-07).
    A long prompt forwards 1,024 positions at once, and the curve was held flat past 256: one
    probe read the products' time a position rising past 256 (f32 8.4, 8.9, 10.7 and q4 5.3, 5.7,
    5.8 ps a weight at 256, 512 and 1,024 positions), a calibration read them flat within 1 %, and
    score-1-long-q4 ran 0.67x its prediction in two runs, 0.92x with 512 and 1,024 measured. The
    host's memory bandwidth moves in regimes of 10-20 s (6 s windows of one streaming read: 13.7
    to 18.6 GB/s), and the first second after a stage's build ran 35 % slower (f32 decode, 4 rows;
    most likely the host taking back the build's freed memory): 3 rounds (~0.3 s a precision)
    left one rank alone's f32 decode of 1 row at 0.35 ns a weight against 0.13 for 2 rows. So 5
    rounds, median kept, and a decode call (1-30 ms) timed 3 times a round.

    The spread. Precision by precision, a precision's rounds took 2-4 s, inside one of the host's
    regimes: two calibrations 13 min apart (bench runs O and P) read the shared f32 decode of 1-4
    rows 0.21-0.22 and 0.28-0.30 ns a weight while the same jobs ran within 10 % of each other, and
    P's predictions came out 20 % long (whole-job median error 4.5 % in O, 20.6 % in P). Two
    processes decoding side by side, in 2 s windows over 60 s: 0.17-0.24 ns a weight. So every
    precision's every call runs in each round, and a precision's rounds (then 5) spread over the
    pass's ~16 s. (Run J had tried this without the lock-step and a barrier, and found it no better.)
    That still left calibrations apart: run T's read the shared f32 decode of 1-4 rows at 0.16-0.18
    ns a weight, R's 0.23-0.28, while T's jobs ran as long as R's or longer (gen-pp2-short 4.3 s
    in-job against 5.0, score-pp2-long 14.8 against 13.7): 8 rounds, over ~26 s.

    The lock-step. A job's ranks run the same step at the same moment (a pipeline's stages each
    decode a microbatch, TP's ranks their halves, replicas their rows), but unsynchronised probes
    drift apart: one rank's decodes met the other's prefills, which contend less for memory. Two
    processes decoding 4 rows at f32 together for 8 s read 0.228-0.261 ns a weight (as the 2-stage
    job's steps did, 0.24), the drifting shared pass 0.193-0.245; with ``sync`` before every
    call, 0.260. The alone pass has no neighbour to wait for."""
    import dataclasses

    from ..families import require_preset
    from ..kernels import attend, attend_cache
    from ..model.kv_cache import KvSpec

    family, cfg = require_preset(preset, "probe --calibrate")
    per_layer = probe_layer_weights(preset)
    layers = max(2, math.ceil(PROBE_BYTES / (4 * per_layer)))
    cfg = dataclasses.replace(cfg, num_hidden_layers=layers)
    weights = per_layer * layers
    C = cfg.hidden_size
    rng = np.random.default_rng(0)
    sync = sync or (lambda: None)
    decode, prefill, convert = {}, {}, {}
    probes = {}  # precision -> its calls (each holds its stage)
    for p in precisions:
        # a middle stage (hidden in, hidden out) of medium layers, as a job builds it
        source = _RandomSource(cfg)
        sync()
        t0 = time.perf_counter()
        for name in source.shapes:  # (the tensors' making alone, taken off the build below)
            if name.startswith("layers/"):
                source.read(name)
        made = time.perf_counter() - t0
        sync()
        t0 = time.perf_counter()
        stage = family.build_stage(cfg, source, range(layers), False, False, precision=p)
        convert[p] = max(0.0, time.perf_counter() - t0 - made) / weights  # f32 weights made resident at p
        stage.reset(64, 2 * CONTEXT, KvSpec("full"))
        calls = []  # (kind, rows or positions, its call)
        for rows in DECODE_ROWS:
            x = rng.standard_normal((rows, 1, C), dtype=np.float32)
            slots, pos = np.arange(rows, dtype=np.int64), np.full(rows, CONTEXT, np.int64)
            calls.append(("decode", rows, lambda x=x, s=slots, q=pos, st=stage: st.decode(x, s, q)))
        for n in PREFILL_POSITIONS:  # rows of CHUNK positions (little attention: the layers' own rate)
            B, T = max(1, n // CHUNK), min(n, CHUNK)
            x = rng.standard_normal((B, T, C), dtype=np.float32)
            slots, lengths = np.arange(B, dtype=np.int64), np.full(B, T, np.int64)
            calls.append(("prefill", B * T, lambda x=x, s=slots, n=lengths, st=stage: st.prefill(x, s, n)))
        for _, _, call in calls:  # warm: the first call of a shape compiles or loads its kernels
            call()
        probes[p] = calls
    times: dict[tuple, list[float]] = {}
    for _ in range(1 if quick else rounds):  # every precision's every call in each round (the note's spread)
        for p, calls in probes.items():
            for kind, rows, call in calls:
                for _ in range(DECODE_REPS if kind == "decode" and not quick else 1):
                    sync()
                    t0 = time.perf_counter()
                    call()
                    times.setdefault((p, kind, rows), []).append(time.perf_counter() - t0)
    for p in precisions:
        decode[p] = [[rows, statistics.median(times[(p, "decode", rows)]) / weights] for rows in DECODE_ROWS]
        prefill[p] = [[k[2], statistics.median(t) / weights] for k, t in times.items() if k[:2] == (p, "prefill")]
    probes.clear()  # (the stages, before the attention's probes)
    # attention: a prefill chunk (T queries from 0) and decode rows (one query against ctx keys)
    flops_pos = 4.0 * ATT_HEADS * ATT_DIM
    att_prefill, min_s = [], 0.0 if quick else TIMED_MIN_S
    for T in PREFILL_CONTEXTS:
        q = rng.standard_normal((1, ATT_HEADS, T, ATT_DIM), dtype=np.float32)
        k = rng.standard_normal((1, ATT_KV, T, ATT_DIM), dtype=np.float32)
        t = _timed(lambda: attend(q, k, k), 1 if quick else 2, min_s)
        att_prefill.append([T, flops_pos * T * (T + 1) / 2 / t / 1e9])
    att_decode, B = [], 8
    for L in DECODE_CONTEXTS:
        cache = rng.standard_normal((B, ATT_KV, L, ATT_DIM), dtype=np.float32)
        q = rng.standard_normal((B, ATT_HEADS, 1, ATT_DIM), dtype=np.float32)
        slots, pos = np.arange(B, dtype=np.int64), np.full(B, L - 1, np.int64)
        t = _timed(lambda: attend_cache(q, cache, cache, slots, pos), 3, min_s)
        att_decode.append([L, flops_pos * B * L / t / 1e9])
    big = np.ones(32 << 20, np.float32)  # 128 MB
    read = big.nbytes / _timed(lambda: big.sum(), 2) / 1e9
    return {"layer_decode": decode, "layer_prefill": prefill, "convert": convert, "attention_prefill": att_prefill,
            "attention_decode": att_decode, "row_s": _ring_row_s(), "read_gbps": read}


def _ring_row_s() -> float:
    """The ring's own bookkeeping a row a step: `run_ring` over a pipe that answers at once."""
    from ..engine.records import Request
    from ..engine.ring import run_ring
    from ..engine.scheduler import Scheduler

    reqs = [Request(i, f"p{i}", tuple(range(1, 33)), max_new_tokens=32) for i in range(64)]
    sched = Scheduler(reqs, groups=1, batch=16, max_new_tokens=32, eos_ids=frozenset(), recompute=False,
                      prefill_chunk=64, mixed=True, stages=1)
    rows = [0]

    class Now:
        def issue(self, step):
            rows[0] += len(step.rows)

        def tokens(self, step):
            return np.full(len(step.rows), 7, np.int64), None

        def close(self, stop):
            pass

    t0 = time.perf_counter()
    run_ring(sched, Now(), lambda done: None, lambda: False)
    return (time.perf_counter() - t0) / max(1, rows[0])


def _links(world: Any, ctx: Any) -> tuple[list, dict]:
    """(Send/Recv curve between ranks 0 and 1, {world size: all-reduce curve}); on rank 0."""
    from .. import tags
    from ..comm import transport
    from ..comm.collectives import ReduceKind, all_reduce

    send, reduce = [], []
    link = transport.Link(world, ctx, 120.0)
    for n in MESSAGE_BYTES:
        buf = np.zeros(max(1, n // 4), np.float32)
        reps = 20 if n <= 65536 else 5
        world.Barrier()
        t0 = time.perf_counter()
        for _ in range(reps):
            if world.rank == 0:
                link.send(buf, 1, tags.MICROBATCH[0], "a calibration message")
                link.recv(buf, 1, tags.MICROBATCH[0], "a calibration message")
            elif world.rank == 1:
                link.recv(buf, 0, tags.MICROBATCH[0], "a calibration message")
                link.send(buf, 0, tags.MICROBATCH[0], "a calibration message")
        send.append([buf.nbytes, (time.perf_counter() - t0) / (2 * reps)])
        world.Barrier()
        t0 = time.perf_counter()
        for _ in range(reps):
            all_reduce(buf, ReduceKind.SUM, comm=world, timeout_s=120.0, ctx=ctx)
        reduce.append([buf.nbytes, (time.perf_counter() - t0) / reps])
    return send, {world.size: reduce}


def _precisions(text: str | None) -> tuple[str, ...]:
    """``--precisions f32,q4``: the precisions to measure (default all five), each checked."""
    from .. import rules

    if not text:
        return PRECISIONS
    return tuple(dict.fromkeys(rules.precision_name(p.strip(), "probe --precisions") for p in text.split(",")))


def calibrate(args: Any) -> int:
    """Every rank measures (`measure_local`), rank 0 writes the medians to ``args.calibrate``."""
    from mpi4py import MPI

    from ..cluster.caps import probe_local
    from ..cluster.start import _pin_threads, gather_local_affinity
    from ..comm import transport
    from ..lifecycle.faults import RankContext, agree, wait
    from ..lifecycle.logdir import setup_logging
    from ..model.calibration import CALIBRATION_VERSION, from_json
    from ..outputs import check_output, write_output

    world = MPI.COMM_WORLD
    setup_logging(world, args.debug, args.log_dir, args.command)
    ctx = RankContext(rank=world.rank, size=world.size, debug=args.debug)
    out = agree(world, ctx, 60.0, lambda: (_precisions(args.precisions), check_output("probe --calibrate", args.calibrate)
                                           if world.rank == 0 else None)[1])
    local = world.Split_type(MPI.COMM_TYPE_SHARED)
    affinity = gather_local_affinity(local, 120.0, ctx)
    mine = agree(world, ctx, 120.0, lambda: probe_local(world.rank, local.rank, local.size, None, False, affinity))
    _pin_threads(mine.cpus)

    def barrier() -> None:  # (a waiting rank sleeps: `faults.wait`, never spins on the core being measured)
        wait(world.Ibarrier(), 600.0, ctx, lambda: "every rank to finish measuring", "some rank")

    barrier()
    precisions = _precisions(args.precisions)
    here = Path(str(args.calibrate)).resolve().parent  # (another node may not see it: its temporary folder)
    here = here if os.access(here, os.W_OK) else Path(tempfile.gettempdir())
    held: list = []  # the loads' stages, until both passes are done (measure_load's note)
    startup = measure_startup(here, world.rank, precisions, sync=barrier, hold=held)
    barrier()
    alone_load = None  # a host's first rank's load alone (the others wait), into fresh memory as a job's
    if local.size > 1:
        if world.rank == 0:
            alone_load = measure_load(here, 0, hold=held, rest=REST_ALONE_S)
        barrier()
    held.clear()
    # (not under `faults.agree`: its deadline's watcher thread takes the GIL between kernel calls,
    # a decode step measured 5-10x slower under it)
    rates = measure_local(precisions, sync=barrier if world.size > 1 else None) | {"startup": startup}
    alone = None  # a host's first rank alone on the host's cores (the others wait): a job of fewer ranks a host
    if local.size > 1:
        barrier()
        if world.rank == 0:
            _pin_threads((mine.cpus or 1) * local.size)
            alone = measure_local(precisions) | alone_load
            _pin_threads(mine.cpus)
        barrier()
    send, reduce = _links(world, ctx) if world.size > 1 else ([], {})
    rows = transport.gather_json(world, rates, 0, 600.0, ctx, "the calibration")
    if rows is None:
        return 0

    def med(key):
        return statistics.median(r[key] for r in rows)

    def med_curve(get):
        curves = [get(r) for r in rows]
        return [[x, statistics.median(c[i][1] for c in curves)] for i, (x, _) in enumerate(curves[0])]

    doc = {"version": CALIBRATION_VERSION, "host": socket.gethostname(), "ranks": world.size,
           "layer_decode": {p: med_curve(lambda r, p=p: r["layer_decode"][p]) for p in rows[0]["layer_decode"]},
           "layer_prefill": {p: med_curve(lambda r, p=p: r["layer_prefill"][p]) for p in rows[0]["layer_prefill"]},
           "attention_prefill": med_curve(lambda r: r["attention_prefill"]),
           "attention_decode": med_curve(lambda r: r["attention_decode"]),
           "convert": {p: statistics.median(r["convert"][p] for r in rows) for p in rows[0]["convert"]},
           "row_s": med("row_s"), "read_gbps": med("read_gbps"),
           "send": send, "allreduce": {str(k): v for k, v in reduce.items()}, "local_size": local.size,
           "startup": {"launch_s": max(r["startup"]["launch_s"] for r in rows),  # (a job waits for its slowest rank)
                       "warm_s": {p: max(r["startup"]["warm_s"][p] for r in rows) for p in precisions},
                       "load_gbps": statistics.median(r["startup"]["load_gbps"] for r in rows),
                       "touch_gbps": statistics.median(r["startup"]["touch_gbps"] for r in rows)}}
    if alone is not None:
        doc["alone"] = {k: alone[k] for k in ALONE_KEYS} | \
            {"startup": doc["startup"] | {k: alone[k] for k in ("load_gbps", "touch_gbps")}}
    from_json(doc, str(args.calibrate))  # (what plan --simulate will read back)
    write_output(out, lambda tmp: tmp.write_text(json.dumps(doc, indent=1)))
    p = next(iter(doc["layer_prefill"]))
    print(f"calibration of {world.size} rank{'s' if world.size != 1 else ''} on {doc['host']} written to "
          f"{args.calibrate}: {p} layers {2 * doc['layer_prefill'][p][-1][0] / doc['layer_prefill'][p][-1][1] / 1e9:.1f} "
          f"GFLOP/s at {doc['layer_prefill'][p][-1][0]} positions, decode of 1 row "
          f"{2 / doc['layer_decode'][p][0][1] / 1e9:.1f} GFLOP/s, {doc['read_gbps']:.1f} GB/s read"
          + (f", Send of 1 MiB {doc['send'][3][1] * 1e3:.2f} ms" if send else "")
          + f"; start-up: launch {doc['startup']['launch_s']:.1f} s, kernels {doc['startup']['warm_s'][precisions[0]]:.1f} s"
          f" ({precisions[0]}), weights loaded at {doc['startup']['load_gbps']:.2f} GB/s, fresh memory written at "
          f"{doc['startup']['touch_gbps']:.2f} GB/s")
    return 0
