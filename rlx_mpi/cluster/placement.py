"""Which contiguous layer range each pipeline stage holds. Pure: no MPI here.

Note: a *stage* is a group of ``tp`` ranks that hold the same layers, each a 1/tp shard of
them (tensor parallelism). The planner sees a stage's memory as the sum of its ranks' and its
speed as the sum of their measured GFLOP/s; layer ranges are integer ``range``s in stage
order, every layer placed exactly once, never float fractions.
"""

from __future__ import annotations

import dataclasses
import heapq
from dataclasses import dataclass
from fractions import Fraction
from typing import Callable, Sequence

from .. import rules
from .caps import NodeCaps
from ..config import PlacementPolicy, Precision
from ..errors import ConfigError, FitError
from ..model.cost import ModelCost

__all__ = ["Assignment", "plan_placement", "format_plan", "GridPlan", "plan_grid"]


@dataclass(frozen=True)
class Assignment:
    """One pipeline stage of the plan."""

    stage: int
    ranks: tuple[int, ...]  # world ranks of the stage's tensor-parallel group, tp order
    hosts: tuple[str, ...]  # host of each rank in ``ranks``
    layers: range
    device: str
    est_bytes: int  # estimated resident bytes per rank (stage bytes / tp)
    first: bool
    last: bool
    precision: str = "f32"  # weight precision of the stage's ranks, e.g. "bf16" or "f32,int8" when mixed
    replica: int = 0  # the data-parallel replica (whole pipeline) the stage belongs to

    def to_dict(self) -> dict:
        return {"stage": self.stage, "ranks": list(self.ranks), "hosts": list(self.hosts),
                "layers": [self.layers.start, self.layers.stop], "device": self.device,
                "est_bytes": self.est_bytes, "first": self.first, "last": self.last,
                "precision": self.precision, "replica": self.replica}

    @classmethod
    def from_dict(cls, d: dict) -> "Assignment":
        return cls(stage=d["stage"], ranks=tuple(d["ranks"]), hosts=tuple(d["hosts"]),
                   layers=range(*d["layers"]), device=d["device"], est_bytes=d["est_bytes"],
                   first=d["first"], last=d["last"], precision=d.get("precision", "f32"),
                   replica=d.get("replica", 0))


# Note: the planner's model of a stage.
#   capacity(stage) = sum over its ranks of (ram_available_bytes - reserve_bytes), or None
#                     (unknown, never limiting) if any rank's ram_available_bytes is None;
#   speed(stage)    = sum of its ranks' gflops; if any rank of any stage has no (or a
#                     non-positive) gflops, every stage gets speed 1.0 (FLOPs are balanced);
#   time(stage)     = cost.stage_flops(layers, last) / speed  (the embedding is a lookup): the
#                     FLOPs of the driver's planned step (`ModelCost.planned_step`: a forward of
#                     every position for run and score, a decode step for generate) as
#                     `model.cost.step_cost` prices it for ``plan --simulate``.
# Every layer costs the same, so a stage's bytes and time depend only on its layer *count*
# and on whether it is first/last; the exact balanced optimum is then found by a greedy
# (see _balanced_counts) rather than a DP over split points.

MAX_LAYERS = 100_000  # 100x the deepest real decoders; planning it takes ~0.1 s

_FIX_FIT = ("add ranks, raise --mem-gb, lower reserve_ram_gb, use tensor parallelism "
            "(tp > 1) or lower-precision weights ([run] precision = \"bf16\" or \"int8\")")


def _gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB" if abs(n) >= 1e9 else f"{n / 1e6:.2f} MB"


def _ranks_str(ranks: Sequence[int]) -> str:
    return ",".join(str(r) for r in ranks)


