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


def test_the_cache_folder_is_numbas_own_choice_and_stale_caches_there_are_dropped(tmp_path, monkeypatch):
    """With NUMBA_CACHE_DIR (a site install read-only to its users) numba caches elsewhere than
    the kernels' __pycache__: `drop_stale` must clean that folder when the sources change."""
    from pathlib import Path

    import numba.core.config

    from rlx_mpi.kernels import _fresh

    folder = tmp_path / "kernels"
    folder.mkdir()
    (folder / "k.py").write_text("x = 1\n")
    monkeypatch.setattr(numba.core.config, "CACHE_DIR", str(tmp_path / "cache"))
    where = _fresh.cache_dir(folder)
    assert where is not None and Path(where).parent == tmp_path / "cache" and _fresh.cache_note(folder) is None
    stale = Path(where) / "k.f-1.py311.nbi"
    stale.write_text("old")
    assert _fresh.drop_stale(folder) and not stale.exists()  # first digest: the caches go
    stale.write_text("new build")
    assert not _fresh.drop_stale(folder) and stale.exists()  # same sources: kept
    (folder / "k.py").write_text("x = 2\n")
    assert _fresh.drop_stale(folder) and not stale.exists()  # a source changed: dropped


def test_no_writable_cache_is_named_with_its_fix(tmp_path, monkeypatch):
    import numba.core.caching

    from rlx_mpi.kernels import _fresh

    monkeypatch.setattr(numba.core.caching.CacheImpl, "_locator_classes", [])
    assert _fresh.cache_dir(tmp_path) is None and _fresh.drop_stale(tmp_path) is False
    note = _fresh.cache_note(tmp_path)
    assert "NUMBA_CACHE_DIR" in note and "rlx-mpi compile-kernels" in note and "every job compiles" in note
