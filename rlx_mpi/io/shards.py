"""``--shard K/N`` and ``rlx-mpi merge``: one prompt file split across jobs, the outputs joined.

A Slurm job array (``--array=1-N``, ``--shard $SLURM_ARRAY_TASK_ID/$SLURM_ARRAY_TASK_COUNT``),
or backfill jobs of any size, each take one part of the prompt file; each writes its own
resumable output (the same journal as one job); `merge` joins them into the file one job would
have written, with its sidecar record, so it reads and resumes as that one. Exactly what is
equal: a ``score`` output and its record, byte for byte; a ``generate`` output's record byte for
byte, and every row but its ``ms`` (the milliseconds the row took in the job that made it, which
no two runs share: the rows' tokens, text, finish reason, log-probs and digests are equal), in
the same order (tests/test_replicas_mpi.py checks both).

Note: contiguous ranges, not every N-th line. Shard K of N holds prompts
``[floor((K-1) n / N), floor(K n / N))`` of the file's n prompts. Each shard's output is then a
piece of the one job's output, in order, and merging is concatenation in shard order (what a
user who split the file by hand with ``split -n l/N`` and joined with ``cat`` would expect); a
shard's output also reads on its own as consecutive lines of the input. Interleaving (line i to
shard i mod N) balances a file sorted by length better, but its outputs are not pieces of the
whole and every reader would need the merge. Shards differ by at most one prompt.

Note: what merge refuses. Every shard's sidecar records the run identity (checkpoint, sampling,
max new tokens: `identity.RunIdentity`) and which part it is (K, N, its line range, the file's
prompt count). Merge refuses, in one line naming the file: a file without that record (not a
``--shard`` output), shards whose identities differ (another model or sampling: the first
differing setting is named), shards of different splits (N or prompt count), a shard missing
or given twice, a shard not complete (fewer rows than its prompts: resume it first), and an
output path that exists or is one of the inputs. It writes the output and its record to
temporary files and renames them: nothing is ever overwritten, no input is touched.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Sequence

from ..errors import ConfigError, InputError

__all__ = ["parse_shard", "shard_range", "select", "merge"]


def parse_shard(text: str | None, where: str) -> tuple[int, int] | None:
    """``"K/N"`` -> (K, N) with 1 <= K <= N; None when not given."""
    if text is None:
        return None
    try:
        k, n = (int(x) for x in str(text).split("/"))
    except ValueError:
        raise ConfigError(where, f"got {text!r}", "give K/N, e.g. --shard 2/8 for the second of eight parts "
                          "(under a Slurm array: $SLURM_ARRAY_TASK_ID/$SLURM_ARRAY_TASK_COUNT)") from None
    if not 1 <= k <= n or n > 1_000_000:
        raise ConfigError(where, f"got {text!r}", "give K/N with 1 <= K <= N (shards are numbered from 1)")
    return k, n


def shard_range(total: int, k: int, n: int) -> range:
    """The prompts (0-based positions) of shard ``k`` of ``n`` of ``total`` (the contiguous note)."""
    return range((k - 1) * total // n, k * total // n)


def select(prompts: Sequence, shard: tuple[int, int] | None, where: str) -> tuple[list, dict | None]:
    """Shard ``shard``'s prompts, renumbered from 0 (as the journal wants its prompt list), and
    the record its output's sidecar keeps; all of them and None without a shard."""
    if shard is None:
        return list(prompts), None
    k, n = shard
    if n > len(prompts):
        raise InputError(where, f"--shard {k}/{n}: the prompt file has only {len(prompts)} prompts, so some of "
                         f"the {n} shards would be empty", f"use at most {len(prompts)} shards")
    part = shard_range(len(prompts), k, n)
    mine = [dataclasses.replace(p, index=i) for i, p in enumerate(prompts[part.start:part.stop])]
    return mine, {"k": k, "n": n, "lines": [part.start, part.stop], "of": len(prompts)}


def _read_meta(path: Path) -> dict:
    from .identity import META_FORMAT, RunIdentity, meta_path

    meta = meta_path(path)
    where = f"merge {path}"
    if not path.is_file():
        raise InputError(where, "not found" if not path.exists() else "is not a regular file",
                         "give the output files of the shard jobs")
    try:
        doc = json.loads(meta.read_bytes())
        if doc.get("format") != META_FORMAT or doc.get("version") != 1:
            raise ValueError("not our record")
        doc["identity"] = RunIdentity.from_json(doc)
    except FileNotFoundError:
        raise InputError(where, f"has no record of how it was made ({meta} is missing)",
                         "give outputs written by rlx-mpi generate/score --shard K/N") from None
    except (OSError, ValueError, AttributeError) as e:
        raise InputError(where, f"{meta} is not a record rlx-mpi wrote ({e})",
                         "give outputs written by rlx-mpi generate/score --shard K/N") from None
    shard = doc.get("shard")
    if not (isinstance(shard, dict) and {"k", "n", "lines", "of"} <= set(shard)):
        raise InputError(where, "is not a shard's output (its record names no shard)",
                         "give outputs of runs with --shard K/N; an unsharded output is complete already")
    if not isinstance(doc.get("prompts"), dict):
        raise InputError(where, f"{meta} has no prompt digests", "give outputs written by rlx-mpi --shard K/N")
    return doc