def _check_grid(caps: Sequence[NodeCaps],
                grid: Sequence[Sequence[int]] | None) -> list[tuple[int, ...]]:
    if len(caps) == 0:
        raise ConfigError("placement", "no ranks to place the model on (caps is empty)",
                          "run with at least one MPI rank")
    if grid is None:
        return [(r,) for r in range(len(caps))]
    stages = [tuple(g) for g in grid]
    if not stages:
        raise ConfigError("placement", "the stage grid is empty", "give at least one stage")
    widths = sorted({len(g) for g in stages})
    if len(widths) != 1 or widths[0] < 1:
        raise ConfigError("placement",
                          f"the stage grid has stages of widths {widths}; every stage needs "
                          "the same number (tp >= 1) of ranks",
                          "make the world size a multiple of tp")
    seen: set[int] = set()
    for s, g in enumerate(stages):
        for r in g:
            if not isinstance(r, int) or not 0 <= r < len(caps):
                raise ConfigError("placement",
                                  f"stage {s} names rank {r!r} but ranks are 0..{len(caps) - 1}",
                                  "use world ranks that exist")
            if r in seen:
                raise ConfigError("placement", f"rank {r} is in more than one stage",
                                  "put each rank in one stage only")
            seen.add(r)
    return stages


def _capacities(caps: Sequence[NodeCaps], stages: list[tuple[int, ...]],
                reserve_bytes: int) -> list[int | None]:
    out: list[int | None] = []
    for g in stages:
        avail = [caps[r].ram_available_bytes for r in g]
        out.append(None if any(a is None for a in avail)
                   else sum(max(a - reserve_bytes, 0) for a in avail))  # a reserve above RAM leaves 0
    return out


def _speeds(caps: Sequence[NodeCaps], stages: list[tuple[int, ...]]) -> list[float] | None:
    """Stage speeds, or None when any is unknown (then all stages count as equally fast)."""
    flops = [[caps[r].gflops for r in g] for g in stages]
    if any(f is None or f <= 0 for g in flops for f in g):
        return None
    return [float(sum(g)) for g in flops]


def _weight_scales(precision: Sequence[str] | None, stages: list[tuple[int, ...]],
                   held: tuple[tuple[str, float], ...] = ()) -> list[float]:
    """Per stage, the mean over its ranks of (bytes per weight / 4), or the checkpoint's measured
    ratio (``held``, `ModelCost.held_scales`): the cost is priced in float32, and a stage's memory
    is the sum of its ranks' (each holds 1/tp of the weights)."""
    if precision is None:
        return [1.0] * len(stages)
    measured = dict(held)
    per_rank = [measured.get(Precision(rules.precision_name(p, "placement precision")).value,
                             Precision(rules.precision_name(p, "placement precision")).bytes_per_param / 4.0)
                for p in precision]
    return [sum(per_rank[r] for r in g) / len(g) for g in stages]



def _stage_precision(precision: Sequence[str] | None, ranks: tuple[int, ...]) -> str:
    if precision is None:
        return "f32"
    return ",".join(dict.fromkeys(rules.precision_name(precision[r], "placement precision") for r in ranks))


