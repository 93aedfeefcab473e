"""StopRequest: the stop signals set a flag and nothing else; restore puts the old handlers back."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from rlx_mpi.signals import STOP_SIGNALS, StopRequest


def _deliver(sig) -> None:
    os.kill(os.getpid(), sig)
    time.sleep(0.01)  # Python runs the handler at the next bytecode boundary; be generous


def test_sigusr1_sets_the_flag_and_restore_puts_the_old_handler_back():
    before = {s: signal.getsignal(s) for s in STOP_SIGNALS}
    stop = StopRequest().install()
    try:
        assert not stop.requested and stop.signal_name is None
        _deliver(signal.SIGUSR1)
        assert stop.requested and stop.signal_name == "SIGUSR1" and stop.count == 1
        _deliver(signal.SIGTERM)  # a later signal does not change which one asked first
        assert stop.signal_name == "SIGUSR1" and stop.count == 2
    finally:
        stop.restore()
    assert {s: signal.getsignal(s) for s in STOP_SIGNALS} == before


def test_second_sigint_interrupts_as_without_us():
    with StopRequest() as stop:
        _deliver(signal.SIGINT)
        assert stop.requested and stop.signal_name == "SIGINT"
        with pytest.raises(KeyboardInterrupt):
            _deliver(signal.SIGINT)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_install_outside_the_main_thread_says_why():
    errors = []
    t = threading.Thread(target=lambda: errors.append(_try_install()))
    t.start()
    t.join(10)
    assert errors and "main thread" in str(errors[0])


def _try_install():
    try:
        StopRequest().install()
    except RuntimeError as e:
        return e


def test_sigterm_from_outside_lets_the_loop_finish_its_step_and_exit_with_the_requeue_code():
    # A real process, a real kill: the loop sees the flag between steps and leaves cleanly.
    script = textwrap.dedent("""
        import sys, time
        from rlx_mpi.journal import REQUEUE_EXIT
        from rlx_mpi.signals import StopRequest
        stop = StopRequest().install()
        print("ready", flush=True)
        steps = 0
        deadline = time.monotonic() + 20
        while not stop.requested and time.monotonic() < deadline:
            time.sleep(0.01)  # one "step"
            steps += 1
        print(stop.signal_name, steps > 0, flush=True)
        sys.exit(REQUEUE_EXIT if stop.requested else 1)
    """)
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, env=env)
    try:
        ready, _, _ = select.select([proc.stdout], [], [], 60)
        assert ready and proc.stdout.readline() == "ready\n"
        time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=20)
    finally:
        proc.kill()
    assert out.split() == ["SIGTERM", "True"] and proc.returncode == 75
