"""The journal: prompt-order appends, resume, torn-line repair, refusals, and kill -9 writers."""

from __future__ import annotations

import json
import logging
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
from rlx_mpi.io.journal import REQUEUE_EXIT, Journal
from rlx_mpi.io.prompts import Prompt


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
        assert not out.exists() and j.held == 2  # waiting for prompt 0 (the file comes with the first row)
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
    out.write_bytes(b"")
    with Journal(out, prompts(2)):
        with pytest.raises(InputError, match="another process is writing"):
            Journal(out, prompts(2))
    Journal(out, prompts(2)).close()  # the lock went with the first


def test_a_file_system_without_locks_is_said_once_at_info_with_its_name(tmp_path, monkeypatch, caplog):
    import errno
    import fcntl

    from rlx_mpi.io import journal

    def no_lock(fd, op):  # what flock gives on a Lustre mount without -o flock
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(fcntl, "flock", no_lock)
    monkeypatch.setattr(journal, "_WARNED_NO_LOCK", set())
    fs = journal._filesystem(tmp_path / "a.jsonl")
    assert fs != "unknown" and " at /" in fs  # "TYPE at MOUNTPOINT" from /proc/mounts
    caplog.set_level("INFO", logger="rlx_mpi")
    for name in ("a.jsonl", "b.jsonl"):
        (tmp_path / name).write_bytes(b"")
        Journal(tmp_path / name, prompts(2)).close()  # carries on without a lock
    said = [r for r in caplog.records if "gives no file lock" in r.getMessage()]
    assert len(said) == 1 and said[0].levelname == "INFO", [r.getMessage() for r in caplog.records]
    assert fs in said[0].getMessage() and "one job per output file" in said[0].getMessage()


def test_a_second_writer_of_a_new_file_is_refused_at_its_first_row(tmp_path):
    # A new file is made at the first row, so two jobs started on one new name both run until
    # then; the second to write finds the file there and stops, its rows unwritten.
    out = tmp_path / "out.jsonl"
    a, b = Journal(out, prompts(2)), Journal(out, prompts(2))
    a.complete(0, row(0))
    with pytest.raises(InputError, match="appeared while this job ran"):
        b.complete(0, row(0))
    a.complete(1, row(1))
    a.close()
    with pytest.raises(InputError, match="appeared while this job ran"):
        b.close()  # its row is still not written
    assert out.read_bytes() == expected_bytes(prompts(2))


def test_fsync_at_most_every_sync_s(tmp_path, monkeypatch):
    calls = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (calls.append(fd), real(fd)))
    ps = prompts(50)
    j = Journal(tmp_path / "out.jsonl", ps, sync_s=3600.0)
    assert calls == []
    j.complete(0, row(0))
    n = len(calls)  # the directory of the new file, made at the first row (the row not fsynced)
    for p in ps[1:]:
        j.complete(p.index, row(p.index))
    assert len(calls) == n  # all 50 rows written, none fsynced yet: sync_s not passed
    assert rows_of(tmp_path / "out.jsonl")[-1]["id"] == "p49"
    j.close()
    assert len(calls) == n + 1
    (tmp_path / "out2.jsonl").write_bytes(b"")
    j = Journal(tmp_path / "out2.jsonl", ps[:3], sync_s=0.0)
    n = len(calls)
    for p in ps[:3]:
        j.complete(p.index, row(p.index))
    assert len(calls) == n + 3
    j.close()


# -- kill -9 of a writer, several times, then resume ------------------------------------------------

