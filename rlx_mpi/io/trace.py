"""Timelines of a run: Chrome Trace Event Format (opens in ui.perfetto.dev as is), a Gantt
picture, and the measured pipeline bubble.

A `Span` is one timed piece of work on one rank (a compute, a pack, a wait), in seconds on a
clock common to all ranks (the executor aligns them). `chrome_trace` turns spans into the
JSON object format of the Trace Event spec: one process per rank (``pid`` = rank, named
``rank r (host, stage s)``), one thread per category inside it (so spans of one category
nest, as Perfetto requires), complete ("X") events with ``ts``/``dur`` in microseconds from
the earliest span. `validate_trace` checks exactly what the viewer and `gantt_png` rely on.

Note: matplotlib is optional (extra ``plot``) and imported only inside `gantt_png`, through its
object API (Figure + Agg canvas): no pyplot, no global backend switch, nothing at import.
"""

from __future__ import annotations

import json
import math
import numbers
import os
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import ConfigError, InputError

__all__ = ["CATEGORIES", "BUSY_CATEGORIES", "Span", "chrome_trace", "validate_trace", "save_trace",
           "load_trace", "spans_from_trace", "gantt_png", "bubble", "summary"]

# the thread (tid) of each category inside a rank's process lane is its index here
CATEGORIES = ("compute", "pack", "unpack", "send_wait", "recv_wait", "startup", "collective")
# what counts as a rank doing the pipeline's work in `bubble` (waits and start-up do not;
# "collective" spans are taken to lie inside compute spans, so are not counted twice)
BUSY_CATEGORIES = ("compute", "pack", "unpack")
# Gantt colours per category (colour-blind safe Okabe-Ito palette)
_COLOURS = {"compute": "#0072B2", "pack": "#009E73", "unpack": "#56B4E9", "send_wait": "#E69F00",
            "recv_wait": "#D55E00", "startup": "#999999", "collective": "#CC79A7"}
_WAITS = ("send_wait", "recv_wait")


@dataclass(frozen=True)
class Span:
    """One timed piece of work on one rank."""

    rank: int  # world rank (the trace's pid)
    name: str  # shown on the slice, e.g. "F3" or "load weights"
    cat: str  # one of CATEGORIES
    start_s: float  # seconds on the clock common to all ranks
    dur_s: float  # seconds, >= 0
    args: dict = field(default_factory=dict)  # e.g. {"microbatch": 3, "stage": 1}; JSON values


def _plain(v):
    """numpy scalars and arrays to Python ones, so args always serialise."""
    return v.tolist() if hasattr(v, "tolist") and not isinstance(v, (list, dict, str)) else v


def _lane_name(lane: dict, show_tp: bool) -> str:
    bits = [str(lane.get("host", "?")), f"stage {lane.get('stage', '?')}"]
    if show_tp and lane.get("tp_rank") is not None:
        bits.append(f"tp {lane['tp_rank']}")
    return f"rank {lane['rank']} ({', '.join(bits)})"


