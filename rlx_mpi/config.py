"""The job TOML: what to run, how, and where.

Validation happens here, at the edge: unknown keys, wrong types, out-of-range values and
cross-field conflicts raise `ConfigError` naming the file, the key, the value and what is
expected. Everything past `load_job` is plain, trusted data.
"""

from __future__ import annotations

import dataclasses
import enum
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

from .errors import ConfigError
from . import rules
from .rules import WIRE_FORMATS
from .rules import DEFAULT_STARTUP_TIMEOUT_S

__all__ = ["PlacementPolicy", "Precision", "OnRankFailure", "ModelSection", "RunSection",
           "PlacementSection", "RankOverride", "GenerateSection", "JobConfig", "load_job", "parse_job",
           "WIRE_FORMATS"]


class PlacementPolicy(str, enum.Enum):
    """How the planner splits layers among stages."""

    UNIFORM = "uniform"  # equal layer counts
    MEMORY = "memory"  # proportional to each stage's available RAM
    COMPUTE = "compute"  # proportional to each stage's measured GFLOP/s
    BALANCED = "balanced"  # minimise the slowest stage's time, every stage within its memory
    MANUAL = "manual"  # explicit ranges from the job file


class OnRankFailure(str, enum.Enum):
    """What the job does when a rank dies mid-run (docs/reliability.md, "When a node dies")."""

    ABORT = "abort"  # end the job naming the rank (today's behaviour, every MPI and launcher)
    CONTINUE = "continue"  # the survivors carry on (needs an MPI with ULFM: `lifecycle.ulfm`)


class Precision(str, enum.Enum):
    """How a rank holds its weights (activations are always float32): converted at load from
    whatever the checkpoint stores. int8 is symmetric with one float32 scale per 64 weights of a row (kernels.INT8_BLOCK);
    q4 is 4-bit codes with a float16 scale and minimum per 32 weights of a row (kernels/quant.py).
    AUTO (the default) is the checkpoint's stored format (`checkpoint.stored_precision`), made
    concrete once where the job meets the checkpoint (`JobConfig.resolve_precision`)."""

    F32 = "f32"  # the names are rules.PRECISIONS (one list for job files, plan and the planner)
    BF16 = "bf16"
    F16 = "f16"
    INT8 = "int8"
    Q4 = "q4"
    AUTO = "auto"  # a job file's word only: never reaches the planner or a stage
    FLOAT32 = "f32"  # an alias: the seed's name

    @property
    def bytes_per_param(self) -> float:
        """Resident bytes per weight (int8: one byte and a 4-byte scale per 64 weights; q4: half a
        byte and a 2-byte scale and minimum per 32, as our quantizer and Q4_0 / Q4_1 hold them;
        a Q4_K checkpoint's float32 pairs take 0.75)."""
        if self is Precision.AUTO:
            raise ValueError('precision "auto" has no size until resolved against the checkpoint '
                             "(JobConfig.resolve_precision)")
        return {"f32": 4.0, "bf16": 2.0, "f16": 2.0, "int8": 1.0 + 4.0 / 64, "q4": 0.5 + 4.0 / 32}[self.value]





@dataclass(frozen=True)
class KvSpec:
    """A parsed ``kv_cache`` setting: ``none``, ``full`` or ``window:W``."""

    policy: str = "full"  # "none" | "full" | "window"
    window: int = 0  # W, only with policy "window"

    @classmethod
    def parse(cls, text: object, where: str) -> "KvSpec":
        if isinstance(text, str):
            if text in ("none", "full"):
                return cls(text)
            head, _, tail = text.partition(":")
            if head == "window" and tail.isdigit() and int(tail) > 0:
                return cls("window", int(tail))
        raise ConfigError(where, f"got {text!r}", 'expected "none", "full" or "window:W" with W >= 1 (e.g. "window:256")')

    def __str__(self) -> str:
        return f"window:{self.window}" if self.policy == "window" else self.policy

    @property
    def recompute(self) -> bool:
        """True when decode steps must recompute the prefix (no cache)."""
        return self.policy == "none"

    def cache_len(self, max_seq: int) -> int:
        """Positions a cache row holds for sequences of up to ``max_seq`` tokens."""
        if self.policy == "none":
            return 0
        return min(self.window, max_seq) if self.policy == "window" else max_seq


