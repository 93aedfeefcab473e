"""Chrome trace writer, validator, loader, bubble and Gantt picture. Pure: no MPI."""

import copy
import json
import struct
import sys

import numpy as np
import pytest

from rlx_mpi.io import trace
from rlx_mpi.errors import EXIT_BAD_INPUT, ConfigError, InputError
from rlx_mpi.io.trace import Span

T0 = 1000.0  # a clock origin far from 0, as perf_counter/monotonic give


def gpipe_spans(p=3, m=4, t=0.010, comm=0.001, startup=True):
    """A fill-drain forward by hand: stage s computes microbatch k in step s + k; each stage
    but the first waits for its input, each but the last packs and waits on its send."""
    spans, lanes = [], []
    for s in range(p):
        lanes.append({"rank": s, "host": "vm", "stage": s, "tp_rank": 0})
        if startup:
            spans.append(Span(s, "load weights", "startup", T0 - 0.5, 0.4, {}))
        for k in range(m):
            start = T0 + (s + k) * (t + 2 * comm)
            if s > 0:
                spans.append(Span(s, f"recv {k}", "recv_wait", start - comm, comm * 0.5, {"microbatch": k}))
                spans.append(Span(s, f"unpack {k}", "unpack", start - comm * 0.5, comm * 0.5, {"microbatch": k}))
            spans.append(Span(s, f"F{k}", "compute", start, t, {"microbatch": k, "stage": s}))
            if s < p - 1:
                spans.append(Span(s, f"pack {k}", "pack", start + t, comm * 0.5, {"microbatch": np.int64(k)}))
                spans.append(Span(s, f"send {k}", "send_wait", start + t + comm * 0.5, comm * 0.5, {"microbatch": k}))
    return spans, lanes


def make_doc(**kw):
    spans, lanes = gpipe_spans(**kw)
    return trace.chrome_trace(spans, lanes, meta={"microbatches": 4, "n_stages": 3, "wire": "bf16"})


