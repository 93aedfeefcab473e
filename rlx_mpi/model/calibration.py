"""A host's measured rates (``rlx-mpi probe --calibrate``) and the price of a step under them.

`Calibration` is what the probe writes (one JSON file per allocation type: the rates of one rank
while its neighbours run too, and of the links between ranks) and ``plan --simulate`` reads;
`step_seconds` turns a `model.cost.StepCost` into seconds on such a rank. Pure: no MPI, no
numpy, no kernels (the simulator imports this; tests/test_imports.py checks it).

Note: the price. A step on one rank of a stage of ``tp`` ranks costs
  layers     layer weights / tp x the measured seconds a layer weight at that many rows: a real
             stage of the decoder at the rank's precision, its decode steps (1..64 rows: the
             fused decode layer) or its prefills (8..1,024 positions: the product kernels), with
             norms, RoPE and calls inside the rate; below the first point its time, past
             the last its rate (the time grows with the rows)
  head       the head's weights / tp at its rows (one a row; every position for score), at the
             prefill rate (a `Linear`, as the prefill's products)
  attention  its FLOPs / tp over the measured rate at that context (prefill and decode apart)
  rows       a fixed cost a row (the ring's bookkeeping: scheduler, header, sampling)
  all-reduce two a layer of the positions' hidden state (tp > 1), the measured Allreduce
  send       the hidden state to the next stage (or the tokens back), the measured Send/Recv
The start-up (`Startup`, measured by the probe when present; else `plan --simulate` says it
estimates it): the launch, the kernels' load at the job's precision (and the shared ones), the
largest stage's stored bytes at the measured load rate, and the conversion to the held precision.
A model of another shape is priced by its weights at these rates: its own kernel calls per
weight differ (a narrow model's fixed costs weigh more), which the medium preset's rate hides.
Every curve is interpolated log-log between the measured points.
"""

from __future__ import annotations

import bisect
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import ConfigError

__all__ = ["Calibration", "Startup", "load_calibration", "step_seconds", "CALIBRATION_VERSION"]

CALIBRATION_VERSION = 1
_ALONE = ("layer_decode", "layer_prefill", "attention_prefill", "attention_decode")
_ALONE_MAYBE = ("startup", "convert")  # (the weights' load alone, their conversion alone: later calibrations)
PRODUCT_ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)

Curve = tuple[tuple[float, float], ...]  # (x, y) points, x increasing


def interp(curve: Curve, x: float) -> float:
    """``curve`` at ``x``: log-log linear between points, the end values beyond them."""
    xs = [p[0] for p in curve]
    if x <= xs[0]:
        return curve[0][1]
    if x >= xs[-1]:
        return curve[-1][1]
    i = bisect.bisect_right(xs, x)
    (x0, y0), (x1, y1) = curve[i - 1], curve[i]
    if y0 <= 0 or y1 <= 0:
        return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    f = math.log(x / x0) / math.log(x1 / x0)
    return math.exp(math.log(y0) + f * (math.log(y1) - math.log(y0)))


def transfer(curve: Curve, nbytes: float) -> float:
    """Seconds to move ``nbytes`` by a (bytes, seconds) curve; past its largest point at the
    bandwidth of that point."""
    if nbytes <= 0:
        return 0.0
    big, t = curve[-1]
    return t * nbytes / big if nbytes > big else interp(curve, nbytes)


@dataclass(frozen=True)
class Startup:
    """A job's start-up as the probe measured it (`drivers.calibrate.measure_startup`)."""

    launch_s: float  # the launcher's start to the command's first line (interpreter, imports, MPI_Init): slowest rank
    warm_s: dict[str, float]  # precision -> the family's kernels loaded (the first measured also loads the shared ones)
    load_gbps: float  # f32 stored bytes a second read from HDF5 and made resident in a stage
    touch_gbps: float = 0.0  # fresh memory a second written the first time: the KV cache at the first step (0: an
    # older calibration's, which did not measure it: `touch_s` prices it at load_gbps)

    def touch_s(self, nbytes: float) -> float:
        """Seconds ``nbytes`` of fresh memory take to be written the first time (a job's KV cache,
        which its first step faults in: `engine.simulate`'s first-touch note)."""
        return nbytes / ((self.touch_gbps or self.load_gbps) * 1e9)

    def kernels_s(self, precision: str) -> float:
        """The kernels a job at ``precision`` loads: the shared ones (the first measured
        precision's time) and its own (an unmeasured precision: its neighbours' largest)."""
        first = next(iter(self.warm_s))
        own = self.warm_s.get(precision, max(self.warm_s.values()))
        return self.warm_s[first] + (own if precision != first else 0.0)

    def to_json(self) -> dict:
        return {"launch_s": self.launch_s, "warm_s": dict(self.warm_s), "load_gbps": self.load_gbps} | \
            ({"touch_gbps": self.touch_gbps} if self.touch_gbps else {})


