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

from .errors import EXIT_BAD_INPUT, EXIT_FAULT, EXIT_INTERNAL, EXIT_TIMEOUT, ConfigError, RlxError

__all__ = ["main"]

EPILOG = """exit codes: 0 ok, 1 internal error, 2 bad input (command line, job file, checkpoint,
input ids), 3 model does not fit, 4 a rank failed at run time, 5 a rank timed out waiting
(a rank that dies, stops or ends early is named by its supervisor, which ends the job: the
code is then the launcher's, 9 under MPICH); 75 generate stopped by a signal, rerun to resume.
docs: README.md"""


_LAUNCH_RANK_VARS = ("PMI_RANK", "PMIX_RANK", "OMPI_COMM_WORLD_RANK", "SLURM_PROCID")


def _launch_rank() -> int | None:
    """This process's rank as the launcher set it (before MPI starts), or None outside a launch."""
    for var in _LAUNCH_RANK_VARS:
        if os.environ.get(var, "").isdigit():
            return int(os.environ[var])
    return None


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one ``rlx-mpi: error:`` line, printed by one rank only."""

    def error(self, message: str):
        if _launch_rank() in (None, 0):  # every rank parses the same argv: rank 0 speaks for all
            sys.stderr.write(self.format_usage())
            sys.stderr.write(f"rlx-mpi: error: {self.prog}: {message}; see {self.prog} --help\n")
        sys.exit(2)


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="rlx-mpi", description="Pipeline- and tensor-parallel Llama inference over MPI.",
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
    r.add_argument("--log-dir", metavar="DIR", help="one log per rank, DIR/rank-0003.log (lines prefixed with rank "
                   "and host); only rank 0 logs to the terminal")
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
    pr.add_argument("--log-dir", metavar="DIR", help="one log per rank, DIR/rank-0003.log; only rank 0 logs to the terminal")

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
                       help="weight precision for the memory estimate, the same as --precision f32|f16|bf16")
    shape.add_argument("--tied", action="store_true", help="LM head shares the embedding matrix")
    pl.add_argument("--precision", help="weight precision in memory: f32 | bf16 | f16 | int8 for every rank, or a "
                    "comma list with one per rank (default: the job's [run]/[[rank]] precision, else --dtype's)")
    pl.add_argument("--kv-cache", metavar="POLICY", help="KV cache that `generate` keeps: none | full | window:W "
                    "(default: the job's [run]/[[rank]] kv_cache, else full: batch x seq positions per layer)")

    c = sub.add_parser("convert", help="convert a Hugging Face Llama directory to an rlx_mpi HDF5 checkpoint")
    c.add_argument("hf_dir", help="directory with config.json and *.safetensors")
    c.add_argument("out", help="output .h5 file")
    c.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default="float32",
                   help="storage precision (default float32; bfloat16 is stored as uint16, see README)")

    i = sub.add_parser("init-model", help="write a random Llama checkpoint from a preset")
    i.add_argument("out", help="output .h5 file")
    i.add_argument("--preset", default="tiny", help="tiny | small | medium (default tiny)")
    i.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    i.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default="float32",
                   help="storage precision (default float32; bfloat16 is stored as uint16, see README)")
    return p


def _setup_logging(rank: int, debug: bool) -> None:
    level = logging.DEBUG if debug else (logging.INFO if rank == 0 else logging.WARNING)
    prefix = "rlx-mpi: " if rank == 0 else f"rlx-mpi [rank {rank}]: "
    logging.basicConfig(level=level, format=prefix + "%(message)s", stream=sys.stderr)


def _setup_mpi_logging(world, args) -> None:
    """Logging of an MPI command: `_setup_logging`, or with ``--log-dir`` one log per rank (agreed)."""
    if getattr(args, "log_dir", None) is None:
        _setup_logging(world.rank, args.debug)
        return
    import socket

    from .faults import RankContext, agree
    from .logdir import setup_rank_logging

    def setup() -> None:
        try:
            setup_rank_logging(world.rank, world.size, args.debug, args.log_dir, args.command)
        except OSError as e:
            raise ConfigError(f"--log-dir {args.log_dir}", f"cannot write a log there ({e.strerror})",
                              "give a folder every rank can write (on a filesystem every node mounts)") from None

    agree(world, RankContext(world.rank, world.size, host=socket.gethostname(), debug=args.debug), 60.0, setup)


# -- commands ----------------------------------------------------------------------------------


def cmd_run(args) -> int:
    from mpi4py import MPI

    from .cluster import Cluster
    from .faults import agree
    from .outputs import check_outputs, write_output
    from .placement import format_plan

    started = time.perf_counter()
    world = MPI.COMM_WORLD
    _setup_mpi_logging(world, args)
    cx = Cluster.from_path(args.job, debug=args.debug)
    # the end barrier's deadline (`_finish`): past every staggered deadline of the forward, so a
    # rank stuck in the run is named by the rank waiting for it, not by the barrier
    t = cx.job.run.timeout_s
    args.finish_timeout_s = t + (cx.world.size + 2) * max(1.0, 0.1 * t)

    def outputs() -> list:  # before any compute: a bad output path must not cost the run
        if world.rank != 0:
            return []
        inputs = {"the job file": args.job, "the checkpoint": cx.job.model.checkpoint,
                  "the input ids": args.input_ids}
        return check_outputs((("--out", args.out), ("--json", args.json), ("--trace", args.trace)), inputs)

    checked = {o.flag: o for o in agree(cx.world, cx.ctx, cx.job.run.startup_timeout_s, outputs,
                                        "checking the output paths")}
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
    from .logdir import job_id

    run.job_id = job_id()  # the table and the JSON name the Slurm job
    print(run.table())
    sys.stdout.flush()
    if args.trace:
        from .executor import trace_document
        from .trace import save_trace

        doc = trace_document(run)
        write_output(checked["--trace"], lambda tmp: save_trace(doc, tmp))
    if args.json:
        write_output(checked["--json"], lambda tmp: tmp.write_text(run.to_json()))
    if args.out:
        import h5py

        def write(tmp):
            with h5py.File(tmp, "w", locking=False) as f:
                f.create_dataset("logits", data=run.output)
                f.attrs["stats"] = run.to_json()
                f.attrs["job"] = str(Path(args.job).resolve())

        write_output(checked["--out"], write, run.output.nbytes)
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
    from .outputs import check_output, write_output

    world = MPI.COMM_WORLD
    _setup_logging(world.rank, args.debug)
    cx = Cluster.from_path(args.job, debug=args.debug)
    opts = cx._agree(lambda: _generate_options(args, cx.job))

    def json_output():  # before any compute, like run's outputs (rlx_mpi/outputs.py)
        if not cx.is_root or not args.json:
            return None
        inputs = {"the job file": args.job, "the checkpoint": cx.job.model.checkpoint,
                  "the prompt file": opts.prompts, "the output file": opts.out}
        return check_output("--json", args.json, inputs)

    json_out = cx._agree(json_output, "checking the output paths")
    result = generate(cx, opts)
    if result is None:
        return 0
    if cx.is_root:
        print(result.table())
        sys.stdout.flush()
        if json_out is not None:
            write_output(json_out, lambda tmp: tmp.write_text(json.dumps(result.to_dict(), indent=2)))
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
        from .outputs import check_output, write_output

        out = check_output("--png", args.png, {"the trace": args.trace})
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise ConfigError("--png", "matplotlib is not installed",
                              "pip install 'rlx_mpi[plot]' (or matplotlib) to draw the Gantt chart") from None
        write_output(out, lambda tmp: gantt_png(doc, str(tmp), title=args.title or Path(args.trace).name))
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
    from .caps import NodeCaps, format_caps, gather_local_affinity, probe_local
    from .faults import RankContext, agree

    world = MPI.COMM_WORLD
    _setup_mpi_logging(world, args)
    ctx = RankContext(rank=world.rank, size=world.size, debug=args.debug)
    ckpt = None
    if args.job:
        from .config import load_job

        ckpt = agree(world, ctx, 60.0, lambda: load_job(args.job)).model.checkpoint
    local = world.Split_type(MPI.COMM_TYPE_SHARED)
    affinity = gather_local_affinity(local, 120.0, ctx)
    mine = agree(world, ctx, 120.0, lambda: probe_local(world.rank, local.rank, local.size, ckpt, args.gflops,
                                                        affinity))
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
    seq = args.seq or (job.run.seq if job else (2048 if given else min(2048, cfg.max_position_embeddings)))
    if not given and seq > cfg.max_position_embeddings:  # what `run` would refuse (shape flags carry no limit)
        raise ConfigError("plan --seq" if args.seq else f"{job.path}: [run] seq",
                          f"sequence length {seq} exceeds the model's maximum {cfg.max_position_embeddings} positions",
                          f"plan at most {cfg.max_position_embeddings} tokens per sequence")
    precision = _plan_precision(args.precision or args.dtype, args.ranks, job)
    from .generation import kv_cost
    from .kv_cache import KvSpec

    if args.kv_cache is not None:
        kv_specs = [KvSpec.parse(args.kv_cache, "plan --kv-cache")]
    else:
        kv_specs = [job.kv_for(r) for r in range(args.ranks)] if job else [KvSpec("full")]
    # priced in f32 (each rank's precision scales its weight bytes), the KV term cut to the policy
    cost = kv_cost(cfg.cost(batch, seq), kv_specs, seq)
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
    plan = plan_placement(cost, caps, policy, int(reserve * 1e9) if mem is not None else 0, grid=grid, manual=manual,
                          precision=precision)
    held = ",".join(dict.fromkeys(precision)) if precision else "f32"
    print(f"model: {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, {cfg.num_attention_heads} heads "
          f"({cfg.num_key_value_heads} kv), vocab {cfg.vocab_size}; {held} weights; "
          f"batch {batch} x seq {seq}; kv cache {_kv_text(kv_specs)}; policy {policy.value}; "
          f"{args.ranks} ranks = {len(grid)} stages x tp {tp}")
    print(format_plan(plan, cost))
    return 0


def _kv_text(specs) -> str:
    return ",".join(dict.fromkeys(str(s) for s in specs))


def _plan_precision(flag: str | None, ranks: int, job) -> list[str] | None:
    """Each rank's weight precision for ``plan``: --precision, else the job's, else None (--dtype)."""
    from .config import _PRECISION_ALIASES, Precision

    if flag is None:
        if job is None or not (job.run.precision is not Precision.F32 or any(o.precision for o in job.ranks)):
            return None
        return [job.precision_for(r).value for r in range(ranks)]
    names = [_PRECISION_ALIASES.get(p.strip(), p.strip()) for p in flag.split(",")]
    choices = [p.value for p in Precision]
    bad = [p for p in names if p not in choices]
    if bad:
        raise ConfigError("plan --precision", f"got {bad[0]!r}", f"expected one of {choices}, or a comma list of them")
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
              "--vocab": args.vocab}
    for flag, value in counts.items():
        if value is not None and value < 1:
            raise ConfigError(f"plan {flag}", f"got {value}", "give an integer >= 1")
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
              "--mem-gb": (args.mem_gb, 1e9), "--gflops": (args.gflops, 1e12), "--reserve-gb": (args.reserve_gb, 1e6)}
    for flag, (value, most) in limits.items():
        if value is not None and value > most:
            raise ConfigError(f"plan {flag}", f"got {value}", f"give at most {most:g}")


def cmd_convert(args) -> int:
    from .llama.convert import convert_hf
    from .outputs import check_output

    src = Path(args.hf_dir)
    inputs = {f"the source file {p.name}": p for p in (sorted(src.iterdir()) if src.is_dir() else []) if p.is_file()}
    check_output("convert OUT", args.out, inputs, stream_ok=False)
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
    from .outputs import check_output

    out = Path(args.out)
    check_output("init-model OUT", out, stream_ok=False)
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
        from . import supervisor

        supervisor.supervise()
    if under_mpi:
        if (code := _check_pmix()) is not None:
            return code
        _start_mpi(getattr(args, "job", None))
        if (code := _check_launch()) is not None:
            return code
    try:
        try:
            code = COMMANDS[args.command](args)
        except ImportError as e:  # numpy, numba, h5py...: the node's Python, not a bug of ours
            raise _broken_import(e) from e
        if under_mpi:
            _finish(getattr(args, "finish_timeout_s", _FINISH_TIMEOUT_S), args.debug)
        return code
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
        from .faults import AgreedFailure  # (numpy-free: this also reports a rank whose numpy is broken)

        if isinstance(e, AgreedFailure):  # every rank raised it: rank 0 speaks for all
            if _rank() == 0:
                print(f"rlx-mpi: error: {e.line}", file=sys.stderr)
            _finish(getattr(args, "finish_timeout_s", _FINISH_TIMEOUT_S), args.debug)
            return e.exit_code
        if under_mpi:  # a fault outside the agreed steps: report once and end every rank
            _abort(sys.exc_info(), EXIT_FAULT, True)
        import traceback

        traceback.print_exc()
        print(f"rlx-mpi: error: internal error ({type(e).__name__}: {e}); please report it with the traceback above",
              file=sys.stderr)
        return EXIT_INTERNAL


def _start_mpi(job: str | None) -> None:
    """Initialise MPI under the supervisor's start-up deadline, then tell it MPI is up.

    The deadline is the job's ``[run] startup_timeout_s`` when the job file can be read
    without blocking (a regular file), else the supervisor's default.
    """
    from . import supervisor

    limit = _startup_timeout_of(job)
    if limit is not None:
        supervisor.watch(limit, "startup_timeout_s")
    _test_fault_before_mpi()
    supervisor.entering_mpi()
    try:
        from mpi4py import MPI
    except ImportError as e:  # a broken mpi4py or MPI on this node: the supervisor names the rank
        sys.stderr.write(f"rlx-mpi: rank {_launch_rank()}: cannot import mpi4py.MPI ({e}); reinstall mpi4py "
                         "against this node's MPI\n")
        sys.stderr.flush()
        os._exit(EXIT_FAULT)
    MPI.COMM_WORLD  # noqa: B018  (initialised on import; touched so the order is plain)
    supervisor.ready()


STARTUP_TIMEOUT_DEFAULT_S = 600.0  # [run] startup_timeout_s's default (config.RunSection; a test keeps them equal)


def _startup_timeout_of(job: str | None) -> float | None:
    """``[run] startup_timeout_s`` of ``job`` if it reads quickly and sanely, else None."""
    if not job:
        return None
    try:
        import stat

        if not stat.S_ISREG(os.stat(job).st_mode):  # a FIFO would block: the default deadline covers it
            return None
        try:  # not via .config: that imports numpy, and this runs before the rank is known to have one
            import tomllib
        except ModuleNotFoundError:  # Python < 3.11
            import tomli as tomllib

        run = tomllib.loads(Path(job).read_text(encoding="utf-8-sig")).get("run", {})
        value = run.get("startup_timeout_s", STARTUP_TIMEOUT_DEFAULT_S) if isinstance(run, dict) else None
        if isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value < math.inf:
            return float(value)
    except Exception:  # the real load, after MPI is up, reports what is wrong with the file
        pass
    return None


def _test_fault_before_mpi() -> None:
    """Test-only fault injection before MPI_Init (tests/test_reliability_mpi.py).

    ``RLX_MPI_TEST_PREINIT`` = exit0 | exit3 | kill | stop | hang, on the rank given by
    ``RLX_MPI_TEST_PREINIT_RANK`` (default 1); it stands for a broken Python or MPI on one
    node, the OOM killer at start-up, a SIGSTOP or a hung mount. Unset in normal use.
    """
    kind = os.environ.get("RLX_MPI_TEST_PREINIT")
    if not kind or _launch_rank() != int(os.environ.get("RLX_MPI_TEST_PREINIT_RANK", "1")):
        return
    import signal
    import time

    if kind == "exit0":
        os._exit(0)
    elif kind == "exit3":
        os._exit(3)
    elif kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif kind == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
    elif kind == "hang":
        while True:
            time.sleep(3600)


def _abort(exc_info, exit_code: int, debug: bool) -> None:
    """Report this rank's failure once and end every rank of the job."""
    import socket

    from mpi4py import MPI

    from .faults import RankContext, report_and_abort

    world = MPI.COMM_WORLD
    report_and_abort(world, RankContext(world.rank, world.size, host=socket.gethostname(), debug=debug),
                     exc_info, exit_code)


