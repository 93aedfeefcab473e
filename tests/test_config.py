"""Job TOML validation: every bad value is a ConfigError naming file, key and value."""

from pathlib import Path

import pytest

from rlx_mpi.config import PlacementPolicy, load_job, parse_job
from rlx_mpi.errors import ConfigError

JOB = Path("/jobs/j.toml")


def parse(**sections):
    return parse_job({"model": {"checkpoint": "m.h5"}, **sections}, JOB)


def test_defaults_and_relative_paths():
    job = parse()
    assert job.model.checkpoint == Path("/jobs/m.h5")
    assert job.placement.policy is PlacementPolicy.BALANCED
    assert (job.run.batch, job.run.seq, job.placement.tp) == (1, 16, 1)
    assert job.override_for(3).device == "cpu"


@pytest.mark.parametrize("sections, where, what", [
    ({"run": {"seq": 0}}, "[run] seq", "got 0"),
    ({"run": {"batch": 1.5}}, "[run] batch", "expected an integer"),
    ({"run": {"batch": True}}, "[run] batch", "expected an integer"),
    ({"run": {"timeout_s": "10"}}, "[run] timeout_s", "expected a number"),
    ({"run": {"timeout_s": float("nan")}}, "[run] timeout_s", "finite"),
    ({"run": {"batch": 3, "microbatches": 4}}, "[run] microbatches", "4 microbatches for batch = 3"),
    ({"run": {"wire": "int8"}}, "[run] wire", "got 'int8'"),
    ({"run": {"timeout_s": 100.0, "startup_timeout_s": 10.0}}, "startup_timeout_s", "shorter"),
    ({"run": {"sequence": 4}}, "[run] sequence", "unknown key"),
    ({"placement": {"policy": "fastest"}}, "[placement] policy", "'fastest'"),
    ({"placement": {"policy": "manual"}}, "[placement] manual", "needs manual ranges"),
    ({"placement": {"manual": ["0:2", "2:4"]}}, "[placement] manual", "policy = \"balanced\""),
    ({"placement": {"policy": "manual", "manual": ["0-2"]}}, "[placement] manual", "'0-2'"),
    ({"placement": {"policy": "manual", "manual": ["3:3"]}}, "[placement] manual", "empty"),
    ({"placement": {"policy": "compute"}}, "[placement] policy", "measure_gflops"),
    ({"placement": {"tp": 0}}, "[placement] tp", "got 0"),
    ({"placement": {"reserve_ram_gb": -1}}, "[placement] reserve_ram_gb", "got -1"),
    ({"rank": [{"rank": 0}, {"rank": 0}]}, "[[rank]] rank", "twice"),
    ({"rank": [{"rank": 1, "precision": "int3"}]}, "precision", "'int3'"),
    ({"rank": [{"device": "cpu"}]}, "[[rank]] #1 rank", "missing required key"),
    ({"extra": {}}, "j.toml", "unknown section [extra]"),
])
def test_bad_values_name_key_and_value(sections, where, what):
    with pytest.raises(ConfigError) as e:
        parse(**sections)
    assert str(JOB) in e.value.where
    assert where in e.value.line() and what in e.value.line()


def test_missing_model_section():
    with pytest.raises(ConfigError, match="missing section \\[model\\]"):
        parse_job({}, JOB)


def test_world_checks():
    job = parse(placement={"tp": 2})
    with pytest.raises(ConfigError, match="tp = 2 does not divide the 3 launched ranks"):
        job.check_world(3)
    job.check_world(4)
    manual = parse(placement={"policy": "manual", "manual": ["0:2", "2:8"]})
    with pytest.raises(ConfigError, match="2 ranges for 3 stages"):
        manual.check_world(3)
    with pytest.raises(ConfigError, match="rank = 5 but only 2 ranks"):
        parse(rank=[{"rank": 5}]).check_world(2)


def test_load_job_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="job file not found"):
        load_job(tmp_path / "none.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[model\ncheckpoint = 1")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_job(bad)


def test_shipped_jobs_load():
    paths = sorted(Path(__file__).parent.parent.joinpath("jobs").glob("*.toml"))
    assert len(paths) >= 3, paths  # tiny, generate, tiny_tp at least: a moved folder must not pass silently
    for path in paths:
        load_job(path)


def test_precision_per_job_and_per_rank():
    from rlx_mpi.config import Precision

    job = parse(run={"precision": "bf16"}, rank=[{"rank": 1, "precision": "float32"}, {"rank": 2, "precision": "int8"}])
    assert [job.precision_for(r) for r in range(4)] == [Precision.BF16, Precision.F32, Precision.INT8, Precision.BF16]
    assert parse().precision_for(0) is Precision.F32 is Precision.FLOAT32
    with pytest.raises(ConfigError, match="expected one of \\['f32', 'bf16', 'f16', 'int8', 'q4'\\]"):
        parse(run={"precision": "fp8"})
