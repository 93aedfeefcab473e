"""The ``rlx-mpi`` command line: parsing and dispatch only.

Commands launched under mpiexec/srun (every rank runs the same command line):
  run        one forward of a job over the pipeline (`drivers/run.py`)
  generate   complete a prompt file with the decode ring, resumable (`drivers/generate.py`)
  score      log-likelihood of a file of texts, resumable (`drivers/score.py`)
  probe      every rank's hardware
Plain single-process commands:
  plan       placement for hypothetical ranks (a job's checkpoint, a preset, or shape flags)
  convert    a Hugging Face directory to a checkpoint (the family of its ``model_type``)
  init-model a random checkpoint from a family's preset
  trace      summarise or draw a ``run --trace`` file

The MPI lifecycle of a command (supervisor, MPI start and finish, exit codes) is `launch.py`;
the start-up every MPI command shares is `Cluster.start` (`cluster.py`). Every failure ends as
one line ``rlx-mpi: error: <where>: <what>; <fix>`` and a documented exit code (see
`rlx_mpi.errors`); ``--debug`` adds the traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from .errors import ConfigError

__all__ = ["main"]

EPILOG = """exit codes: 0 ok, 1 internal error, 2 bad input (command line, job file, checkpoint,
input ids), 3 model does not fit, 4 a rank failed at run time, 5 a rank timed out waiting
(a rank that dies, stops or ends early is named by its supervisor, which ends the job: the
code is then the launcher's, 9 under MPICH); 75 generate/score stopped by a signal, rerun to resume.
docs: README.md"""


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one ``rlx-mpi: error:`` line, printed by one rank only
    (`launch.refuse`, which also ends an MPMD launch whose other ranks accepted theirs)."""

    def error(self, message: str):
        from .lifecycle.launch import UsageError

        raise UsageError(self.format_usage(), f"{self.prog}: {message}; see {self.prog} --help")


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
    g.add_argument("--prompts", metavar="PROMPTS.jsonl", help="prompt file, ours or an OpenAI batch file (default: "
                   "[generate] prompts)")
    g.add_argument("--out", metavar="COMPLETIONS.jsonl", help="output, appended to and resumed (default: [generate] out)")
    g.add_argument("--max-new-tokens", type=int, metavar="N", help="new tokens per prompt at most")
    g.add_argument("--temperature", type=float, metavar="T", help="0 = greedy (default); else sample")
    g.add_argument("--top-k", type=int, metavar="K", help="sample among the K most likely tokens (0 = off)")
    g.add_argument("--top-p", type=float, metavar="P", help="sample within probability mass P (1 = off)")
    g.add_argument("--seed", type=int, metavar="S", help="seed of the draws (default: [generate] seed, else [run] seed)")
    g.add_argument("--eos-id", type=int, metavar="ID", help="end-of-sequence token (default: every one the checkpoint "
                   "names in generation_config.json, else the tokenizer's)")
    g.add_argument("--logprobs", type=int, metavar="K", help="add each new token's log-prob and the top K alternatives "
                   "to every row (1..20; 0 = none, the default)")
    g.add_argument("--ignore-eos", action="store_true", default=None, help="run every row to its max tokens, past "
                   "end-of-sequence ids (fixed-length benchmarks, as llama.cpp's and vLLM's; default: [generate] "
                   "ignore_eos)")
    g.add_argument("--structured", metavar="SPEC", help="structured output for every row that asks for none of its "
                   "own: a vLLM structured_outputs object as JSON text or a .json file, e.g. '{\"json\": {schema}}', "
                   "'{\"regex\": \"[0-9]+\"}', '{\"choice\": [\"yes\", \"no\"]}', '{\"json_object\": true}' (needs "
                   "pip install 'rlx_mpi[structured]'; default: [generate] structured; docs/structured-output.md)")
    g.add_argument("--no-prefix-cache", dest="prefix_cache", action="store_false", default=None,
                   help="compute every prompt's whole prefill, even the blocks another prompt began with "
                   "(A/B runs; default: [generate] prefix_cache, else on)")
    g.add_argument("--adapter", action="append", metavar="NAME=DIR", help="a LoRA adapter (a PEFT directory) that "
                   "requests name (an OpenAI line's \"model\", our \"adapter\"); repeatable; adds to [adapters]")
    g.add_argument("--batch", type=int, metavar="B", help="sequences per group")
    g.add_argument("--kv-rows", type=int, metavar="N", help="KV budget in full-length rows; with the block cache "
                   "shorter rows share it by what they use, up to groups x batch at once (default: [generate] "
                   "kv_rows, else groups x batch)")
    g.add_argument("--groups", type=int, metavar="G", help="groups in flight (0 = one per stage)")
    g.add_argument("--prefill-chunk", type=int, metavar="N", help="prefill positions per step: a new group's prompts "
                   "go N positions a step, so the other groups keep decoding between its chunks, and a step that "
                   "also decodes carries at most N (the longest wait between a row's tokens; 0 = whole prompts; "
                   "default: [generate] prefill_chunk, else 256)")
    g.add_argument("--json", metavar="STATS.json", help="write the run's per-rank stats and totals as JSON")
    g.add_argument("--shard", metavar="K/N", help="this job's part of the prompt file: shard K of N contiguous parts (1 <= K <= N), e.g. "
                   "$SLURM_ARRAY_TASK_ID/$SLURM_ARRAY_TASK_COUNT; join the outputs with rlx-mpi merge")
    g.add_argument("--adopt-output", action="store_true", help="resume into an output whose rows carry no "
                    "identity (written by an older rlx-mpi, its record lost): take them as made with this run's settings")
    g.add_argument("--log-dir", metavar="DIR", help="one log per rank, DIR/rank-0003.log (lines prefixed with rank "
                   "and host); only rank 0 logs to the terminal")

    sc = sub.add_parser("score", help="log-likelihood of a file of texts across the launched ranks (under mpiexec/srun)",
                        description="Teacher-forced log-likelihood: read JSON-lines ({\"id\", \"tokens\"}, {\"id\", "
                        "\"text\"}, or {\"id\", \"context\", \"continuation\"}: only the continuation is scored), run "
                        "the pipeline forward over microbatches of lines, append one JSON row per line (scored tokens, "
                        "their log-probs, sum) to --out and print the perplexity of the whole file. Resumable as "
                        "generate: a rerun skips the lines already there; SIGTERM/SIGINT/SIGUSR1 finish the round "
                        "and exit 75. Example: mpiexec -n 2 rlx-mpi score jobs/tiny.toml --prompts p.jsonl --out s.jsonl",
                        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    sc.add_argument("job", help="job TOML file (see jobs/)")
    sc.add_argument("--prompts", metavar="LINES.jsonl", help="the lines to score (default: [score] prompts)")
    sc.add_argument("--out", metavar="SCORES.jsonl", help="output, appended to and resumed (default: [score] out)")
    sc.add_argument("--batch", type=int, metavar="TOKENS", help="padded tokens per microbatch (rows x longest line; "
                    "default: [score] batch, 2048): the last stage holds TOKENS x vocab float32 logits")
    sc.add_argument("--json", metavar="STATS.json", help="write the run's per-rank stats, totals and summary as JSON")
    sc.add_argument("--no-prefix-cache", dest="prefix_cache", action="store_false", default=None,
                    help="compute every line whole, even the context blocks another line began with "
                    "(A/B runs; default: [score] prefix_cache, else on)")
    sc.add_argument("--shard", metavar="K/N", help="this job's part of the prompt file: shard K of N contiguous parts (1 <= K <= N), e.g. "
                   "$SLURM_ARRAY_TASK_ID/$SLURM_ARRAY_TASK_COUNT; join the outputs with rlx-mpi merge")
    sc.add_argument("--adopt-output", action="store_true", help="resume into an output whose rows carry no "
                    "identity (written by an older rlx-mpi, its record lost): take them as made with this run's settings")
    sc.add_argument("--log-dir", metavar="DIR", help="one log per rank, DIR/rank-0003.log (lines prefixed with rank "
                    "and host); only rank 0 logs to the terminal")

    pr = sub.add_parser("probe", help="show every launched rank's hardware (under mpiexec/srun)")
    pr.add_argument("job", nargs="?", help="optional job TOML: also checks its checkpoint is readable")
    pr.add_argument("--json", action="store_true", help="print JSON instead of a table")
    pr.add_argument("--gflops", action="store_true", help="measure each rank's matmul speed (~0.2 s)")
    pr.add_argument("--calibrate", metavar="OUT_JSON", help="measure the rates plan --simulate prices with (the "
                    "start-up, the product kernels at each precision, attention, the links; 30-100 s) and write them to "
                    "OUT_JSON (its folder also holds a short-lived weights file: put it beside the checkpoints to time "
                    "their file system)")
    pr.add_argument("--precisions", metavar="P[,P...]", help="--calibrate: only these weight precisions (default "
                    "f32,bf16,f16,int8,q4; a job at one precision needs only its own)")
    pr.add_argument("--log-dir", metavar="DIR", help="one log per rank, DIR/rank-0003.log; only rank 0 logs to the terminal")

    pl = sub.add_parser("plan", help="plan placement for hypothetical ranks, without launching MPI",
                        description="Size an allocation before queueing: plan a model (a checkpoint via a job "
                        "file, a preset, or a shape) over N hypothetical ranks of equal memory and speed.")
    pl.add_argument("job", nargs="?", help="job TOML whose checkpoint, batch, seq and placement to use")
    pl.add_argument("--ranks", type=int, required=True, help="number of ranks (replicas x stages x tp)")
    pl.add_argument("--replicas", help='whole pipelines sharing the prompts: N, or "auto" (the fewest stages that '
                    'hold the model, as many replicas as the ranks allow; default: the job\'s, else auto)')
    pl.add_argument("--tp", type=int, help="tensor-parallel ranks per stage (default: the job's, else 1)")
    pl.add_argument("--mem-gb", type=float, help="available RAM per rank in GB (default: unlimited)")
    pl.add_argument("--gflops", type=float, help="speed per rank in GFLOP/s (default: all equal)")
    pl.add_argument("--ranks-per-host", type=int, help="ranks sharing each host (default: tp, one TP group per host)")
    pl.add_argument("--policy", choices=["uniform", "memory", "compute", "balanced"], help="default: the job's, else balanced")
    pl.add_argument("--batch", type=int, help="sequences per forward (default: the job's, else 1)")
    pl.add_argument("--seq", type=int, help="tokens per sequence (default: the job's, else 2048)")
    pl.add_argument("--reserve-gb", type=float, help="RAM kept free per rank (default: the job's, else 1.0)")
    pl.add_argument("--preset", help="plan a random preset's shape (e.g. tiny, small, medium)")
    pl.add_argument("--hf-config", metavar="CONFIG_JSON", help="plan a Hugging Face model from its config.json alone "
                    "(before downloading the weights; any model type `convert` reads)")
    shape = pl.add_argument_group("model shape (instead of a checkpoint), e.g. Llama-3-70B: --layers 80 "
                                  "--hidden 8192 --heads 64 --kv-heads 8 --intermediate 28672 --vocab 128256 --dtype bfloat16")
    pl.add_argument("--family", default="llama", help="model family of the shape flags (default llama)")
    from .drivers.plan import SHAPE_FLAGS

    for flag in SHAPE_FLAGS:
        shape.add_argument(f"--{flag}", type=int)
    shape.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default=None,
                       help="weight precision for the memory estimate, the same as --precision f32|f16|bf16")
    shape.add_argument("--tied", action="store_true", help="LM head shares the embedding matrix")
    pl.add_argument("--precision", help="weight precision in memory: f32 | bf16 | f16 | int8 | q4 for every rank, or a "
                    "comma list with one per rank (default: the job's [run]/[[rank]] precision, whose auto is its "
                    "checkpoint's stored format, else --dtype's)")
    sim = pl.add_argument_group("simulation (docs/performance.md: how long a job takes)")
    sim.add_argument("--simulate", nargs="?", const="generate", choices=["generate", "score"],
                     help="replay the job's loop under a clock and print its predicted wall time, tokens/s, each "
                     "stage's busy share and the first row's time (default generate)")
    sim.add_argument("--prompts", help="the job's prompt file (its tokens: lengths and prefix-cache hits; default "
                     "the job's [generate]/[score] prompts)")
    sim.add_argument("--calibration", metavar="CAL_JSON", help="the rates rlx-mpi probe --calibrate measured on "
                     "this allocation type (without: a roofline estimate, labelled as such)")
    sim.add_argument("--compare", action="store_true", help="also every replicas x stages x tp the ranks allow, "
                     "ranked by predicted time")
    sim.add_argument("--json", action="store_true", help="print the prediction as one JSON object")
    sim.add_argument("--time-limit", metavar="TIME", help="the queue's limit (2:00:00, 90, 45m, 2h): does the job "
                     "fit, or how often it requeues")
    sim.add_argument("--max-new-tokens", type=int, help="generate: new tokens a row (default the job's, else 32)")
    sim.add_argument("--groups", type=int, help="generate: groups in flight (default the job's, else one a stage)")
    sim.add_argument("--prefill-chunk", type=int, help="generate: positions a prefill step (default the job's)")
    sim.add_argument("--no-prefix-cache", action="store_true", help="price the job without its prefix cache")
    pl.add_argument("--kv-cache", metavar="POLICY", help="KV cache that `generate` keeps: none | full | window:W "
                    "(default: the job's [run]/[[rank]] kv_cache, else full: batch x seq positions per layer)")

    c = sub.add_parser("convert", help="convert a Hugging Face Llama directory to an rlx_mpi HDF5 checkpoint")
    c.add_argument("hf_dir", help="directory with config.json and *.safetensors, or a .gguf file (llama.cpp's)")
    c.add_argument("--dequantize", action="store_true",
                   help="GGUF: store every tensor as --dtype floats instead of keeping Q4_0/Q4_1/Q4_K "
                   "(4-bit) and Q8_0/Q6_K/Q5_0/Q3_K (int8) as quantized groups (docs/gguf.md)")
    c.add_argument("out", help="output .h5 file")
    c.add_argument("--dtype", choices=["float32", "float16", "bfloat16", "q4"], default="float32",
                   help="storage precision (default float32; bfloat16 is stored as uint16, see README; q4: "
                   "linear weights as 4-bit groups, docs/precision-q4.md)")

    mg = sub.add_parser("merge", help="join the outputs of generate/score --shard K/N jobs into one file (no MPI)",
                        description="Join the complete outputs of shards 1..N of one run (generate or score with "
                        "--shard K/N) into OUT and its record OUT.meta.json: the file one unsharded job would have "
                        "written (score: byte for byte; generate: the record byte for byte and every row but its "
                        "\"ms\" timing). Refuses shards of different runs, a shard missing, given twice or "
                        "unfinished, and an OUT that exists or is an input. Example: rlx-mpi merge all.jsonl "
                        "part-*.jsonl")
    mg.add_argument("out", help="the merged output (must not exist)")
    mg.add_argument("shards", nargs="+", help="every shard's output file, in any order")

    i = sub.add_parser("init-model", help="write a random Llama checkpoint from a preset")
    i.add_argument("out", help="output .h5 file")
    i.add_argument("--preset", default="tiny", help="tiny | small | medium (default tiny)")
    i.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    i.add_argument("--dtype", choices=["float32", "float16", "bfloat16", "q4"], default="float32",
                   help="storage precision (default float32; bfloat16 is stored as uint16, see README; q4: "
                   "linear weights as 4-bit groups, docs/precision-q4.md)")
    sub.add_parser("compile-kernels", help="compile every numba kernel into its on-disk cache once (a site or "
                   "read-only install: run it after installing, on the CPU kind the jobs use)")
    return p


# -- commands ----------------------------------------------------------------------------------


def cmd_run(args) -> int:
    from .drivers.run import RunDriver

    driver = RunDriver(args.job, input_ids=args.input_ids, out=args.out, json=args.json, trace=args.trace,
                       plan_only=args.plan_only)
    return _on_the_cluster(args, driver)


def cmd_merge(args) -> int:
    from .io.shards import merge

    done = merge(args.out, args.shards)
    print(f"merge: {done['rows']} rows of {done['shards']} shards in {args.out}")
    return 0


def cmd_generate(args) -> int:
    from .cluster.restart import run_command
    from .drivers.generate import GenerateDriver
    from .lifecycle.hooks import TestHooks

    # (a new driver for each start: the survivors of a dead rank start again, `cluster.restart`)
    return run_command(args.job, lambda: GenerateDriver(args, hooks=TestHooks.from_env()),  # (hooks: tests only)
                       debug=args.debug, log_dir=args.log_dir, nothing_to_do=lambda driver: driver.nothing_to_do())


def cmd_score(args) -> int:
    from .cluster.restart import run_command
    from .drivers.score import ScoreDriver
    from .lifecycle.hooks import TestHooks

    def nothing_to_do(driver) -> int:  # every line already scored: the summary of the file still ends the job
        if driver.holder.get("journal") is not None:
            print(driver.summary_line())
        return 0

    return run_command(args.job, lambda: ScoreDriver(args, hooks=TestHooks.from_env()),  # (hooks: tests only)
                       debug=args.debug, log_dir=args.log_dir, nothing_to_do=nothing_to_do)


def _on_the_cluster(args, driver) -> int:
    """The shared start-up, the driver's work and its report (`cluster.py`, `drivers/`)."""
    from .cluster.start import Cluster

    cx = Cluster.start(args.job, driver, debug=args.debug, log_dir=args.log_dir)
    if cx is None:  # nothing left to do (a batch file's failed lines still give its exit code)
        return driver.nothing_to_do() if hasattr(driver, "nothing_to_do") else 0
    return driver.report(cx, cx.run(driver))


def cmd_trace(args) -> int:
    """Summarise a trace file and, with --png, draw it."""
    from .io.trace import gantt_png, load_trace, summary

    doc = load_trace(args.trace)
    print(summary(doc))
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


def cmd_probe(args) -> int:
    if args.precisions and not args.calibrate:
        from .errors import ConfigError

        raise ConfigError("probe --precisions", "is a flag of --calibrate", "add --calibrate OUT.json")
    if args.calibrate:
        from .drivers.calibrate import calibrate

        return calibrate(args)
    from .drivers.probe import probe

    return probe(args)


def cmd_plan(args) -> int:
    from .drivers.plan import plan

    return plan(args)


def cmd_convert(args) -> int:
    from .drivers.convert import convert

    return convert(args)


def cmd_init_model(args) -> int:
    from .drivers.convert import init_model

    return init_model(args)


def cmd_compile_kernels(args) -> int:
    from .drivers.precompile import compile_report

    print("\n".join(compile_report()))
    return 0


COMMANDS = {"run": cmd_run, "generate": cmd_generate, "score": cmd_score, "probe": cmd_probe, "plan": cmd_plan, "convert": cmd_convert,
            "init-model": cmd_init_model, "trace": cmd_trace, "merge": cmd_merge,
            "compile-kernels": cmd_compile_kernels}
MPI_COMMANDS = {"run", "generate", "score", "probe"}


def main(argv: list[str] | None = None, *, supervise: bool = False) -> int:
    """Parse ``argv`` and run its command through `launch.run` (MPI commands under the MPI
    lifecycle); ``supervise`` (the console script's choice) forks each MPI rank under its
    supervisor (`rlx_mpi.supervisor`). Returns the exit code."""
    from .lifecycle import launch

    try:
        args = _parser().parse_args(argv)
    except launch.UsageError as e:
        return launch.refuse(e, mpi=_may_start_mpi(sys.argv[1:] if argv is None else argv), supervise=supervise)
    return launch.run(COMMANDS[args.command], args, mpi=args.command in MPI_COMMANDS, supervise=supervise)


def _may_start_mpi(argv: list[str]) -> bool:
    """Could this refused command line be meant for an MPI command (or name none we know)?"""
    word = next((str(a) for a in argv if not str(a).startswith("-")), None)
    return word not in COMMANDS or word in MPI_COMMANDS


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
    from .lifecycle import supervisor

    supervisor.done()  # the normal end: any other end of a rank is a fault its supervisor reports
    sys.exit(code)


if __name__ == "__main__":
    entry()