def _max_layers(cost: ModelCost, cap: int | None, first: bool, last: bool, scale: float = 1.0) -> int:
    """Most layers (at most n_layers) a stage of capacity ``cap`` can hold; < 1 if none."""
    L = cost.n_layers
    if cap is None:
        return L
    fixed = cost.stage_bytes(range(0), first, last, scale)
    per = cost.layer_cost_bytes(scale)
    if fixed > cap:
        return -1
    if per <= 0:
        return L
    return min(L, (cap - fixed) // per)


def _proportional(L: int, weights: Sequence[int | float]) -> list[int]:
    """Largest-remainder apportionment of L layers by weight, every part >= 1.

    Quotas are exact (Fractions). Remainder layers go to the largest fractional parts, ties
    to the earlier stage. A stage left at 0 then takes one layer from the stage furthest
    above its quota (ties: the later stage)."""
    S = len(weights)
    w = [Fraction(max(x, 0)) for x in weights]
    total = sum(w)
    if total == 0:
        return _uniform_counts(L, S)
    quota = [L * x / total for x in w]
    counts = [int(q) for q in quota]  # floor: quotas are >= 0
    order = sorted(range(S), key=lambda s: (-(quota[s] - counts[s]), s))
    for s in order[:L - sum(counts)]:
        counts[s] += 1
    for s in range(S):
        while counts[s] < 1:
            donor = max((d for d in range(S) if counts[d] > 1),
                        key=lambda d: (counts[d] - quota[d], d))
            counts[donor] -= 1
            counts[s] += 1
    return counts


def _uniform_counts(L: int, S: int) -> list[int]:
    q, r = divmod(L, S)
    return [q + 1 if s < r else q for s in range(S)]


def _balanced_counts(cost: ModelCost, max_layers: list[int],
                     speeds: list[float]) -> list[int]:
    """Exact minimum of the slowest stage's time, each stage within ``max_layers``.

    Every stage starts with one layer; then, L - S times, one layer goes to the stage whose
    time *after* taking it is smallest (ties: the earliest stage), among stages still below
    their memory limit. Stage time is nondecreasing in its layer count, so the values taken
    come out in nondecreasing order and are the L - S smallest increments available: no
    split has a smaller bottleneck. This is also the tie-break among optimal plans: equal
    stages get the uniform split (10 over 4 -> 3,3,2,2), faster stages get more layers.
    Caller guarantees max_layers[s] >= 1 and sum(max_layers) >= L."""
    S, L = len(max_layers), cost.n_layers
    last = S - 1
    layer, head = cost.stage_flops(range(1), False), cost.stage_flops(range(0), True)  # (linear in the count)

    def t(s: int, n: int) -> float:
        return (n * layer + (head if s == last else 0.0)) / speeds[s]

    counts = [1] * S
    heap = [(t(s, 2), s) for s in range(S) if max_layers[s] >= 2]
    heapq.heapify(heap)
    for _ in range(L - S):
        _, s = heapq.heappop(heap)
        counts[s] += 1
        if counts[s] < max_layers[s]:
            heapq.heappush(heap, (t(s, counts[s] + 1), s))
    return counts


def _check_manual(manual: Sequence[range] | None, L: int, S: int) -> list[int]:
    where = "[placement] manual"
    if manual is None:
        raise ConfigError(where, "policy is 'manual' but no layer ranges were given",
                          'add manual = ["0:4", "4:8"], one "a:b" per stage')
    ranges = list(manual)
    for s, rg in enumerate(ranges):  # a job file's ranges are such; a caller's own may not be
        if not isinstance(rg, range) or rg.step != 1 or len(rg) == 0:
            raise ConfigError(where, f"stage {s} range {rg!r} is not a non-empty range with step 1",
                              'give "a:b" ranges with a < b')
    rules.manual_ranges_tile(ranges, where, n_layers=L, stages=S)
    return [len(rg) for rg in ranges]


def _no_fit_balanced(cost: ModelCost, stages: list[tuple[int, ...]],
                     capacities: list[int | None], max_layers: list[int],
                     scales: list[float] | None = None) -> FitError:
    S, L = len(stages), cost.n_layers
    scales = scales or [1.0] * S
    mean = sum(scales) / S  # the layers' bytes at the stages' average precision
    need = sum(cost.stage_bytes(range(0), s == 0, s == S - 1, scales[s]) for s in range(S)) + L * (
        cost.layer_cost_bytes(mean))
    known = [c for c in capacities if c is not None]
    have = (f"the {S} stages have {_gb(sum(known))}" if len(known) == S else
            f"the {len(known)} stages of known memory have {_gb(sum(known))}")
    head = f"the model needs {_gb(need)} but {have}"
    if len(known) == S and need > sum(known):
        head += f" ({_gb(need - sum(known))} short)"
    small = [s for s in range(S) if max_layers[s] < 1]
    if small:
        one = {s: cost.stage_bytes(range(1), s == 0, s == S - 1, scales[s]) for s in small}
        cap = {s: capacities[s] or 0 for s in small}  # known: unknown stages never lack room
        s = max(small, key=lambda s: (one[s] - cap[s], -s))  # the worst, earliest on ties
        what = (f"{head}; stage {s} (ranks {_ranks_str(stages[s])}) has {_gb(cap[s])} "
                f"but one layer there needs {_gb(one[s])} ({_gb(one[s] - cap[s])} short)")
    else:
        what = (f"{head}; the stages hold at most {sum(max_layers)} of the {L} layers "
                f"(one layer is {_gb(cost.layer_cost_bytes(mean))})")
    return FitError("placement", what, _FIX_FIT)


def plan_placement(cost: ModelCost, caps: Sequence[NodeCaps], policy: PlacementPolicy,
                   reserve_bytes: int = 0, *, grid: Sequence[Sequence[int]] | None = None,
                   manual: Sequence[range] | None = None, device: str = "cpu",
                   precision: Sequence[str] | None = None) -> list[Assignment]:
    """Split ``cost.n_layers`` layers into contiguous ranges, one per stage of ``grid``.

    ``caps`` holds one NodeCaps per world rank (index = rank); ``grid`` lists the stages in
    pipeline order, each the world ranks of its tensor-parallel group (default: one rank per
    stage, ``[[0], [1], ...]``); ``reserve_bytes`` is kept free on every rank; ``manual``
    is used by the manual policy only; ``precision`` gives each world rank's weight precision
    ("f32", "bf16", "f16", "int8", "q4"; default all f32, which is what ``cost`` is priced in), so a
    16-bit stage counts half the weight bytes and can take more layers. Raises ConfigError for a bad grid or manual ranges and
    FitError when a stage would not fit its memory.

    >>> # 4 ranks, tp=2: stage 0 = ranks 0,1, stage 1 = ranks 2,3
    >>> # plan_placement(cost, caps, PlacementPolicy.BALANCED, grid=[[0, 1], [2, 3]])
    """
    try:
        policy = PlacementPolicy(policy)
    except ValueError:
        raise ConfigError("placement.policy", f"unknown policy {policy!r}",
                          "use one of " + ", ".join(p.value for p in PlacementPolicy)) from None
    if reserve_bytes < 0:
        raise ConfigError("placement", f"reserve_bytes is {reserve_bytes}, below 0",
                          "reserve zero or more bytes")
    if not 0 < cost.n_layers <= MAX_LAYERS:  # the planner is linear in layers: refuse, don't compute for minutes
        raise ConfigError("placement", f"the model has {cost.n_layers} layers",
                          f"rlx_mpi plans 1 to {MAX_LAYERS} layers; check the model shape")
    stages = _check_grid(caps, grid)
    S, L, tp = len(stages), cost.n_layers, len(stages[0])
    cost = cost.under_tp(tp)
    if S > L:
        rules.stages_fit_layers(len(caps), len(caps) // S, L, "placement")
    if precision is not None and len(precision) != len(caps):
        raise ConfigError("placement", f"{len(precision)} precisions for {len(caps)} ranks",
                          "give one precision per world rank")
    capacities = _capacities(caps, stages, reserve_bytes)
    speeds = _speeds(caps, stages)
    scales = _weight_scales(precision, stages, cost.held_scales)
    max_layers = [_max_layers(cost, capacities[s], s == 0, s == S - 1, scales[s]) for s in range(S)]
    fits = all(m >= 1 for m in max_layers) and sum(max_layers) >= L

    if policy is PlacementPolicy.BALANCED:
        if not fits:
            raise _no_fit_balanced(cost, stages, capacities, max_layers, scales)
        counts = _balanced_counts(cost, max_layers, speeds or [1.0] * S)
    elif policy is PlacementPolicy.UNIFORM:
        counts = _uniform_counts(L, S)
    elif policy is PlacementPolicy.MEMORY:
        counts = (_uniform_counts(L, S) if any(c is None for c in capacities)  # layers that fit, not bytes:
                  else _proportional(L, [Fraction(c) / Fraction(scales[s]) for s, c in enumerate(capacities)]))
    elif policy is PlacementPolicy.COMPUTE:
        counts = _uniform_counts(L, S) if speeds is None else _proportional(L, speeds)
    else:
        counts = _check_manual(manual, L, S)
    assert len(counts) == S and sum(counts) == L and min(counts) >= 1, counts

    plan: list[Assignment] = []
    start = 0
    for s, (g, n) in enumerate(zip(stages, counts)):
        layers = range(start, start + n)
        start += n
        first, last = s == 0, s == S - 1
        need = cost.stage_bytes(layers, first, last, scales[s])
        cap = capacities[s]
        if cap is not None and need > cap:
            fix = ("placement policy 'balanced' fits this model on these ranks" if fits
                   else _FIX_FIT)
            raise FitError("placement",
                           f"stage {s} (ranks {_ranks_str(g)}, layers {layers.start}:"
                           f"{layers.stop}) needs {_gb(need)} but has {_gb(cap)} "
                           f"({_gb(need - cap)} short) under policy '{policy.value}'", fix)
        plan.append(Assignment(stage=s, ranks=g, hosts=tuple(caps[r].host for r in g),
                               layers=layers, device=device, est_bytes=-(-need // tp),
                               first=first, last=last, precision=_stage_precision(precision, g)))
    return plan


def format_plan(plan: Sequence[Assignment], cost: ModelCost | None = None) -> str:
    """The plan as a plain-text table, one row per stage (``rlx-mpi plan`` prints it); with
    more than one replica, a first column names each stage's replica.

    With ``cost``, a last line gives the model's layer count and total resident bytes (of one
    replica, and of all of them)."""
    n_rep = 1 + max((a.replica for a in plan), default=0)
    header = ("stage", "ranks", "hosts", "layers", "n_layers", "device", "precision", "est/rank")
    rows = [(("replica",) if n_rep > 1 else ()) + header]
    for a in plan:
        hosts = ",".join(dict.fromkeys(a.hosts))  # unique, in rank order
        rows.append(((str(a.replica),) if n_rep > 1 else ()) + (
            str(a.stage), _ranks_str(a.ranks), hosts, f"{a.layers.start}:{a.layers.stop}", str(len(a.layers)),
            a.device, a.precision, _gb(a.est_bytes)))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    right = {i + (n_rep > 1) for i in (0, 4, 7)} | ({0} if n_rep > 1 else set())  # numeric columns
    lines = ["  ".join(c.rjust(w) if i in right else c.ljust(w)
                       for i, (c, w) in enumerate(zip(r, widths))).rstrip() for r in rows]
    if cost is not None:
        total = sum(a.est_bytes * len(a.ranks) for a in plan if a.replica == 0)
        stages = sum(a.replica == 0 for a in plan)
        if n_rep == 1:
            lines.append(f"{stages} stages, {cost.n_layers} layers, {_gb(total)} estimated in total")
        else:
            lines.append(f"{n_rep} replicas x {stages} {_plural(stages, 'stage')}, {cost.n_layers} layers, {_gb(total)} estimated in "
                         f"total per replica ({_gb(total * n_rep)} for all {n_rep})")
    return "\n".join(lines)


@dataclass(frozen=True)
class GridPlan:
    """The placement of every replica (each a list of stages, as `plan_placement` returns) and
    why the grid is what it is (one line ``plan`` prints)."""

    replicas: list[list[Assignment]]
    why: str

    @property
    def flat(self) -> list[Assignment]:
        """Every stage of every replica, replica by replica."""
        return [a for rep in self.replicas for a in rep]

    @property
    def n_stages(self) -> int:
        return len(self.replicas[0])


# Note: replicas = "auto". A replica is a whole pipeline; every replica holds the whole model,
# so the fewest stages whose memory holds it (with the KV cache the job needs, priced at that
# stage count: `cost_for`) leaves the most ranks for more replicas, and replicas exchange no
# hidden states at all. So auto tries stage counts 1, 2, ... (divisors of the TP-group count,
# every replica alike) and takes the first at which every replica fits. It cannot move ranks
# between hosts, but it says so when a host runs several replicas: decode reads every weight
# once per step for all the rows of a step, so one rank per host with all the host's cores
# (and a larger batch) beats k one-core replicas on one host, which read the weights k times
# over the same memory bus (two one-core decode jobs side by side reach ~1.3x one on the
# 2-core VM, not 2x).

def plan_grid(cost_for: "ModelCost | Callable[[int], ModelCost]", caps: Sequence[NodeCaps],
              policy: PlacementPolicy, reserve_bytes: int = 0, *, tp: int = 1, replicas: "int | str" = 1,
              manual: Sequence[range] | None = None, device: str = "cpu",
              precision: Sequence[str] | None = None, where: str = "placement replicas") -> GridPlan:
    """Place ``replicas`` whole pipelines (an integer, or "auto": the note above) of ``tp``-rank
    stages over the ranks of ``caps``, each planned by `plan_placement`.

    ``cost_for`` is the cost, or a function of the stage count giving it (a job whose KV cache
    grows with its stages, as generate's one group per stage does). Raises as `plan_placement`;
    under auto, the error of the last stage count tried (one replica over every rank).

    >>> # 8 ranks of 64 GB, Llama-3-8B in bf16 (16 GB): 8 replicas of one stage
    >>> # plan_grid(cost, caps, PlacementPolicy.BALANCED, replicas="auto").n_stages == 1
    """
    from ..comm.topology import make_grid, replica_grids

    hosts = [c.host for c in caps]
    grid = make_grid(hosts, tp)
    groups = len(grid)
    cost_of = cost_for if callable(cost_for) else (lambda _s: cost_for)
    split = next((g for g in grid if len({hosts[r] for r in g}) > 1), None)
    if split is not None and replicas != 1:  # (one replica keeps the pooled leftovers of `make_grid`)
        on = sorted({hosts[r] for r in split})
        raise ConfigError(where, f"the tp group of ranks {_ranks_str(split)} would span hosts {', '.join(on)} (a "
                          f"host's rank count is not a multiple of tp {tp})", f"launch a multiple of {tp} ranks on "
                          "every host: a TP group all-reduces every layer and must stay on one host")

    def place(n_rep: int) -> list[list[Assignment]]:
        grids = replica_grids(hosts, tp, n_rep)
        cost = cost_of(len(grids[0]))
        return [[dataclasses.replace(a, replica=r) for a in
                 plan_placement(cost, caps, policy, reserve_bytes, grid=grid, manual=manual, device=device,
                                precision=precision)] for r, grid in enumerate(grids)]

    if replicas != "auto":
        rules.replicas_divide(len(caps), tp, replicas, where)
        reps = place(replicas)
        S = len(reps[0])
        return GridPlan(reps, f"{replicas} {_plural(replicas, 'replica')} x {S} {_plural(S, 'stage')} x tp {tp}"
                        f" (replicas = {replicas})")
    n_layers = cost_of(1).n_layers
    if manual:
        counts = [len(manual)] if groups % len(manual) == 0 else []
    else:
        counts = [s for s in range(1, min(groups, n_layers) + 1) if groups % s == 0]
    if not counts:
        raise ConfigError(where, f"auto finds no stage count: {len(manual or ())} manual ranges do not divide "
                          f"the {groups} stages of tp {tp}", "give replicas = N, or manual ranges whose count divides "
                          "the stage count")
    first_miss: FitError | None = None
    for S in counts:
        try:
            reps = place(groups // S)
        except FitError as e:
            if S == counts[-1]:
                raise
            first_miss = first_miss or e
            continue
        R = len(reps)
        why = (f"replicas auto: {R} {_plural(R, 'replica')} x {S} {_plural(S, 'stage')} x tp {tp}; "
               f"{S} {_plural(S, 'stage')} of tp {tp} {'is' if S == 1 else 'are'} the fewest that hold the model")
        if first_miss is not None:
            why += f" (with fewer: {first_miss.what})"
        why += _per_host_advice(hosts, tp, R)
        return GridPlan(reps, why)
    raise AssertionError("unreachable")  # the last count raised or returned


def _plural(n: int, noun: str) -> str:
    return noun if n == 1 else noun + "s"


def _per_host_advice(hosts: Sequence[str], tp: int, replicas: int) -> str:
    """The auto note's advice when a host runs more than one replica's worth of ranks."""
    from collections import Counter

    per_host = max(Counter(hosts).values())
    if replicas < 2 or per_host <= tp:
        return ""
    k = per_host // tp
    ranks = f"{tp} ranks" if tp > 1 else "one rank"
    return (f"; note: hosts run {per_host} ranks each, so {k} replicas share a host's memory bus: for decode "
            f"one replica per host ({ranks} with all the host's cores) and a {k}x larger [generate] batch is "
            "faster (each step reads the weights once for all its rows)")