def test_chrome_trace_layout_and_json_round_trip():
    spans, lanes = gpipe_spans()
    doc = trace.chrome_trace(spans, lanes, meta={"microbatches": 4})
    back = json.loads(json.dumps(doc, allow_nan=False))
    assert back == doc
    assert set(doc) == {"traceEvents", "displayTimeUnit", "otherData"} and doc["displayTimeUnit"] == "ms"
    ev = doc["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in ev if e["ph"] == "M" and e["name"] == "process_name"}
    assert names == {0: "rank 0 (vm, stage 0)", 1: "rank 1 (vm, stage 1)", 2: "rank 2 (vm, stage 2)"}
    sort = {e["pid"]: e["args"]["sort_index"] for e in ev if e["ph"] == "M" and e["name"] == "process_sort_index"}
    assert sort == {0: 0, 1: 1, 2: 2}
    xs = [e for e in ev if e["ph"] == "X"]
    assert len(xs) == len(spans) and {e["pid"] for e in xs} == {0, 1, 2}
    for e in xs:
        assert {"name", "cat", "ts", "dur", "pid", "tid", "args"} <= set(e) and e["dur"] >= 0
        assert e["tid"] == trace.CATEGORIES.index(e["cat"])
    for pid in (0, 1, 2):  # ts monotonic per lane
        ts = [e["ts"] for e in xs if e["pid"] == pid]
        assert ts == sorted(ts)
    # microseconds from the earliest span (the start-up at T0 - 0.5)
    f0 = next(e for e in xs if e["pid"] == 0 and e["name"] == "F0")
    assert f0["ts"] == pytest.approx(0.5e6) and f0["dur"] == pytest.approx(10_000)
    assert doc["otherData"]["clock_origin_s"] == T0 - 0.5 and doc["otherData"]["microbatches"] == 4
    assert doc["otherData"]["lanes"] == lanes
    pack = next(e for e in xs if e["cat"] == "pack")
    assert type(pack["args"]["microbatch"]) is int  # numpy scalars made plain
    arr = trace.chrome_trace([Span(0, "F", "compute", 0, 1, {"shape": np.array([2, 3]), "x": np.float32(0.5)})],
                             [{"rank": np.int64(0), "stage": np.int32(0)}])
    assert arr["traceEvents"][-1]["args"] == {"shape": [2, 3], "x": 0.5}
    trace.validate_trace(arr)  # numpy ints in lanes made plain too
    threads = {(e["pid"], e["args"]["name"]) for e in ev if e["ph"] == "M" and e["name"] == "thread_name"}
    assert (0, "compute") in threads and (2, "recv_wait") in threads and (2, "send_wait") not in threads
    trace.validate_trace(doc)


def test_tp_rank_in_lane_names_only_with_tensor_parallelism():
    spans = [Span(r, "F0", "compute", 0.0, 1.0) for r in range(4)]
    lanes = [{"rank": r, "host": f"n{r // 2}", "stage": r // 2, "tp_rank": r % 2} for r in range(4)]
    doc = trace.chrome_trace(spans, lanes)
    names = [e["args"]["name"] for e in doc["traceEvents"] if e.get("name") == "process_name"]
    assert names == ["rank 0 (n0, stage 0, tp 0)", "rank 1 (n0, stage 0, tp 1)",
                     "rank 2 (n1, stage 1, tp 0)", "rank 3 (n1, stage 1, tp 1)"]


@pytest.mark.parametrize("spans, lanes, match", [
    ([Span(0, "x", "compute", 0, 1)], [{"rank": 0}, {"rank": 0}], "distinct int 'rank'"),
    ([Span(0, "x", "compute", 0, 1)], [{"host": "a"}], "distinct int 'rank'"),
    ([Span(1, "x", "compute", 0, 1)], [{"rank": 0}], r"rank 1 has no lane"),
    ([Span(0, "x", "sleep", 0, 1)], [{"rank": 0}], "category 'sleep' is not one of"),
    ([Span(0, "x", "compute", 0, -1)], [{"rank": 0}], "duration >= 0"),
    ([Span(0, "x", "compute", float("nan"), 1)], [{"rank": 0}], "finite"),
])
def test_chrome_trace_rejects_bad_spans(spans, lanes, match):
    with pytest.raises(ValueError, match=match):
        trace.chrome_trace(spans, lanes)


def _break(doc, how):
    doc = copy.deepcopy(doc)
    ev = doc["traceEvents"]
    x = next(i for i, e in enumerate(ev) if e["ph"] == "X")
    if how == "no events":
        del doc["traceEvents"]
    elif how == "not a dict":
        return [doc]
    elif how == "negative dur":
        ev[x]["dur"] = -1
    elif how == "nan ts":
        ev[x]["ts"] = float("nan")
    elif how == "string pid":
        ev[x]["pid"] = "0"
    elif how == "bool pid":
        ev[x]["pid"] = True
    elif how == "phase":
        ev[x]["ph"] = "B"
    elif how == "unnamed lane":
        doc["traceEvents"] = [e for e in ev if not (e["ph"] == "M" and e["name"] == "process_name" and e["pid"] == 1)]
    elif how == "two names":
        ev.append({"ph": "M", "name": "process_name", "pid": 0, "tid": 0, "args": {"name": "again"}})
    elif how == "overlap":
        e = ev[x]
        ev.append(dict(e, ts=e["ts"] + e["dur"] / 2, name="late"))
    elif how == "time unit":
        doc["displayTimeUnit"] = "s"
    elif how == "args":
        ev[x]["args"] = [1]
    elif how == "unserialisable":
        ev[x]["args"] = {"obj": object()}
    return doc


@pytest.mark.parametrize("how, match", [
    ("no events", "missing the 'traceEvents' list"),
    ("not a dict", "expected a JSON object"),
    ("negative dur", r"traceEvents\[\d+\]: dur must be a finite number >= 0"),
    ("nan ts", "ts must be a finite number"),
    ("string pid", "pid must be an int"),
    ("bool pid", "pid must be an int"),
    ("phase", "unsupported phase 'B'"),
    ("unnamed lane", "pid 1: has events but no process_name"),
    ("two names", "a second process_name for pid 0"),
    ("overlap", "overlaps an earlier slice on pid 0"),
    ("time unit", "displayTimeUnit"),
    ("args", "args must be an object"),
    ("unserialisable", "not serialisable as strict JSON"),
])
def test_validate_trace_rejects_broken_docs(how, match):
    doc = make_doc()
    trace.validate_trace(doc)
    with pytest.raises(ValueError, match=match):
        trace.validate_trace(_break(doc, how))


def test_nested_slices_are_valid():
    spans = [Span(0, "outer", "compute", 0.0, 1.0), Span(0, "inner", "compute", 0.2, 0.3),
             Span(0, "next", "compute", 1.0, 0.5)]
    trace.validate_trace(trace.chrome_trace(spans, [{"rank": 0}]))


def test_save_load_round_trip(tmp_path):
    doc = make_doc()
    path = tmp_path / "t.json"
    trace.save_trace(doc, path)
    assert trace.load_trace(path) == doc
    # what Perfetto's streaming reader needs: displayTimeUnit first, "ts" before any other
    # key of an event that could hold an array, no \u escapes
    text = path.read_text(encoding="utf-8")
    assert text.startswith('{"displayTimeUnit": "ms", "traceEvents": [')
    for e in doc["traceEvents"]:
        keys = list(e)
        assert "ts" not in keys or keys.index("ts") < keys.index("args")
    accented = trace.chrome_trace([Span(0, "F0", "compute", 0.0, 1.0)], [{"rank": 0, "host": "nœud-7"}])
    trace.save_trace(accented, tmp_path / "u.json")
    assert "nœud-7" in (tmp_path / "u.json").read_text(encoding="utf-8")
    assert "\\u" not in (tmp_path / "u.json").read_text(encoding="utf-8")
    assert not list(tmp_path.glob(".*tmp*"))  # no temporary left behind
    spans = trace.spans_from_trace(doc)
    want, _ = gpipe_spans()
    assert len(spans) == len(want)
    f = next(s for s in spans if s.rank == 2 and s.name == "F3")
    assert f.cat == "compute" and f.args == {"microbatch": 3, "stage": 2}
    assert f.start_s == pytest.approx((2 + 3) * 0.012 + 0.5) and f.dur_s == pytest.approx(0.010)
    with pytest.raises(ConfigError, match="does not exist"):
        trace.save_trace(doc, tmp_path / "no" / "t.json")


def test_load_trace_errors_name_the_file(tmp_path):
    cases = {tmp_path / "missing.json": "cannot read the trace",
             tmp_path / "bad.json": "not JSON",
             tmp_path / "wrong.json": "not a valid trace: trace: missing the 'traceEvents' list"}
    (tmp_path / "bad.json").write_text("{not json")
    (tmp_path / "wrong.json").write_text('{"events": []}')
    for path, what in cases.items():
        with pytest.raises(InputError) as err:
            trace.load_trace(path)
        assert err.value.exit_code == EXIT_BAD_INPUT
        assert err.value.line().startswith(f"{path}: {what}")
        assert "rlx-mpi run --trace" in err.value.line()


def test_bubble_of_an_ideal_gpipe_equals_the_formula():
    p, m = 3, 4
    spans, _ = gpipe_spans(p, m, comm=0.0)
    b = trace.bubble(spans, p, m)
    assert b["ideal_bubble"] == pytest.approx((p - 1) / (m + p - 1))
    assert b["window_s"] == pytest.approx((m + p - 1) * 0.010)  # start-up spans not counted
    assert [r["rank"] for r in b["ranks"]] == [0, 1, 2]
    for r in b["ranks"]:
        assert r["busy_fraction"] == pytest.approx(m / (m + p - 1))
    assert b["measured_bubble"] == pytest.approx(b["ideal_bubble"])
    json.dumps(b)


def test_bubble_counts_overlaps_once_and_waits_not_at_all():
    spans = [Span(0, "F0", "compute", 0.0, 1.0), Span(0, "pack", "pack", 0.5, 1.0),  # union 1.5
             Span(0, "send", "send_wait", 1.5, 2.5), Span(1, "recv", "recv_wait", 0.0, 2.0),
             Span(1, "F0", "compute", 2.0, 2.0)]
    b = trace.bubble(spans, 2, 1)
    assert b["window_s"] == pytest.approx(4.0)
    assert [r["busy_s"] for r in b["ranks"]] == pytest.approx([1.5, 2.0])
    assert [r["bubble"] for r in b["ranks"]] == pytest.approx([1 - 1.5 / 4, 0.5])
    assert b["ideal_bubble"] == pytest.approx(0.5)


def test_bubble_rejects_bad_arguments():
    with pytest.raises(ValueError, match="n_stages >= 1"):
        trace.bubble([Span(0, "F", "compute", 0, 1)], 0, 1)
    with pytest.raises(ValueError, match="no spans outside start-up"):
        trace.bubble([Span(0, "load", "startup", 0, 1)], 1, 1)


def _png_size(path):
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    return struct.unpack(">II", data[16:24])


def test_gantt_png(tmp_path):
    pytest.importorskip("matplotlib", reason="matplotlib is not installed (pip install 'rlx_mpi[plot]')")
    out = tmp_path / "gantt.png"
    trace.gantt_png(make_doc(), out)
    assert out.stat().st_size > 5000
    assert _png_size(out) == (1200, int(100 * (1.2 + 0.55 * 3)))
    trace.gantt_png(make_doc(), out, title="custom", startup=True)  # an existing output is replaced
    only_startup = trace.chrome_trace([Span(0, "load", "startup", 0.0, 1.0)], [{"rank": 0}])
    trace.gantt_png(only_startup, tmp_path / "startup.png")
    assert _png_size(tmp_path / "startup.png")[0] == 1200
    assert not list(tmp_path.glob(".*tmp*"))
    with pytest.raises(ValueError, match="missing the 'traceEvents'"):
        trace.gantt_png({"otherData": {}}, tmp_path / "x.png")
    with pytest.raises(ConfigError, match="does not exist"):
        trace.gantt_png(make_doc(), tmp_path / "no" / "x.png")


def test_gantt_png_without_matplotlib(tmp_path, monkeypatch):
    for name in [n for n in sys.modules if n == "matplotlib" or n.startswith("matplotlib.")] + ["matplotlib"]:
        monkeypatch.setitem(sys.modules, name, None)  # None in sys.modules: that import fails
    out = tmp_path / "gantt.png"
    with pytest.raises(ConfigError) as err:
        trace.gantt_png(make_doc(), out)
    assert err.value.exit_code == EXIT_BAD_INPUT
    assert err.value.line() == "trace --png: matplotlib is not installed; pip install 'rlx_mpi[plot]'"
    assert not out.exists()
