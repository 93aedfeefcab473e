"""What made a job's rows: the run identity, recorded beside the output and in every row.

Note: what made the rows. Resuming into a file whose rows were made another way (another
checkpoint, temperature, ``--max-new-tokens``, or another prompt under a done id) would leave
two experiments under one name, so a journal opened with a `RunIdentity` keeps a sidecar
``<out>.meta.json`` (one JSON object, replaced atomically) that records the identity and a
digest of every prompt's tokens. A sidecar, not a leading record, so that every line of the
completions file stays one completion for readers (``pandas.read_json(lines=True)``, ``jq``).
Opening a file that already holds rows compares: the first setting that differs is refused in
one line naming both values and how to start afresh. The layout (ranks, tensor parallelism,
replicas, batch, groups, threads) is not part of it: rows are the same on any layout, so a
resume may run on another allocation. The model is identified without hashing a 100 GB file: its
family, a digest of its config, its size in bytes, and a digest of every tensor's name, shape,
dtype and first and last 1024 values (`model_identity`); a copy of the file is the same model,
a fine-tune (or a single edited weight in a tensor's first or last row) is another.

Note: settings stated per rank, said per layer. ``precision`` and ``kv_cache`` may differ by
rank (``[[rank]]``), and which layers a rank holds is the layout's choice; what the rows
depend on is each *layer's* precision and cache policy, so `layout_settings` records those
(once the job is placed: `Journal.settle`, before any compute), and a resume on another
layout that gives every layer the same is accepted. The wire codec rounds the hidden state
only where stages are cut: ``f32`` is lossless and a single stage sends nothing, so both are
recorded as ``"f32"``; a lossy codec is recorded with its cut layers (``"bf16 before layers
4"``), as moving a cut moves the rounding. The tokenizer and chat template (digests of the
files beside the checkpoint) fix a text prompt's tokens and a row's text.

Note: the file alone resumes. Every row ends with `ROW_IDENTITY`: 64 bits of the digest of
the whole identity and the row's prompt digest (`RunIdentity.row_digest`). A key, not a header
line, so that the file stays one plain row per prompt for every reader. The sidecar stays
the fast check that can *name* the setting that differs; without it (a ``.jsonl`` copied
alone) each row's digest says whether this run makes it, and a file with no digests at all
(an older rlx-mpi's) is resumed only when adopted (``--adopt-output``: recorded as
``"adopted"`` rows in the new sidecar). Every refusal's advice works as written (tests follow it);
`journal.Journal` does the checking.

Note: the kernels' arithmetic. The invariance contract (docs/invariance.md) fixes each element's
float operations and their order, so rows depend on the code's kernels too: a release that changes
any kernel's per-element arithmetic (not its speed) bumps `NUMERICS`, which every identity records,
so a job started before the change is not resumed with rows of the new arithmetic appended
(an older record without it is refused unless adopted, ``--adopt-output``).
"""

from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

__all__ = ["RunIdentity", "model_identity", "prompt_digest", "digest_of", "meta_path", "meta_bytes", "META_FORMAT",
           "ROW_IDENTITY", "layout_settings", "unplaced_settings", "beside_settings", "NUMERICS"]

NUMERICS = 2  # the kernels' arithmetic (the note above); 2: attention in float32 throughout, q4 in one order

META_FORMAT = "rlx_mpi.journal"  # the sidecar's "format"; "version" 1
ROW_IDENTITY = "identity"  # the key of each row's digest of (run identity, its prompt): the file alone resumes
_SAMPLE = 1024  # values read from each end of every tensor for the model's identity


def meta_path(out) -> Path:
    """The sidecar of completions file ``out``: ``<out>.meta.json``."""
    out = Path(out)
    return out.with_name(out.name + ".meta.json")


def prompt_digest(tokens: Sequence[int], *extra: int) -> str:
    """64 bits (hex) of the sha256 of a prompt's token ids (and ``extra`` ints, e.g. where a
    scored continuation starts), as little-endian int64: the same on every platform."""
    import numpy as np

    data = np.asarray([*tokens, -1, *extra] if extra else list(tokens), dtype="<i8").tobytes()
    return hashlib.sha256(data).hexdigest()[:16]


def meta_bytes(identity: "RunIdentity", digests: dict, shard: dict | None = None, adopted: int = 0) -> bytes:
    """The sidecar's bytes: the run identity, every prompt's digest (in prompt order) and, for a
    ``--shard`` output, which part of the prompt file it holds (`shards.py`); ``adopted``: the
    first rows carry no identity digest and were taken as this run's (``--adopt-output``)."""
    doc = {"format": META_FORMAT, "version": 1, **identity.to_json(), "prompts": digests}
    if shard is not None:
        doc["shard"] = shard
    if adopted:
        doc["adopted"] = adopted
    return json.dumps(doc, ensure_ascii=False, separators=(",", ":")).encode("utf-8") + b"\n"