@dataclass(frozen=True)
class Calibration:
    """One rank's measured rates (all ranks of the allocation measured at once) and its links."""

    host: str
    ranks: int  # ranks that measured together (their shared cores and memory are in the rates)
    layer_decode: dict[str, Curve]  # precision -> (rows, seconds per layer weight) of a decode step
    layer_prefill: dict[str, Curve]  # precision -> (positions, seconds per layer weight) of a prefill
    attention_prefill: Curve  # (context, GFLOP/s) of a prefill chunk's attention
    attention_decode: Curve  # (context, GFLOP/s) of a decode row's attention
    row_s: float  # seconds a row a step outside the layers (the ring's bookkeeping, the sampling)
    read_gbps: float  # streaming read of a large array
    send: Curve = ()  # (bytes, seconds) of one Send/Recv between two ranks
    allreduce: dict[int, Curve] = field(default_factory=dict)  # ranks -> (bytes, seconds) of an all-reduce
    convert: dict[str, float] = field(default_factory=dict)  # precision -> seconds a float32 weight takes to be
    # made resident at it at load (a q4 job on an f32 checkpoint quantizes at start-up)
    local_size: int = 1  # ranks that shared a host while measuring
    startup: Startup | None = None  # (a calibration written before the start-up was measured: None)
    alone: "Calibration | None" = None  # the same rates of a host's rank alone on its cores (local_size > 1)
    path: str = ""

    def sharing(self, ranks_per_host: int) -> "Calibration":
        """The rates of a job with ``ranks_per_host`` ranks a host: a host's only rank takes the
        `alone` rates (all its cores), more the shared ones."""
        return self.alone if ranks_per_host <= 1 and self.alone is not None else self

    def weight_s(self, precision: str, rows: int, decode: bool) -> float:
        """Seconds a layer weight at ``rows`` rows (positions), a decode step's or a prefill's (a
        precision not measured: refused, named)."""
        curves = self.layer_decode if decode else self.layer_prefill
        curve = curves.get(precision)
        if curve is None:
            raise ConfigError(f"{self.path}: layer_{'decode' if decode else 'prefill'}", f"no rates for precision "
                              f"{precision!r} (it has {sorted(curves)})",
                              f"run rlx-mpi probe --calibrate again with --precisions {precision} among them")
        last_rows, last_s = curve[-1]
        if rows > last_rows:  # past the last point the rate holds: the time a weight grows with the rows
            return last_s * rows / last_rows
        return interp(curve, max(1, rows))

    def send_s(self, nbytes: float) -> float:
        return transfer(self.send, nbytes) if self.send else 0.0

    def allreduce_s(self, nbytes: float, tp: int) -> float:
        if tp <= 1 or not self.allreduce:
            return 0.0
        near = min(self.allreduce, key=lambda n: (abs(n - tp), n))
        return transfer(self.allreduce[near], nbytes) * (2 * (tp - 1) / tp) / (2 * (near - 1) / near)

    def to_json(self) -> dict:
        return {"version": CALIBRATION_VERSION, "host": self.host, "ranks": self.ranks,
                "layer_decode": {p: [list(x) for x in c] for p, c in self.layer_decode.items()},
                "layer_prefill": {p: [list(x) for x in c] for p, c in self.layer_prefill.items()},
                "attention_prefill": [list(x) for x in self.attention_prefill],
                "attention_decode": [list(x) for x in self.attention_decode],
                "row_s": self.row_s, "read_gbps": self.read_gbps,
                "send": [list(x) for x in self.send],
                "allreduce": {str(n): [list(x) for x in c] for n, c in self.allreduce.items()},
                "local_size": self.local_size, "convert": dict(self.convert),
                **({"startup": self.startup.to_json()} if self.startup else {}),
                **({"alone": {k: v for k, v in self.alone.to_json().items() if k in _ALONE or k in _ALONE_MAYBE}}
                   if self.alone else {})}


