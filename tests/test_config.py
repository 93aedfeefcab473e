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
    assert Precision.F32 is Precision.FLOAT32
    with pytest.raises(ConfigError, match="expected one of \\['auto', 'f32', 'bf16', 'f16', 'int8', 'q4'\\]"):
        parse(run={"precision": "fp8"})


def test_precision_defaults_to_auto_the_checkpoints_stored_format():
    """Issue 41 section 4: no precision in the job = the checkpoint's stored format ("auto"),
    made concrete once (`resolve_precision`) so the planner, the stages and the run identity never
    see "auto"; a [[rank]] may say auto too, and a concrete precision stays as written."""
    import dataclasses

    from rlx_mpi.config import Precision

    job = parse()
    assert job.run.precision is Precision.AUTO and job.precision_for(0) is Precision.AUTO and job.asks_auto
    assert parse(run={"precision": "auto"}) == job
    q4 = job.resolve_precision(Precision.Q4)
    assert q4.precision_for(3) is Precision.Q4 and not q4.asks_auto
    assert q4 == dataclasses.replace(job, run=dataclasses.replace(job.run, precision=Precision.Q4))  # the same job
    mixed = parse(run={"precision": "f32"}, rank=[{"rank": 1, "precision": "auto"}, {"rank": 2, "precision": "int8"}])
    assert mixed.asks_auto
    got = mixed.resolve_precision(Precision.BF16)
    assert [got.precision_for(r) for r in range(4)] == [Precision.F32, Precision.BF16, Precision.INT8, Precision.F32]
    concrete = parse(run={"precision": "int8"})
    assert concrete.resolve_precision(Precision.Q4) is concrete  # nothing asked for auto
    with pytest.raises(ValueError, match="no size until resolved"):
        Precision.AUTO.bytes_per_param


@pytest.mark.parametrize("sections, where", [
    ({"run": {"precision": "q3"}}, "[run] precision"),
    ({"run": {"precision": 4}}, "[run] precision"),
    ({"rank": [{"rank": 1, "precision": "Auto"}]}, "[[rank]] #1 precision"),
])
def test_a_bad_precision_names_the_key_the_value_and_the_choices(sections, where):
    with pytest.raises(ConfigError) as e:
        parse(**sections)
    line = e.value.line()
    assert str(JOB) in line and where in line and "got" in line, line
    assert "expected one of ['auto', 'f32', 'bf16', 'f16', 'int8', 'q4']" in line and "stored format" in line, line
    assert "\n" not in line