_FINISH_TIMEOUT_S = 60.0  # the end barrier's deadline when no job file gave [run] timeout_s


def _finish(timeout_s: float, debug: bool) -> None:
    """Meet every rank at a barrier under a deadline before MPI_Finalize; abort when it expires.

    Note: MPI_Finalize has no deadline of its own. A rank that dies after its last message (after
    the table, say) left the others blocked in it for ever on two hosts; a barrier first, with a
    deadline, turns that into one error line and an abort (exit code 5).
    """
    import socket

    from mpi4py import MPI

    from .faults import RankContext, report_and_abort, wait

    world = MPI.COMM_WORLD
    if world.size == 1:
        return
    ctx = RankContext(world.rank, world.size, host=socket.gethostname(), debug=debug)
    try:
        wait(world.Ibarrier(), timeout_s, ctx, lambda: "every rank to finish", "some rank")
    except RlxError:
        report_and_abort(world, ctx, sys.exc_info(), EXIT_TIMEOUT)
    _finalize(ctx, timeout_s)


def _finalize(ctx, timeout_s: float) -> None:
    """MPI_Finalize under a watchdog: a rank that dies between the barrier and here leaves the
    others blocked in it for ever (seen across two hosts), so past ``timeout_s`` this process
    ends itself; its supervisor names it and the launcher ends the job.

    Note: faulthandler's watchdog is a C thread, so it fires while MPI_Finalize holds the GIL;
    it can only _exit(1), hence the context posted first for the supervisor's message.
    """
    import faulthandler

    from mpi4py import MPI

    from . import supervisor

    supervisor.post_context(f"{ctx.describe()} in MPI_Finalize (stuck over {timeout_s:g} s: a rank died at "
                            "the end of the job)")
    with open(os.devnull, "w") as devnull:
        faulthandler.dump_traceback_later(timeout_s, exit=True, file=devnull)
        try:
            MPI.Finalize()
        finally:
            faulthandler.cancel_dump_traceback_later()
    supervisor.post_context(ctx.describe())


