"""Structured output's inputs: the job-wide constraint (``--structured`` / ``[generate]
structured``), and the grammar engine built from the checkpoint's tokenizer, on rank 0 (to check
each request while the file is read) and on the last stage (to mask its rows). The engine itself,
the request keys and the masks are `engine.constraints` (docs/structured-output.md)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Iterable

from ..errors import ConfigError, InputError

__all__ = ["job_constraint", "grammars_for", "last_stage_masks"]


def job_constraint(flag: str | None, value: str | None, job_path: Any) -> dict:
    """The job-wide constraint (--structured, else [generate] structured) as GenerateOptions
    fields: JSON text, or the path of a .json file (the job's key: relative to the job file)
    holding a structured_outputs object; {} when neither is given."""
    from ..engine.constraints import ConstraintError, parse_structured

    spec, where = (flag, "generate --structured") if flag is not None else (value, f"{job_path}: [generate] structured")
    if spec is None:
        return {}
    text = spec.strip()
    if not text.startswith("{"):
        path = Path(text).expanduser()
        if flag is None and not path.is_absolute():
            path = Path(job_path).parent / path
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as e:
            raise ConfigError(where, f"{spec!r} is not JSON and cannot be read as a file ({e.strerror})",
                              "give a structured_outputs object as JSON text, or the path of a .json file holding one")
        where = f"{where} ({path})"
    try:
        obj = json.loads(text)
    except ValueError as e:
        raise ConfigError(where, f"not JSON ({e})", 'give e.g. {"json": {"type": "object"}}') from None
    try:
        c = parse_structured(obj, "the structured_outputs object")
    except ConstraintError as e:
        raise ConfigError(where, e.message, "docs/structured-output.md shows each kind") from None
    return {"structured": c, "structured_where": where}


def grammars_for(tokenizer: Any, vocab_size: int, eos: list[int], where: str, ignore_eos: bool = False) -> Any:
    """The job's grammar engine (`engine.constraints.Grammars`), or the error that says why a job
    that asks for structured output cannot have one."""
    from ..engine.constraints import Grammars

    if not eos:
        why = "--ignore-eos runs every row past its end" if ignore_eos else \
            "the checkpoint names no end-of-sequence id (generation_config.json / tokenizer_config.json)"
        raise ConfigError(where, f"asks for structured output, which ends a row at an end-of-sequence id, but {why}",
                          "drop --ignore-eos (or [generate] ignore_eos), or give --eos-id")
    if tokenizer is None:
        raise InputError(where, "asks for structured output, which needs the checkpoint's tokenizer",
                         "put the model's tokenizer.json next to the checkpoint (rlx-mpi convert copies it)")
    return Grammars(Path(tokenizer.path).read_text(encoding="utf-8"), vocab_size, list(eos), where)


def last_stage_masks(checkpoint: Any, vocab_size: int, eos: list[int], where: str, ignore_eos: bool,
                     constraints: Iterable[Any]) -> Any:
    """The last stage's `engine.constraints.GrammarMasks`, every distinct constraint compiled
    before the first step (off the step path), llguidance's mask threads as many as the rank's
    cores."""
    from ..engine.constraints import GrammarMasks
    from .tokenizer import load_tokenizer

    g = grammars_for(load_tokenizer(checkpoint), vocab_size, eos, where, ignore_eos)
    for c in {c.key: c for c in constraints}.values():
        g.matcher(c)
    return GrammarMasks(g, threads=max(1, len(os.sched_getaffinity(0))))