def _rows(path: Path, ids: list[str]) -> bytes:
    """The shard's bytes, checked to be one whole row per prompt of its part, in order."""
    from .journal import _row_id

    data = path.read_bytes()
    where = f"merge {path}"
    lines = data.split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()
    elif data:
        raise InputError(where, "its last row is cut short (a job killed while writing it)",
                         "rerun that shard's job to resume it, then merge")
    got = [_row_id(line + b"\n") for line in lines]
    if len(got) < len(ids):
        raise InputError(where, f"holds {len(got)} of its {len(ids)} rows (the shard did not finish)",
                         "rerun that shard's job to resume it, then merge")
    if got != ids:
        bad = next((i for i, (a, b) in enumerate(zip(got, ids)) if a != b), len(ids))
        raise InputError(f"{where}:{bad + 1}", "its rows do not match its record's prompts (edited, or "
                         "another run's file?)", "rerun that shard into a new file")
    return data


def merge(out: str | os.PathLike, shards: Sequence[str | os.PathLike]) -> dict:
    """Join the complete outputs of shards 1..N of one run into ``out`` (and its sidecar): the
    file and record one unsharded job would have written. Returns a summary (rows, shards)."""
    from .identity import meta_bytes, meta_path
    from ..outputs import check_output

    if not shards:
        raise ConfigError("merge", "no shard outputs given", "give OUT then every shard's output file")
    paths = [Path(s) for s in shards]
    out = Path(out)
    inputs = {f"the shard output {p}": p for p in paths}
    inputs.update({f"the record {meta_path(p)}": meta_path(p) for p in paths})
    check_output("merge OUT", out, inputs, stream_ok=False)
    for target in (out, meta_path(out)):
        if target.exists():
            raise ConfigError(f"merge OUT {target}", "exists already", "choose a new output path "
                              "(merge never overwrites a file)")
    docs = [_read_meta(p) for p in paths]
    first = docs[0]
    mine = first["identity"].fields()
    for p, d in zip(paths[1:], docs[1:]):
        theirs = d["identity"].fields()
        for name in [*mine, *(n for n in theirs if n not in mine)]:
            a, b = theirs.get(name, "(not set)"), mine.get(name, "(not set)")
            if a != b:
                raise InputError(f"merge {p}", f"was made with {name} {a!r} but {paths[0]} with {b!r}: another run",
                                 "merge only the shards of one run (same model and settings)")
        for key in ("n", "of"):
            if d["shard"][key] != first["shard"][key]:
                what = "shards" if key == "n" else "prompts in its file"
                raise InputError(f"merge {p}", f"is a shard of a split into {d['shard'][key]} {what}, "
                                 f"{paths[0]} of {first['shard'][key]}", "merge the shards of one split")
    n = first["shard"]["n"]
    by_k: dict[int, Path] = {}
    for p, d in zip(paths, docs):
        k = d["shard"]["k"]
        if k in by_k:
            raise InputError(f"merge {p}", f"is shard {k}/{n} again ({by_k[k]} is too)", "give each shard once")
        by_k[k] = p
    missing = [k for k in range(1, n + 1) if k not in by_k]
    if missing:
        raise InputError("merge", f"shard{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))} of {n} "
                         f"missing", "give every shard's output (run the missing shards first)")
    total = first["shard"]["of"]
    parts, digests = [], {}
    for k in range(1, n + 1):
        d = docs[paths.index(by_k[k])]
        if d["shard"]["lines"] != [shard_range(total, k, n).start, shard_range(total, k, n).stop]:
            raise InputError(f"merge {by_k[k]}", f"holds lines {d['shard']['lines']}, not shard {k}/{n}'s",
                             "its record was edited; rerun that shard")
        parts.append(_rows(by_k[k], list(d["prompts"])))
        digests.update(d["prompts"])
    meta = meta_bytes(first["identity"], digests)
    tmp_meta = meta_path(out).with_name(f".{meta_path(out).name}.tmp{os.getpid()}")
    tmp_out = out.with_name(f".{out.name}.tmp{os.getpid()}")
    try:
        tmp_meta.write_bytes(meta)
        with open(tmp_out, "wb") as f:
            for part in parts:
                f.write(part)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp_meta, meta_path(out))  # the record first, as the journal writes it
        os.replace(tmp_out, out)
    except OSError as e:
        from ..outputs import write_failed

        raise write_failed(f"merge OUT {out}", e) from None
    finally:
        for t in (tmp_meta, tmp_out):
            t.unlink(missing_ok=True)
    return {"rows": len(digests), "shards": n}