@dataclass(frozen=True)
class ModelSection:
    checkpoint: Path
    """HDF5 checkpoint; a relative path is resolved against the job file's folder."""
    preset: str | None = None
    """When set and ``checkpoint`` does not exist, create it from this random preset."""
    init_seed: int = 0
    """Seed of the random weights made from ``preset``."""
    check_finite: bool = False
    """Scan every loaded weight for NaN/Inf (costs one pass over the weights)."""
    plugins: tuple[str, ...] = ()
    """Python modules to import before loading, so they can `register_family` a model of their own."""
    name: str | None = None
    """The base model's name in requests (an OpenAI line's "model"); default: the checkpoint's file stem."""

    @property
    def base_names(self) -> frozenset[str]:
        """The names a request's "model" gives to mean the base model (no adapter)."""
        return frozenset({self.name or self.checkpoint.stem})


@dataclass(frozen=True)
class RunSection:
    batch: int = 1
    """Sequences per forward."""
    seq: int = 16
    """Tokens per sequence."""
    microbatches: int = 1
    """Microbatches the batch is cut into, so stages work on different ones at once."""
    seed: int = 0
    """Seed of the random input ids when none are given."""
    timeout_s: float = 60.0
    """Longest any rank waits for another during the run before it names the laggard and aborts."""
    startup_timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S  # the one default (also before the file is read)
    """Deadline for the start-up collectives (probe, plan, weight loading on a slow filesystem)."""
    on_rank_failure: OnRankFailure = OnRankFailure.ABORT
    """abort | continue: when a rank dies, end the job naming it (abort), or let the survivors finish
    the prompt file (continue; Open MPI 5 under ``mpirun --with-ft ulfm`` only, checked at start-up)."""
    wire: str = "f32"
    """Format of the hidden states between stages: f32 (exact, no copy) | bf16 | f16 (half the bytes)."""
    precision: Precision = Precision.AUTO
    """auto | f32 | bf16 | f16 | int8 | q4: how every rank holds its weights, unless [[rank]] precision
    overrides; auto: as the checkpoint stores them (q4 for a Q4_K_M GGUF's conversion, int8 for a
    Q8_0's, bf16 for a bf16 conversion, f32 for a float32 one)."""
    kv_cache: KvSpec = KvSpec("full")
    """Generation's KV cache: "none" (recompute the prefix), "full", or "window:W" (sliding-window
    attention over the last W positions: a different model from the checkpoint's)."""


@dataclass(frozen=True)
class PlacementSection:
    policy: PlacementPolicy = PlacementPolicy.BALANCED
    """uniform | memory | compute | balanced | manual."""
    reserve_ram_gb: float = 1.0
    """RAM left free on every rank for the OS and MPI buffers."""
    tp: int = 1
    """Tensor-parallel ranks per stage; the world is stages x tp ranks."""
    measure_gflops: bool = False
    """Time a short matmul on every rank at start-up (the compute policy needs it)."""
    manual: tuple[range, ...] = ()
    """With policy = "manual": one "a:b" layer range per stage, e.g. ["0:5", "5:8"]."""
    replicas: int | str = 1
    """Whole pipelines (stages x tp ranks each) sharing the prompts: an integer, or "auto" (the
    fewest stages whose memory holds the model, as many replicas as the ranks allow: `placement.plan_grid`)."""


@dataclass(frozen=True)
class RankOverride:
    rank: int
    """World rank this override applies to."""
    device: str = "cpu"
    precision: Precision | None = None
    """This rank's weight precision (auto: the checkpoint's stored format); None: the job's [run] precision."""
    kv_cache: KvSpec | None = None
    """This rank's kv_cache instead of [run] kv_cache (the ranks of one stage must agree)."""


PREFILL_CHUNK = 256  # [generate] prefill_chunk's default (see scheduler.py's chunked-prefill note)


