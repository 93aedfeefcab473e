"""Progress: a plain periodic line in a batch log, a bar redrawn in place on a terminal."""

from __future__ import annotations

import io

import pytest

from rlx_mpi.lifecycle.progress import Progress, format_duration


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


class FakeTty(io.StringIO):
    def isatty(self):
        return True


def test_batch_log_gets_a_plain_line_every_interval():
    clock, log = Clock(), io.StringIO()
    p = Progress(100, already_done=20, stream=log, interval_s=10.0, clock=clock)
    assert not p.tty
    clock.t += 5
    p.update(30, 500)  # before the interval: nothing
    assert log.getvalue() == ""
    clock.t += 5
    p.update(40, 500)  # 10 s in: 20 prompts done here, 1000 tokens
    assert log.getvalue() == "generate: 40/100 prompts (40.0%), 100.0 tokens/s, ETA 30s\n"
    clock.t += 3
    p.update(50, 300)  # 3 s later: within the interval, nothing new
    assert log.getvalue().count("\n") == 1
    clock.t += 7
    p.update(60, 700)  # 20 s, 40 done here, 2000 tokens: 40 left at 2 prompts/s
    assert log.getvalue().splitlines()[-1] == "generate: 60/100 prompts (60.0%), 100.0 tokens/s, ETA 20s"
    assert "\r" not in log.getvalue()
    clock.t += 20
    p.update(100, 2000)
    p.finish()
    p.finish()  # once only
    assert log.getvalue().splitlines()[-1] == "generate: 100/100 prompts done; 4000 tokens in 40s, 100.0 tokens/s"


def test_terminal_gets_a_bar_redrawn_in_place():
    clock, tty = Clock(), FakeTty()
    p = Progress(8, stream=tty, interval_s=10.0, clock=clock)
    assert p.tty
    clock.t += 1
    p.update(2, 50)
    clock.t += 1
    p.update(4, 50)
    clock.t += 0.01
    p.update(5, 1)  # redraws are throttled: a decode step can take a millisecond
    frames = tty.getvalue().split("\r")[1:]
    assert len(frames) == 2 and "\n" not in tty.getvalue()
    assert frames[0].startswith("[" + "#" * 6 + "." * 18 + "] 2/8 prompts (25.0%), 50.0 tokens/s, ETA 3s")
    assert frames[1].startswith("[" + "#" * 12 + "." * 12 + "] 4/8 prompts (50.0%), 50.0 tokens/s, ETA 2s")
    clock.t += 1
    p.finish()
    assert tty.getvalue().endswith("\n") and "5/8 prompts" in tty.getvalue().split("\r")[-1]


def test_eta_unknown_before_any_prompt_and_argument_checks():
    clock = Clock()
    p = Progress(10, already_done=3, stream=io.StringIO(), clock=clock)
    clock.t += 1
    assert p.line().endswith("ETA ?")
    with pytest.raises(ValueError):
        p.update(2, 0)  # fewer than already done
    with pytest.raises(ValueError):
        p.update(11, 0)
    with pytest.raises(ValueError):
        p.update(5, -1)
    with pytest.raises(ValueError):
        Progress(3, already_done=4)


def test_a_broken_stream_does_not_stop_the_job():
    log = io.StringIO()
    clock = Clock()
    p = Progress(2, stream=log, interval_s=1.0, clock=clock)
    log.close()
    clock.t += 2
    p.update(1, 10)
    p.finish()


@pytest.mark.parametrize("s, text", [(0, "0s"), (42.4, "42s"), (185, "3m05s"), (7620, "2h07m"), (-3, "0s")])
def test_format_duration(s, text):
    assert format_duration(s) == text