WRITER = textwrap.dedent("""
    import random, sys, time
    from rlx_mpi.io.journal import Journal
    from rlx_mpi.io.prompts import Prompt
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
    # (EFBIG; Python ignores SIGXFSZ), as a full disk or quota does, at offsets chosen here
    # inside rows. The writer stops with the journal's one-line fault, having cut the file back
    # to its last whole line: a reader never sees half a row, and a rerun resumes from there.
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
        data = out.read_bytes() if out.exists() else b""  # no file: its first write failed
        whole = want[:max(e for e in [0, *ends] if e <= limit)]  # the whole lines the limit allows
        assert data == whole  # no torn row, and no whole row that reached the file cut back with it
        with Journal(out, ps) as j:
            assert (out.read_bytes() if out.exists() else b"") == whole and len(j.done) == whole.count(b"\n")
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


# -- what made the rows (issue 17, finding 2) ------------------------------------------------------

from rlx_mpi.io.identity import NUMERICS, RunIdentity, meta_path, model_identity  # noqa: E402
from rlx_mpi.engine.sampling import SamplingParams  # noqa: E402


def ident(ckpt, **kw) -> RunIdentity:
    sampling = kw.pop("sampling", SamplingParams())
    args = dict(max_new_tokens=8, eos_ids=(2,), logprobs=0)
    args.update(kw)
    return RunIdentity.for_generate(ckpt, sampling, **args)


def half_done(out: Path, ps, identity) -> bytes:
    with Journal(out, ps, identity=identity, sync_s=0) as j:
        for p in ps[:2]:
            j.complete(p.index, row(p.index))
    return out.read_bytes()


@pytest.mark.parametrize("change, words", [
    (dict(max_new_tokens=16), "max_new_tokens 8, this run has max_new_tokens 16"),
    (dict(sampling=SamplingParams(temperature=0.7, seed=1)), "temperature 0.0, this run has temperature 0.7"),
    (dict(eos_ids=()), "eos_ids [2], this run has eos_ids []"),
    (dict(logprobs=5), "logprobs 0, this run has logprobs 5"),
])
def test_a_resume_with_other_settings_is_refused_naming_both_values(tmp_path, tiny_ckpt, change, words):
    ps, out = prompts(4), tmp_path / "C.jsonl"
    before = half_done(out, ps, ident(tiny_ckpt))
    meta = meta_path(out).read_bytes()
    with pytest.raises(InputError) as e:
        Journal(out, ps, identity=ident(tiny_ckpt, **change))
    line = e.value.line()
    assert "\n" not in line and words in line, line
    assert f"remove {out} and {out}.meta.json, or choose another --out" in line
    assert out.read_bytes() == before and meta_path(out).read_bytes() == meta  # nothing touched
    with Journal(out, ps, identity=ident(tiny_ckpt), sync_s=0) as j:  # the same settings resume
        assert [p.id for p in j.pending] == ["p2", "p3"]


def test_rows_made_by_other_kernel_arithmetic_are_refused(tmp_path, tiny_ckpt):
    """A release that changes a kernel's per-element arithmetic bumps NUMERICS (identity's note):
    a job started before it is not resumed with rows of the new arithmetic appended."""
    ps, out = prompts(4), tmp_path / "C.jsonl"
    old = ident(tiny_ckpt).with_settings(numerics=NUMERICS - 1)
    before = half_done(out, ps, old)
    with pytest.raises(InputError) as e:
        Journal(out, ps, identity=ident(tiny_ckpt))
    assert f"numerics {NUMERICS - 1}, this run has numerics {NUMERICS}" in e.value.line()
    assert out.read_bytes() == before
    meta = json.loads(meta_path(out).read_text())  # a record from before NUMERICS: refused unless adopted
    del meta["settings"]["numerics"]
    meta_path(out).write_text(json.dumps(meta))
    with pytest.raises(InputError, match="does not say which numerics"):
        Journal(out, ps, identity=ident(tiny_ckpt))


def test_sampled_settings_count_only_when_sampling(tmp_path, tiny_ckpt):
    ps, out = prompts(4), tmp_path / "C.jsonl"
    half_done(out, ps, ident(tiny_ckpt))
    greedy_other_seed = ident(tiny_ckpt, sampling=SamplingParams(seed=9, top_k=3))
    Journal(out, ps, identity=greedy_other_seed).close()  # greedy: seed and top_k change nothing
    out2 = tmp_path / "D.jsonl"
    half_done(out2, ps, ident(tiny_ckpt, sampling=SamplingParams(temperature=1.0, seed=1)))
    with pytest.raises(InputError, match="seed 1, this run has seed 2"):
        Journal(out2, ps, identity=ident(tiny_ckpt, sampling=SamplingParams(temperature=1.0, seed=2)))


def test_another_checkpoint_is_refused_and_a_copy_is_the_same_model(tmp_path, tiny_ckpt):
    import shutil

    import h5py

    ps, out = prompts(4), tmp_path / "C.jsonl"
    half_done(out, ps, ident(tiny_ckpt))
    copy = tmp_path / "copy.h5"
    shutil.copy(tiny_ckpt, copy)
    Journal(out, ps, identity=ident(copy)).close()  # another path, the same model: resumes
    with h5py.File(copy, "r+", locking=False) as f:  # one weight, as in the NaN case
        ds = f["layers/5/down_proj"]
        ds[0, 0] = ds[0, 0] + 1.0
    with pytest.raises(InputError, match="made with checkpoint tensors_sha256 "):
        Journal(out, ps, identity=ident(copy))
    assert model_identity(copy)["bytes"] == model_identity(tiny_ckpt)["bytes"]  # same size: the digest tells


def test_a_changed_prompt_under_a_done_id_is_refused_a_pending_one_is_not(tmp_path, tiny_ckpt):
    ps, out = prompts(4), tmp_path / "C.jsonl"
    before = half_done(out, ps, ident(tiny_ckpt))
    later = ps[:3] + [Prompt(3, "p3", (9, 9), None)]  # a prompt not yet done may change
    with Journal(out, later, identity=ident(tiny_ckpt), sync_s=0) as j:
        assert len(j.pending) == 2
    changed = [ps[0], Prompt(1, "p1", (5, 6), None), *ps[2:]]
    with pytest.raises(InputError) as e:
        Journal(out, changed, identity=ident(tiny_ckpt))
    assert "prompt 'p1' (prompt 2 of the prompt file) has other tokens or settings than when its row was written" in e.value.line()
    assert out.read_bytes() == before


def test_rows_alone_resume_when_their_identity_is_this_runs(tmp_path, tiny_ckpt):
    """The record lost (the .jsonl copied alone): every row's identity digest decides."""
    ps, out = prompts(3), tmp_path / "C.jsonl"
    half_done(out, ps, ident(tiny_ckpt))
    meta = meta_path(out).read_bytes()
    meta_path(out).unlink()
    with Journal(out, ps, identity=ident(tiny_ckpt), sync_s=0) as j:
        assert [p.id for p in j.pending] == ["p2"]
        j.complete(2, {"tokens": [3]})
    assert [r["id"] for r in rows_of(out)] == ["p0", "p1", "p2"] and meta_path(out).exists()