def model_identity(checkpoint) -> dict:
    """What identifies a checkpoint's model, cheaply: see the module's note.

    ``{"family", "config_sha256", "bytes", "tensors_sha256"}``; reads the header and 2 x 1024
    values of each tensor (a few MB for a 70B model), never the whole file.
    """
    import h5py
    import numpy as np

    from ..model.checkpoint import _open, read_header

    path = Path(checkpoint)
    family, config = read_header(path)
    h = hashlib.sha256()
    with _open(path) as f:
        names: list[str] = []
        f.visititems(lambda name, obj: names.append(name) if isinstance(obj, h5py.Dataset) else None)
        for name in sorted(names):
            ds = f[name]
            h.update(f"{name}\0{ds.shape}\0{ds.dtype.str}\0{ds.attrs.get('dtype', '')}\0".encode())
            if ds.size == 0:
                continue
            if ds.ndim == 0:
                h.update(np.ascontiguousarray(ds[()]).tobytes())
                continue
            k = min(_SAMPLE, ds.shape[-1])
            lead = (0,) * (ds.ndim - 1)
            last = tuple(n - 1 for n in ds.shape[:-1])
            h.update(np.ascontiguousarray(ds[lead + (slice(0, k),)]).tobytes())
            h.update(np.ascontiguousarray(ds[last + (slice(ds.shape[-1] - k, None),)]).tobytes())
    return {"family": family, "config_sha256": hashlib.sha256(config.encode("utf-8")).hexdigest()[:16],
            "bytes": path.stat().st_size, "tensors_sha256": h.hexdigest()[:16]}


@dataclass(frozen=True)
class RunIdentity:
    """What determines a job's rows, recorded beside its output and checked on resume.

    ``model`` is `model_identity` of the checkpoint; ``settings`` the plain-JSON values that
    change the rows (sampling, max new tokens, eos ids, logprobs). Nothing about the layout.
    Build one with `for_generate` or `for_score`.
    """

    command: str  # "generate" | "score": one file never holds both
    model: dict = field(default_factory=dict)
    settings: dict = field(default_factory=dict)

    @classmethod
    def for_generate(cls, checkpoint, sampling: Any, max_new_tokens: int, eos_ids: Iterable[int] = (),
                     logprobs: int = 0, sampled: bool = False) -> "RunIdentity":
        """``sampling`` is a `SamplingParams`; at temperature 0 (greedy) its top_k, top_p and
        seed change nothing, so they are not recorded (a greedy rerun with another seed resumes)
        unless ``sampled``: some row samples with its own temperature and the job's other
        settings (a row's own settings are in its prompt digest, `prompts.Prompt.digest`)."""
        settings: dict = {"numerics": NUMERICS, "temperature": float(sampling.temperature)}
        if not sampling.greedy or sampled:
            settings.update(top_k=int(sampling.top_k), top_p=float(sampling.top_p), seed=int(sampling.seed))
        settings.update(max_new_tokens=int(max_new_tokens), eos_ids=sorted({int(e) for e in eos_ids}),
                        logprobs=int(logprobs))
        return cls("generate", model_identity(checkpoint), settings)

    @classmethod
    def for_score(cls, checkpoint) -> "RunIdentity":
        return cls("score", model_identity(checkpoint), {"numerics": NUMERICS})

    def with_settings(self, **settings: Any) -> "RunIdentity":
        """This identity with more settings (names with spaces go through a dict: ``**{"chat template": d}``)."""
        return RunIdentity(self.command, self.model, {**self.settings, **settings})

    def digest(self) -> str:
        """64 bits (hex) of the sha256 of the canonical JSON of the whole identity."""
        return self._digest

    @functools.cached_property
    def _digest(self) -> str:  # once per identity, not once per row (a frozen record: it cannot change)
        text = json.dumps(self.to_json(), sort_keys=True, separators=(",", ":"), ensure_ascii=True)
        return hashlib.sha256(text.encode("ascii")).hexdigest()[:16]

    def row_digest(self, prompt: str) -> str:
        """What a row made by this run from a prompt of digest ``prompt`` carries as its `ROW_IDENTITY`."""
        return hashlib.sha256(f"{self.digest()}:{prompt}".encode("ascii")).hexdigest()[:16]

    def fields(self) -> dict:
        """Flat name -> value, in the order a mismatch is looked for (and named)."""
        out = {"command": self.command}
        out.update({f"checkpoint {k}": v for k, v in self.model.items()})
        out.update(self.settings)
        return out

    def to_json(self) -> dict:
        return {"command": self.command, "model": dict(self.model), "settings": dict(self.settings)}

    @classmethod
    def from_json(cls, obj: Any) -> "RunIdentity":
        if not (isinstance(obj, dict) and isinstance(obj.get("command"), str)
                and isinstance(obj.get("model"), dict) and isinstance(obj.get("settings"), dict)):
            raise ValueError("not a run identity")
        return cls(obj["command"], obj["model"], obj["settings"])


