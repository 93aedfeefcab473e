"""Data-parallel replicas, the pure parts: the replicas x stages x tp grid, `[placement]
replicas`, and the planner's ``auto`` (no MPI)."""

import re

import pytest

from rlx_mpi.cluster.caps import NodeCaps
from rlx_mpi.cli import main
from rlx_mpi.config import PlacementPolicy, parse_job
from rlx_mpi.errors import ConfigError, FitError
from rlx_mpi.cluster.placement import plan_grid
from rlx_mpi.model.cost import ModelCost
from rlx_mpi.comm.topology import replica_grids

LLAMA3_8B = ["--layers", "32", "--hidden", "4096", "--heads", "32", "--kv-heads", "8", "--intermediate", "14336",
             "--vocab", "128256", "--dtype", "bfloat16"]
LLAMA31_70B = ["--layers", "80", "--hidden", "8192", "--heads", "64", "--kv-heads", "8", "--intermediate", "28672",
               "--vocab", "128256", "--dtype", "bfloat16"]


def test_replicas_of_a_round_robin_launch_stay_on_one_host_each():
    hosts = list("abababab")
    assert replica_grids(hosts, 1, 2) == [[[0], [2], [4], [6]], [[1], [3], [5], [7]]]
    assert replica_grids(hosts, 1, 8) == [[[r]] for r in range(8)]
    assert replica_grids(hosts, 1, 1) == [[[0], [1], [2], [3], [4], [5], [6], [7]]]


def test_replicas_of_tp_groups_never_split_a_group_and_start_at_rank_0():
    hosts = ["a"] * 4 + ["b"] * 4
    assert replica_grids(hosts, 2, 2) == [[[0, 1], [2, 3]], [[4, 5], [6, 7]]]
    assert replica_grids(hosts, 2, 4) == [[[0, 1]], [[2, 3]], [[4, 5]], [[6, 7]]]
    for reps in (replica_grids(list("abcabcabcabc"), t, r) for t, r in ((1, 3), (1, 4), (2, 2), (3, 4))):
        ranks = [x for rep in reps for g in rep for x in g]
        assert sorted(ranks) == list(range(12)) and reps[0][0][0] == 0
        assert len({len(rep) for rep in reps}) == 1  # every replica alike


def test_replicas_must_divide_the_stage_groups():
    with pytest.raises(ConfigError, match="3 replicas of tp 1 do not divide the 4 ranks"):
        replica_grids(["a"] * 4, 1, 3)


def _job(tmp_path, placement: str):
    import tomllib

    return parse_job(tomllib.loads(f'[model]\ncheckpoint = "m.h5"\n[placement]\n{placement}\n'), tmp_path / "j.toml")


def test_job_file_replicas(tmp_path):
    assert _job(tmp_path, "").placement.replicas == 1
    assert _job(tmp_path, 'replicas = "auto"').placement.replicas == "auto"
    assert _job(tmp_path, "replicas = 3").placement.replicas == 3
    for bad in ('replicas = 0', 'replicas = "many"', "replicas = 1.5", "replicas = true"):
        with pytest.raises(ConfigError, match=r"\[placement\] replicas: got .*expected \"auto\" or an integer"):
            _job(tmp_path, bad)
    job = _job(tmp_path, "replicas = 3")
    with pytest.raises(ConfigError, match=r"\[placement\] replicas: 3 replicas of tp 1 do not divide the 4 ranks"):
        job.check_world(4)
    job.check_world(6)
    job.check_layers(2, 6)  # 2 stages per replica of a 2-layer model: fine
    with pytest.raises(ConfigError, match="3 stages"):
        job.check_layers(2, 9)


def _cost(layers=8, layer_gb=1.0, ends_gb=0.5):
    return ModelCost(n_layers=layers, layer_bytes=int(layer_gb * 1e9), layer_flops_per_token=1.0,
                     embed_bytes=int(ends_gb * 1e9), head_bytes=int(ends_gb * 1e9), head_flops_per_token=1.0,
                     kv_bytes_per_layer=0, act_bytes=0)


def _caps(n, mem_gb, per_host=1):
    b = int(mem_gb * 1e9)
    return [NodeCaps(rank=r, host=f"h{r // per_host}", local_rank=r % per_host, local_size=per_host, cpus=None,
                     ram_total_bytes=b, ram_available_bytes=b, gflops=None) for r in range(n)]


