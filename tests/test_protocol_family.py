"""The core goes through the family contract only: a family written to `rlx_mpi.model.stage.ModelFamily`
alone (tests/protocol_family.py, nothing from Llama) plans, converts, makes a random model and
generates; its ``run`` is in test_executor_mpi.py. Its numbers are checked against naive numpy."""

import json

import numpy as np
import pytest

import protocol_family as proto
from conftest import run_cli, write_job
from rlx_mpi import cli


def test_plan_preset_and_shape_through_the_family(capsys):
    assert cli.main(["plan", "--ranks", "2", "--preset", "proto-tiny"]) == 0
    out = capsys.readouterr().out
    assert "model: proto_mlp, 4 layers, hidden 16, vocab 40" in out
    assert cli.main(["plan", "--ranks", "2", "--family", proto.NAME, "--layers", "6", "--hidden", "8",
                     "--vocab", "30"]) == 0
    assert "model: proto_mlp, 6 layers, hidden 8, vocab 30" in capsys.readouterr().out


def test_plan_unknown_family_is_one_line(capsys):
    assert cli.main(["plan", "--ranks", "2", "--family", "nope", "--layers", "2"]) == 2
    assert "plan --family: got 'nope'" in capsys.readouterr().err


def test_init_model_and_convert_pick_the_family(tmp_path, capsys):
    from rlx_mpi.model.checkpoint import read_header

    assert cli.main(["init-model", str(tmp_path / "r.h5"), "--preset", "proto-tiny"]) == 0
    name, cfg = read_header(tmp_path / "r.h5")
    assert name == proto.NAME and json.loads(cfg) == proto.ProtoFamily.presets["proto-tiny"]
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({"model_type": "proto_mlp", "vocab_size": 20, "hidden_size": 4,
                                                "num_hidden_layers": 2}))
    assert cli.main(["convert", str(hf), str(tmp_path / "c.h5")]) == 0
    assert "proto_mlp, 2 layers, hidden 4, vocab 20" in capsys.readouterr().out
    assert read_header(tmp_path / "c.h5")[0] == proto.NAME


def test_convert_unknown_model_type_lists_the_supported(tmp_path, capsys):
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({"model_type": "gpt_neox"}))
    assert cli.main(["convert", str(hf), str(tmp_path / "c.h5")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert "model_type: 'gpt_neox' is not a supported model type" in err[0]
    assert "llama" in err[0] and "proto_mlp" in err[0]
    assert not (tmp_path / "c.h5").exists()


@pytest.mark.mpi
@pytest.mark.parametrize("ranks", [1, 3])
def test_generate_through_the_contract(tmp_path, ranks):
    ckpt = tmp_path / "proto.h5"
    cfg = proto.write_checkpoint(ckpt)
    rng = np.random.default_rng(3)
    prompts = {f"p{i}": rng.integers(0, cfg["vocab"], n).tolist() for i, n in enumerate((3, 7, 1, 5))}
    (tmp_path / "p.jsonl").write_text("".join(json.dumps({"id": k, "tokens": v}) + "\n" for k, v in prompts.items()))
    job = write_job(tmp_path, model={"checkpoint": str(ckpt), "plugins": ["protocol_family"]},
                    run={"timeout_s": 30.0}, placement={"reserve_ram_gb": 0.0})
    out, events = tmp_path / "c.jsonl", tmp_path / "events"
    events.mkdir()
    proc = run_cli(["generate", job, "--prompts", tmp_path / "p.jsonl", "--out", out, "--max-new-tokens", "4",
                    "--batch", "2"], ranks=ranks, timeout=120, env={"RLX_TEST_EVENTS": str(events)})
    assert proc.returncode == 0, proc.stderr
    rows = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert set(rows) == set(prompts)
    for pid, prompt in prompts.items():
        assert rows[pid]["tokens"] == proto.greedy(cfg, prompt, 4), pid
    # the cold start: the family's optional warm_up ran on the node's first rank alone, with what
    # generation runs, before any rank built its stage (`Cluster.warm_up`)
    seen = {p.name: json.loads(p.read_text()) for p in events.iterdir()}
    assert sorted(seen) == sorted(["warm.0"] + [f"build.{r}" for r in range(ranks)])
    assert {k: v for k, v in seen["warm.0"].items() if k != "t"} == {"precision": "f32", "tp": 1, "decode": True}
    assert seen["warm.0"]["t"] <= min(v["t"] for k, v in seen.items() if k.startswith("build."))