def _curve(doc: dict, key: str, where: str, optional: bool = False) -> Curve:
    v = doc.get(key)
    if optional and (v is None or v == []):  # (one rank: no link measured)
        return ()
    if not isinstance(v, list) or not v:
        raise ConfigError(f"{where}: {key}", f"got {v!r}", "expected a list of [x, y] pairs; run rlx-mpi probe "
                          "--calibrate again")
    out = []
    for i, p in enumerate(v):
        if not (isinstance(p, list) and len(p) == 2 and all(isinstance(x, (int, float)) and not isinstance(x, bool)
                                                            and math.isfinite(x) and x >= 0 for x in p)):
            raise ConfigError(f"{where}: {key}[{i}]", f"got {p!r}", "expected [x, y], two finite numbers >= 0")
        if out and p[0] <= out[-1][0]:
            raise ConfigError(f"{where}: {key}[{i}]", f"x {p[0]} after {out[-1][0]}", "expected increasing x")
        out.append((float(p[0]), float(p[1])))
    return tuple(out)


def _number(doc: dict, key: str, where: str) -> float:
    v = doc.get(key)
    if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v < 0:
        raise ConfigError(f"{where}: {key}", f"got {v!r}", "expected a finite number >= 0; run rlx-mpi probe "
                          "--calibrate again")
    return float(v)


def _startup(doc: Any, where: str) -> Startup:
    need = {"launch_s", "warm_s", "load_gbps"}
    if not isinstance(doc, dict) or not need <= set(doc) <= need | {"touch_gbps"}:
        raise ConfigError(where, f"got {sorted(doc) if isinstance(doc, dict) else doc!r}",
                          "expected {launch_s, warm_s: {precision: s}, load_gbps[, touch_gbps]}; run rlx-mpi probe "
                          "--calibrate again")
    warm = doc["warm_s"]
    if not isinstance(warm, dict) or not warm:
        raise ConfigError(f"{where}: warm_s", f"got {warm!r}", "expected {precision: seconds}")
    touch = _rate(doc, "touch_gbps", where) if "touch_gbps" in doc else 0.0  # (optional: an older file's 0)
    return Startup(_number(doc, "launch_s", where), {p: _number(warm, p, f"{where}: warm_s") for p in warm},
                   _rate(doc, "load_gbps", where), touch)


def _rate(doc: dict, key: str, where: str) -> float:
    v = _number(doc, key, where)
    if v <= 0:
        raise ConfigError(f"{where}: {key}", f"got {v!r}", "expected a rate > 0; run rlx-mpi probe --calibrate again")
    return v