def _broken_import(e: ImportError) -> RlxError:
    """The one line for a dependency that fails to import on this rank's node."""
    import traceback

    from .errors import RankFault

    name = e.name.split(".")[0] if e.name else None
    if name is None:  # raised inside the module (a broken install): the first frame outside rlx_mpi
        ours = Path(__file__).resolve().parent
        for frame, _ in traceback.walk_tb(e.__traceback__):
            f = Path(frame.f_code.co_filename)
            if f.is_absolute() and ours not in f.resolve().parents:
                name = f.parent.name if f.name == "__init__.py" else f.stem
                break
    check = f"import {name}" if name else "import rlx_mpi.cluster, rlx_mpi.llama"
    return RankFault(f"cannot import {name or 'a dependency'}", f"{type(e).__name__}: {e}",
                     f"this node's Python environment is broken or differs from the other nodes': run "
                     f"`{sys.executable} -c '{check}'` there, and start every rank from the same venv")


def _check_pmix() -> int | None:
    """Exit code 2 when the launcher speaks only PMIx and the MPI library is an MPICH without it.

    Note: MPICH built without PMIx (the `mpich` wheel speaks PMI-1 and PMI-2) aborts inside
    MPI_Init under ``srun --mpi=pmix`` with a stack of internal errors on every rank. We look
    before MPI starts: MPI_Get_library_version may be called before MPI_Init, then we start MPI
    as mpi4py would have.
    """
    env = os.environ
    if "PMIX_RANK" not in env or any(v in env for v in ("PMI_FD", "PMI_PORT", "PMI_RANK")) \
            or "mpi4py.MPI" in sys.modules:
        return None
    import mpi4py

    initialize, finalize = mpi4py.rc.initialize, mpi4py.rc.finalize
    mpi4py.rc.initialize, mpi4py.rc.finalize = False, True
    from mpi4py import MPI

    mpi4py.rc.initialize, mpi4py.rc.finalize = initialize, finalize
    version = MPI.Get_library_version()
    if "MPICH" in version and "pmix" not in version.lower():
        if env.get("PMIX_RANK") == "0":
            first = " ".join(version.strip().splitlines()[0].split())
            print(f"rlx-mpi: error: launch: the launcher speaks PMIx but this MPI ({first}) was built without it; "
                  "launch with `srun --mpi=pmi2` (the mpich wheel speaks PMI-1 and PMI-2), or use the site's MPI "
                  "(mpi4py built against it)", file=sys.stderr)
        return EXIT_BAD_INPUT
    MPI.Init_thread({"single": MPI.THREAD_SINGLE, "funneled": MPI.THREAD_FUNNELED, "serialized":
                     MPI.THREAD_SERIALIZED}.get(str(mpi4py.rc.thread_level), MPI.THREAD_MULTIPLE))
    return None


