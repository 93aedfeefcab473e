"""The order of receives, computes and sends on each stage, as plain data (no MPI).

An action prints as ``<stage><kind><microbatch>``, e.g. ``1F0`` = stage 1 computes
microbatch 0; kinds are R (receive the input), F (forward), S (send the output). The
fill-drain order below already overlaps stages across microbatches: while stage 1 computes
microbatch 0, stage 0 computes microbatch 1.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Action", "forward_schedule", "format_grid"]

RECV, FORWARD, SEND = "R", "F", "S"


@dataclass(frozen=True)
class Action:
    stage: int
    kind: str  # RECV | FORWARD | SEND
    microbatch: int

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.microbatch}"


def forward_schedule(stage: int, n_stages: int, microbatches: int) -> list[Action]:
    """The actions of ``stage`` for one forward of ``microbatches`` microbatches."""
    actions = []
    for m in range(microbatches):
        if stage > 0:
            actions.append(Action(stage, RECV, m))
        actions.append(Action(stage, FORWARD, m))
        if stage < n_stages - 1:
            actions.append(Action(stage, SEND, m))
    return actions


def format_grid(n_stages: int, microbatches: int) -> str:
    """The forward actions as a time-step x stage grid (F only), for docs and debugging."""
    steps = n_stages + microbatches - 1
    rows = []
    for s in range(n_stages):
        cells = ["  . "] * steps
        for m in range(microbatches):
            cells[s + m] = f"{s}F{m}".rjust(4)
        rows.append(f"stage {s}: " + "".join(cells))
    return "\n".join(rows)