@dataclass(frozen=True)
class GenerateSection:
    """``rlx-mpi generate`` settings; command-line flags override them."""

    prompts: Path | None = None
    """JSON-lines prompt file (--prompts)."""
    out: Path | None = None
    """JSON-lines completions file, appended to and resumed (--out)."""
    max_new_tokens: int = 32
    """New tokens per prompt at most (fewer when an end-of-sequence token comes)."""
    temperature: float = 0.0
    """0 = greedy; otherwise logits are divided by it before sampling."""
    top_k: int = 0
    """Sample among the k most likely tokens only (0 = off)."""
    top_p: float = 1.0
    """Sample among the most likely tokens whose mass reaches top_p (1 = off)."""
    seed: int | None = None
    """Seed of the draws (default [run] seed); with the prompt id and step it fixes every draw."""
    eos_id: int | None = None
    """End-of-sequence token id (default: every one the checkpoint names: generation_config.json,
    else the tokenizer's; none when neither does)."""
    logprobs: int = 0
    """Log-probabilities in each row: the chosen token's and the top K alternatives' (0 = none)."""
    batch: int = 4
    """Sequences per group (cache slots per group)."""
    groups: int = 0
    """Groups in flight; 0 = one per pipeline stage, so every stage has work during decode."""
    prefill_chunk: int = PREFILL_CHUNK
    """Positions per prefill step of a group whose prompts are all new (0 = the whole prompt in one
    step): the other groups decode between its chunks, so a long prompt does not stall them; a
    step that also decodes carries at most this many prefill positions in all."""
    sync_s: float = 2.0
    """Completed rows are fsynced to the output at least this often."""
    ignore_eos: bool = False
    """Run every row to its max tokens, past end-of-sequence ids (fixed-length benchmarks)."""
    prefix_cache: bool = True
    """Reuse the cached KV blocks of a prompt prefix computed before (docs/prefix-cache.md);
    false (or --no-prefix-cache): every prompt is prefilled whole."""
    structured: str | None = None
    """Structured output for every row that asks for none of its own: a vLLM ``structured_outputs``
    object as JSON text, or the path of a .json file holding one (docs/structured-output.md)."""
    kv_rows: int = 0
    """The KV budget in full-length rows (0 = groups x batch): with the block cache, rows take its
    blocks by what they use, so up to groups x batch shorter rows decode at once (docs/prefix-cache.md)."""


@dataclass(frozen=True)
class ScoreSection:
    """``rlx-mpi score`` settings; command-line flags override them."""

    prompts: Path | None = None
    """JSON-lines file of the lines to score (--prompts)."""
    out: Path | None = None
    """JSON-lines scores file, appended to and resumed (--out)."""
    batch: int = 2048
    """Padded tokens per microbatch (rows x longest line); the last stage holds batch x vocab logits."""
    sync_s: float = 2.0
    """Written rows are fsynced to the output at least this often."""
    prefix_cache: bool = True
    """Compute a context that lines begin with once and reuse its cached KV blocks
    (docs/prefix-cache.md); false (or --no-prefix-cache): every line is computed whole."""