def from_json(doc: Any, where: str) -> Calibration:
    """A `Calibration` from its JSON document, every key checked (the error names file and key)."""
    if not isinstance(doc, dict):
        raise ConfigError(where, f"got a JSON {type(doc).__name__}", "expected the object rlx-mpi probe --calibrate writes")
    if doc.get("version") != CALIBRATION_VERSION:
        raise ConfigError(f"{where}: version", f"got {doc.get('version')!r}, expected {CALIBRATION_VERSION}",
                          "run rlx-mpi probe --calibrate again with this version")
    known = {"version", "host", "ranks", "layer_decode", "layer_prefill", "attention_prefill", "attention_decode",
             "row_s", "read_gbps", "send", "allreduce", "local_size", "alone", "convert", "startup"}
    extra = sorted(set(doc) - known)
    if extra:
        raise ConfigError(f"{where}: {extra[0]}", "unknown key", f"expected only {sorted(known)}")
    layer = {}
    for key in ("layer_decode", "layer_prefill"):
        v = doc.get(key)
        if not isinstance(v, dict) or not v:
            raise ConfigError(f"{where}: {key}", f"got {v!r}", "expected {precision: [[rows, s], ...]}")
        layer[key] = {p: _curve(v, p, f"{where}: {key}") for p in v}
    allreduce = doc.get("allreduce") or {}
    if not isinstance(allreduce, dict) or not all(k.isdigit() and int(k) >= 2 for k in allreduce):
        raise ConfigError(f"{where}: allreduce", f"got keys {list(allreduce)!r}", "expected {ranks >= 2: curve}")
    ranks = doc.get("ranks")
    if not isinstance(ranks, int) or isinstance(ranks, bool) or ranks < 1:
        raise ConfigError(f"{where}: ranks", f"got {ranks!r}", "expected an int >= 1")
    local_size = doc.get("local_size", 1)
    if not isinstance(local_size, int) or isinstance(local_size, bool) or local_size < 1:
        raise ConfigError(f"{where}: local_size", f"got {local_size!r}", "expected an int >= 1")
    convert = doc.get("convert") or {}
    if not isinstance(convert, dict):
        raise ConfigError(f"{where}: convert", f"got {convert!r}", "expected {precision: seconds a weight}")
    convert = {p: _number(convert, p, f"{where}: convert") for p in convert}
    startup = _startup(doc.get("startup"), f"{where}: startup") if doc.get("startup") is not None else None
    alone = None
    if doc.get("alone") is not None:
        a = doc["alone"]
        if not isinstance(a, dict) or not set(_ALONE) <= set(a) <= {*_ALONE, *_ALONE_MAYBE}:
            raise ConfigError(f"{where}: alone", f"got keys {sorted(a) if isinstance(a, dict) else a!r}",
                              f"expected {sorted(_ALONE)} and perhaps {' and '.join(_ALONE_MAYBE)}")
        alone = from_json({k: v for k, v in doc.items() if k not in ("alone", *_ALONE)} | a | {"local_size": 1},
                          f"{where}: alone")
    return Calibration(host=str(doc.get("host", "")), ranks=ranks, local_size=local_size, alone=alone, convert=convert,
                       startup=startup,
                       layer_decode=layer["layer_decode"], layer_prefill=layer["layer_prefill"],
                       attention_prefill=_curve(doc, "attention_prefill", where),
                       attention_decode=_curve(doc, "attention_decode", where),
                       row_s=_number(doc, "row_s", where),
                       read_gbps=_number(doc, "read_gbps", where), send=_curve(doc, "send", where, optional=True),
                       allreduce={int(k): _curve(allreduce, k, f"{where}: allreduce") for k in allreduce},
                       path=where)


def load_calibration(path: str | Path) -> Calibration:
    """Read and check a calibration file (one-line errors naming the file and key)."""
    p = Path(path)
    try:
        doc = json.loads(p.read_text())
    except OSError as e:
        raise ConfigError(str(p), f"cannot read it ({e.strerror})", "give the file rlx-mpi probe --calibrate wrote") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{p}:{e.lineno}", f"not JSON ({e.msg})", "give the file rlx-mpi probe --calibrate wrote") from None
    return from_json(doc, str(p))


def step_seconds(sc: Any, cal: Calibration, precision: str, tp: int = 1, send: bool = True) -> float:
    """One rank's seconds for a `StepCost` on a stage of ``tp`` ranks (the module's price note);
    ``send``: with the hidden state's (or tokens') way to the next stage."""
    decode = sc.positions == sc.rows and not sc.attn_prefill_flops and tp == 1  # (tp > 1: no fused decode layer)
    t = sc.product_weights / tp * cal.weight_s(precision, sc.positions, decode)
    t += sc.head_weights / tp * cal.weight_s(precision, sc.head_rows, False) if sc.head_rows else 0.0
    ctx = max(1.0, sc.context)
    if sc.attn_prefill_flops:
        t += sc.attn_prefill_flops / tp / (interp(cal.attention_prefill, ctx) * 1e9)
    if sc.attn_decode_flops:
        t += sc.attn_decode_flops / tp / (interp(cal.attention_decode, ctx) * 1e9)
    t += sc.rows * cal.row_s
    if tp > 1:
        t += 2 * sc.layers * cal.allreduce_s(sc.positions * sc.hidden * 4.0, tp)
    if send:
        t += cal.send_s(sc.send_bytes)
    return t