def test_rows_alone_made_another_way_are_refused_and_the_advice_works(tmp_path, tiny_ckpt):
    ps, out = prompts(3), tmp_path / "C.jsonl"
    before = half_done(out, ps, ident(tiny_ckpt))
    meta = meta_path(out).read_bytes()
    meta_path(out).unlink()
    with pytest.raises(InputError) as e:
        Journal(out, ps, identity=ident(tiny_ckpt, max_new_tokens=16))
    line = e.value.line()
    assert "row 1 ('p0') was made with other settings" in line and f"put its record {meta_path(out)} back" in line
    assert out.read_bytes() == before
    meta_path(out).write_bytes(meta)  # as the advice says: the record names the setting
    with pytest.raises(InputError, match="max_new_tokens 8, this run has max_new_tokens 16; to resume, rerun with "
                                         "max_new_tokens 8"):
        Journal(out, ps, identity=ident(tiny_ckpt, max_new_tokens=16))
    meta_path(out).unlink()  # ... or rerun with the settings the rows were made with
    Journal(out, ps, identity=ident(tiny_ckpt)).close()
    assert out.read_bytes() == before


def test_an_older_file_without_identity_is_adopted_only_when_asked(tmp_path, tiny_ckpt):
    ps, out = prompts(3), tmp_path / "C.jsonl"
    half_done(out, ps, ident(tiny_ckpt))
    old = b"".join(json.dumps({k: v for k, v in r.items() if k != "identity"}, separators=(",", ":")).encode() + b"\n"
                   for r in rows_of(out))
    out.write_bytes(old)
    meta_path(out).unlink()
    with pytest.raises(InputError) as e:
        Journal(out, ps, identity=ident(tiny_ckpt))
    line = e.value.line()
    assert "row 1 ('p0') carries no identity" in line and "add --adopt-output" in line, line
    with Journal(out, ps, identity=ident(tiny_ckpt), sync_s=0, adopt=True) as j:  # as the advice says
        j.complete(2, {"tokens": [3]})
    assert json.loads(meta_path(out).read_text())["adopted"] == 2
    Journal(out, ps, identity=ident(tiny_ckpt)).close()  # the record remembers the adoption
    with pytest.raises(InputError, match="max_new_tokens 8, this run has max_new_tokens 16"):
        Journal(out, ps, identity=ident(tiny_ckpt, max_new_tokens=16), adopt=True)  # adopting is not mixing


