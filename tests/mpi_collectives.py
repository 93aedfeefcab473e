"""Run under mpiexec by test_collectives_mpi.py: all_reduce of every kind and dtype against
numpy on the same data. Any failure aborts every rank (a failed assertion must not hang)."""

import sys
import traceback

import numpy as np
from mpi4py import MPI

from rlx_mpi import ReduceKind, all_reduce
from rlx_mpi.errors import DeadlineExpired

comm = MPI.COMM_WORLD.Dup()


def data(rank, dtype, shape=(3, 5)):
    rng = np.random.default_rng(100 + rank)
    if np.dtype(dtype).kind == "f":
        return rng.standard_normal(shape).astype(dtype)
    return rng.integers(-1000, 1000, shape).astype(dtype)


def check_kinds():
    everyone = lambda dtype: np.stack([data(r, dtype) for r in range(comm.size)])  # noqa: E731
    for dtype in (np.float32, np.float64, np.int32, np.int64):
        expected = {ReduceKind.SUM: everyone(dtype).sum(0), ReduceKind.MAX: everyone(dtype).max(0),
                    ReduceKind.MIN: everyone(dtype).min(0)}
        if np.dtype(dtype).kind == "f":
            expected[ReduceKind.MEAN] = everyone(dtype).sum(0) / comm.size
        for kind, want in expected.items():
            for timeout in (None, 10.0):
                buf = data(comm.rank, dtype)
                out = all_reduce(buf, kind, comm=comm, timeout_s=timeout)
                assert out is buf, "all_reduce must work in place"
                tol = 1e-5 if dtype == np.float32 else 1e-12
                if np.dtype(dtype).kind == "f":
                    np.testing.assert_allclose(buf, want, rtol=tol, atol=tol)
                else:
                    np.testing.assert_array_equal(buf, want)
    # default communicator: a lazily made clone of COMM_WORLD
    buf = np.full(4, comm.rank + 1, dtype=np.int64)
    all_reduce(buf)
    assert (buf == comm.size * (comm.size + 1) // 2).all()


def check_errors():
    cases = [
        (lambda: all_reduce(np.zeros((4, 4), np.float32)[:, ::2], comm=comm), ValueError, "not C-contiguous"),
        (lambda: all_reduce(np.zeros(3, np.float16), comm=comm), TypeError, "float16 is not supported"),
        (lambda: all_reduce([1.0, 2.0], comm=comm), TypeError, "must be a numpy array"),
        (lambda: all_reduce(np.zeros(3, np.int32), ReduceKind.MEAN, comm=comm), TypeError, "MEAN needs a float"),
        (lambda: all_reduce(np.zeros(3, np.float32), "sum", comm=comm), TypeError, "ReduceKind"),
    ]
    ro = np.zeros(3, np.float32)
    ro.flags.writeable = False
    cases.append((lambda: all_reduce(ro, comm=comm), ValueError, "read-only"))
    for call, exc, text in cases:
        try:
            call()
        except exc as e:
            assert text in str(e), f"{text!r} not in {e}"
        else:
            raise AssertionError(f"expected {exc.__name__} containing {text!r}")


def check_deadline():
    """Rank 0 skips the collective: the others' deadline fires instead of hanging."""
    if comm.size == 1:
        return
    if comm.rank != 0:
        try:
            all_reduce(np.ones(8, np.float32), comm=comm, timeout_s=0.5)
        except DeadlineExpired as e:
            assert "waited 0.5 s for an all-reduce" in str(e), str(e)
            assert f"one of world ranks {list(range(comm.size))} is stuck" in str(e), str(e)
        else:
            raise AssertionError("the all-reduce with a missing rank did not time out")


try:
    check_kinds()
    check_errors()
    check_deadline()
except Exception:
    traceback.print_exc()
    sys.stderr.flush()
    MPI.COMM_WORLD.Abort(1)
if comm.rank == 0:
    print(f"collectives ok on {comm.size} ranks")
