"""all_reduce for every ReduceKind and dtype against numpy, on 1 to 4 real MPI ranks."""

import subprocess
import sys

import pytest

from conftest import MPIEXEC, TESTS

pytestmark = pytest.mark.mpi


@pytest.mark.parametrize("ranks", [1, 2, 3, 4])
def test_all_reduce_matches_numpy(ranks):
    proc = subprocess.run([MPIEXEC, "-n", str(ranks), sys.executable, str(TESTS / "mpi_collectives.py")],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"collectives ok on {ranks} ranks" in proc.stdout