def _check_launch() -> int | None:
    """Exit code 2 when a launcher started N > 1 tasks but MPI sees a world of 1, else None.

    Note: ``srun --mpi=none`` (or a PMI the MPI library does not speak) starts N copies that
    each believe they are the whole job: N tables, N times the work, exit 0. Only the task the
    launcher numbers 0 prints the line, so the log shows it once.
    """
    from mpi4py import MPI

    from .caps import launcher_tasks

    said = launcher_tasks()
    if MPI.COMM_WORLD.size != 1 or said is None:
        return None
    var, n = said
    if os.environ.get("SLURM_PROCID", os.environ.get("PMI_RANK", "0")) == "0":
        line = ConfigError("launch", f"{var}={n} says this is one of {n} tasks, but the MPI world has 1 rank "
                           f"(every task would run the whole job alone)",
                           "under Slurm launch with `srun --mpi=pmi2` (the mpich wheel speaks PMI-1 and PMI-2, "
                           "not PMIx) or use the site's MPI (mpi4py built against it, e.g. `pip install "
                           "--no-binary=mpi4py mpi4py` after `module load` of it); under mpiexec use the "
                           "mpiexec of the MPI that mpi4py was built with").line()
        print(f"rlx-mpi: error: {line}", file=sys.stderr)
    return EXIT_BAD_INPUT


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
    from . import supervisor

    supervisor.done()  # the normal end: any other end of a rank is a fault its supervisor reports
    sys.exit(code)


if __name__ == "__main__":
    entry()