def beside_settings(tokenizer: Any) -> dict:
    """``{"tokenizer", "chat template"}``: digests of the tokenizer file and chat template found
    beside the checkpoint (`tokenizer.load_tokenizer`'s), "none" where there is none. A text or
    chat prompt's tokens and a row's text depend on them."""
    tok = tmpl = "none"
    if tokenizer is not None:
        tok = hashlib.sha256(Path(tokenizer.path).read_bytes()).hexdigest()[:16]
        if getattr(tokenizer, "chat_template", None) is not None:
            tmpl = hashlib.sha256(tokenizer.chat_template.source.encode("utf-8")).hexdigest()[:16]
    return {"tokenizer": tok, "chat template": tmpl}


def layout_settings(job: Any, plan: Sequence[Any], command: str = "generate", caps: Sequence[Any] = ()) -> dict:
    """The settings that change rows but are stated per rank or act where the stages are cut,
    said per layer so that they do not depend on the layout (see the module's note).

    ``plan`` is the placement's assignments (every replica's). Returns ``{"precision",
    "kv_cache", "wire"}``: each layer's weight precision and cache policy (one value when
    every layer has the same, else ``"0:12 int8, 12:24 f32"``), and the wire codec where it
    rounds: ``"f32"`` when it is lossless or no stage is cut, else ``"bf16 before layers 12"``.
    ``score`` keeps no cache, so only a window is a different model there (none = full).
    With ``caps`` (every rank's `NodeCaps`), also ``"arithmetic"``: what each layer's products
    run (`kernels.isa`: amx / avx512 / ...), since a row's bits depend on it (docs/invariance.md:
    one job, one result per machine), so a resume on hosts of another arithmetic is refused.
    """
    _resolved(job)
    prec: dict[int, set] = {}
    kv: dict[int, set] = {}
    arith: dict[int, set] = {}
    by_rank = {c.rank: c.arithmetic for c in caps if getattr(c, "arithmetic", None)}
    replicas: dict[int, list] = {}
    for a in plan:
        p = {job.precision_for(r).value for r in a.ranks}
        k = {_kv_name(job.kv_for(r), command) for r in a.ranks}
        ar = {by_rank[r] for r in a.ranks if r in by_rank}
        for layer in a.layers:
            prec.setdefault(layer, set()).update(p)
            kv.setdefault(layer, set()).update(k)
            arith.setdefault(layer, set()).update(ar)
        replicas.setdefault(a.replica, []).append(a)
    cuts = sorted({tuple(sorted(a.layers.start for a in rep if a.stage > 0)) for rep in replicas.values()})
    wire = job.run.wire
    wires = sorted({"f32" if wire == "f32" or not c else f"{wire} before layers {', '.join(map(str, c))}"
                    for c in cuts}) or ["f32"]
    out = {"precision": _by_layer(prec), "kv_cache": _by_layer(kv), "wire": " / ".join(wires)}
    if by_rank and all(arith.values()):
        out["arithmetic"] = _by_layer(arith)
    return out


def unplaced_settings(job: Any, command: str = "generate") -> dict:
    """Those of `layout_settings` known without a plan: precision and kv_cache when no ``[[rank]]``
    overrides them (every layer has the job's), the wire when it is lossless ("f32")."""
    _resolved(job)
    out = {}
    if not any(o.precision for o in job.ranks):
        out["precision"] = job.run.precision.value
    if not any(o.kv_cache for o in job.ranks):
        out["kv_cache"] = _kv_name(job.run.kv_cache, command)
    if job.run.wire == "f32":
        out["wire"] = "f32"
    return out


def _resolved(job: Any) -> None:
    """A run is judged by the precision that ran: "auto" must be made the checkpoint's stored
    format first (`cluster.start.resolve_precision`), never recorded as "auto"."""
    if getattr(job, "asks_auto", False):
        raise ValueError('identity: the job\'s precision "auto" is not resolved against the checkpoint yet')


def _kv_name(spec: Any, command: str) -> str:
    if command == "score" and spec.policy != "window":
        return "full"
    return str(spec)


def _by_layer(values: dict[int, set]) -> str:
    """Per-layer values as one value, or ``"a:b v, b:c w"`` runs (a layer held by ranks that
    differ, e.g. replicas at other precisions, is ``"f32/int8"``)."""
    names = ["/".join(sorted(values[i])) for i in sorted(values)]
    if len(set(names)) <= 1:
        return names[0] if names else "none"
    runs, start = [], 0
    for i in range(1, len(names) + 1):
        if i == len(names) or names[i] != names[start]:
            runs.append(f"{start}:{i} {names[start]}")
            start = i
    return ", ".join(runs)


def digest_of(p) -> str:
    """A prompt's digest: its own ``digest`` (score prompts add where the scored part starts)
    or that of its tokens."""
    d = getattr(p, "digest", None)
    return d if isinstance(d, str) else prompt_digest(p.tokens)
