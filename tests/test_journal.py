"""The journal: prompt-order appends, resume, torn-line repair, refusals, and kill -9 writers."""

from __future__ import annotations

import json
import os
import random
import resource
import select
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from helpers import rows_of
from rlx_mpi.errors import EXIT_BAD_INPUT, InputError
from rlx_mpi.journal import REQUEUE_EXIT, Journal
from rlx_mpi.prompts import Prompt


def prompts(n: int, prefix: str = "p") -> list[Prompt]:
    return [Prompt(i, f"{prefix}{i}", (i % 7 + 1,), None) for i in range(n)]


def row(i: int) -> dict:
    return {"tokens": [i, i + 1], "finish_reason": "length", "text": f"é{i}"}


def expected_bytes(ps: list[Prompt]) -> bytes:
    """An uninterrupted run's file, made independently of Journal."""
    return b"".join(json.dumps({"id": p.id, **row(p.index)}, ensure_ascii=False,
                               separators=(",", ":")).encode() + b"\n" for p in ps)


def test_requeue_code_is_documented_and_distinct():
    assert REQUEUE_EXIT == 75 and REQUEUE_EXIT not in range(6) and REQUEUE_EXIT < 128


def test_rows_come_out_in_prompt_order_whatever_the_completion_order(tmp_path):
    ps, out = prompts(6), tmp_path / "out.jsonl"
    with Journal(out, ps, sync_s=0) as j:
        assert [p.id for p in j.pending] == [p.id for p in ps] and j.done == set()
        j.complete(2, row(2))
        j.complete(1, row(1))
        assert out.read_bytes() == b"" and j.held == 2  # waiting for prompt 0
        j.complete(0, row(0))
        assert out.read_bytes() == expected_bytes(ps[:3]) and j.held == 0
        assert j.done == {"p0", "p1", "p2"}
        j.complete(5, row(5))
        j.complete(4, row(4))
    assert out.read_bytes() == expected_bytes(ps[:3])  # 4, 5 were held behind 3: not written
    with Journal(out, ps) as j:  # resume: skips the done ones, then writes the rest in order
        assert [p.index for p in j.pending] == [3, 4, 5] and j.done == {"p0", "p1", "p2"}
        for i in (5, 3, 4):
            j.complete(i, row(i))
    assert out.read_bytes() == expected_bytes(ps)


def test_complete_rejects_misuse(tmp_path):
    ps = prompts(3)
    with Journal(tmp_path / "o.jsonl", ps) as j:
        j.complete(0, row(0))
        with pytest.raises(ValueError, match="complete already"):
            j.complete(0, row(0))
        j.complete(2, row(2))
        with pytest.raises(ValueError, match="complete already"):
            j.complete(2, row(2))
        with pytest.raises(ValueError, match="not in"):
            j.complete(3, row(3))
        with pytest.raises(ValueError, match="not prompt 1's id"):
            j.complete(1, {"id": "p2"})
        with pytest.raises(ValueError):  # a NaN never reaches the file
            j.complete(1, {"score": float("nan")})


def test_torn_last_line_is_cut_and_rewritten(tmp_path):
    ps, out = prompts(4), tmp_path / "out.jsonl"
    full = expected_bytes(ps)
    cut = len(expected_bytes(ps[:2]))
    for tail in (full[cut:cut + 1], full[cut:cut + 7], full[cut:cut + 20], full[cut:len(full) - 1 -
                 len(expected_bytes(ps[3:]))]):  # the last is a whole row but for its newline
        out.write_bytes(full[:cut] + tail)
        with Journal(out, ps) as j:
            assert j.done == {"p0", "p1"} and out.read_bytes() == full[:cut]
            for i in (3, 2):
                j.complete(i, row(i))
        assert out.read_bytes() == full


def test_zeros_left_by_a_power_loss_are_cut(tmp_path):
    ps, out = prompts(3), tmp_path / "out.jsonl"
    out.write_bytes(expected_bytes(ps[:1]) + b"\0" * 300)
    with Journal(out, ps) as j:
        assert j.done == {"p0"}
    assert out.read_bytes() == expected_bytes(ps[:1])


