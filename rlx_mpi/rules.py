"""Every validation rule the core states in more than one place, named once with its fix text.

Each function raises the project's error (`errors.py`: one line ``<where>: <what>; <fix>``, exit
code 2) naming ``where``, the flag or job-file key the value came from; the caller chooses
``where``, the rule chooses the words. Rules of one input only (a job file's key range, an
output path) live beside that input (`config.py`, `outputs.py`); the start-up deadline's
default is `DEFAULT_STARTUP_TIMEOUT_S` below; preset names are `families.require_preset`.

Note: numpy-free and import-light, so `config.py` and `cli.py` use it before a rank is known
to have a working numpy.
"""

from __future__ import annotations

from typing import Any, Sequence

from .errors import ConfigError, InputError

__all__ = ["PRECISIONS", "WIRE_FORMATS", "precision_name", "tp_divides_ranks", "stages_fit_layers",
           "manual_ranges_tile", "seq_fits", "ids_array", "microbatches_fit", "int_at_least", "at_most",
           "token_in_vocab", "LOGPROBS_MAX", "adapter_name", "adapter_flag", "replicas_value", "replicas_divide", "DEFAULT_STARTUP_TIMEOUT_S"]

DEFAULT_STARTUP_TIMEOUT_S = 600.0  # [run] startup_timeout_s: the one default (also before the job file is read)

PRECISIONS = ("f32", "bf16", "f16", "int8", "q4")  # how a rank holds its weights (config.Precision)
_PRECISION_ALIASES = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}  # numpy-style spellings
LOGPROBS_MAX = 20  # generate --logprobs K: top alternatives per token at most (as OpenAI's and vLLM's APIs)
WIRE_FORMATS = ("f32", "bf16", "f16")  # wire.py's codecs, named here so the job file is checked without numba


ADAPTER_NAME_CHARS = "letters, digits and . _ - : /"  # a request's "model" names an adapter: ft:org/name-1


def adapter_name(name: Any, where: str) -> str:
    """A LoRA adapter's name as a job file or ``--adapter`` gives it (requests name it: a line's
    "model", our "adapter")."""
    import re

    if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9._:/-]{1,200}", name):
        raise ConfigError(where, f"adapter name {name!r}", f"use 1-200 {ADAPTER_NAME_CHARS}")
    return name


def adapter_flag(text: str, where: str) -> tuple[str, str]:
    """``--adapter NAME=PATH`` as (name, path)."""
    name, eq, path = text.partition("=")
    if not eq or not path:
        raise ConfigError(where, f"got {text!r}", "pass --adapter NAME=DIR (a PEFT adapter directory)")
    return adapter_name(name, where), path


def precision_name(value: Any, where: str, *, auto: bool = False) -> str:
    """The canonical precision name of ``value`` (f32 | bf16 | f16 | int8 | q4, or a numpy spelling);
    ``auto``: the caller also takes "auto" (a job file's precision), so the fix names it."""
    name = _PRECISION_ALIASES.get(value, value) if isinstance(value, str) else value
    if name not in PRECISIONS:
        choices = ["auto", *PRECISIONS] if auto else list(PRECISIONS)
        raise ConfigError(where, f"got {value!r}", f"expected one of {choices}"
                          + (" (auto: the checkpoint's stored format)" if auto else ""))
    return name


def tp_divides_ranks(ranks: int, tp: int, where: str, *, launched: bool = True) -> None:
    """The world is cut into stages of ``tp`` ranks: ``tp`` must divide it."""
    if tp < 1 or ranks % tp:
        who = "launched ranks" if launched else "ranks"
        raise ConfigError(where, f"tp = {tp} does not divide the {ranks} {who}",
                          f"use a multiple of {tp} ranks (e.g. {tp * max(1, ranks // max(tp, 1))}), or another tp")


def stages_fit_layers(ranks: int, tp: int, n_layers: int, where: str) -> None:
    """Every stage holds at least one layer: at most ``n_layers`` stages of ``tp`` ranks."""
    stages = ranks // tp
    if stages > n_layers:
        layers = f"{n_layers} layer" + ("s" if n_layers != 1 else "")
        raise ConfigError(where, f"{stages} stages ({ranks} ranks / tp {tp}) but the model has only {layers}",
                          f"use at most {n_layers} stages: at most {n_layers * tp} ranks, or a larger tp")


