"""The ``rlx-mpi`` command line: run, probe, plan, convert, init-model.

``run`` and ``probe`` are launched under mpiexec/srun (every rank runs the same command);
``plan``, ``convert`` and ``init-model`` are plain single-process commands. Every failure
ends as one line ``rlx-mpi: error: <where>: <what>; <fix>`` and a documented exit code
(see `rlx_mpi.errors`); ``--debug`` adds the traceback.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
import time
from pathlib import Path

from .errors import EXIT_FAULT, EXIT_INTERNAL, ConfigError, RlxError

__all__ = ["main"]

EPILOG = """exit codes: 0 ok, 1 internal error, 2 bad input (command line, job file, checkpoint,
input ids), 3 model does not fit, 4 a rank failed at run time, 5 a rank timed out waiting
(a rank killed by a signal is named too, but the code is then the launcher's: 9 under MPICH).
docs: README.md"""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rlx-mpi", description="Pipeline- and tensor-parallel Llama inference over MPI.",
                                epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--debug", action="store_true", help="show tracebacks and debug logs")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    r = sub.add_parser("run", help="one forward of a job across the launched ranks (under mpiexec/srun)",
                       description="Probe every rank, plan the stages, load each rank's layers and run one "
                       "forward; rank 0 prints the per-stage table. Example: mpiexec -n 4 rlx-mpi run jobs/tiny.toml",
                       epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    r.add_argument("job", help="job TOML file (see jobs/)")
    r.add_argument("--input-ids", metavar="IDS.npy", help="integer .npy of shape [batch, seq] (default: random "
                   "ids from [run] seed, batch, seq)")
    r.add_argument("--out", metavar="RESULT.h5", help="write dataset /logits float32 [batch, seq, vocab] and the stats")
    r.add_argument("--json", metavar="STATS.json", help="write the run's per-stage stats as JSON")
    r.add_argument("--plan-only", action="store_true", help="probe and plan on the launched ranks, print the plan, stop")
    r.add_argument("--trace", metavar="TRACE.json", help="write every rank's timeline (start-up phases; compute, pack, "
                   "unpack, send/recv waits per microbatch) as Chrome Trace Event JSON: opens in ui.perfetto.dev")

    t = sub.add_parser("trace", help="summarise a --trace file, or draw it as a Gantt chart (plain, no MPI)")
    t.add_argument("trace", help="TRACE.json written by rlx-mpi run --trace")
    t.add_argument("--png", metavar="GANTT.png", help="draw one row per rank (needs matplotlib: pip install 'rlx_mpi[plot]')")
    t.add_argument("--title", help="title of the picture (default: the file name)")

    g = sub.add_parser("generate", help="complete a file of prompts across the launched ranks (under mpiexec/srun)",
                       description="Read JSON-lines prompts ({\"id\", \"tokens\"} or {\"id\", \"text\"}), generate "
                       "across the pipeline with a KV cache, append one JSON line per completed prompt to --out. "
                       "A rerun of the same command skips the ids already there. SIGTERM/SIGINT/SIGUSR1 finish "
                       "the current step, write what is complete and exit with code 75 (requeue). Flags "
                       "override the job's [generate] section. Example: mpiexec -n 2 rlx-mpi generate "
                       "jobs/tiny.toml --prompts p.jsonl --out c.jsonl",
                       epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    g.add_argument("job", help="job TOML file (see jobs/)")
    g.add_argument("--prompts", metavar="PROMPTS.jsonl", help="prompt file (default: [generate] prompts)")
    g.add_argument("--out", metavar="COMPLETIONS.jsonl", help="output, appended to and resumed (default: [generate] out)")
    g.add_argument("--max-new-tokens", type=int, metavar="N", help="new tokens per prompt at most")
    g.add_argument("--temperature", type=float, metavar="T", help="0 = greedy (default); else sample")
    g.add_argument("--top-k", type=int, metavar="K", help="sample among the K most likely tokens (0 = off)")
    g.add_argument("--top-p", type=float, metavar="P", help="sample within probability mass P (1 = off)")
    g.add_argument("--seed", type=int, metavar="S", help="seed of the draws (default: [generate] seed, else [run] seed)")
    g.add_argument("--eos-id", type=int, metavar="ID", help="end-of-sequence token (default: the tokenizer's)")
    g.add_argument("--batch", type=int, metavar="B", help="sequences per group")
    g.add_argument("--groups", type=int, metavar="G", help="groups in flight (0 = one per stage)")
    g.add_argument("--json", metavar="STATS.json", help="write the run's per-rank stats and totals as JSON")

    pr = sub.add_parser("probe", help="show every launched rank's hardware (under mpiexec/srun)")
    pr.add_argument("job", nargs="?", help="optional job TOML: also checks its checkpoint is readable")
    pr.add_argument("--json", action="store_true", help="print JSON instead of a table")
    pr.add_argument("--gflops", action="store_true", help="measure each rank's matmul speed (~0.2 s)")

    pl = sub.add_parser("plan", help="plan placement for hypothetical ranks, without launching MPI",
                        description="Size an allocation before queueing: plan a model (a checkpoint via a job "
                        "file, a preset, or a shape) over N hypothetical ranks of equal memory and speed.")
    pl.add_argument("job", nargs="?", help="job TOML whose checkpoint, batch, seq and placement to use")
    pl.add_argument("--ranks", type=int, required=True, help="number of ranks (stages x tp)")
    pl.add_argument("--tp", type=int, help="tensor-parallel ranks per stage (default: the job's, else 1)")
    pl.add_argument("--mem-gb", type=float, help="available RAM per rank in GB (default: unlimited)")
    pl.add_argument("--gflops", type=float, help="speed per rank in GFLOP/s (default: all equal)")
    pl.add_argument("--ranks-per-host", type=int, help="ranks sharing each host (default: tp, one TP group per host)")
    pl.add_argument("--policy", choices=["uniform", "memory", "compute", "balanced"], help="default: the job's, else balanced")
    pl.add_argument("--batch", type=int, help="sequences per forward (default: the job's, else 1)")
    pl.add_argument("--seq", type=int, help="tokens per sequence (default: the job's, else 2048)")
    pl.add_argument("--reserve-gb", type=float, help="RAM kept free per rank (default: the job's, else 1.0)")
    pl.add_argument("--preset", help="plan a random preset's shape (tiny, small, medium)")
    shape = pl.add_argument_group("model shape (instead of a checkpoint), e.g. Llama-3-70B: --layers 80 "
                                  "--hidden 8192 --heads 64 --kv-heads 8 --intermediate 28672 --vocab 128256 --dtype bfloat16")
    for flag in ("layers", "hidden", "heads", "kv-heads", "intermediate", "vocab"):
        shape.add_argument(f"--{flag}", type=int)
    shape.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default=None,
                       help="weight precision for the memory estimate (default float32, what rlx_mpi computes in)")
    shape.add_argument("--tied", action="store_true", help="LM head shares the embedding matrix")

    c = sub.add_parser("convert", help="convert a Hugging Face Llama directory to an rlx_mpi HDF5 checkpoint")
    c.add_argument("hf_dir", help="directory with config.json and *.safetensors")
    c.add_argument("out", help="output .h5 file")
    c.add_argument("--dtype", choices=["float32", "float16"], default="float32", help="storage precision (default float32)")

    i = sub.add_parser("init-model", help="write a random Llama checkpoint from a preset")
    i.add_argument("out", help="output .h5 file")
    i.add_argument("--preset", default="tiny", help="tiny | small | medium (default tiny)")
    i.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    i.add_argument("--dtype", choices=["float32", "float16"], default="float32", help="storage precision (default float32)")
    return p


def _setup_logging(rank: int, debug: bool) -> None:
    level = logging.DEBUG if debug else (logging.INFO if rank == 0 else logging.WARNING)
    prefix = "rlx-mpi: " if rank == 0 else f"rlx-mpi [rank {rank}]: "
    logging.basicConfig(level=level, format=prefix + "%(message)s", stream=sys.stderr)


def _write_atomic(path: str, write) -> None:
    """Write through a temporary name and rename, so no half-written file looks complete."""
    target = Path(path)
    if not target.parent.is_dir():
        raise ConfigError(path, f"folder {target.parent} does not exist", "create it or choose another path")
    tmp = target.with_name(f".{target.name}.tmp{os.getpid()}")
    try:
        write(tmp)
        os.replace(tmp, target)
    finally:
        if tmp.exists():
            tmp.unlink()


# -- commands ----------------------------------------------------------------------------------


def cmd_run(args) -> int:
    from mpi4py import MPI

    from .cluster import Cluster
    from .faults import agree
    from .placement import format_plan

    started = time.perf_counter()
    world = MPI.COMM_WORLD
    _setup_logging(world.rank, args.debug)
    cx = Cluster.from_path(args.job, debug=args.debug)

    def check_outputs() -> None:
        for flag, path in (("--out", args.out), ("--json", args.json), ("--trace", args.trace)):
            if path and world.rank == 0 and not Path(path).parent.is_dir():
                raise ConfigError(f"{flag} {path}", f"folder {Path(path).parent} does not exist",
                                  "create it or choose another path")

    agree(cx.world, cx.ctx, 60.0, check_outputs)
    phase = _phases(cx, started)
    with phase("load inputs"):
        ids = cx.load_inputs(args.input_ids)
    with phase("probe"):
        cx.probe()
    with phase("plan"):
        plan = cx.plan()
    if args.plan_only:
        if cx.is_root:
            print(format_plan(plan, cx.cost()))
        return 0
    with phase("build"):
        cx.build()
    run = cx.drive(ids, trace=bool(args.trace))
    if run is None:
        return 0
    print(run.table())
    sys.stdout.flush()
    if args.trace:
        from .executor import trace_document
        from .trace import save_trace

        save_trace(trace_document(run), args.trace)
    if args.json:
        _write_atomic(args.json, lambda tmp: tmp.write_text(run.to_json()))
    if args.out:
        import h5py

        def write(tmp):
            with h5py.File(tmp, "w", locking=False) as f:
                f.create_dataset("logits", data=run.output)
                f.attrs["stats"] = run.to_json()
                f.attrs["job"] = str(Path(args.job).resolve())

        _write_atomic(args.out, write)
    return 0


def _generate_options(args, job):
    """The job's [generate] section under the command-line flags, checked."""
    from .generation import GenerateOptions
    from .sampling import SamplingParams

    sec = job.generate
    pick = lambda flag, value: value if flag is None else flag  # noqa: E731
    prompts = args.prompts or (str(sec.prompts) if sec.prompts else None)
    out = args.out or (str(sec.out) if sec.out else None)
    if not prompts:
        raise ConfigError("generate --prompts", "no prompt file given", "pass --prompts FILE or set [generate] prompts")
    if not out:
        raise ConfigError("generate --out", "no output file given", "pass --out FILE or set [generate] out")
    for flag, value, low in (("--max-new-tokens", args.max_new_tokens, 1), ("--top-k", args.top_k, 0),
                             ("--seed", args.seed, 0), ("--eos-id", args.eos_id, 0), ("--batch", args.batch, 1),
                             ("--groups", args.groups, 0)):
        if value is not None and value < low:
            raise ConfigError(f"generate {flag}", f"got {value}", f"give an integer >= {low}")
    if args.json and not Path(args.json).parent.is_dir():
        raise ConfigError(f"--json {args.json}", f"folder {Path(args.json).parent} does not exist",
                          "create it or choose another path")
    if args.json and Path(args.json).resolve() in (Path(prompts).resolve(), Path(out).resolve()):
        raise ConfigError(f"--json {args.json}", "is the prompt or output file", "choose another path")
    seed = pick(args.seed, sec.seed if sec.seed is not None else job.run.seed)
    sampling = SamplingParams(pick(args.temperature, sec.temperature), pick(args.top_k, sec.top_k),
                              pick(args.top_p, sec.top_p), seed).check("generate")
    return GenerateOptions(prompts=Path(prompts), out=Path(out), max_new_tokens=pick(args.max_new_tokens, sec.max_new_tokens),
                           sampling=sampling, eos_id=pick(args.eos_id, sec.eos_id), batch=pick(args.batch, sec.batch),
                           groups=pick(args.groups, sec.groups), sync_s=sec.sync_s)


def cmd_generate(args) -> int:
    from mpi4py import MPI

    from .cluster import Cluster
    from .generation import generate
    from .journal import REQUEUE_EXIT

    world = MPI.COMM_WORLD
    _setup_logging(world.rank, args.debug)
    cx = Cluster.from_path(args.job, debug=args.debug)
    opts = cx._agree(lambda: _generate_options(args, cx.job))
    result = generate(cx, opts)
    if result is None:
        return 0
    if cx.is_root:
        print(result.table())
        sys.stdout.flush()
        if args.json:
            _write_atomic(args.json, lambda tmp: tmp.write_text(json.dumps(result.to_dict(), indent=2)))
    if result.stopped_by:
        if cx.is_root:
            print(f"rlx-mpi: stopped by {result.stopped_by} after the current step: "
                  f"{result.done_before + result.done_now} of {result.total} prompts are in {opts.out}; "
                  f"run the same command again to resume (exit code {REQUEUE_EXIT})", file=sys.stderr)
        return REQUEUE_EXIT
    return 0


def _phases(cx, started: float):
    """A context manager factory recording start-up phases (perf_counter) for the trace; the
    first, "start", covers MPI init and the job file."""
    import contextlib

    cx.phases.append(("start", started, time.perf_counter() - started))

    @contextlib.contextmanager
    def phase(name: str):
        t0 = time.perf_counter()
        yield
        cx.phases.append((name, t0, time.perf_counter() - t0))

    return phase


def cmd_trace(args) -> int:
    """Summarise a trace file and, with --png, draw it."""
    from .trace import gantt_png, load_trace

    doc = load_trace(args.trace)
    print(_trace_summary(doc))
    if args.png:
        if not Path(args.png).parent.is_dir():
            raise ConfigError(f"--png {args.png}", f"folder {Path(args.png).parent} does not exist",
                              "create it or choose another path")
        if Path(args.png).resolve() == Path(args.trace).resolve():
            raise ConfigError(f"--png {args.png}", "is the input trace", "choose another output path")
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise ConfigError("--png", "matplotlib is not installed",
                              "pip install 'rlx_mpi[plot]' (or matplotlib) to draw the Gantt chart") from None
        _write_atomic(args.png, lambda tmp: gantt_png(doc, str(tmp), title=args.title or Path(args.trace).name))
        print(f"wrote {args.png}")
    return 0


def _trace_summary(doc: dict) -> str:
    """Per lane: milliseconds in each category; then the measured bubble beside the ideal."""
    from .trace import bubble, spans_from_trace

    names = {e["pid"]: e["args"]["name"] for e in doc["traceEvents"] if e.get("ph") == "M"
             and e.get("name") == "process_name"}
    spans = spans_from_trace(doc)
    lines = []
    for pid in sorted(names):
        totals: dict[str, float] = {}
        for sp in spans:
            if sp.rank == pid:
                totals[sp.cat] = totals.get(sp.cat, 0.0) + sp.dur_s * 1e3
        lines.append(f"{names[pid]}: " + ", ".join(f"{k} {v:.1f} ms" for k, v in totals.items()))
    other = doc.get("otherData", {})
    if isinstance(other.get("n_stages"), int) and isinstance(other.get("microbatches"), int):
        b = bubble(spans, other["n_stages"], other["microbatches"])
        lines.append(f"bubble {100 * b['measured_bubble']:.1f}% measured (busy = compute + pack + unpack), "
                     f"{100 * b['ideal_bubble']:.1f}% ideal (p-1)/(M+p-1) for p = {b['n_stages']}, "
                     f"M = {b['microbatches']}; window {b['window_s'] * 1e3:.1f} ms")
    return "\n".join(lines)


def cmd_probe(args) -> int:
    from mpi4py import MPI

    from . import transport
    from .caps import NodeCaps, format_caps, probe_local
    from .faults import RankContext, agree

    world = MPI.COMM_WORLD
    _setup_logging(world.rank, args.debug)
    ctx = RankContext(rank=world.rank, size=world.size, debug=args.debug)
    ckpt = None
    if args.job:
        from .config import load_job

        ckpt = agree(world, ctx, 60.0, lambda: load_job(args.job)).model.checkpoint
    local = world.Split_type(MPI.COMM_TYPE_SHARED)
    mine = agree(world, ctx, 120.0, lambda: probe_local(world.rank, local.rank, local.size, ckpt, args.gflops))
    rows = transport.gather_json(world, mine.to_dict(), 0, 120.0, ctx, "the probe")
    if rows is not None:
        caps = [NodeCaps.from_dict(r) for r in rows]
        print(json.dumps([c.to_dict() for c in caps], indent=2) if args.json else format_caps(caps))
    return 0


def cmd_plan(args) -> int:
    from .caps import NodeCaps
    from .config import PlacementPolicy, load_job
    from .llama import PRESETS, LlamaConfig
    from .placement import format_plan, plan_placement
    from .topology import make_grid

    _check_plan_flags(args)
    job = load_job(args.job) if args.job else None
    shape_flags = {k: getattr(args, k.replace("-", "_")) for k in
                   ("layers", "hidden", "heads", "kv-heads", "intermediate", "vocab")}
    given = {k: v for k, v in shape_flags.items() if v is not None}
    if given:
        missing = sorted(set(shape_flags) - set(given) - {"kv-heads"})
        if missing:
            raise ConfigError("plan", f"model shape incomplete: missing --{', --'.join(missing)}",
                              "give all of --layers --hidden --heads --intermediate --vocab (and --kv-heads)")
        cfg = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
                          num_hidden_layers=args.layers, num_attention_heads=args.heads,
                          num_key_value_heads=args.kv_heads or args.heads, tie_word_embeddings=args.tied
                          ).validate("plan: model shape")
    elif args.preset:
        if args.preset not in PRESETS:
            raise ConfigError("plan --preset", f"got {args.preset!r}", f"expected one of {sorted(PRESETS)}")
        cfg = PRESETS[args.preset]
    elif job is not None:
        from .checkpoint import read_header

        ckpt = job.model.checkpoint
        if not ckpt.exists() and job.model.preset in PRESETS:
            cfg = PRESETS[job.model.preset]
        else:
            cfg = LlamaConfig.from_json(read_header(ckpt)[1], str(ckpt))
    else:
        raise ConfigError("plan", "no model given", "pass a job file, --preset NAME, or the model shape flags")
    tp = args.tp if args.tp is not None else (job.placement.tp if job else 1)
    from .llama import FAMILY

    FAMILY.check_tp(cfg, tp, "plan --tp")
    if args.ranks % tp:
        raise ConfigError("plan --ranks", f"tp = {tp} does not divide the {args.ranks} ranks",
                          f"give --ranks a multiple of {tp}, or another --tp")
    if job is not None:
        job.check_layers(cfg.num_hidden_layers, args.ranks, tp)
    elif args.ranks // tp > cfg.num_hidden_layers:
        n = cfg.num_hidden_layers
        raise ConfigError("plan --ranks", f"{args.ranks // tp} stages ({args.ranks} ranks / tp {tp}) but the model "
                          f"has only {n} layers", f"give at most {n * tp} ranks, or a larger --tp")
    batch = args.batch or (job.run.batch if job else 1)
    seq = args.seq or (job.run.seq if job else 2048)
    weight_bytes = {"float32": 4, "float16": 2, "bfloat16": 2, None: 4}[args.dtype]
    cost = cfg.cost(batch, seq, weight_bytes)
    per_host = max(1, args.ranks_per_host or tp)
    mem = None if args.mem_gb is None else int(args.mem_gb * 1e9)
    caps = [NodeCaps(rank=r, host=f"host{r // per_host}", local_rank=r % per_host, local_size=per_host, cpus=None,
                     ram_total_bytes=mem, ram_available_bytes=mem, gflops=args.gflops) for r in range(args.ranks)]
    grid = make_grid([c.host for c in caps], tp)
    policy = PlacementPolicy(args.policy) if args.policy else (job.placement.policy if job else PlacementPolicy.BALANCED)
    if policy is PlacementPolicy.COMPUTE and args.gflops is None:
        policy = PlacementPolicy.UNIFORM
    reserve = args.reserve_gb if args.reserve_gb is not None else (job.placement.reserve_ram_gb if job else 1.0)
    manual = job.placement.manual if job and policy is PlacementPolicy.MANUAL else None
    plan = plan_placement(cost, caps, policy, int(reserve * 1e9) if mem is not None else 0, grid=grid, manual=manual)
    print(f"model: {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, {cfg.num_attention_heads} heads "
          f"({cfg.num_key_value_heads} kv), vocab {cfg.vocab_size}; {args.dtype or 'float32'} weights; "
          f"batch {batch} x seq {seq}; policy {policy.value}; {args.ranks} ranks = {len(grid)} stages x tp {tp}")
    print(format_plan(plan, cost))
    return 0


