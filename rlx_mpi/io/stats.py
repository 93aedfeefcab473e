"""What every rank measured, and the tables rank 0 prints (`format_table`, the one printer):
`StageTiming` per rank of a ``run`` and its `ClusterRun`; the per-rank rows of a ``generate`` and
its `GenerateResult`; `peak_rss_bytes`. The executor's own counters are `executor.ExecStats`."""

from __future__ import annotations

import json
import resource
from dataclasses import asdict, dataclass, field

import numpy as np

__all__ = ["StageTiming", "ClusterRun", "GenerateResult", "peak_rss_bytes", "format_table"]


def peak_rss_bytes() -> int:
    """High-water mark of this process's resident memory (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


@dataclass(frozen=True)
class StageTiming:
    """What one rank measured: the one per-rank record of every command (``run``'s forward,
    ``generate``'s ring). The generate-only fields are None for a run and left out of its JSON."""

    rank: int
    host: str
    stage: int
    tp_rank: int
    tp_ranks: tuple[int, ...]
    layers: range
    device: str
    build_ms: float  # the node's kernel compile (or the wait for it), weight loading, stage construction
    forward_ms: float  # compute only
    recv_wait_ms: float  # waiting for the previous stage
    send_ms: float  # handing the output to the next stage
    bytes_sent: int
    est_bytes: int  # the planner's estimate of resident bytes
    weight_bytes: int  # weights this rank actually holds
    peak_rss_bytes: int  # measured high-water mark of the process
    pack_ms: float = 0.0  # encoding outputs to the wire format (0 with f32: no copy)
    unpack_ms: float = 0.0  # decoding received inputs to float32
    wall_ms: float = 0.0  # from the common start of the forward to this rank's last action
    precision: str = "f32"  # how this rank holds its weights (f32 | bf16 | f16 | int8)
    # generate: the KV cache policy and bytes, compute split into prefill, decode and sampling
    kv: str | None = None
    kv_bytes: int | None = None
    prefill_ms: float | None = None
    decode_ms: float | None = None
    sample_ms: float | None = None
    replica: int | None = None  # the data-parallel replica of the rank (None: the job has one)

    def to_dict(self) -> dict:
        d = {k: v for k, v in asdict(self).items() if v is not None}
        d["layers"] = [self.layers.start, self.layers.stop]
        d["tp_ranks"] = list(self.tp_ranks)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "StageTiming":
        return cls(**{**d, "layers": range(*d["layers"]), "tp_ranks": tuple(d["tp_ranks"])})


def _mb(n: float) -> str:
    return f"{n / 1e6:.2f}"


def format_table(head: tuple[str, ...], rows: list[tuple[str, ...]], left: tuple[int, ...] = ()) -> str:
    """The one table printer: columns right-aligned to their widest cell (those in ``left`` left-aligned)."""
    lines = [head, *rows]
    widths = [max(len(r[i]) for r in lines) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) if i in left else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
                     for r in lines)


@dataclass
class ClusterRun:
    """The result of one forward: per-rank timings, totals and (on rank 0) the logits."""

    timings: list[StageTiming]
    total_forward_ms: float  # wall time on rank 0 from the start of the forward to the logits
    tokens: int
    microbatches: int = 1
    output: np.ndarray | None = field(default=None, repr=False)
    job_id: str | None = None  # the Slurm job id, when there is one
    wire: str = "f32"  # the [run] wire format
    spans: dict | None = field(default=None, repr=False)  # rank -> [[name, cat, start_s, dur_s, args]] with --trace

    @property
    def n_stages(self) -> int:
        return len({t.stage for t in self.timings})

    @property
    def span_ms(self) -> float:
        """The schedule's wall time: from the common start to the last rank's last action."""
        return max((t.wall_ms for t in self.timings), default=0.0)

    def busy(self, t: StageTiming) -> float:
        """Fraction of the schedule's wall time this rank spent working (compute, pack, unpack),
        as trace.bubble counts it."""
        return (t.forward_ms + t.pack_ms + t.unpack_ms) / self.span_ms if self.span_ms > 0 else float("nan")

    @property
    def ideal_bubble(self) -> float:
        """GPipe's idle fraction with equal stages and free communication: (p-1)/(M+p-1)."""
        p = self.n_stages
        return (p - 1) / (self.microbatches + p - 1)

    @property
    def bubble(self) -> float:
        """Measured idle fraction: 1 - mean busy fraction over the stages."""
        if not self.timings or self.span_ms <= 0:
            return float("nan")
        return 1.0 - sum(self.busy(t) for t in self.timings) / len(self.timings)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / (self.total_forward_ms / 1e3) if self.total_forward_ms > 0 else float("nan")

    def table(self) -> str:
        head = ("stage", "rank", "host", "tp", "layers", "device", "precision", "build_ms", "forward_ms",
                "recv_wait_ms", "send_ms", "busy", "sent_MB", "est_MB", "weights_MB", "peak_rss_MB")
        rows = []
        many = any(t.replica is not None for t in self.timings)  # replicas: a first column names each rank's
        for t in sorted(self.timings, key=lambda t: (t.replica or 0, t.stage, t.tp_rank)):
            tp = ",".join(map(str, t.tp_ranks)) if len(t.tp_ranks) > 1 else "-"
            rows.append(((str(t.replica),) if many else ()) + (
                         str(t.stage), str(t.rank), t.host, tp, f"{t.layers.start}:{t.layers.stop}", t.device,
                         t.precision, f"{t.build_ms:.1f}", f"{t.forward_ms:.1f}", f"{t.recv_wait_ms:.1f}", f"{t.send_ms:.1f}",
                         f"{100 * self.busy(t):.0f}%", _mb(t.bytes_sent), _mb(t.est_bytes), _mb(t.weight_bytes), _mb(t.peak_rss_bytes)))
        lines = [format_table((("replica",) if many else ()) + head, rows,
                              left=(3, 6, 7) if many else (2, 5, 6))]
        lines.append(f"total forward {self.total_forward_ms:.1f} ms for {self.tokens} tokens "
                     f"({self.microbatches} microbatch{'es' if self.microbatches != 1 else ''}): "
                     f"{self.tokens_per_s:.1f} tokens/s; bubble {100 * self.bubble:.1f}% "
                     f"(ideal (p-1)/(M+p-1) = {100 * self.ideal_bubble:.1f}%); wire {self.wire}")
        if self.job_id:
            lines.append(f"slurm job {self.job_id}")
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return {"timings": [t.to_dict() for t in self.timings], "total_forward_ms": self.total_forward_ms,
                "tokens": self.tokens, "microbatches": self.microbatches, "tokens_per_s": self.tokens_per_s,
                "wire": self.wire, "span_ms": self.span_ms, "bubble": self.bubble, "ideal_bubble": self.ideal_bubble,
                "job_id": self.job_id}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)


