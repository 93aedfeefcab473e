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

from rlx_mpi.lifecycle.signals import STOP_SIGNALS, StopRequest


def _deliver(sig) -> None:
    os.kill(os.getpid(), sig)
    time.sleep(0.01)  # Python runs the handler at the next bytecode boundary; be generous


@pytest.fixture
def handlers():
    """Put this process's handlers back whatever a test leaves."""
    before = {s: signal.getsignal(s) for s in STOP_SIGNALS}
    yield before
    for s, h in before.items():
        signal.signal(s, h)


def test_sigusr1_sets_the_flag_and_late_copies_cannot_kill_the_exiting_rank(handlers):
    stop = StopRequest().install()
    try:
        assert not stop.requested and stop.signal_name is None
        _deliver(signal.SIGUSR1)
        assert stop.requested and stop.signal_name == "SIGUSR1" and stop.count == 1
        _deliver(signal.SIGTERM)  # a later signal does not change which one asked first
        assert stop.signal_name == "SIGUSR1" and stop.count == 2
    finally:
        stop.restore()
    # a stop was requested: from now on a second copy of the signal is ignored
    assert signal.getsignal(signal.SIGTERM) == signal.getsignal(signal.SIGUSR1) == signal.SIG_IGN
    assert signal.getsignal(signal.SIGINT) == handlers[signal.SIGINT]
    _deliver(signal.SIGTERM)  # we are still here


def test_restore_without_a_request_puts_the_old_handlers_back(handlers):
    stop = StopRequest().install()
    assert signal.getsignal(signal.SIGTERM) == stop._handle
    stop.restore()
    assert {s: signal.getsignal(s) for s in STOP_SIGNALS} == handlers


def test_second_sigint_interrupts_as_without_us(handlers):
    # Python's own handler, whatever the suite was started with (nohup, a background job: SIGINT
    # ignored); the fixture puts the inherited one back.
    signal.signal(signal.SIGINT, signal.default_int_handler)
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
        from rlx_mpi.io.journal import REQUEUE_EXIT
        from rlx_mpi.lifecycle.signals import StopRequest
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


RANK_SCRIPT = textwrap.dedent("""
    import os, sys, time
    from rlx_mpi.lifecycle.faults import supervise
    supervise()  # as the CLI does: the rank runs under its supervisor
    from mpi4py import MPI
    from rlx_mpi.io.journal import REQUEUE_EXIT
    from rlx_mpi.lifecycle.signals import StopRequest
    stop = StopRequest().install()
    rank, folder = MPI.COMM_WORLD.rank, sys.argv[1]
    open(os.path.join(folder, f"ready{rank}"), "w").close()
    deadline = time.monotonic() + 30
    while not stop.requested and time.monotonic() < deadline:
        time.sleep(0.01)
    with open(os.path.join(folder, f"rank{rank}"), "w") as f:  # the launcher mixes stdout lines
        f.write(f"{stop.signal_name} {stop.count} {time.monotonic() - deadline + 30:.2f}")
    stop.restore()
    sys.exit(REQUEUE_EXIT if stop.requested else 1)
""")


@pytest.mark.mpi
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGUSR1], ids=lambda s: s.name)
def test_a_signal_to_mpiexec_reaches_every_rank_under_its_supervisor(sig, tmp_path):
    # What Slurm and a Ctrl-C do to a job: signal the launcher. MPICH's mpiexec passes SIGTERM,
    # SIGINT and SIGUSR1 on to each rank's process group, so every rank, not only its
    # supervisor, sees the request, and the requeue code comes out of mpiexec. A rank may get
    # SIGTERM twice (from mpiexec, and passed on by its supervisor): without `restore` ignoring
    # the late copy, this failed about one run in three with 143 (death by SIGTERM).
    from conftest import MPIEXEC, kill_tree

    if MPIEXEC is None:
        pytest.skip("no mpiexec found")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    proc = subprocess.Popen([MPIEXEC, "-n", "2", sys.executable, "-c", RANK_SCRIPT, str(tmp_path)],
                            env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while not all((tmp_path / f"ready{r}").exists() for r in range(2)):
            assert time.monotonic() < deadline and proc.poll() is None, "the ranks did not start"
            time.sleep(0.02)
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=30)
    finally:
        kill_tree(proc.pid)
    seen = [(tmp_path / f"rank{r}").read_text() for r in range(2)]
    assert [s.split()[0] for s in seen] == [sig.name] * 2, (seen, out, err)
    assert proc.returncode == 75, (out, err)


def test_a_stop_signal_after_the_work_is_finished_cannot_kill_the_exiting_rank():
    # A real process, a real kill: the time limit's SIGTERM (twice: launcher and supervisor) lands
    # after the last row, while the rank reports and exits; it must still exit 0, not 143.
    script = textwrap.dedent("""
        import time
        from rlx_mpi.lifecycle.signals import StopRequest
        stop = StopRequest().install()
        stop.restore(finished=True)  # what Cluster.run does when the driver returned
        print("ready", flush=True)
        time.sleep(1.0)  # the report and the exit
        print("complete", stop.requested, flush=True)
    """)
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, env=env)
    try:
        ready, _, _ = select.select([proc.stdout], [], [], 60)
        assert ready and proc.stdout.readline() == "ready\n"
        proc.send_signal(signal.SIGTERM)
        proc.send_signal(signal.SIGUSR1)
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=20)
    finally:
        proc.kill()
    assert out.split() == ["complete", "False"] and proc.returncode == 0, (out, proc.returncode)


def test_cluster_run_ignores_stop_signals_once_the_driver_returned(handlers):
    """Cluster.run restores with ``finished`` only when drive returned: SIGTERM is then ignored;
    a driver that raised goes through report_and_abort, and its handlers are put back."""
    from rlx_mpi.cluster import start as cluster_mod

    class Driver:
        stop_signals = True

        def __init__(self, fail):
            self.fail = fail

        def drive(self, cx):
            assert signal.getsignal(signal.SIGTERM) == cx.stop._handle
            if self.fail:
                raise RuntimeError("boom")
            return "result"

    from types import SimpleNamespace

    from rlx_mpi.config import OnRankFailure

    cx = cluster_mod.Cluster.__new__(cluster_mod.Cluster)  # no MPI: run() needs ctx, stop and the job's run section
    cx.ctx, cx.world, cx.stop = type("Ctx", (), {"extra": {}})(), None, None
    cx.job = SimpleNamespace(run=SimpleNamespace(on_rank_failure=OnRankFailure.ABORT))
    assert cx.run(Driver(False)) == "result"
    assert signal.getsignal(signal.SIGTERM) == signal.getsignal(signal.SIGUSR1) == signal.SIG_IGN
    assert signal.getsignal(signal.SIGINT) == handlers[signal.SIGINT]
    for s, h in handlers.items():
        signal.signal(s, h)
    cx.stop, aborted = None, []
    real = cluster_mod.report_and_abort
    cluster_mod.report_and_abort = lambda world, ctx, info: aborted.append(info[1])
    try:
        with pytest.raises(RuntimeError, match="boom"):
            cx.run(Driver(True))
    finally:
        cluster_mod.report_and_abort = real
    assert len(aborted) == 1 and {s: signal.getsignal(s) for s in STOP_SIGNALS} == handlers