def _check_plan_flags(args) -> None:
    """Refuse flag values the planner would otherwise replace by a default or misuse."""
    counts = {"--ranks": args.ranks, "--tp": args.tp, "--ranks-per-host": args.ranks_per_host,
              "--batch": args.batch, "--seq": args.seq, "--layers": args.layers, "--hidden": args.hidden,
              "--heads": args.heads, "--kv-heads": args.kv_heads, "--intermediate": args.intermediate,
              "--vocab": args.vocab}
    for flag, value in counts.items():
        if value is not None and value < 1:
            raise ConfigError(f"plan {flag}", f"got {value}", "give an integer >= 1")
    for flag, value, low in (("--mem-gb", args.mem_gb, 0.0), ("--gflops", args.gflops, 0.0),
                             ("--reserve-gb", args.reserve_gb, None)):
        if value is not None and not (math.isfinite(value) and (value > low if low is not None else value >= 0)):
            raise ConfigError(f"plan {flag}", f"got {value}",
                              "give a finite number " + ("> 0" if low is not None else ">= 0"))


def cmd_convert(args) -> int:
    from .llama.convert import convert_hf

    cfg = convert_hf(args.hf_dir, args.out, dtype=args.dtype)
    print(f"wrote {args.out}: llama, {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, vocab {cfg.vocab_size}")
    tok = Path(args.out).with_name(f"{Path(args.out).stem}.tokenizer.json")
    if tok.is_file():  # copied by convert_hf: text prompts work with `generate`
        print(f"wrote {tok}: the model's tokenizer")
    return 0