def test_a_record_that_is_not_ours_is_refused_and_moving_it_aside_resumes(tmp_path, tiny_ckpt):
    ps, out = prompts(3), tmp_path / "C.jsonl"
    half_done(out, ps, ident(tiny_ckpt))
    meta_path(out).write_text("[1, 2]\n")
    with pytest.raises(InputError, match="is not a record rlx-mpi wrote.*move it aside to resume from the rows"):
        Journal(out, ps, identity=ident(tiny_ckpt))
    meta_path(out).rename(tmp_path / "aside.json")
    Journal(out, ps, identity=ident(tiny_ckpt)).close()


def test_a_settled_journal_decides_and_writes_only_after_settle(tmp_path, tiny_ckpt, caplog):
    ps, out = prompts(3), tmp_path / "C.jsonl"
    half_done(out, ps, ident(tiny_ckpt).with_settings(precision="f32"))
    with caplog.at_level(logging.INFO, logger="rlx_mpi.io.journal"):
        j = Journal(out, ps, identity=ident(tiny_ckpt), settle=True)
        assert "resuming" not in caplog.text  # nothing said before the decision
        with pytest.raises(ValueError, match="not settled"):
            j.complete(2, {"tokens": [3]})
        with pytest.raises(InputError, match='precision "f32", this run has precision "int8"'):
            j.settle(precision="int8")
        j.close()
        j = Journal(out, ps, identity=ident(tiny_ckpt), settle=True)
        j.settle(precision="f32")
        assert "2 of 3 prompts already done; resuming" in caplog.text
        j.close()


def test_the_record_is_a_sidecar_and_the_output_stays_one_row_per_line(tmp_path, tiny_ckpt):
    ps, out = prompts(3), tmp_path / "C.jsonl"
    half_done(out, ps, ident(tiny_ckpt))
    assert [r["id"] for r in rows_of(out)] == ["p0", "p1"]  # no metadata line among the rows
    meta = json.loads(meta_path(out).read_text())
    assert meta["format"] == "rlx_mpi.journal" and meta["version"] == 1 and meta["command"] == "generate"
    assert meta["settings"] == {"numerics": NUMERICS, "temperature": 0.0, "max_new_tokens": 8, "eos_ids": [2],
                                "logprobs": 0}
    assert set(meta["prompts"]) == {"p0", "p1", "p2"} and meta["model"]["family"] == "llama"
    assert not list(tmp_path.glob(".*tmp*"))  # the sidecar's temporary name is gone


# -- no leftovers, no torn lines (finding 3) -------------------------------------------------------


def test_a_job_that_writes_no_row_leaves_no_file(tmp_path, tiny_ckpt):
    out = tmp_path / "C.jsonl"
    with Journal(out, prompts(3), identity=ident(tiny_ckpt)) as j:
        j.complete(2, row(2))  # held behind 0 and 1: never written
    assert sorted(tmp_path.iterdir()) == []
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    if os.geteuid() != 0:  # root writes anywhere: the permission case is for users
        with pytest.raises(InputError, match="cannot create a file in"):
            Journal(ro / "C.jsonl", prompts(1))


@pytest.mark.parametrize("taken", ["half of row 1", "row 1 and 3 bytes of row 2"])
def test_a_failed_write_is_cut_back_to_the_last_whole_line(tmp_path, monkeypatch, taken):
    import errno

    ps, out = prompts(6), tmp_path / "C.jsonl"
    lines = expected_bytes(ps).splitlines(keepends=True)
    j = Journal(out, ps, sync_s=0)
    j.complete(0, row(0))
    assert out.read_bytes() == lines[0]
    real = os.write
    state = {"calls": 0}
    n = len(lines[1]) // 2 if taken == "half of row 1" else len(lines[1]) + 3

    def full_disk(fd, data):  # the kernel takes part of the batch, then the disk is full
        state["calls"] += 1
        if state["calls"] == 1:
            return real(fd, bytes(data[:n]))
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "write", full_disk)
    j.complete(2, row(2))
    with pytest.raises(Exception, match="writing the completions failed: No space left on device; free disk"):
        j.complete(1, row(1))  # rows 1 and 2 go out in one write
    kept = 2 if n > len(lines[1]) else 1  # the rows the kernel took whole stay; no torn line
    assert out.read_bytes() == b"".join(lines[:kept])
    monkeypatch.setattr(os, "write", real)
    j._closed = True  # the job ends here (its fault is raised); resume:
    os.close(j._fd)
    with Journal(out, ps, sync_s=0) as k:
        assert [p.id for p in k.pending] == [f"p{i}" for i in range(kept, 6)]
        for p in k.pending:
            k.complete(p.index, row(p.index))
    assert out.read_bytes() == expected_bytes(ps)


