"""``rlx-mpi plan``: the placement of a model over hypothetical ranks, without MPI.

The model comes from shape flags (through ``--family``), a preset, a Hugging Face
``config.json`` or a job's checkpoint; the ranks are ``--ranks`` equal ones (``--mem-gb``,
``--gflops``). The planner itself is `placement.plan_grid` (pure); this module turns the flags
and the job file into its inputs, refuses what the launched command would refuse, and prints.
"""

from __future__ import annotations

import math

from .. import rules
from ..errors import ConfigError

__all__ = ["SHAPE_FLAGS", "plan"]

SHAPE_FLAGS = ("layers", "hidden", "heads", "kv-heads", "intermediate", "vocab", "head-dim", "experts", "top-k",
               "max-positions")


def _plan_model(args, job):
    """(family, config, given) for ``plan``: shape flags (through ``--family``), a preset, or the job's checkpoint."""
    from ..families import family_names, get_family, require_preset

    shape = {k.replace("-", "_"): getattr(args, k.replace("-", "_")) for k in SHAPE_FLAGS}
    given = {k: v for k, v in shape.items() if v is not None}
    if given or args.tied:
        family = get_family(args.family)
        if family is None:
            raise ConfigError("plan --family", f"got {args.family!r}", f"expected one of {family_names()}")
        return family, family.config_from_shape({**given, "tied": args.tied}, "plan"), True
    if args.preset:
        return (*require_preset(args.preset, "plan --preset"), False)
    if args.hf_config:
        return (*_hf_config_model(args.hf_config), False)
    if job is not None:
        from ..model.checkpoint import read_header
        from ..families import load_plugins

        load_plugins(job.model.plugins, f"{job.path}: [model] plugins")
        ckpt = job.model.checkpoint
        if not ckpt.exists() and job.model.preset:
            return (*require_preset(job.model.preset, f"{job.path}: [model] preset"), False)
        name, config_json = read_header(ckpt)
        family = get_family(name)
        if family is None:
            from ..errors import CheckpointError

            raise CheckpointError(str(ckpt), f"model family {name!r} is not registered",
                                  "import the package that registers it (rlx_mpi.register_family)")
        return family, family.load_config(config_json, str(ckpt)), False
    raise ConfigError("plan", "no model given", "pass a job file, --preset NAME, or the model shape flags")


def _hf_config_model(path: str):
    """(family, config) of a Hugging Face config.json; its quantization_config is left aside
    (plan prices the precision it is given: a bf16 / int8 conversion of the model)."""
    from pathlib import Path

    from ..errors import CheckpointError
    from ..families import family_for_model_type
    from ..families.hf import read_hf_config

    raw = read_hf_config(Path(path))
    family = family_for_model_type(raw.get("model_type")) if isinstance(raw.get("model_type"), str) else None
    if family is None:
        raise CheckpointError(f"{path}: model_type", f"{raw.get('model_type')!r} is not a supported model type",
                              "give the config.json of a model `rlx-mpi convert` reads")
    raw = {k: v for k, v in raw.items() if k != "quantization_config"}
    return family, family.arch_from_hf(raw, path).validate(path)