def manual_ranges_tile(manual: Sequence[range], where: str, *, n_layers: int | None = None,
                       stages: int | None = None, detail: str = "") -> None:
    """``[placement] manual``: one "a:b" range per stage, each starting where the previous one
    stops, from layer 0 to the model's last (checked once ``n_layers`` is known)."""
    if stages is not None and len(manual) != stages:
        raise ConfigError(where, f"{_count(len(manual), 'range')} for {_count(stages, 'stage')}{detail}",
                          f"give one range per stage, e.g. manual = {_example(stages, n_layers)}")
    prev = 0
    for s, rg in enumerate(manual):
        if rg.start != prev:
            what = (f"gap: layers {prev}:{rg.start} are in no stage" if rg.start > prev else
                    f"overlap: layers {rg.start}:{prev} are in stage {s} and in an earlier stage")
            raise ConfigError(where, f"{what} (stage {s} is \"{rg.start}:{rg.stop}\")",
                              f'start each range where the previous one stops, e.g. "{prev}:{max(rg.stop, prev + 1)}"'
                              if s else f'start the first range at layer 0, e.g. "0:{rg.stop}"')
        prev = rg.stop
    if n_layers is not None and manual and prev != n_layers:
        what = (f"the ranges stop at layer {prev} but the model has {n_layers} layers (layers {prev}:{n_layers} are "
                "in no stage)" if prev < n_layers else
                f"the ranges run to layer {prev} but the model has only {n_layers} layers")
        raise ConfigError(where, what,
                          f'make the last range end at {n_layers}, e.g. "{manual[-1].start}:{n_layers}"')


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


def _example(stages: int, n_layers: int | None) -> str:
    n = n_layers or 4 * stages
    cuts = [round(i * n / stages) for i in range(stages + 1)]
    return "[" + ", ".join(f'"{a}:{b}"' for a, b in zip(cuts, cuts[1:])) + "]"


def seq_fits(seq: int, max_positions: int, where: str, error: type = InputError) -> None:
    """A sequence (prompt + new tokens) fits the model's positions."""
    if seq > max_positions:
        raise error(where, f"sequence length {seq} exceeds the model's maximum {max_positions} positions",
                    "truncate or split the sequences")


def ids_array(dtype: Any, shape: tuple[int, ...], where: str) -> None:
    """Input ids are an integer array [batch, seq] (``dtype`` a numpy dtype)."""
    if getattr(dtype, "kind", "") not in "iu" or not getattr(dtype, "kind", ""):
        raise InputError(where, f"input ids have dtype {dtype}", "save them as an integer array (np.int64)")
    if len(shape) != 2:
        raise InputError(where, f"input ids have shape {tuple(shape)}, expected 2-D [batch, seq]",
                         "reshape to [batch, seq], e.g. ids[None, :] for one sequence")


def microbatches_fit(microbatches: int, batch: int, where: str, error: type = ConfigError) -> None:
    """Uneven splits are fine (the last microbatches one row smaller); empty microbatches are not."""
    if microbatches > batch:
        raise error(where, f"{microbatches} microbatches for batch = {batch}",
                    "use at most one microbatch per sequence (lower [run] microbatches)")


def int_at_least(value: int | None, low: int, where: str) -> None:
    """A count given on the command line or in a job file: None (not given) or >= ``low``."""
    if value is not None and value < low:
        raise ConfigError(where, f"got {value}", f"give an integer >= {low}")


def at_most(value: float | None, most: float, where: str) -> None:
    """Bounds far past any machine, so absurd values are refused instead of overflowing."""
    if value is not None and value > most:
        raise ConfigError(where, f"got {value}", f"give at most {most:g}")


def token_in_vocab(value: int | None, vocab_size: int, where: str, fix: str = "", error: type = ConfigError) -> None:
    """A token id given by the user (an end-of-sequence id): None (not given) or in [0, vocab_size)."""
    if value is not None and not 0 <= value < vocab_size:
        raise error(where, f"got {value}, but the model's vocabulary has {vocab_size} tokens (ids 0..{vocab_size - 1})",
                    fix or f"give an id in [0, {vocab_size})")


def replicas_value(value: Any, where: str) -> int | str:
    """``[placement] replicas`` / ``--replicas``: "auto" or an integer >= 1 (a numeric string too)."""
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if value == "auto" or (isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= 2**20):
        return value
    raise ConfigError(where, f"got {value!r}", 'expected "auto" or an integer >= 1 (whole pipelines working '
                      "through the prompts side by side)")


def replicas_divide(ranks: int, tp: int, replicas: int, where: str) -> None:
    """A replica is stages x tp ranks, every replica alike: replicas x tp must divide the ranks."""
    if ranks % tp or (ranks // tp) % replicas:
        raise ConfigError(where, f"{replicas} replicas of tp {tp} do not divide the {ranks} ranks",
                          f"launch a multiple of {replicas * tp} ranks, or choose replicas dividing "
                          f"{ranks // max(tp, 1)} (or \"auto\")")