@dataclass
class GenerateResult:
    """What rank 0 reports at the end of ``generate``: per-rank rows and the totals."""

    timings: list[StageTiming]  # one per rank
    total: int
    done_before: int
    done_now: int
    new_tokens: int
    wall_s: float
    stopped_by: str | None  # a signal name when stopped early
    prefill_steps: int = 0  # steps stage 0 issued that carried prefill positions (chunks, MIXED steps too)
    token_gap_ms: dict | None = None  # between a row's decode tokens at stage 0: median, p99, max (`Scheduler.token_gaps_ms`)
    replicas: list[dict] | None = None  # per replica: rows, tokens, wall_s, tokens_per_s (None: one replica)
    prefix_hits: list[int] | None = None  # [prompt positions reused from the prefix cache, all of them] (None: off)
    rows_at_once: int = 0  # the most rows stage 0 held at once (`Scheduler.peak_rows`; replicas: summed)

    def to_dict(self) -> dict:
        d = {k: v for k, v in asdict(self).items() if k != "timings" and not (k in ("replicas", "prefix_hits")
                                                                               and v is None)}
        return {"rows": [t.to_dict() for t in self.timings], **d}

    def table(self) -> str:
        head = ("stage", "rank", "tp", "layers", "kv", "prefill_ms", "decode_ms", "sample_ms", "recv_wait_ms",
                "send_ms", "kv_MB", "weights_MB", "peak_rss_MB")
        rows = []
        many = self.replicas is not None
        for t in sorted(self.timings, key=lambda t: (t.replica or 0, t.stage, t.tp_rank)):
            tp = ",".join(map(str, t.tp_ranks)) if len(t.tp_ranks) > 1 else "-"
            rows.append(((str(t.replica),) if many else ()) + (
                         str(t.stage), str(t.rank), tp, f"{t.layers.start}:{t.layers.stop}", t.kv or "-",
                         f"{t.prefill_ms or 0.0:.1f}", f"{t.decode_ms or 0.0:.1f}", f"{t.sample_ms or 0.0:.1f}",
                         f"{t.recv_wait_ms:.1f}", f"{t.send_ms:.1f}",
                         _mb(t.kv_bytes or 0), _mb(t.weight_bytes), _mb(t.peak_rss_bytes)))
        rate = self.new_tokens / self.wall_s if self.wall_s > 0 else float("nan")
        gaps = self.token_gap_ms
        gap = f"; between a row's tokens {gaps['median']:.1f} ms median, {gaps['max']:.1f} ms at most" if gaps else ""
        if self.prefix_hits is not None:
            hit, of = self.prefix_hits
            gap += f"; prefix cache: {hit} of {of} prompt tokens reused ({100 * hit / of if of else 0:.1f}%)"
        per = "".join(f"replica {r['replica']}: {r['rows']} prompts, {r['tokens']} new tokens in {r['wall_s']:.2f} s"
                      f" ({r['tokens_per_s'] or 0.0:.1f} tokens/s)\n" for r in self.replicas or [])
        table = format_table((("replica",) if many else ()) + head, rows, left=(5,) if many else (4,))
        return (table + "\n" + per +
                f"{self.done_now} prompts completed in {self.wall_s:.2f} s ({self.done_before} done before, "
                f"{self.total} in total): {self.new_tokens} new tokens, {rate:.1f} tokens/s{gap}")