def test_a_real_full_disk_leaves_whole_lines(tmp_path_factory):
    import shutil

    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a small tmpfs needs root")
    where = tmp_path_factory.mktemp("full")
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8k", "tmpfs", str(where)], capture_output=True, text=True)
    if made.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({made.stderr.strip()})")
    try:
        ps, out = prompts(40), where / "C.jsonl"
        big = {"tokens": list(range(300)), "finish_reason": "length"}
        with pytest.raises(Exception, match="No space left on device"):
            with Journal(out, ps, sync_s=0) as j:
                for p in ps:
                    j.complete(p.index, big)
        data = out.read_bytes()
        assert data and data.endswith(b"\n") and all(json.loads(x)["tokens"] == big["tokens"]
                                                      for x in data.splitlines())
    finally:
        subprocess.run(["umount", str(where)], check=False)


def test_the_sidecar_never_replaces_an_input(tmp_path):
    prompts_file = tmp_path / "C.jsonl.meta.json"
    prompts_file.write_text("{}\n")
    with pytest.raises(InputError, match=r"its record \S*C.jsonl.meta.json: is the input file"):
        Journal(tmp_path / "C.jsonl", prompts(1), inputs=[prompts_file])
    assert prompts_file.read_text() == "{}\n"


# -- settings stated per rank, said per layer (issue 36) ----------------------------------------------

from rlx_mpi.config import parse_job  # noqa: E402
from rlx_mpi.io.identity import layout_settings  # noqa: E402
from rlx_mpi.cluster.placement import Assignment  # noqa: E402


def _plan(*stages, replicas=1):
    """Assignments of ``stages`` [(ranks, layers range)] per replica (ranks shifted per replica)."""
    out, width = [], sum(len(r) for r, _ in stages)
    for rep in range(replicas):
        for s, (ranks, layers) in enumerate(stages):
            out.append(Assignment(s, tuple(r + rep * width for r in ranks), ("h",) * len(ranks), layers, "cpu", 0,
                                  s == 0, s == len(stages) - 1, replica=rep))
    return out


def _job(tmp_path, run=None, ranks=()):
    """A job as the start-up hands it on: precision "auto" made concrete (here f32, a float32
    checkpoint's stored format: `JobConfig.resolve_precision`)."""
    from rlx_mpi.config import Precision

    raw = {"model": {"checkpoint": "m.h5"}, "run": run or {}}
    if ranks:
        raw["rank"] = list(ranks)
    return parse_job(raw, tmp_path / "job.toml").resolve_precision(Precision.F32)


def test_precision_and_kv_are_said_per_layer_whatever_the_layout(tmp_path):
    job = _job(tmp_path, {"precision": "int8"}, [{"rank": 1, "precision": "f32"}])
    two = layout_settings(job, _plan(([0], range(0, 4)), ([1], range(4, 8))))
    assert two["precision"] == "0:4 int8, 4:8 f32" and two["kv_cache"] == "full" and two["wire"] == "f32"
    other = layout_settings(job, _plan(([0], range(0, 6)), ([1], range(6, 8))))  # the cut moved: other layers f32
    assert other["precision"] == "0:6 int8, 6:8 f32"
    same = _job(tmp_path, {"precision": "f32"}, [{"rank": 0, "precision": "int8"}, {"rank": 1, "precision": "int8"}])
    assert layout_settings(same, _plan(([0, 1], range(0, 4)), ([2], range(4, 8))))["precision"] == two["precision"]
    uniform = _job(tmp_path, {"precision": "bf16"})
    assert layout_settings(uniform, _plan(([0], range(0, 8)), replicas=3))["precision"] == "bf16"