@pytest.mark.parametrize("content, line, words", [
    (b'{"id":"zz","tokens":[1]}\n', 1, ["'zz' is not in the prompt file", "another prompt file"]),
    (b'{"id":"p0"}\n{"id":"p1"}\n{"id":"p0"}\n', 3, ["'p0' appears twice"]),
    (b'{"id":"p1"}\n{"id":"p0"}\n', 1, ["row 1 is id 'p1', but prompt 1 is 'p0'", "prompt order"]),
    (b'{"id":"p0"}\nhello\n{"id":"p1"}\n', 2, ["not a completions row", "never overwritten"]),
    (b'{"id":"p0"}\n{"id": 1}\n', 2, ["not a completions row"]),
    (b'my notes, no newline', 1, ["not a completions row"]),
    (b'\x89HDF\r\n\x1a\n\x00\x00', 1, ["not a completions row"]),
])
def test_a_file_that_is_not_ours_is_refused_and_left_alone(tmp_path, content, line, words):
    out = tmp_path / "out.jsonl"
    out.write_bytes(content)
    with pytest.raises(InputError) as e:
        Journal(out, prompts(3))
    assert e.value.exit_code == EXIT_BAD_INPUT and e.value.where == f"{out}:{line}"
    for word in words:
        assert word in e.value.line(), (word, e.value.line())
    assert out.read_bytes() == content  # never truncated


def test_output_equal_to_an_input_or_a_directory_is_refused(tmp_path):
    inp = tmp_path / "prompts.jsonl"
    inp.write_text('{"id": "p0", "tokens": [1]}\n')
    before = inp.read_bytes()
    link = tmp_path / "hard.jsonl"
    os.link(inp, link)
    sym = tmp_path / "sym.jsonl"
    sym.symlink_to(inp)
    for out in (inp, tmp_path / "." / "prompts.jsonl", link, sym):
        with pytest.raises(InputError, match="is the input file"):
            Journal(out, prompts(1), inputs=[inp, tmp_path / "model.h5"])
    assert inp.read_bytes() == before
    with pytest.raises(InputError, match="is a directory"):
        Journal(tmp_path, prompts(1))
    with pytest.raises(InputError, match="does not exist"):
        Journal(tmp_path / "no" / "out.jsonl", prompts(1))


def test_a_second_writer_is_refused(tmp_path):
    out = tmp_path / "out.jsonl"
    with Journal(out, prompts(2)):
        with pytest.raises(InputError, match="another process is writing"):
            Journal(out, prompts(2))
    Journal(out, prompts(2)).close()  # the lock went with the first


def test_fsync_at_most_every_sync_s(tmp_path, monkeypatch):
    calls = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (calls.append(fd), real(fd)))
    ps = prompts(50)
    j = Journal(tmp_path / "out.jsonl", ps, sync_s=3600.0)
    n = len(calls)  # the directory of the new file
    for p in ps:
        j.complete(p.index, row(p.index))
    assert len(calls) == n  # all 50 rows written, none fsynced yet: sync_s not passed
    assert rows_of(tmp_path / "out.jsonl")[-1]["id"] == "p49"
    j.close()
    assert len(calls) == n + 1
    j = Journal(tmp_path / "out2.jsonl", ps[:3], sync_s=0.0)
    n = len(calls)
    for p in ps[:3]:
        j.complete(p.index, row(p.index))
    assert len(calls) == n + 3
    j.close()


# -- kill -9 of a writer, several times, then resume ------------------------------------------------

WRITER = textwrap.dedent("""
    import random, sys, time
    from rlx_mpi.journal import Journal
    from rlx_mpi.prompts import Prompt
    n, big, every, out = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    ps = [Prompt(i, f"p{i}", (1,), None) for i in range(n)]
    def row(i):
        return {"tokens": list(range(i % 50)), "text": "x" * (big if i % every == 0 else i)}
    j = Journal(out, ps, sync_s=0.05)
    print("ready", flush=True)
    todo = [p.index for p in j.pending]
    rng = random.Random()
    while todo:  # finish prompts out of order, a few in flight at once, as the decode does
        k = rng.randrange(min(4, len(todo)))
        i = todo.pop(k)
        j.complete(i, row(i))
        time.sleep(rng.random() * 0.004)
    j.close()
""")


def _expected_for_writer(n: int, big: int, every: int) -> bytes:
    def row(i):
        return {"tokens": list(range(i % 50)), "text": "x" * (big if i % every == 0 else i)}
    return b"".join(json.dumps({"id": f"p{i}", **row(i)}, separators=(",", ":")).encode() + b"\n"
                    for i in range(n))


def _wait_ready(proc, timeout_s: float = 60.0) -> None:
    ready, _, _ = select.select([proc.stdout], [], [], timeout_s)
    assert ready and proc.stdout.readline() == b"ready\n", "the writer did not start"