def plan(args) -> int:
    """Plan ``args`` (the parsed ``plan`` flags) and print the model line, the table and why."""
    from ..cluster.caps import NodeCaps
    from ..config import PlacementPolicy, load_job
    from ..cluster.placement import format_plan, plan_grid

    _check_plan_flags(args)
    job = load_job(args.job) if args.job else None
    family, cfg, given = _plan_model(args, job)
    dims = family.dims(cfg)
    tp = args.tp if args.tp is not None else (job.placement.tp if job else 1)
    family.check_tp(cfg, tp, "plan --tp")
    rules.tp_divides_ranks(args.ranks, tp, "plan --ranks", launched=False)
    replicas = (rules.replicas_value(args.replicas, "plan --replicas") if args.replicas is not None
                else job.placement.replicas if job else "auto")
    if replicas != "auto":
        rules.replicas_divide(args.ranks, tp, replicas, "plan --replicas")
        if job is not None:
            job.check_layers(dims.n_layers, args.ranks // replicas, tp)
        else:
            rules.stages_fit_layers(args.ranks // replicas, tp, dims.n_layers, "plan --ranks")
    batch = args.batch or (job.run.batch if job else 1)
    seq = args.seq or (job.run.seq if job else (2048 if given else min(2048, dims.max_positions)))
    if not given:  # what `run` would refuse (shape flags carry no limit)
        rules.seq_fits(seq, dims.max_positions, "plan --seq" if args.seq or job is None else f"{job.path}: [run] seq", ConfigError)
    flag = args.precision or args.dtype
    job, auto_note = _resolve_auto(job, family, given or bool(args.preset or args.hf_config), flag)
    precision = _plan_precision(flag, args.ranks, job)
    from ..model.kv_cache import KvSpec
    from ..model.cost import kv_cost

    if args.kv_cache is not None:
        kv_specs = [KvSpec.parse(args.kv_cache, "plan --kv-cache")]
    else:
        kv_specs = [job.kv_for(r) for r in range(args.ranks)] if job else [KvSpec("full")]
    # priced in f32 (each rank's precision scales its weight bytes), the KV term cut to the policy
    cost = kv_cost(family.cost(cfg, batch, seq), kv_specs, seq)
    if job is not None and job.adapters and not given:  # the job's LoRA adapters, as the stages stack them
        from ..families.hf.peft import stacked_layer_bytes
        from ..model.cost import with_adapters

        cost = with_adapters(cost, stacked_layer_bytes(list(job.adapters), cfg))
    if (precision and job is not None and not (given or args.preset or args.hf_config) and hasattr(family, "held_bytes")
            and job.model.checkpoint.is_file()):  # the checkpoint's own storage priced as held (a Q4_K file's pairs)
        from ..model.cost import with_held_scales

        cost = with_held_scales(cost, lambda p: family.held_bytes(cfg, job.model.checkpoint, p), precision)
    if args.simulate == "generate":  # the layers balanced as generate balances them (a decode step)
        from ..model.cost import decoding

        cost = decoding(cost)
    per_host = max(1, args.ranks_per_host or tp)
    mem = None if args.mem_gb is None else int(args.mem_gb * 1e9)
    caps = [NodeCaps(rank=r, host=f"host{r // per_host}", local_rank=r % per_host, local_size=per_host, cpus=None,
                     ram_total_bytes=mem, ram_available_bytes=mem, gflops=args.gflops) for r in range(args.ranks)]
    policy = PlacementPolicy(args.policy) if args.policy else (job.placement.policy if job else PlacementPolicy.BALANCED)
    if policy is PlacementPolicy.COMPUTE and args.gflops is None:
        policy = PlacementPolicy.UNIFORM
    reserve = args.reserve_gb if args.reserve_gb is not None else (job.placement.reserve_ram_gb if job else 1.0)
    manual = job.placement.manual if job and policy is PlacementPolicy.MANUAL else None
    grid = plan_grid(cost, caps, policy, int(reserve * 1e9) if mem is not None else 0, tp=tp, replicas=replicas,
                     manual=manual, precision=precision, where="plan --replicas")
    if args.simulate:  # how long the job takes (`drivers.simulate`): the same model, placement and flags
        from .simulate import simulate_plan

        if auto_note and not args.json:
            print(auto_note)
        return simulate_plan(args, job, family, cfg, grid, tp, lambda r, t: plan_grid(
            cost, caps, policy, int(reserve * 1e9) if mem is not None else 0, tp=t, replicas=r, manual=manual,
            precision=precision, where="plan --compare"))
    held = ",".join(dict.fromkeys(precision)) if precision else "f32"
    shape = ((f"{len(grid.replicas)} replicas x " if len(grid.replicas) > 1 else "") + f"{grid.n_stages} stage"
             + ("s" if grid.n_stages != 1 else "") + f" x tp {tp}")
    if auto_note:
        print(auto_note)
    print(f"model: {family.describe(cfg)}; {held} weights; "
          f"batch {batch} x seq {seq}; kv cache {_kv_text(kv_specs)}; policy {policy.value}; "
          f"{args.ranks} ranks = {shape}")
    print(format_plan(grid.flat, cost))
    print(grid.why)
    return 0


def _kv_text(specs) -> str:
    return ",".join(dict.fromkeys(str(s) for s in specs))


def _resolve_auto(job, family, elsewhere: bool, flag: str | None):
    """(job, the line saying what "auto" became) for ``plan``: the job's "auto" precisions made the
    stored format of its checkpoint, as the start-up makes them (`cluster.start.resolve_precision`);
    f32 when the model comes from elsewhere (``elsewhere``: shape flags, --preset, --hf-config) or
    the checkpoint is not there yet (a preset's, written at f32). No line when the job asks for no
    auto or --precision / --dtype replaces it."""
    if job is None or not job.asks_auto or flag is not None:
        return job, None
    from ..config import Precision

    ckpt = job.model.checkpoint
    if not elsewhere and ckpt.is_file():
        from ..cluster.start import resolve_precision

        return resolve_precision(job, family)
    why = ("the model comes from the flags, not the job's checkpoint" if elsewhere
           else f"no checkpoint to read: {ckpt} does not exist yet")
    return job.resolve_precision(Precision.F32), f"precision auto -> f32 ({why})"


def _plan_precision(flag: str | None, ranks: int, job) -> list[str] | None:
    """Each rank's weight precision for ``plan``: --precision, else the job's, else None (--dtype)."""
    from ..config import Precision

    if flag is None:
        if job is None or not (job.run.precision is not Precision.F32 or any(o.precision for o in job.ranks)):
            return None
        return [job.precision_for(r).value for r in range(ranks)]
    names = [rules.precision_name(p.strip(), "plan --precision") for p in flag.split(",")]
    if len(names) == 1:
        return names * ranks
    if len(names) != ranks:
        raise ConfigError("plan --precision", f"{len(names)} precisions for {ranks} ranks",
                          "give one precision for all ranks or exactly one per rank")
    return names


def _check_plan_flags(args) -> None:
    """Refuse flag values the planner would otherwise replace by a default or misuse."""
    counts = {"--ranks": args.ranks, "--tp": args.tp, "--ranks-per-host": args.ranks_per_host,
              "--batch": args.batch, "--seq": args.seq, "--layers": args.layers, "--hidden": args.hidden,
              "--heads": args.heads, "--kv-heads": args.kv_heads, "--intermediate": args.intermediate,
              "--vocab": args.vocab, "--head-dim": args.head_dim, "--max-positions": args.max_positions}
    for flag, value in counts.items():
        rules.int_at_least(value, 1, f"plan {flag}")
    if not args.simulate:
        for flag, value in (("--prompts", args.prompts), ("--calibration", args.calibration), ("--compare", args.compare),
                            ("--json", args.json), ("--time-limit", args.time_limit),
                            ("--max-new-tokens", args.max_new_tokens), ("--groups", args.groups),
                            ("--prefill-chunk", args.prefill_chunk), ("--no-prefix-cache", args.no_prefix_cache)):
            if value not in (None, False):
                raise ConfigError(f"plan {flag}", "is a flag of the simulation", "add --simulate [generate|score]")
    rules.int_at_least(args.max_new_tokens, 1, "plan --max-new-tokens")
    rules.int_at_least(args.groups, 1, "plan --groups")
    rules.int_at_least(args.prefill_chunk, 0, "plan --prefill-chunk")
    for flag, value in (("--experts", args.experts), ("--top-k", args.top_k)):  # 0: a dense model
        rules.int_at_least(value, 0, f"plan {flag}")
    for flag, value, low in (("--mem-gb", args.mem_gb, 0.0), ("--gflops", args.gflops, 0.0),
                             ("--reserve-gb", args.reserve_gb, None)):
        if value is not None and not (math.isfinite(value) and (value > low if low is not None else value >= 0)):
            raise ConfigError(f"plan {flag}", f"got {value}",
                              "give a finite number " + ("> 0" if low is not None else ">= 0"))
    # Bounds far past any machine, so absurd values are refused instead of overflowing or
    # building millions of hypothetical ranks.
    limits = {"--ranks": (args.ranks, 1_000_000), "--ranks-per-host": (args.ranks_per_host, 1_000_000),
              "--tp": (args.tp, 1_000_000), "--batch": (args.batch, 2**31), "--seq": (args.seq, 2**31),
              "--hidden": (args.hidden, 2**31), "--heads": (args.heads, 2**31), "--kv-heads": (args.kv_heads, 2**31),
              "--intermediate": (args.intermediate, 2**31), "--vocab": (args.vocab, 2**31),
              "--head-dim": (args.head_dim, 2**31), "--max-positions": (args.max_positions, 2**31),
              "--experts": (args.experts, 2**20), "--top-k": (args.top_k, 2**20),
              "--mem-gb": (args.mem_gb, 1e9), "--gflops": (args.gflops, 1e12), "--reserve-gb": (args.reserve_gb, 1e6)}
    for flag, (value, most) in limits.items():
        rules.at_most(value, most, f"plan {flag}")