def test_auto_takes_the_fewest_stages_that_fit():
    # 9 GB of model: one 10 GB rank holds it (4 replicas); 5 GB ranks need 2 stages (2 replicas)
    one = plan_grid(_cost(), _caps(4, 10), PlacementPolicy.BALANCED, replicas="auto")
    assert (len(one.replicas), one.n_stages) == (4, 1) and "the fewest" in one.why
    two = plan_grid(_cost(), _caps(4, 5), PlacementPolicy.BALANCED, replicas="auto")
    assert (len(two.replicas), two.n_stages) == (2, 2) and "with fewer:" in two.why
    assert [[a.ranks for a in rep] for rep in two.replicas] == [[(0,), (1,)], [(2,), (3,)]]
    assert [a.replica for a in two.flat] == [0, 0, 1, 1]
    with pytest.raises(FitError, match="short"):  # nothing fits: the one-replica error, as before replicas
        plan_grid(_cost(), _caps(4, 1), PlacementPolicy.BALANCED, replicas="auto")
    fixed = plan_grid(_cost(), _caps(4, 10), PlacementPolicy.BALANCED, replicas=1)
    assert (len(fixed.replicas), fixed.n_stages) == (1, 4)


def test_auto_prices_the_kv_cache_at_each_stage_count():
    # the job's KV cache grows with the stage count (generate: one group of slots per stage)
    seen = []

    def cost_for(stages):
        seen.append(stages)
        return _cost(layer_gb=1.2) if stages == 1 else _cost()

    g = plan_grid(cost_for, _caps(4, 10), PlacementPolicy.BALANCED, replicas="auto")
    assert {1, 2} <= set(seen) and g.n_stages == 2  # 1 stage needs 10.6 GB with its cache: 2 stages


def test_auto_says_when_replicas_share_a_host():
    g = plan_grid(_cost(), _caps(4, 10, per_host=2), PlacementPolicy.BALANCED, replicas="auto")
    assert len(g.replicas) == 4 and "one replica per host (one rank with all the host's cores)" in g.why
    assert "one replica per host" not in plan_grid(_cost(), _caps(4, 10), PlacementPolicy.BALANCED, replicas="auto").why


def test_replicas_never_split_a_tp_group_across_hosts():
    caps = _caps(4, 10, per_host=3)  # hosts h0 h0 h0 h1: tp 2 leaves ranks 2 and 3 on two hosts
    with pytest.raises(ConfigError, match="the tp group of ranks 2,3 would span hosts h0, h1"):
        plan_grid(_cost(), caps, PlacementPolicy.BALANCED, tp=2, replicas="auto")
    assert len(plan_grid(_cost(), caps, PlacementPolicy.BALANCED, tp=2, replicas=1).flat) == 2  # as before


def _plan(capsys, *args):
    assert main(["plan", *args]) == 0
    return capsys.readouterr().out


def test_plan_llama3_8b_on_8_nodes_of_64_gb_is_8_replicas(capsys):
    out = _plan(capsys, "--ranks", "8", "--mem-gb", "64", *LLAMA3_8B)
    assert "8 ranks = 8 replicas x 1 stage x tp 1" in out
    assert "replicas auto: 8 replicas x 1 stage x tp 1" in out
    rows = [line.split() for line in out.splitlines() if re.match(r"\s+\d+\s+0\s", line)]
    assert [r[0] for r in rows] == [str(i) for i in range(8)] and all(r[4] == "0:32" for r in rows)


def test_plan_llama31_70b_on_16_nodes_of_128_gb_is_8_replicas_of_2_stages(capsys):
    out = _plan(capsys, "--ranks", "16", "--mem-gb", "128", *LLAMA31_70B)
    assert "16 ranks = 8 replicas x 2 stages x tp 1" in out
    assert "with fewer: the model needs" in out  # why not one stage
    one = _plan(capsys, "--ranks", "16", "--mem-gb", "128", "--replicas", "1", *LLAMA31_70B)
    assert "16 ranks = 16 stages x tp 1" in one


def test_plan_refuses_replicas_that_do_not_divide(capsys):
    assert main(["plan", "--ranks", "6", "--replicas", "4", "--preset", "tiny"]) == 2
    assert "plan --replicas: 4 replicas of tp 1 do not divide the 6 ranks" in capsys.readouterr().err
    assert main(["plan", "--ranks", "6", "--replicas", "x", "--preset", "tiny"]) == 2
    assert "plan --replicas: got 'x'" in capsys.readouterr().err


# -- --shard K/N and merge (no MPI: journals written directly) ------------------------------------