def test_the_arithmetic_is_said_per_layer_and_a_resume_on_another_is_refused(tmp_path, tiny_ckpt):
    """Rows are the same bits on one machine kind (docs/invariance.md): the kernels' arithmetic of
    the ranks holding each layer is part of the identity, so rows made on AMX hosts are not
    appended to rows made on AVX-512 hosts."""
    from types import SimpleNamespace as Caps

    job, plan = _job(tmp_path), _plan(([0], range(0, 4)), ([1], range(4, 8)))
    same = [Caps(rank=0, arithmetic="avx512"), Caps(rank=1, arithmetic="avx512")]
    mixed = [Caps(rank=0, arithmetic="amx"), Caps(rank=1, arithmetic="avx512")]
    assert layout_settings(job, plan, "generate", same)["arithmetic"] == "avx512"
    assert layout_settings(job, plan, "generate", mixed)["arithmetic"] == "0:4 amx, 4:8 avx512"
    assert "arithmetic" not in layout_settings(job, plan)  # (no caps: not known, not recorded)
    ps, out = prompts(3), tmp_path / "C.jsonl"
    half_done(out, ps, ident(tiny_ckpt).with_settings(**layout_settings(job, plan, "generate", same)))
    j = Journal(out, ps, identity=ident(tiny_ckpt), settle=True)
    with pytest.raises(InputError, match='made with arithmetic "avx512", this run has arithmetic "0:4 amx, 4:8 '
                       'avx512"; to resume, rerun with its layers on hosts whose kernels run "avx512"'):
        j.settle(**layout_settings(job, plan, "generate", mixed))
    j.close()


def test_the_wire_counts_only_where_it_rounds(tmp_path):
    bf16 = _job(tmp_path, {"wire": "bf16"})
    assert layout_settings(bf16, _plan(([0], range(0, 8))))["wire"] == "f32"  # one stage sends nothing
    assert layout_settings(_job(tmp_path), _plan(([0], range(0, 4)), ([1], range(4, 8))))["wire"] == "f32"
    assert layout_settings(bf16, _plan(([0], range(0, 4)), ([1], range(4, 8))))["wire"] == "bf16 before layers 4"
    assert layout_settings(bf16, _plan(([0, 1], range(0, 4)), ([2, 3], range(4, 8)), replicas=2))["wire"] == \
        "bf16 before layers 4"  # TP and replicas change nothing


def test_score_keeps_no_cache_so_only_a_window_is_another_model(tmp_path):
    plan = _plan(([0], range(0, 8)))
    assert layout_settings(_job(tmp_path, {"kv_cache": "none"}), plan, "score")["kv_cache"] == "full"
    assert layout_settings(_job(tmp_path, {"kv_cache": "none"}), plan, "generate")["kv_cache"] == "none"
    assert layout_settings(_job(tmp_path, {"kv_cache": "window:8"}), plan, "score")["kv_cache"] == "window:8"


def test_a_finished_file_made_another_way_is_not_called_done(tmp_path, tiny_ckpt):
    ps, out = prompts(2), tmp_path / "C.jsonl"
    half_done(out, ps, ident(tiny_ckpt).with_settings(precision="int8", kv_cache="full", wire="f32"))
    j = Journal(out, ps, identity=ident(tiny_ckpt), settle=True)
    j.check_done(precision="int8", wire="f32")  # the same (kv_cache unknown without a plan: not compared)
    with pytest.raises(InputError, match='made with precision "int8"; this run has precision "f32"'):
        j.check_done(precision="f32")
    j.close()
    changed = [ps[0], Prompt(1, "p1", (5, 6), None)]
    j = Journal(out, changed, identity=ident(tiny_ckpt), settle=True)
    with pytest.raises(InputError, match="prompt 'p1' .* has other tokens"):
        j.check_done()
    j.close()


def test_the_tokenizer_and_chat_template_are_part_of_the_identity(tmp_path, tiny_ckpt):
    from types import SimpleNamespace

    from rlx_mpi.io.identity import beside_settings

    assert beside_settings(None) == {"tokenizer": "none", "chat template": "none"}
    f = tmp_path / "tokenizer.json"
    f.write_text('{"model": 1}')
    a = beside_settings(SimpleNamespace(path=f, chat_template=SimpleNamespace(source="{{ messages }}")))
    b = beside_settings(SimpleNamespace(path=f, chat_template=SimpleNamespace(source="{{ messages }}!")))
    assert a["tokenizer"] == b["tokenizer"] != "none" and a["chat template"] != b["chat template"]
    ps, out = prompts(3), tmp_path / "C.jsonl"
    half_done(out, ps, ident(tiny_ckpt).with_settings(**a))
    with pytest.raises(InputError, match=f'chat template "{a["chat template"]}", this run has chat template'):
        Journal(out, ps, identity=ident(tiny_ckpt).with_settings(**b))
