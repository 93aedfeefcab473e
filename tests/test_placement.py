"""Pure tests of the layer planner: no MPI."""

from __future__ import annotations

import itertools
import math
import random

import pytest

from rlx_mpi.cluster.caps import NodeCaps
from rlx_mpi.config import PlacementPolicy as P
from rlx_mpi.errors import ConfigError, FitError
from rlx_mpi.cluster.placement import Assignment, format_plan, plan_placement
from rlx_mpi.model.cost import ModelCost

GB = 10**9


def make_cost(n_layers=10, layer_bytes=GB, layer_flops=1.0, embed_bytes=0, head_bytes=0,
              head_flops=0.0, kv=0, act=0, tokens=1) -> ModelCost:
    return ModelCost(n_layers=n_layers, layer_bytes=layer_bytes,
                     layer_flops_per_token=layer_flops, embed_bytes=embed_bytes,
                     head_bytes=head_bytes, head_flops_per_token=head_flops,
                     kv_bytes_per_layer=kv, act_bytes=act, tokens=tokens)


def make_caps(avail, gflops=None, hosts=None) -> list[NodeCaps]:
    n = len(avail)
    gflops = gflops if gflops is not None else [None] * n
    hosts = hosts or [f"h{r}" for r in range(n)]
    return [NodeCaps(rank=r, host=hosts[r], local_rank=0, local_size=1, cpus=4,
                     ram_total_bytes=avail[r], ram_available_bytes=avail[r], gflops=gflops[r])
            for r in range(n)]


def counts(plan: list[Assignment]) -> list[int]:
    return [len(a.layers) for a in plan]


def check_partition(plan: list[Assignment], n_layers: int, n_stages: int) -> None:
    assert len(plan) == n_stages
    stop = 0
    for s, a in enumerate(plan):
        assert a.stage == s
        assert a.layers.step == 1 and len(a.layers) >= 1
        assert a.layers.start == stop
        stop = a.layers.stop
        assert a.first == (s == 0) and a.last == (s == n_stages - 1)
    assert stop == n_layers
    placed = [i for a in plan for i in a.layers]
    assert placed == list(range(n_layers))


# -- reference model, written independently of the planner ------------------------------

def stage_caps(caps, grid, reserve):
    out = []
    for g in grid:
        av = [caps[r].ram_available_bytes for r in g]
        out.append(None if None in av else sum(a - reserve for a in av))
    return out


def stage_speeds(caps, grid):
    fl = [caps[r].gflops for g in grid for r in g]
    if any(f is None for f in fl):
        return [1.0] * len(grid)
    return [sum(caps[r].gflops for r in g) for g in grid]


def compositions(n, k):
    """All tuples of k positive ints summing to n."""
    for cuts in itertools.combinations(range(1, n), k - 1):
        b = (0, *cuts, n)
        yield tuple(b[i + 1] - b[i] for i in range(k))


def split_ranges(sizes):
    out, start = [], 0
    for n in sizes:
        out.append(range(start, start + n))
        start += n
    return out


def bottleneck(cost, ranges, speeds):
    S = len(ranges)
    return max(cost.stage_flops(rg, s == S - 1) / speeds[s] for s, rg in enumerate(ranges))


def stage_need(cost, layers, first, last, tp):
    """Bytes a stage of ``tp`` ranks holds: the cost's whole-stage bytes, with the embedding
    once per TP rank (each holds all of it) and no tied sharing under TP."""
    return cost.stage_bytes(layers, first, last) + (tp - 1) * cost.embed_bytes * first \
        + (cost.shared_end_bytes if tp > 1 and first and last else 0)


def brute_force(cost, caps, grid, reserve):
    """Best bottleneck time over all feasible contiguous splits, or None if none fits."""
    S, tp = len(grid), len(grid[0])
    cap = stage_caps(caps, grid, reserve)
    spd = stage_speeds(caps, grid)
    best = None
    for sizes in compositions(cost.n_layers, S):
        rgs = split_ranges(sizes)
        if any(cap[s] is not None and stage_need(cost, rg, s == 0, s == S - 1, tp) > cap[s]
               for s, rg in enumerate(rgs)):
            continue
        t = bottleneck(cost, rgs, spd)
        best = t if best is None else min(best, t)
    return best