def test_shards_are_contiguous_near_equal_parts():
    from rlx_mpi.io.shards import parse_shard, shard_range

    assert [shard_range(11, k, 3) for k in (1, 2, 3)] == [range(0, 3), range(3, 7), range(7, 11)]
    assert sum((list(shard_range(100, k, 7)) for k in range(1, 8)), []) == list(range(100))
    assert parse_shard("2/8", "w") == (2, 8) and parse_shard(None, "w") is None
    for bad in ("0/3", "4/3", "3", "a/b", "1/0"):
        with pytest.raises(ConfigError, match="w: got"):
            parse_shard(bad, "w")
    from rlx_mpi.errors import InputError
    from rlx_mpi.io.prompts import Prompt
    from rlx_mpi.io.shards import select

    prompts = [Prompt(i, f"q{i}", (i,), None) for i in range(5)]
    part, record = select(prompts, (2, 2), "p.jsonl")
    assert [(p.index, p.id) for p in part] == [(0, "q2"), (1, "q3"), (2, "q4")]  # renumbered for the journal
    assert record == {"k": 2, "n": 2, "lines": [2, 5], "of": 5}
    with pytest.raises(InputError, match="p.jsonl: --shard 1/6: the prompt file has only 5 prompts"):
        select(prompts, (1, 6), "p.jsonl")


def _journals(tmp_path, n_shards, rows=10, identity_settings=None, finish=True):
    from rlx_mpi.io.identity import RunIdentity
    from rlx_mpi.io.journal import Journal
    from rlx_mpi.io.prompts import Prompt
    from rlx_mpi.io.shards import select

    prompts = [Prompt(i, f"q{i}", (i, i + 1), None) for i in range(rows)]
    ident = RunIdentity("generate", {"family": "x"}, identity_settings or {"temperature": 0.0})
    paths = []
    for k in range(1, n_shards + 1):
        part, shard = select(prompts, (k, n_shards) if n_shards > 1 else None, "p.jsonl")
        path = tmp_path / (f"part{k}.jsonl" if n_shards > 1 else "whole.jsonl")
        with Journal(path, part, identity=ident, shard=shard) as j:
            for p in part[:len(part) - (0 if finish or k != 2 else 1)]:
                j.complete(p.index, {"tokens": list(p.tokens), "n": len(p.tokens)})
        paths.append(path)
    return paths


def test_merge_joins_shards_into_the_one_job_file(tmp_path):
    from rlx_mpi.io.identity import meta_path
    from rlx_mpi.io.shards import merge

    whole, = _journals(tmp_path, 1)
    parts = _journals(tmp_path, 3)
    assert merge(tmp_path / "all.jsonl", parts[::-1]) == {"rows": 10, "shards": 3}
    assert (tmp_path / "all.jsonl").read_bytes() == whole.read_bytes()
    assert meta_path(tmp_path / "all.jsonl").read_bytes() == meta_path(whole).read_bytes()


def test_merge_refuses_unfinished_foreign_and_unsharded_inputs(tmp_path):
    from rlx_mpi.errors import InputError
    from rlx_mpi.io.shards import merge

    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    unfinished = _journals(tmp_path / "a", 3, finish=False)
    with pytest.raises(InputError, match=r"part2.jsonl: holds 2 of its 3 rows \(the shard did not finish\)"):
        merge(tmp_path / "x.jsonl", unfinished)
    other = _journals(tmp_path / "b", 3, identity_settings={"temperature": 0.5})
    with pytest.raises(InputError, match=r"b/part2.jsonl: was made with temperature 0.5 but .* with 0.0"):
        merge(tmp_path / "x.jsonl", [unfinished[0], other[1], unfinished[2]])
    whole, = _journals(tmp_path, 1)
    with pytest.raises(InputError, match="is not a shard's output"):
        merge(tmp_path / "x.jsonl", [whole])
    assert not (tmp_path / "x.jsonl").exists()


def test_a_shard_output_resumes_only_as_that_shard(tmp_path):
    from rlx_mpi.errors import InputError
    from rlx_mpi.io.identity import RunIdentity
    from rlx_mpi.io.journal import Journal
    from rlx_mpi.io.prompts import Prompt
    from rlx_mpi.io.shards import select

    parts = _journals(tmp_path, 3)
    prompts = [Prompt(i, f"q{i}", (i, i + 1), None) for i in range(10)]
    ident = RunIdentity("generate", {"family": "x"}, {"temperature": 0.0})
    for shard, now in (((1, 3), "shard 1/3"), (None, "the whole prompt file")):
        part, record = select(prompts, shard, "p.jsonl")
        with pytest.raises(InputError, match=f"part2.jsonl: holds shard 2/3, this run is {now}"):
            Journal(parts[1], part, identity=ident, shard=record)
    part, record = select(prompts, (2, 3), "p.jsonl")
    with Journal(parts[1], part, identity=ident, shard=record) as j:  # the same shard: resumes (all done)
        assert not j.pending