@dataclass(frozen=True)
class JobConfig:
    """A validated job file."""

    path: Path
    model: ModelSection
    run: RunSection = field(default_factory=RunSection)
    placement: PlacementSection = field(default_factory=PlacementSection)
    ranks: tuple[RankOverride, ...] = ()
    generate: GenerateSection = field(default_factory=GenerateSection)
    score: ScoreSection = field(default_factory=ScoreSection)
    adapters: tuple[tuple[str, Path], ...] = ()
    """[adapters] name = "PEFT directory": LoRA adapters a request names (index 0.. in this order)."""

    def with_adapters(self, flags: list[str] | None, where: str = "generate --adapter") -> "JobConfig":
        """This job with ``--adapter NAME=DIR`` flags added (a name the job file has is replaced)."""
        if not flags:
            return self
        out = dict(self.adapters)
        for text in flags:
            name, path = rules.adapter_flag(text, where)
            out[name] = Path(os.path.expandvars(os.path.expanduser(path))).absolute()
        job = dataclasses.replace(self, adapters=tuple(out.items()))
        _check_adapters(job, where)
        return job

    def kv_for(self, rank: int) -> KvSpec:
        """The KV cache policy of ``rank``: its [[rank]] kv_cache, else [run] kv_cache."""
        return self.override_for(rank).kv_cache or self.run.kv_cache

    def override_for(self, rank: int) -> RankOverride:
        """The per-rank settings of ``rank`` (defaults when the job file names none)."""
        for o in self.ranks:
            if o.rank == rank:
                return o
        return RankOverride(rank=rank)

    def precision_for(self, rank: int) -> Precision:
        """The weight precision of world rank ``rank``: its [[rank]] override, else [run] precision
        (AUTO until `resolve_precision`; the start-up and ``plan`` resolve it before any use)."""
        return self.override_for(rank).precision or self.run.precision

    @property
    def asks_auto(self) -> bool:
        """Does any rank's precision say "auto" (the checkpoint's stored format)?"""
        return self.run.precision is Precision.AUTO or any(o.precision is Precision.AUTO for o in self.ranks)

    def resolve_precision(self, stored: Precision) -> "JobConfig":
        """This job with every "auto" precision replaced by ``stored`` (the checkpoint's stored
        format, `checkpoint.stored_precision`): the same job otherwise, so nothing past the
        start-up sees "auto"."""
        if stored is Precision.AUTO:
            raise ValueError("resolve_precision: the stored format is a concrete precision, not auto")
        if not self.asks_auto:
            return self
        auto = Precision.AUTO
        run = dataclasses.replace(self.run, precision=stored) if self.run.precision is auto else self.run
        ranks = tuple(dataclasses.replace(o, precision=stored) if o.precision is auto else o for o in self.ranks)
        return dataclasses.replace(self, run=run, ranks=ranks)

    def check_world(self, world_size: int) -> None:
        """Cross-check the job against the number of ranks actually launched."""
        tp = self.placement.tp
        rules.tp_divides_ranks(world_size, tp, f"{self.path}: [placement] tp")
        stages = world_size // tp
        if isinstance(self.placement.replicas, int):
            rules.replicas_divide(world_size, tp, self.placement.replicas, f"{self.path}: [placement] replicas")
            stages //= self.placement.replicas
        if self.placement.policy is PlacementPolicy.MANUAL:
            rules.manual_ranges_tile(self.placement.manual, f"{self.path}: [placement] manual", stages=stages,
                                     detail=f" ({_count(world_size, 'rank')} / tp {tp})")
        for o in self.ranks:
            if o.rank >= world_size:
                raise ConfigError(f"{self.path}: [[rank]] rank", f"rank = {o.rank} but only {world_size} ranks were launched",
                                  f"use ranks 0..{world_size - 1}")

    def check_layers(self, n_layers: int, world_size: int, tp: int | None = None) -> None:
        """Cross-check the placement against the model's layer count, once the checkpoint is read."""
        tp = tp or self.placement.tp
        replicas = self.placement.replicas
        if replicas != "auto":  # (auto picks at most n_layers stages itself)
            rules.stages_fit_layers(world_size // replicas, tp, n_layers, f"{self.path}: [placement]")
        if self.placement.policy is PlacementPolicy.MANUAL:
            rules.manual_ranges_tile(self.placement.manual, f"{self.path}: [placement] manual", n_layers=n_layers)


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


# -- loading ------------------------------------------------------------------------------------

_SECTIONS = {"model": ModelSection, "run": RunSection, "placement": PlacementSection, "generate": GenerateSection,
             "score": ScoreSection}
_POSITIVE = {"batch", "seq", "microbatches", "tp", "timeout_s", "startup_timeout_s", "max_new_tokens", "sync_s"}
_NON_NEGATIVE = {"reserve_ram_gb", "init_seed", "seed", "rank", "temperature", "top_k", "groups", "eos_id", "logprobs",
                 "prefill_chunk", "kv_rows"}
# Bounds far past any real job, so an absurd value is refused here instead of overflowing later
# (1e300 GB as bytes is not an integer; a 1e300 s wait is too long for a thread join).
_AT_MOST = {"batch": 2**31, "seq": 2**31, "microbatches": 2**31, "tp": 2**20, "rank": 2**31,
            "seed": 2**63 - 1, "init_seed": 2**63 - 1, "timeout_s": 1e7, "startup_timeout_s": 1e7,
            "reserve_ram_gb": 1e6, "logprobs": rules.LOGPROBS_MAX}
DEVICES = ("cpu",)  # [[rank]] device values that are implemented today


def load_job(path: str | os.PathLike) -> JobConfig:
    """Read and validate a job TOML file."""
    path = Path(path)
    where = str(path)
    if not path.exists():
        raise ConfigError(where, "job file not found", "check the path (jobs/tiny.toml is the example)")
    if not path.is_file():  # a directory, or a FIFO that would block every rank
        raise ConfigError(where, "is not a regular file", "give the path of a TOML job file")
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8-sig"))  # -sig: an editor's byte-order mark is fine
    except OSError as e:
        raise ConfigError(where, f"cannot read job file ({os.strerror(e.errno or 0).lower()})",
                          "check the file's permissions (and its folder's)") from None
    except UnicodeDecodeError as e:
        raise ConfigError(where, f"job file is not UTF-8 text ({e.reason} at byte {e.start})",
                          "save it as UTF-8") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(where, f"not valid TOML ({e})", "fix the syntax at that line") from None
    return parse_job(raw, path)


def parse_job(raw: dict[str, Any], path: Path) -> JobConfig:
    """Validate an already-parsed TOML document; ``path`` anchors relative paths and messages."""
    path = Path(path)
    where = str(path)
    unknown = sorted(set(raw) - set(_SECTIONS) - {"rank", "adapters"})
    if unknown:
        raise ConfigError(where, f"unknown section [{unknown[0]}]",
                          f"expected sections {sorted([*_SECTIONS, 'adapters', 'rank'])}")
    if "model" not in raw:
        raise ConfigError(where, "missing section [model]", 'add [model] with checkpoint = "path/to/model.h5"')
    sections = {}
    for name, cls in _SECTIONS.items():
        table = raw.get(name, {})
        if not isinstance(table, dict):
            raise ConfigError(f"{where}: {name}", f"expected a table [{name}], got {type(table).__name__}")
        sections[name] = _build(cls, table, f"{where}: [{name}]", path)
    overrides = raw.get("rank", [])
    if not isinstance(overrides, list):
        raise ConfigError(f"{where}: rank", "expected an array of tables [[rank]]", "write each override as [[rank]] with rank = N")
    ranks = tuple(_build(RankOverride, o, f"{where}: [[rank]] #{i + 1}", path) for i, o in enumerate(overrides))
    for i, o in enumerate(ranks):
        if o.device not in DEVICES:  # a device that would be ignored, and then shown in the table
            raise ConfigError(f"{where}: [[rank]] #{i + 1} device", f"got {o.device!r}",
                              f"expected one of {list(DEVICES)} (the devices implemented today)")
    seen = set()
    for o in ranks:
        if o.rank in seen:
            raise ConfigError(f"{where}: [[rank]] rank", f"rank {o.rank} is overridden twice", "merge the two [[rank]] tables")
        seen.add(o.rank)
    table = raw.get("adapters", {})
    if not isinstance(table, dict):
        raise ConfigError(f"{where}: adapters", f"expected a table [adapters], got {type(table).__name__}",
                          'write [adapters] with one name = "path/to/peft_adapter_dir" per line')
    adapters = tuple((rules.adapter_name(k, f"{where}: [adapters]"),
                      _coerce(k, "Path", v, f"{where}: [adapters] {k}", path)) for k, v in table.items())
    job = JobConfig(path=path, ranks=ranks, adapters=adapters, **sections)
    _cross_check(job)
    return job


def _check_adapters(job: JobConfig, where: str) -> None:
    """An adapter may not take the base model's name (a request naming it would be ambiguous)."""
    for name, _ in job.adapters:
        if name in job.model.base_names:
            raise ConfigError(f"{where} {name}", "is the base model's name (what a request's \"model\" gives "
                              "for no adapter)", "give the adapter another name, or set [model] name")


def _cross_check(job: JobConfig) -> None:
    where = f"{job.path}: [placement]"
    p = job.placement
    if p.policy is PlacementPolicy.MANUAL and not p.manual:
        raise ConfigError(f"{where} manual", 'policy = "manual" needs manual ranges',
                          'add manual = ["0:4", "4:8"], one "a:b" per stage')
    rules.manual_ranges_tile(p.manual, f"{where} manual")  # the model's layer count is checked at load
    if p.manual and p.policy is not PlacementPolicy.MANUAL:
        raise ConfigError(f"{where} manual", f'manual ranges are given but policy = "{p.policy.value}"',
                          'set policy = "manual" or remove manual')
    if p.policy is PlacementPolicy.COMPUTE and not p.measure_gflops:
        raise ConfigError(f"{where} policy", 'policy = "compute" needs measured speeds',
                          "set measure_gflops = true or choose another policy")
    _check_adapters(job, f"{job.path}: [adapters]")
    rules.microbatches_fit(job.run.microbatches, job.run.batch, f"{job.path}: [run] microbatches")
    if job.run.wire not in WIRE_FORMATS:
        raise ConfigError(f"{job.path}: [run] wire", f"got {job.run.wire!r}", f"expected one of {list(WIRE_FORMATS)}")
    if job.run.startup_timeout_s < job.run.timeout_s:
        raise ConfigError(f"{job.path}: [run] startup_timeout_s",
                          f"{job.run.startup_timeout_s} is shorter than timeout_s = {job.run.timeout_s}",
                          "make startup_timeout_s at least timeout_s")


def _build(cls, table: dict, where: str, job_path: Path):
    if not isinstance(table, dict):
        raise ConfigError(where, f"expected a table, got {type(table).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(table) - set(fields))
    if unknown:
        raise ConfigError(f"{where} {unknown[0]}", "unknown key", f"expected one of {sorted(fields)}")
    values = {}
    for name, f in fields.items():
        if name not in table:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise ConfigError(f"{where} {name}", "missing required key", f"add {name} = ...")
            continue
        values[name] = _coerce(name, f.type, table[name], f"{where} {name}", job_path)
    return cls(**values)


def _coerce(name: str, type_name: str, value: Any, where: str, job_path: Path) -> Any:
    """Check one value against its field's annotated type (a string, under __future__ annotations)."""
    t = type_name.replace(" | None", "")
    if t == "Path":
        if not isinstance(value, str) or not value:
            raise ConfigError(where, f"got {value!r}, expected a path string")
        p = Path(os.path.expandvars(os.path.expanduser(value)))
        return p if p.is_absolute() else Path(os.path.normpath(job_path.parent / p))
    if t == "str":
        if not isinstance(value, str):
            raise ConfigError(where, f"got {value!r}, expected a string")
        return value
    if t == "bool":
        if not isinstance(value, bool):
            raise ConfigError(where, f"got {value!r}, expected true or false")
        return value
    if t == "int":
        if not isinstance(value, int) or isinstance(value, bool):
            raise ConfigError(where, f"got {value!r}, expected an integer")
        _check_range(name, value, where)
        return value
    if t == "float":
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise ConfigError(where, f"got {value!r}, expected a number")
        if value != value or value in (float("inf"), float("-inf")):
            raise ConfigError(where, f"got {value!r}, expected a finite number")
        _check_range(name, value, where)
        return float(value)
    if t == "int | str":  # [placement] replicas, the one such field
        return rules.replicas_value(value, where)
    if t == "KvSpec":
        return KvSpec.parse(value, where)
    enums = {"PlacementPolicy": PlacementPolicy, "Precision": Precision, "OnRankFailure": OnRankFailure}
    if t in enums:
        choices = [m.value for m in enums[t]]
        if t == "Precision":  # auto, or a precision (rules.PRECISIONS, or a numpy spelling)
            value = value if value == "auto" else rules.precision_name(value, where, auto=True)
        if value not in choices:
            raise ConfigError(where, f"got {value!r}", f"expected one of {choices}")
        return enums[t](value)
    if t == "tuple[str, ...]":
        if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
            raise ConfigError(where, f"got {value!r}, expected a list of module names")
        return tuple(value)
    if t == "tuple[range, ...]":
        if not isinstance(value, list):
            raise ConfigError(where, f"got {value!r}, expected a list of \"a:b\" strings")
        return tuple(_parse_range(v, where) for v in value)
    raise AssertionError(f"unhandled field type {type_name}")  # internal invariant


def _check_range(name: str, value: float, where: str) -> None:
    if name in _AT_MOST and value > _AT_MOST[name]:
        raise ConfigError(where, f"got {value!r}, expected a value <= {_AT_MOST[name]:g}")
    if name in _POSITIVE and value <= 0:
        raise ConfigError(where, f"got {value!r}, expected a value > 0")
    if name in _NON_NEGATIVE and value < 0:
        raise ConfigError(where, f"got {value!r}, expected a value >= 0")


def _parse_range(text: Any, where: str) -> range:
    try:
        a, b = (int(x) for x in text.split(":"))
    except (AttributeError, ValueError):
        raise ConfigError(where, f"got {text!r}, expected a layer range \"a:b\" such as \"0:4\"") from None
    if not 0 <= a < b:
        raise ConfigError(where, f"range {text!r} is empty or negative", "use \"a:b\" with 0 <= a < b")
    return range(a, b)
