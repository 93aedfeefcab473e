"""`rlx-mpi compile-kernels`: a site install fills numba's cache once; a job's start-up
deadline that expires while a cold node compiles says so and names the command."""

from __future__ import annotations

import pytest

from conftest import run_cli, write_job


@pytest.mark.mpi
def test_compile_kernels_fills_the_cache_a_short_startup_deadline_then_needs(tmp_path, tiny_ckpt):
    cold, warm = tmp_path / "cold-cache", tmp_path / "warm-cache"
    job = write_job(tmp_path, model={"checkpoint": str(tiny_ckpt)},
                    run={"batch": 1, "seq": 8, "startup_timeout_s": 5.0, "timeout_s": 5.0})

    # an empty cache (a read-only install's first job): the compile outlasts the deadline
    r = run_cli(["run", job], ranks=1, timeout=120, env={"NUMBA_CACHE_DIR": str(cold)})
    assert r.returncode == 5, r.stderr[-2000:]
    line = [ln for ln in r.stderr.splitlines() if ln.startswith("rlx-mpi: error:")]
    assert len(line) == 1 and "compiling the kernels" in line[0] and "rlx-mpi compile-kernels" in line[0], r.stderr[-2000:]

    # the site's one compile, then the same job under the same deadline starts
    r = run_cli(["compile-kernels"], timeout=600, env={"NUMBA_CACHE_DIR": str(warm)})
    assert r.returncode == 0, r.stderr[-2000:]
    assert f"kernel cache: {warm}" in r.stdout and "(written)" in r.stdout, r.stdout
    assert any(warm.rglob("*.nbi")), "compile-kernels wrote no cache index"
    r = run_cli(["run", job], ranks=1, timeout=120, env={"NUMBA_CACHE_DIR": str(warm)})
    assert r.returncode == 0, r.stderr[-2000:]