def random_instance(rng: random.Random):
    L = rng.randint(1, 9)
    S = rng.randint(1, min(4, L))
    tp = rng.choice([1, 1, 2])
    cost = make_cost(n_layers=L, layer_bytes=rng.randint(1, 100),
                     layer_flops=rng.choice([0.0, rng.uniform(0.5, 10)]),
                     embed_bytes=rng.randint(0, 200), head_bytes=rng.randint(0, 200),
                     head_flops=rng.choice([0.0, rng.uniform(0, 20)]),
                     kv=rng.randint(0, 20), act=rng.randint(0, 30),
                     tokens=rng.randint(1, 4))
    per_layer = cost.layer_bytes + cost.kv_bytes_per_layer
    total = L * per_layer + S * cost.act_bytes + cost.embed_bytes + cost.head_bytes
    n = S * tp + rng.randint(0, 2)  # some ranks may be left out of the grid
    reserve = rng.choice([0, 0, rng.randint(0, 20)])
    avail = []
    for _ in range(n):
        kind = rng.random()
        if kind < 0.15:
            avail.append(None)
        elif kind < 0.6:  # tight: around an even share of the model
            avail.append(int(total / (S * tp) * rng.uniform(0.7, 1.4)) + reserve)
        else:
            avail.append(rng.randint(0, 3 * total // max(1, S * tp)) + reserve)
    gflops = [None if rng.random() < 0.1 else rng.uniform(1, 100) for _ in range(n)]
    caps = make_caps(avail, gflops)
    ranks = rng.sample(range(n), S * tp)
    grid = [ranks[s * tp:(s + 1) * tp] for s in range(S)]
    return cost, caps, grid, reserve


# -- balanced against brute force --------------------------------------------------------

def test_balanced_equals_brute_force():
    rng = random.Random(1234)
    n_fit = n_nofit = 0
    for _ in range(600):
        cost, caps, grid, reserve = random_instance(rng)
        best = brute_force(cost, caps, grid, reserve)
        if best is None:
            with pytest.raises(FitError):
                plan_placement(cost, caps, P.BALANCED, reserve, grid=grid)
            n_nofit += 1
            continue
        plan = plan_placement(cost, caps, P.BALANCED, reserve, grid=grid)
        check_partition(plan, cost.n_layers, len(grid))
        got = bottleneck(cost, [a.layers for a in plan], stage_speeds(caps, grid))
        assert math.isclose(got, best, rel_tol=1e-9, abs_tol=1e-12), (got, best)
        cap = stage_caps(caps, grid, reserve)
        for s, a in enumerate(plan):  # memory respected
            need = stage_need(cost, a.layers, a.first, a.last, len(grid[0]))
            assert cap[s] is None or need <= cap[s]
            assert a.est_bytes == -(-need // len(grid[0]))
            assert a.ranks == tuple(grid[s])
            assert a.hosts == tuple(caps[r].host for r in grid[s])
        n_fit += 1
    assert n_fit >= 200 and n_nofit >= 50  # both branches well exercised


def test_balanced_is_deterministic_and_spreads_like_uniform():
    cost = make_cost(n_layers=10)
    caps = make_caps([None] * 4)
    plan = plan_placement(cost, caps, P.BALANCED)
    assert counts(plan) == [3, 3, 2, 2]
    assert plan == plan_placement(cost, caps, P.BALANCED)


def test_balanced_favours_faster_stages_and_lightens_the_head_stage():
    cost = make_cost(n_layers=12)
    caps = make_caps([None] * 2, gflops=[1.0, 3.0])
    assert counts(plan_placement(cost, caps, P.BALANCED)) == [3, 9]
    # head costs two layers of flops: the last stage takes two fewer layers
    cost = make_cost(n_layers=12, head_flops=2.0)
    assert counts(plan_placement(cost, make_caps([None] * 2), P.BALANCED)) == [7, 5]


def test_balanced_respects_memory_over_speed():
    cost = make_cost(n_layers=10)
    # stage 1 is 9x faster but holds only 3 layers
    caps = make_caps([100 * GB, 3 * GB], gflops=[1.0, 9.0])
    plan = plan_placement(cost, caps, P.BALANCED)
    assert counts(plan) == [7, 3]


# -- every policy yields a partition ------------------------------------------------------

@pytest.mark.parametrize("policy", list(P))
def test_every_policy_places_every_layer_once(policy):
    rng = random.Random(hash(policy.value) & 0xFFFF)
    for _ in range(150):
        L = rng.randint(1, 60)
        S = rng.randint(1, min(12, L))
        cost = make_cost(n_layers=L, layer_bytes=rng.randint(1, 10**6),
                         head_flops=rng.uniform(0, 5))
        avail = [None if rng.random() < 0.1 else rng.randint(0, 10**8) for _ in range(S)]
        gflops = [None if rng.random() < 0.1 else rng.uniform(0.1, 50) for _ in range(S)]
        cuts = sorted(rng.sample(range(1, L), S - 1))
        manual = split_ranges([b - a for a, b in zip([0, *cuts], [*cuts, L])])
        caps = make_caps(avail, gflops)
        try:
            plan = plan_placement(cost, caps, policy, manual=manual, device="cuda:0")
        except FitError:
            continue
        check_partition(plan, L, S)
        assert all(a.device == "cuda:0" for a in plan)


# -- simple policies, known answers -------------------------------------------------------

def test_uniform_10_over_4():
    plan = plan_placement(make_cost(n_layers=10), make_caps([None] * 4), P.UNIFORM)
    assert counts(plan) == [3, 3, 2, 2]
    assert [a.layers for a in plan] == [range(0, 3), range(3, 6), range(6, 8), range(8, 10)]


@pytest.mark.parametrize("weights, L, expected", [
    ([10, 30], 8, [2, 6]),
    ([50, 30, 20], 7, [4, 2, 1]),  # quotas 3.5, 2.1, 1.4: the remainder goes to stage 0
    ([1, 1, 1], 10, [4, 3, 3]),  # equal remainders: the earlier stage
    ([1, 100], 5, [1, 4]),  # a stage whose quota rounds to 0 still gets one layer
])
def test_memory_and_compute_are_proportional(weights, L, expected):
    cost = make_cost(n_layers=L, layer_bytes=1)
    mem = plan_placement(cost, make_caps([w * GB for w in weights]), P.MEMORY)
    assert counts(mem) == expected
    big = [1000 * GB] * len(weights)
    comp = plan_placement(cost, make_caps(big, gflops=[float(w) for w in weights]), P.COMPUTE)
    assert counts(comp) == expected


def test_memory_subtracts_the_reserve():
    cost = make_cost(n_layers=8, layer_bytes=1)
    # 12 and 32 GB minus a 2 GB reserve: 10:30
    assert counts(plan_placement(cost, make_caps([12 * GB, 32 * GB]), P.MEMORY,
                                 2 * GB)) == [2, 6]


def test_unknown_memory_or_speed_falls_back_to_uniform():
    cost = make_cost(n_layers=10, layer_bytes=1)
    assert counts(plan_placement(cost, make_caps([GB, None, 9 * GB, GB]), P.MEMORY)) == [3, 3, 2, 2]
    caps = make_caps([GB] * 4, gflops=[1.0, 50.0, None, 1.0])
    assert counts(plan_placement(cost, caps, P.COMPUTE)) == [3, 3, 2, 2]


def test_manual_ranges_are_used():
    plan = plan_placement(make_cost(n_layers=10), make_caps([None] * 3), P.MANUAL,
                          manual=[range(0, 1), range(1, 8), range(8, 10)])
    assert counts(plan) == [1, 7, 2]


@pytest.mark.parametrize("manual, words", [
    (None, "no layer ranges"),
    ([range(0, 5), range(5, 10)], "2 ranges for 3 stages"),
    ([range(0, 3), range(4, 7), range(7, 10)], "gap"),
    ([range(0, 4), range(3, 7), range(7, 10)], "overlap"),
    ([range(1, 4), range(4, 7), range(7, 10)], "gap: layers 0:1"),
    ([range(0, 3), range(3, 7), range(7, 9)], "stop at layer 9"),
    ([range(0, 3), range(3, 7), range(7, 12)], "only 10 layers"),
    ([range(0, 3), range(3, 3), range(3, 10)], "empty"),
    ([range(0, 3), range(3, 7, 2), range(7, 10)], "step 1"),
])
def test_manual_errors(manual, words):
    with pytest.raises(ConfigError) as e:
        plan_placement(make_cost(n_layers=10), make_caps([None] * 3), P.MANUAL, manual=manual)
    assert e.value.where == "[placement] manual"
    assert words in e.value.what
    assert e.value.fix and e.value.exit_code == 2


# -- fitting ------------------------------------------------------------------------------

def test_fit_error_states_the_shortfall():
    cost = make_cost(n_layers=12)  # 12 GB of layers
    with pytest.raises(FitError) as e:
        plan_placement(cost, make_caps([5 * GB, 5 * GB]), P.BALANCED)
    err = e.value
    assert err.exit_code == 3 and err.where == "placement"
    assert "12.00 GB" in err.what and "10.00 GB" in err.what and "2.00 GB short" in err.what
    assert "--mem-gb" in err.fix and "ranks" in err.fix


def test_fit_error_when_one_stage_cannot_hold_a_layer():
    cost = make_cost(n_layers=4, embed_bytes=3 * GB)
    with pytest.raises(FitError) as e:  # plenty in total, but stage 0 must hold the embedding
        plan_placement(cost, make_caps([3 * GB, 100 * GB]), P.BALANCED)
    assert "stage 0" in e.value.what and "1.00 GB short" in e.value.what


def test_fit_error_with_fixed_policy_names_the_stage_and_suggests_balanced():
    cost = make_cost(n_layers=10)
    caps = make_caps([4 * GB, 20 * GB])
    with pytest.raises(FitError) as e:
        plan_placement(cost, caps, P.UNIFORM)
    assert "stage 0 (ranks 0, layers 0:5) needs 5.00 GB but has 4.00 GB" in e.value.what
    assert "balanced" in e.value.fix
    assert counts(plan_placement(cost, caps, P.BALANCED)) == [4, 6]


def test_reserve_can_make_it_not_fit():
    cost = make_cost(n_layers=4)
    caps = make_caps([2 * GB, 2 * GB])
    assert counts(plan_placement(cost, caps, P.BALANCED)) == [2, 2]
    with pytest.raises(FitError):
        plan_placement(cost, caps, P.BALANCED, reserve_bytes=GB // 2)


def test_tensor_parallel_grid_sums_memory_and_splits_bytes():
    cost = make_cost(n_layers=10, layer_bytes=3 * GB)  # 15 GB per stage of 5 layers
    caps = make_caps([8 * GB] * 4, gflops=[1.0] * 4, hosts=["a", "a", "b", "b"])
    with pytest.raises(FitError):  # one rank per stage: 8 GB < 15 GB
        plan_placement(cost, caps[:2], P.BALANCED)
    plan = plan_placement(cost, caps, P.BALANCED, grid=[[0, 1], [2, 3]])
    assert counts(plan) == [5, 5]
    assert [a.ranks for a in plan] == [(0, 1), (2, 3)]
    assert [a.hosts for a in plan] == [("a", "a"), ("b", "b")]
    assert all(a.est_bytes == 15 * GB // 2 for a in plan)
    plan = plan_placement(cost, caps, P.UNIFORM, grid=[[0, 1], [2, 3]])
    assert all(a.est_bytes == math.ceil(15 * GB / 2) for a in plan)


def test_est_bytes_rounds_up():
    cost = make_cost(n_layers=3, layer_bytes=1)
    plan = plan_placement(cost, make_caps([None] * 2), P.UNIFORM, grid=[[0, 1]])
    assert plan[0].est_bytes == 2


# -- bad grids ----------------------------------------------------------------------------

def test_more_stages_than_layers():
    with pytest.raises(ConfigError) as e:
        plan_placement(make_cost(n_layers=3), make_caps([None] * 4), P.UNIFORM)
    assert "4 stages (4 ranks / tp 1) but the model has only 3 layers" in e.value.what
    assert "at most 3 stages" in e.value.fix


@pytest.mark.parametrize("caps, grid", [
    ([], None),
    (make_caps([None] * 4), [[0, 1], [2]]),
    (make_caps([None] * 4), []),
    (make_caps([None] * 4), [[0, 1], [1, 2]]),
    (make_caps([None] * 4), [[0], [4]]),
])
def test_bad_grids(caps, grid):
    with pytest.raises(ConfigError):
        plan_placement(make_cost(), caps, P.BALANCED, grid=grid)


def test_unknown_policy_and_negative_reserve():
    with pytest.raises(ConfigError):
        plan_placement(make_cost(), make_caps([None]), "fastest")
    with pytest.raises(ConfigError):
        plan_placement(make_cost(), make_caps([None]), P.UNIFORM, -1)
    assert counts(plan_placement(make_cost(), make_caps([None]), "uniform")) == [10]


# -- a 70B-sized model ----------------------------------------------------------------------

def llama70b_cost() -> ModelCost:
    hidden, inter, heads, kv_heads, vocab, nbytes = 8192, 28672, 64, 8, 128256, 2
    head_dim = hidden // heads
    attn = 2 * hidden * hidden + 2 * hidden * kv_heads * head_dim
    layer_params = attn + 3 * hidden * inter + 2 * hidden
    seq = 4096
    return ModelCost(n_layers=80, layer_bytes=layer_params * nbytes,
                     layer_flops_per_token=2.0 * layer_params,
                     embed_bytes=vocab * hidden * nbytes,
                     head_bytes=(vocab * hidden + hidden) * nbytes,
                     head_flops_per_token=2.0 * vocab * hidden,
                     kv_bytes_per_layer=2 * kv_heads * head_dim * seq * nbytes,
                     act_bytes=seq * (hidden + inter) * 4, tokens=1)


def test_70b_fits_16_ranks_in_4_stages_of_tp4():
    cost = llama70b_cost()
    assert 1.70e9 < cost.layer_bytes < 1.72e9
    caps = make_caps([64 * GB] * 16, hosts=[f"node{r // 4}" for r in range(16)])
    grid = [list(range(4 * s, 4 * s + 4)) for s in range(4)]
    plan = plan_placement(cost, caps, P.BALANCED, 4 * GB, grid=grid)
    check_partition(plan, 80, 4)
    assert all(19 <= n <= 21 for n in counts(plan)), counts(plan)
    assert all(a.est_bytes <= 60 * GB for a in plan)
    for policy in (P.UNIFORM, P.MEMORY, P.COMPUTE):
        assert counts(plan_placement(cost, caps, policy, 4 * GB, grid=grid)) == [20] * 4
    table = format_plan(plan, cost)
    assert "0,1,2,3" in table and "node0" in table and "0:" in table


def test_70b_does_not_fit_2_ranks():
    with pytest.raises(FitError) as e:
        plan_placement(llama70b_cost(), make_caps([64 * GB] * 2), P.BALANCED)
    assert "128.00 GB" in e.value.what and "short" in e.value.what


# -- the table ----------------------------------------------------------------------------

def test_format_plan():
    cost = make_cost(n_layers=10, layer_bytes=GB)
    caps = make_caps([None] * 4, hosts=["a", "a", "b", "b"])
    plan = plan_placement(cost, caps, P.UNIFORM, grid=[[0, 1], [2, 3]])
    lines = format_plan(plan).splitlines()
    assert lines[0].split() == ["stage", "ranks", "hosts", "layers", "n_layers", "device", "precision", "est/rank"]
    assert lines[1].split() == ["0", "0,1", "a", "0:5", "5", "cpu", "f32", "2.50", "GB"]
    assert lines[2].split() == ["1", "2,3", "b", "5:10", "5", "cpu", "f32", "2.50", "GB"]
    assert len(lines) == 3
    assert "10 layers" in format_plan(plan, cost).splitlines()[-1]


# -- per-rank precision --------------------------------------------------------------------

def test_bf16_stage_takes_more_layers_when_memory_binds():
    cost = make_cost(n_layers=12, layer_bytes=GB)  # priced in f32
    caps = make_caps([5 * GB, 10 * GB])
    with pytest.raises(FitError):  # all f32: 15 GB hold 15 of 16 layers
        plan_placement(make_cost(n_layers=16, layer_bytes=GB), caps, P.BALANCED)
    plan = plan_placement(cost, make_caps([5 * GB, 5 * GB]), P.BALANCED, precision=["f32", "bf16"])
    assert counts(plan) == [5, 7]  # equal speeds would give 6/6; stage 0 fits only 5 f32 layers
    assert [a.precision for a in plan] == ["f32", "bf16"]
    assert plan[1].est_bytes == 7 * GB // 2
    plan = plan_placement(cost, make_caps([5 * GB, 5 * GB]), P.MEMORY, precision=["int8", "bf16"])
    assert counts(plan) == [8, 4]  # layers that fit: 20 and 10


def test_mixed_tp_group_counts_mean_bytes_and_names_both():
    cost = make_cost(n_layers=4, layer_bytes=GB)
    plan = plan_placement(cost, make_caps([None] * 4), P.UNIFORM, grid=[[0, 1], [2, 3]],
                          precision=["f32", "int8", "bf16", "bf16"])
    assert [a.precision for a in plan] == ["f32,int8", "bf16"]
    int8 = (1 + 4 / 64) / 4  # a byte per weight and a float32 scale per 64 weights, priced against f32
    assert plan[0].est_bytes == int(2 * GB * (1 + int8) / 2) // 2 and plan[1].est_bytes == GB // 2
    assert Assignment.from_dict(plan[0].to_dict()) == plan[0]
    with pytest.raises(ConfigError, match="3 precisions for 4 ranks"):
        plan_placement(cost, make_caps([None] * 4), P.UNIFORM, precision=["f32"] * 3)


def test_tp_ranks_of_the_first_stage_each_hold_the_whole_embedding():
    """LlamaStage replicates the embedding on every TP rank (sharding it would need a collective
    per lookup) and shards the head: a rank's estimate is its 1/tp of the layers and head plus
    the whole embedding, and a memory that fits the 1/tp share but not the copy is refused."""
    cost = make_cost(n_layers=4, layer_bytes=2 * GB, embed_bytes=4 * GB, head_bytes=4 * GB)
    plan = plan_placement(cost, make_caps([100 * GB] * 4), P.UNIFORM, grid=[[0, 1], [2, 3]])
    assert [a.est_bytes for a in plan] == [2 * GB + 4 * GB, 2 * GB + 2 * GB]  # layers/2 + embed; layers/2 + head/2
    one = plan_placement(cost, make_caps([100 * GB]), P.UNIFORM)
    assert one[0].est_bytes == 8 * GB + 4 * GB + 4 * GB  # tp 1: unchanged
    with pytest.raises(FitError):  # 2 + 4 GB needed on each rank of stage 0; the 1/tp view said 4
        plan_placement(cost, make_caps([5 * GB] * 4), P.UNIFORM, grid=[[0, 1], [2, 3]])


def test_the_planner_balances_step_cost_of_the_drivers_planned_step():
    """A stage's time is `step_cost`'s FLOPs of the planned step (issue 42: one price for plan,
    planner and simulator): a forward of every position for run/score, a decode step for generate.
    SmolLM2's shape (30 layers, a head of ~8 layers) at seq 4,096: causal attention (each position
    attends its past, as `step_cost` prices it) leaves the last stage 4 layers where pricing every
    position's attention at the full seq left it 5."""
    from rlx_mpi.families.decoder.arch import Arch
    from rlx_mpi.model.cost import decoding, step_cost

    cfg = Arch(hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3,
               num_hidden_layers=30, vocab_size=49152, max_position_embeddings=8192, tie_word_embeddings=True)
    forward = cfg.cost(1, 4096)
    assert forward.planned_step() == [(4096, 0)]
    assert decoding(cfg.cost(8, 4096)).planned_step() == [(1, 2048)] * 8
    for cost, every in ((forward, True), (decoding(forward), False)):
        for n, last in ((0, True), (7, False), (7, True)):
            want = step_cost(cost, n, cost.planned_step(), last=last, every=every).flops
            assert cost.stage_flops(range(n), last) == pytest.approx(want, rel=1e-12)
    caps = make_caps([None] * 4)
    got = counts(plan_placement(forward, caps, P.BALANCED))
    best = min(compositions(30, 4), key=lambda c: bottleneck(forward, split_ranges(c), [1.0] * 4))
    assert bottleneck(forward, split_ranges(got), [1.0] * 4) == pytest.approx(
        bottleneck(forward, split_ranges(best), [1.0] * 4))
    assert got == [9, 9, 8, 4]
    full_seq = make_cost(n_layers=30, layer_flops=forward.layer_flops_per_token,
                         head_flops=forward.head_flops_per_token)  # attention at the full seq for every position
    assert counts(plan_placement(full_seq, caps, P.BALANCED)) == [9, 8, 8, 5]