def cmd_init_model(args) -> int:
    from .llama import PRESETS
    from .llama.init import init_random

    if args.preset not in PRESETS:
        raise ConfigError("init-model --preset", f"got {args.preset!r}", f"expected one of {sorted(PRESETS)}")
    out = Path(args.out)
    if not out.parent.is_dir():
        raise ConfigError(args.out, f"folder {out.parent} does not exist", "create it or choose another path")
    init_random(out, PRESETS[args.preset], args.seed, args.dtype)
    print(f"wrote {out}: random llama preset {args.preset!r}, seed {args.seed}")
    return 0


COMMANDS = {"run": cmd_run, "generate": cmd_generate, "probe": cmd_probe, "plan": cmd_plan, "convert": cmd_convert,
            "init-model": cmd_init_model, "trace": cmd_trace}
MPI_COMMANDS = {"run", "generate", "probe"}


def main(argv: list[str] | None = None, *, supervise: bool = False) -> int:
    """Run one command; ``supervise`` (the console script's choice) forks each MPI rank under
    a supervisor that names it if it dies of a signal (see `rlx_mpi.faults.supervise`)."""
    args = _parser().parse_args(argv)
    under_mpi = args.command in MPI_COMMANDS
    if supervise and under_mpi:
        from .faults import supervise as fork_supervisor

        fork_supervisor()
    try:
        return COMMANDS[args.command](args)
    except RlxError as e:
        if under_mpi:  # raised on some ranks outside an agreed step: the others may wait for ever
            _abort(sys.exc_info(), e.exit_code, args.debug)
        if args.debug:
            import traceback

            traceback.print_exc()
        print(f"rlx-mpi: error: {e.line()}", file=sys.stderr)
        return e.exit_code
    except BrokenPipeError:
        raise
    except Exception as e:
        from .faults import AgreedFailure

        if isinstance(e, AgreedFailure):  # every rank raised it: rank 0 speaks for all
            if _rank() == 0:
                print(f"rlx-mpi: error: {e.line}", file=sys.stderr)
            return e.exit_code
        if under_mpi:  # a fault outside the agreed steps: report once and end every rank
            _abort(sys.exc_info(), EXIT_FAULT, True)
        import traceback

        traceback.print_exc()
        print(f"rlx-mpi: error: internal error ({type(e).__name__}: {e}); please report it with the traceback above",
              file=sys.stderr)
        return EXIT_INTERNAL


def _abort(exc_info, exit_code: int, debug: bool) -> None:
    """Report this rank's failure once and end every rank of the job."""
    import socket

    from mpi4py import MPI

    from .faults import RankContext, report_and_abort

    world = MPI.COMM_WORLD
    report_and_abort(world, RankContext(world.rank, world.size, host=socket.gethostname(), debug=debug),
                     exc_info, exit_code)


def _rank() -> int:
    from mpi4py import MPI

    return MPI.COMM_WORLD.rank


def entry() -> None:
    """Console-script entry point."""
    try:
        code = main(supervise=True)
        sys.stdout.flush()
    except BrokenPipeError:  # `rlx-mpi plan ... | head`: the reader left, nothing is wrong
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        code = 0
    except KeyboardInterrupt:  # Ctrl-C reaches every rank: a traceback from each says nothing
        code = 130
    sys.exit(code)


if __name__ == "__main__":
    entry()