def test_kill_9_at_random_moments_never_loses_order_and_resume_equals_uninterrupted(tmp_path):
    n, big, every = 400, 200_000, 9
    ps = [Prompt(i, f"p{i}", (1,), None) for i in range(n)]
    want = _expected_for_writer(n, big, every)
    out = tmp_path / "out.jsonl"
    args = [sys.executable, "-c", WRITER, str(n), str(big), str(every), str(out)]
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    rng = random.Random(1234)
    kills = torn = 0
    progress = []  # rows done after each kill
    for attempt in range(8):
        proc = subprocess.Popen(args, env=env, stdout=subprocess.PIPE)
        try:
            _wait_ready(proc)  # past start-up (imports take a while)
            time.sleep(rng.random() * 0.25)  # a whole run takes ~1 s: kill it somewhere in it
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.stdout.close()
        assert proc.wait(timeout=30) in (-signal.SIGKILL, 0)
        kills += proc.returncode != 0
        data = out.read_bytes() if out.exists() else b""
        torn += bool(data) and not data.endswith(b"\n")
        # whatever was left is a prefix of the uninterrupted file, but for a torn last line
        whole = data[:data.rfind(b"\n") + 1]
        assert want.startswith(whole), f"attempt {attempt}: rows out of order or damaged"
        with Journal(out, ps) as j:  # a reopen repairs it
            assert out.read_bytes() == whole and len(j.done) == whole.count(b"\n")
            progress.append(len(j.done))
        if whole == want:
            break
    proc = subprocess.run(args, env=env, timeout=300, stdout=subprocess.DEVNULL)
    assert proc.returncode == 0
    assert out.read_bytes() == want, "the resumed file differs from an uninterrupted run's"
    assert kills >= 3, f"only {kills} writers were killed mid-run: the test did not test much"
    assert progress == sorted(progress)
    print(f"{kills} writers killed, {torn} left a torn last line; rows done after each: {progress}")


def test_a_write_cut_short_by_the_kernel_is_repaired_and_resumed(tmp_path):
    # A file-size limit makes the kernel take only part of a write and fail the next one
    # (EFBIG; Python ignores SIGXFSZ), as a full disk or quota does: a real torn row, left by
    # Journal's own write path at offsets chosen here (a kill -9 lands inside a write only now
    # and then). The writer stops with the journal's one-line fault.
    n, big, every = 60, 50_000, 7
    ps = [Prompt(i, f"p{i}", (1,), None) for i in range(n)]
    want = _expected_for_writer(n, big, every)
    out = tmp_path / "out.jsonl"
    args = [sys.executable, "-c", WRITER, str(n), str(big), str(every), str(out)]
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    ends = [i + 1 for i, b in enumerate(want) if b == ord("\n")]
    limits = [ends[3] + 10, ends[10] + 30_000, ends[20] - 1, ends[40] + 1]  # in rows, mid-row
    for limit in limits:
        def cap(limit=limit):
            resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
        proc = subprocess.run(args, env=env, timeout=120, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True, preexec_fn=cap)
        assert proc.returncode == 1 and "RankFault" in proc.stderr
        assert "writing the completions failed: File too large; free disk space" in proc.stderr
        data = out.read_bytes()
        assert len(data) == limit and not data.endswith(b"\n")  # torn, by the kernel
        whole = data[:data.rfind(b"\n") + 1]
        assert want.startswith(whole)
        with Journal(out, ps) as j:
            assert out.read_bytes() == whole and len(j.done) == whole.count(b"\n")
    proc = subprocess.run(args, env=env, timeout=120, stdout=subprocess.DEVNULL)
    assert proc.returncode == 0 and out.read_bytes() == want


def test_numpy_values_in_a_row_are_written_as_plain_json(tmp_path):
    np = pytest.importorskip("numpy")
    out = tmp_path / "out.jsonl"
    with Journal(out, prompts(1)) as j:
        j.complete(0, {"tokens": np.arange(3, dtype=np.int64), "new_tokens": np.int32(3),
                       "ms": np.float32(1.5)})
        with pytest.raises(ValueError):
            j.complete(0, {})
    assert out.read_bytes() == b'{"id":"p0","tokens":[0,1,2],"new_tokens":3,"ms":1.5}\n'


def test_empty_output_starts_and_a_finished_one_has_nothing_pending(tmp_path):
    ps, out = prompts(3), tmp_path / "out.jsonl"
    out.write_bytes(b"")
    with Journal(out, ps, inputs=[None]) as j:
        assert len(j.pending) == 3
        for p in ps:
            j.complete(p.index, row(p.index))
    with Journal(out, ps) as j:
        assert j.pending == [] and j.done == {"p0", "p1", "p2"}
    assert out.read_bytes() == expected_bytes(ps)
    with pytest.raises(ValueError, match="unique ids"):
        Journal(tmp_path / "o2.jsonl", ps + ps[:1])


def test_a_pipe_is_refused_without_opening_it(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(InputError, match="not a regular file"):
        Journal(fifo, prompts(1))  # opening it for reading would block: it must not be opened