def chrome_trace(spans: list[Span], lanes: list[dict], meta: dict | None = None) -> dict:
    """Spans -> a Trace Event Format object: M metadata events naming each rank's lane (and its
    category threads), then X events sorted by rank and time. ``lanes``: one dict per rank,
    ``{"rank", "host", "stage", "tp_rank"}``. ``meta`` (e.g. microbatches, n_stages, wire) goes
    into ``otherData`` beside the lanes and the clock origin in seconds."""
    ranks = [lane.get("rank") for lane in lanes]
    if (any(not isinstance(r, numbers.Integral) or isinstance(r, bool) or r < 0 for r in ranks)
            or len(set(ranks)) != len(ranks)):
        raise ValueError(f"lanes: need one dict per rank with a distinct int 'rank' >= 0, got ranks {ranks}")
    lanes = [{k: _plain(v) for k, v in lane.items()} for lane in lanes]  # numpy ints -> int
    spans = [s if type(s.rank) is int else Span(int(s.rank), s.name, s.cat, s.start_s, s.dur_s, s.args) for s in spans]
    for i, s in enumerate(spans):
        if s.rank not in ranks:
            raise ValueError(f"spans[{i}] ({s.name!r}): rank {s.rank} has no lane (lanes: {sorted(ranks)})")
        if s.cat not in CATEGORIES:
            raise ValueError(f"spans[{i}] ({s.name!r}): category {s.cat!r} is not one of {', '.join(CATEGORIES)}")
        if not (math.isfinite(s.start_s) and math.isfinite(s.dur_s)) or s.dur_s < 0:
            raise ValueError(f"spans[{i}] ({s.name!r}): start {s.start_s} s, duration {s.dur_s} s; "
                             "need finite times and a duration >= 0")
    origin = min((s.start_s for s in spans), default=0.0)
    show_tp = any((lane.get("tp_rank") or 0) > 0 for lane in lanes)

    events = []
    for lane in sorted(lanes, key=lambda lane: lane["rank"]):
        r = lane["rank"]
        events.append({"ph": "M", "name": "process_name", "pid": r, "tid": 0, "args": {"name": _lane_name(lane, show_tp)}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": r, "tid": 0, "args": {"sort_index": r}})
    for r, cat in sorted({(s.rank, s.cat) for s in spans}):
        tid = CATEGORIES.index(cat)
        events.append({"ph": "M", "name": "thread_name", "pid": r, "tid": tid, "args": {"name": cat}})
        events.append({"ph": "M", "name": "thread_sort_index", "pid": r, "tid": tid, "args": {"sort_index": tid}})
    for s in sorted(spans, key=lambda s: (s.rank, s.start_s, -s.dur_s)):
        events.append({"ph": "X", "name": s.name, "cat": s.cat, "pid": s.rank, "tid": CATEGORIES.index(s.cat),
                       "ts": round(float(s.start_s - origin) * 1e6, 3), "dur": round(float(s.dur_s) * 1e6, 3),
                       "args": {str(k): _plain(v) for k, v in s.args.items()}})
    other = {"generator": "rlx_mpi", "clock_origin_s": float(origin),
             "lanes": lanes}
    other.update({str(k): _plain(v) for k, v in (meta or {}).items()})
    # key order matters to Perfetto's streaming JSON reader: displayTimeUnit is looked for in the
    # first chunk only, and in an event "ts" must come before any array-valued key
    return {"displayTimeUnit": "ms", "traceEvents": events, "otherData": other}


def _need(cond: bool, where: str, what: str) -> None:
    if not cond:
        raise ValueError(f"{where}: {what}")


def _is_num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def validate_trace(doc: dict) -> None:
    """Raise ValueError naming the first thing wrong: the object layout, an event's fields, a
    rank lane without a name, or X events on one thread that overlap without nesting."""
    _need(isinstance(doc, dict), "trace", f"expected a JSON object, got {type(doc).__name__}")
    events = doc.get("traceEvents")
    _need(isinstance(events, list), "trace", "missing the 'traceEvents' list")
    _need(doc.get("displayTimeUnit", "ms") in ("ms", "ns"), "trace",
          f"displayTimeUnit must be 'ms' or 'ns', got {doc.get('displayTimeUnit')!r}")
    _need(isinstance(doc.get("otherData", {}), dict), "trace", "otherData must be an object")
    named, used = set(), {}
    for i, e in enumerate(events):
        where = f"traceEvents[{i}]"
        _need(isinstance(e, dict), where, f"expected an object, got {type(e).__name__}")
        ph = e.get("ph")
        _need(isinstance(e.get("pid"), int) and not isinstance(e.get("pid"), bool), where, f"pid must be an int, got {e.get('pid')!r}")
        _need(isinstance(e.get("tid", 0), int), where, f"tid must be an int, got {e.get('tid')!r}")
        _need(isinstance(e.get("args", {}), dict), where, "args must be an object")
        if ph == "M":
            _need(e.get("name") in ("process_name", "process_sort_index", "thread_name", "thread_sort_index"),
                  where, f"unknown metadata event {e.get('name')!r}")
            if e["name"] == "process_name":
                _need(isinstance(e.get("args", {}).get("name"), str), where, "process_name needs args.name")
                _need(e["pid"] not in named, where, f"a second process_name for pid {e['pid']}")
                named.add(e["pid"])
        elif ph == "X":
            _need(isinstance(e.get("name"), str), where, "name must be a string")
            _need(isinstance(e.get("cat"), str), where, "cat must be a string")
            _need(_is_num(e.get("ts")), where, f"ts must be a finite number, got {e.get('ts')!r}")
            _need(_is_num(e.get("dur")) and e["dur"] >= 0, where, f"dur must be a finite number >= 0, got {e.get('dur')!r}")
            used.setdefault((e["pid"], e.get("tid", 0)), []).append((e["ts"], e["dur"], i))
        else:
            raise ValueError(f"{where}: unsupported phase {ph!r} (this trace uses 'M' and 'X' events)")
    for (pid, tid), spans in used.items():
        _need(pid in named, f"pid {pid}", "has events but no process_name metadata event (a lane without a rank name)")
        open_ends = []  # a stack of enclosing slices' ends: slices on a thread must nest
        for ts, dur, i in sorted(spans, key=lambda t: (t[0], -t[1])):
            while open_ends and ts >= open_ends[-1] - 1e-3:
                open_ends.pop()
            _need(not open_ends or ts + dur <= open_ends[-1] + 1e-3, f"traceEvents[{i}]",
                  f"overlaps an earlier slice on pid {pid} tid {tid} without nesting in it")
            open_ends.append(ts + dur)
    try:
        json.dumps(doc, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise ValueError(f"trace: not serialisable as strict JSON ({e})") from None


def _write_atomic(path, write) -> None:
    target = Path(path)
    if not target.parent.is_dir():
        raise ConfigError(str(path), f"folder {target.parent} does not exist", "create it or choose another path")
    tmp = target.with_name(f".{target.name}.tmp{os.getpid()}")
    try:
        write(tmp)
        os.replace(tmp, target)
    finally:
        if tmp.exists():
            tmp.unlink()


def save_trace(doc: dict, path) -> None:
    """Validate ``doc`` and write it as JSON through a temporary name (never half a file)."""
    validate_trace(doc)
    # UTF-8, not \uXXXX escapes: Perfetto's JSON reader rejects those (a host name with an accent)
    text = json.dumps(doc, allow_nan=False, ensure_ascii=False) + "\n"
    _write_atomic(path, lambda tmp: Path(tmp).write_text(text, encoding="utf-8"))


def load_trace(path) -> dict:
    """Read and validate a trace file; InputError naming the file and what is wrong."""
    fix = "pass a file written by `rlx-mpi run --trace`"
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise InputError(str(path), f"cannot read the trace ({e.strerror or e})", fix) from None
    try:
        doc = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise InputError(str(path), f"not JSON ({e})", fix) from None
    try:
        validate_trace(doc)
    except ValueError as e:
        raise InputError(str(path), f"not a valid trace: {e}", fix) from None
    return doc


def spans_from_trace(doc: dict) -> list[Span]:
    """The X events of a (validated) trace as Spans, in seconds from the trace's clock origin."""
    return [Span(e["pid"], e["name"], e["cat"], e["ts"] * 1e-6, e["dur"] * 1e-6, dict(e.get("args", {})))
            for e in doc["traceEvents"] if e.get("ph") == "X"]


def _union_s(intervals: list[tuple[float, float]]) -> float:
    """Total length of a union of [start, end) intervals (overlaps counted once)."""
    total, end = 0.0, -math.inf
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def bubble(spans: list[Span], n_stages: int, microbatches: int) -> dict:
    """Measured busy fraction per rank beside the GPipe ideal.

    The window is the forward's wall span: the earliest start to the latest end of every
    non-start-up span, over all ranks (one clock). A rank's busy time is the union of its
    compute, pack and unpack spans; its bubble is 1 - busy / window. The ideal bubble of a
    fill-drain forward with p equal stages and M microbatches is (p-1)/(M+p-1).
    """
    if not (isinstance(n_stages, int) and n_stages >= 1 and isinstance(microbatches, int) and microbatches >= 1):
        raise ValueError(f"bubble: need n_stages >= 1 and microbatches >= 1, got {n_stages} and {microbatches}")
    work = [s for s in spans if s.cat != "startup"]
    if not work:
        raise ValueError("bubble: no spans outside start-up to measure")
    start = min(s.start_s for s in work)
    end = max(s.start_s + s.dur_s for s in work)
    window = end - start
    ranks = []
    for r in sorted({s.rank for s in work}):
        busy = _union_s([(s.start_s, s.start_s + s.dur_s) for s in work if s.rank == r and s.cat in BUSY_CATEGORIES])
        frac = busy / window if window > 0 else 0.0
        ranks.append({"rank": r, "busy_s": busy, "busy_fraction": frac, "bubble": 1.0 - frac})
    ideal = (n_stages - 1) / (microbatches + n_stages - 1)
    mean_busy = sum(x["busy_fraction"] for x in ranks) / len(ranks)
    return {"start_s": start, "end_s": end, "window_s": window, "ranks": ranks,
            "mean_busy_fraction": mean_busy, "measured_bubble": 1.0 - mean_busy,
            "ideal_bubble": ideal, "ideal_busy_fraction": 1.0 - ideal,
            "n_stages": n_stages, "microbatches": microbatches}


def gantt_png(doc: dict, png_path, title: str | None = None, startup: bool = False) -> None:
    """Draw a validated trace as a Gantt chart: one row per rank, a colour per category (waits
    as thin bars under the work), the microbatch number on compute spans wide enough for it.
    Start-up spans (seconds, beside a forward of milliseconds) are left out unless ``startup``
    or unless there is nothing else; the time axis starts at the first span drawn."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch
    except ImportError:
        raise ConfigError("trace --png", "matplotlib is not installed", "pip install 'rlx_mpi[plot]'") from None
    validate_trace(doc)
    events = doc["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    spans = [e for e in events if e["ph"] == "X"]
    if not startup and any(e["cat"] != "startup" for e in spans):
        spans = [e for e in spans if e["cat"] != "startup"]
    origin = min((e["ts"] for e in spans), default=0.0)
    spans = [dict(e, ts=e["ts"] - origin) for e in spans]
    rows = sorted(names)  # top row = lowest rank
    y_of = {pid: len(rows) - 1 - i for i, pid in enumerate(rows)}
    end_ms = max((e["ts"] + e["dur"] for e in spans), default=1.0) / 1e3 or 1.0

    fig = Figure(figsize=(12, 1.2 + 0.55 * len(rows)), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    used = []
    for cat in CATEGORIES:
        mine = [e for e in spans if e["cat"] == cat]
        if not mine:
            continue
        used.append(cat)
        low, height = (-0.4, 0.22) if cat in _WAITS else (-0.3, 0.7)
        for e in mine:
            y = y_of[e["pid"]]
            ax.broken_barh([(e["ts"] / 1e3, e["dur"] / 1e3)], (y + low, height),
                           facecolors=_COLOURS.get(cat, "#000000"), edgecolor="white", linewidth=0.3 if cat == "compute" else 0)
            mb = e.get("args", {}).get("microbatch")
            if cat == "compute" and mb is not None and e["dur"] / 1e3 > 0.025 * end_ms:
                ax.text((e["ts"] + e["dur"] / 2) / 1e3, y + 0.05, str(mb), ha="center", va="center",
                        color="white", fontsize=8, clip_on=True)
    other = [e for e in spans if e["cat"] not in CATEGORIES]  # foreign categories: grey
    for e in other:
        ax.broken_barh([(e["ts"] / 1e3, e["dur"] / 1e3)], (y_of[e["pid"]] - 0.3, 0.7), facecolors="#444444")
    ax.set_yticks([y_of[p] for p in rows], [names[p] for p in rows], fontsize=8)
    ax.set_ylim(-0.6, len(rows) - 0.4)
    ax.set_xlim(0, end_ms * 1.01)
    ax.set_xlabel("time since the first span drawn (ms)")
    meta = doc.get("otherData", {})
    if title is None:
        bits = [f"{len(rows)} ranks"] + [f"{meta[k]} {label}" for k, label in
                                         (("n_stages", "stages"), ("microbatches", "microbatches"), ("wire", "wire"))
                                         if k in meta]
        title = "rlx_mpi trace: " + ", ".join(bits)
    ax.set_title(title, fontsize=10)
    ax.grid(axis="x", linewidth=0.3, alpha=0.5)
    if used:
        ax.legend(handles=[Patch(color=_COLOURS[c], label=c) for c in used], loc="upper center",
                  bbox_to_anchor=(0.5, -0.18 - 0.3 / max(len(rows), 1)), ncol=len(used), fontsize=8, frameon=False)
    fig.tight_layout()
    _write_atomic(png_path, lambda tmp: fig.savefig(tmp, format="png"))


def summary(doc: dict) -> str:
    """Per lane: milliseconds in each category; then the measured bubble beside the ideal
    (``rlx-mpi trace``)."""
    names = {e["pid"]: e["args"]["name"] for e in doc["traceEvents"] if e.get("ph") == "M"
             and e.get("name") == "process_name"}
    spans = spans_from_trace(doc)
    lines = []
    for pid in sorted(names):
        totals: dict[str, float] = {}
        for sp in spans:
            if sp.rank == pid:
                totals[sp.cat] = totals.get(sp.cat, 0.0) + sp.dur_s * 1e3
        lines.append(f"{names[pid]}: " + ", ".join(f"{k} {v:.1f} ms" for k, v in totals.items()))
    other = doc.get("otherData", {})
    if isinstance(other.get("n_stages"), int) and isinstance(other.get("microbatches"), int):
        b = bubble(spans, other["n_stages"], other["microbatches"])
        lines.append(f"bubble {100 * b['measured_bubble']:.1f}% measured (busy = compute + pack + unpack), "
                     f"{100 * b['ideal_bubble']:.1f}% ideal (p-1)/(M+p-1) for p = {b['n_stages']}, "
                     f"M = {b['microbatches']}; window {b['window_s'] * 1e3:.1f} ms")
    return "\n".join(lines)
