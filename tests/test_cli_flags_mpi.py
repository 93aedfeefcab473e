"""Every CLI flag that no other test passes, through the real CLI (under mpiexec where the
command runs ranks): exit 0 and the output the flag promises. A flag nobody runs can break
unseen (generate --json once did)."""

import json

import numpy as np
import pytest

from conftest import run_cli, write_job
from helpers import in_pairs

pytestmark = pytest.mark.mpi


def job_for(tmp_path, ckpt, **run):
    return write_job(tmp_path, model={"checkpoint": str(ckpt)}, run={"timeout_s": 30.0, **run},
                     placement={"reserve_ram_gb": 0.0})


def test_run_plan_only_prints_the_plan_and_computes_nothing(tmp_path, tiny_ckpt):
    out = tmp_path / "r.h5"
    p = run_cli(["run", job_for(tmp_path, tiny_ckpt), "--plan-only", "--out", out], ranks=2, timeout=60)
    assert p.returncode == 0, p.stderr
    assert "stage" in p.stdout and "0:" in p.stdout and "tokens/s" not in p.stdout
    assert not out.exists()


def test_probe_gflops_measures_each_rank(tmp_path, tiny_ckpt):
    p = run_cli(["probe", job_for(tmp_path, tiny_ckpt), "--gflops", "--json"], ranks=2, timeout=90)
    assert p.returncode == 0, p.stderr
    ranks = json.loads(p.stdout)  # one object per rank
    assert len(ranks) == 2 and all(r["gflops"] is not None and r["gflops"] > 0 for r in ranks), p.stdout


def test_generate_groups_gives_the_same_greedy_tokens(tmp_path, tiny_ckpt):
    prompts = tmp_path / "p.jsonl"
    rng = np.random.default_rng(3)
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "tokens": rng.integers(0, 512, 5 + i).tolist()}) + "\n"
                               for i in range(6)))
    outs = {}
    job = job_for(tmp_path, tiny_ckpt)  # read by both runs, written once

    def generate(groups):
        return lambda: run_cli(["generate", job, "--prompts", prompts, "--out", tmp_path / f"g{groups}.jsonl",
                                "--max-new-tokens", "5", "--batch", "2", "--groups", str(groups)], ranks=2, timeout=120)
    for groups, p in zip((1, 2), in_pairs(generate(1), generate(2))):  # independent runs, two at once
        out = tmp_path / f"g{groups}.jsonl"
        assert p.returncode == 0, p.stderr
        outs[groups] = [{k: v for k, v in json.loads(line).items() if k != "ms"} for line in out.read_text().splitlines()]
    assert len(outs[1]) == 6 and outs[1] == outs[2]


def test_trace_title_and_plan_shape_flags(tmp_path, tiny_ckpt):
    trace = tmp_path / "t.json"
    p = run_cli(["run", job_for(tmp_path, tiny_ckpt), "--trace", trace], ranks=2, timeout=60)
    assert p.returncode == 0, p.stderr
    png = tmp_path / "g.png"
    p = run_cli(["trace", trace, "--png", png, "--title", "my run"], timeout=60)
    assert p.returncode == 0, p.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    shape = ["plan", "--ranks", "4", "--layers", "8", "--hidden", "256", "--heads", "4", "--intermediate", "512",
             "--vocab", "1000", "--seq", "64"]
    one = [a if a != "4" else "1" for a in shape]  # one rank holds both ends: a tied matrix once
    tied, untied = (run_cli(one + extra, timeout=60) for extra in (["--tied"], []))
    assert tied.returncode == 0 and untied.returncode == 0, tied.stderr + untied.stderr
    total = lambda p: float(p.stdout.split(" MB estimated")[0].split()[-1])  # noqa: E731
    assert abs((total(untied) - total(tied)) - 1000 * 256 * 4 / 1e6) < 0.02  # one vocab x hidden matrix less
    per_host = run_cli(shape + ["--ranks-per-host", "2", "--policy", "uniform"], timeout=60)
    assert per_host.returncode == 0, per_host.stderr
    assert "policy uniform" in per_host.stdout and "host0" in per_host.stdout and "host1" in per_host.stdout
    assert "host2" not in per_host.stdout
