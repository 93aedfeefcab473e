"""The order of posts, waits and computes on each stage, as plain data (no MPI).

A schedule is one list of `Action`s per stage; the executor (`executor.py`) runs a rank's list
and knows nothing about pipelines. Five kinds:

    POST_RECV  pR  post a receive of microbatch m from ``peer`` into receive slot ``slot``
    WAIT_RECV  wR  wait for it (the data is then in the slot, unpacked to float32)
    COMPUTE    F   run the stage on microbatch m; its input is whatever receive slot ``slot`` holds
                   (none on stage 0 of a forward; a decode ring may relabel: stage 0 computes
                   step k+1 of a group from what it received as step k)
    POST_SEND  pS  pack the output of m into send slot ``slot`` and post its send to ``peer``
    WAIT_SEND  wS  wait for that send (the slot may be packed again afterwards)

An action prints as ``<stage><code><microbatch>``, e.g. ``1pR2``. The GPipe forward below posts
the receives of the next microbatches before computing the current one (``slots`` receive
buffers in flight) and waits on a send only when its buffer is needed again, so a stage never
blocks on a neighbour's readiness while it has work. `simulate` checks any set of schedules
(forward, or a decode ring whose last stage sends to the first) under rendezvous semantics: no
deadlock, every receive posted before the matching send is waited, no slot reused in flight.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Action", "POST_RECV", "WAIT_RECV", "COMPUTE", "POST_SEND", "WAIT_SEND", "KINDS",
           "forward_schedule", "format_grid", "format_actions", "simulate", "ScheduleError",
           "decode_step_actions", "decode_drain_actions", "decode_ring"]

POST_RECV, WAIT_RECV, COMPUTE, POST_SEND, WAIT_SEND = "post_recv", "wait_recv", "compute", "post_send", "wait_send"
KINDS = {POST_RECV: "pR", WAIT_RECV: "wR", COMPUTE: "F", POST_SEND: "pS", WAIT_SEND: "wS"}


@dataclass(frozen=True)
class Action:
    stage: int
    kind: str  # one of KINDS
    microbatch: int
    slot: int = 0  # receive slot (post/wait recv, compute) or send slot (post/wait send)
    peer: int | None = None  # the stage received from / sent to (None for compute)

    def __str__(self) -> str:
        return f"{self.stage}{KINDS[self.kind]}{self.microbatch}"


class ScheduleError(ValueError):
    """A set of schedules that would deadlock or reuse a buffer still in flight."""


def forward_schedule(stage: int, n_stages: int, microbatches: int, slots: int = 2) -> list[Action]:
    """GPipe fill-drain for ``stage``: receives ``slots`` ahead, sends waited on slot reuse."""
    first, last = stage == 0, stage == n_stages - 1
    prev, nxt = stage - 1, stage + 1
    acts: list[Action] = []
    if not first:
        acts += [Action(stage, POST_RECV, m, m % slots, prev) for m in range(min(slots, microbatches))]
    for m in range(microbatches):
        if not first:
            acts.append(Action(stage, WAIT_RECV, m, m % slots, prev))
        acts.append(Action(stage, COMPUTE, m, m % slots))
        if not first and m + slots < microbatches:  # the slot was consumed by the compute
            acts.append(Action(stage, POST_RECV, m + slots, m % slots, prev))
        if not last:
            if m >= slots:  # this send slot last carried m - slots
                acts.append(Action(stage, WAIT_SEND, m - slots, m % slots, nxt))
            acts.append(Action(stage, POST_SEND, m, m % slots, nxt))
    if not last:
        acts += [Action(stage, WAIT_SEND, m, m % slots, nxt) for m in range(max(0, microbatches - slots), microbatches)]
    return acts


def format_actions(actions: list[Action]) -> str:
    return " ".join(map(str, actions))


def format_grid(n_stages: int, microbatches: int, slots: int | None = None) -> str:
    """Without ``slots``: the computes as a time-step x stage grid (ideal fill-drain). With
    ``slots``: each stage's full action list in `simulate`'s order, one column per step."""
    if slots is None:
        steps = n_stages + microbatches - 1
        rows = []
        for s in range(n_stages):
            cells = ["  . "] * steps
            for m in range(microbatches):
                cells[s + m] = f"{s}F{m}".rjust(4)
            rows.append(f"stage {s}: " + "".join(cells))
        return "\n".join(rows)
    steps = simulate([forward_schedule(s, n_stages, microbatches, slots) for s in range(n_stages)])
    cells = [[",".join(str(a) for a in step if a.stage == s) for step in steps] for s in range(n_stages)]
    widths = [max(len(cells[s][t]) for s in range(n_stages)) + 1 for t in range(len(steps))]
    return "\n".join(f"stage {s}: " + "".join((c or ".").rjust(w) for c, w in zip(row, widths))
                     for s, row in enumerate(cells))


def simulate(schedules: list[list[Action]]) -> list[list[Action]]:
    """Run every stage's list in lockstep under rendezvous semantics; return the steps.

    A wait-send completes only once the peer has posted the matching receive, a wait-receive
    once the peer has posted the send. Raises `ScheduleError` on a deadlock, a slot posted while
    still in flight, a compute before its input arrived or a send before its compute.
    """
    n = len(schedules)
    pc = [0] * n
    posted_recv: set[tuple[int, int, int]] = set()  # (receiver, sender, m)
    posted_send: set[tuple[int, int, int]] = set()  # (sender, receiver, m)
    recv_slot: list[dict[int, tuple[str, int]]] = [{} for _ in range(n)]  # slot -> (state, m)
    send_slot: list[dict[int, int]] = [{} for _ in range(n)]  # slot -> m in flight
    computed: list[set[int]] = [set() for _ in range(n)]
    steps: list[list[Action]] = []

    def ready(s: int, a: Action) -> bool:
        if a.kind == WAIT_SEND:
            return (a.peer, s, a.microbatch) in posted_recv
        if a.kind == WAIT_RECV:
            return (a.peer, s, a.microbatch) in posted_send
        return True

    def apply(s: int, a: Action) -> None:
        m, where = a.microbatch, f"stage {s} action {a}"
        if a.kind == POST_RECV:
            if a.slot in recv_slot[s]:
                raise ScheduleError(f"{where}: receive slot {a.slot} still holds microbatch {recv_slot[s][a.slot][1]}")
            recv_slot[s][a.slot] = ("posted", m)
            posted_recv.add((s, a.peer, m))
        elif a.kind == WAIT_RECV:
            if recv_slot[s].get(a.slot) != ("posted", m):
                raise ScheduleError(f"{where}: no receive of microbatch {m} posted in slot {a.slot}")
            recv_slot[s][a.slot] = ("full", m)
        elif a.kind == COMPUTE:  # consumes whatever its slot received (a ring relabels microbatches)
            state = recv_slot[s].get(a.slot)
            if state is not None and state[0] != "full":
                raise ScheduleError(f"{where}: computes before its input (microbatch {state[1]}) arrived in slot {a.slot}")
            if state is not None:
                del recv_slot[s][a.slot]  # consumed: the slot may be posted again
            computed[s].add(m)
        elif a.kind == POST_SEND:
            if m not in computed[s]:
                raise ScheduleError(f"{where}: sends microbatch {m} before computing it")
            if a.slot in send_slot[s]:
                raise ScheduleError(f"{where}: send slot {a.slot} still in flight with microbatch {send_slot[s][a.slot]}")
            send_slot[s][a.slot] = m
            posted_send.add((s, a.peer, m))
        elif a.kind == WAIT_SEND:
            if send_slot[s].get(a.slot) != m:
                raise ScheduleError(f"{where}: no send of microbatch {m} in flight in slot {a.slot}")
            del send_slot[s][a.slot]

    while any(pc[s] < len(schedules[s]) for s in range(n)):
        step = []
        for s in range(n):
            # a stage runs every action that can proceed, up to its next blocked wait
            while pc[s] < len(schedules[s]) and ready(s, schedules[s][pc[s]]):
                a = schedules[s][pc[s]]
                apply(s, a)
                step.append(a)
                pc[s] += 1
                if a.kind in (COMPUTE, WAIT_RECV, WAIT_SEND):
                    break  # one blocking action per step keeps the grid readable
        if not step:
            stuck = {s: str(schedules[s][pc[s]]) for s in range(n) if pc[s] < len(schedules[s])}
            raise ScheduleError(f"deadlock: stages blocked at {stuck}")
        steps.append(step)
    for s in range(n):
        if send_slot[s] or recv_slot[s]:
            raise ScheduleError(f"stage {s} ends with buffers in flight: sends {send_slot[s]}, receives {recv_slot[s]}")
    return steps


# -- generation: the decode ring ---------------------------------------------------------------
# Note: decode steps are issued at run time (a group's next step depends on the tokens that
# came back, rows end and new prompts take their slots), so `generation.DecodeRing` runs one
# step's actions at a time; `decode_ring` is the same order written out for ``rounds`` rounds
# of ``groups`` groups, for `simulate` and `format_actions`. Stage 0 posts the receive of a
# step's tokens right after sending the step, so the last stage's send never waits on it.
# A step's send is waited only when its group's next step sends again (send slot = group), as
# the forward waits on slot reuse: a stage goes on to another group while its neighbour is still
# busy, so a hidden state past MPI's eager limit (a rendezvous send) no longer holds the sender
# until the receiver is free (measured, 2 stages x 8 rows x 1024 of the medium preset: stage 0
# spent 12% of the run blocked in such waits). `decode_drain_actions` waits on what is left.
# (A relay first takes a small header that says the step's shape; headers are not modelled.)


def decode_step_actions(stage: int, n_stages: int, group: int, previous: int | None = None) -> list[Action]:
    """One decode step of ``group`` on ``stage``: receive (not on stage 0), compute, send on;
    the last stage's send goes to stage 0 (the sampled tokens), closing the ring. ``previous``:
    the microbatch of this group's last send, if it is still in flight (waited before sending)."""
    acts = []
    if stage > 0:
        acts += [Action(stage, POST_RECV, group, 0, stage - 1), Action(stage, WAIT_RECV, group, 0, stage - 1)]
    acts.append(Action(stage, COMPUTE, group, 0))
    if n_stages > 1:
        peer = (stage + 1) % n_stages
        if previous is not None:
            acts.append(Action(stage, WAIT_SEND, previous, group, peer))
        acts.append(Action(stage, POST_SEND, group, group, peer))
    return acts


def decode_drain_actions(stage: int, n_stages: int, in_flight: dict[int, int]) -> list[Action]:
    """Wait on the sends still in flight at the end of a ring: ``in_flight`` maps group (the send
    slot) to the microbatch sent."""
    peer = (stage + 1) % n_stages
    return [Action(stage, WAIT_SEND, m, g, peer) for g, m in sorted(in_flight.items())]


def decode_ring(stage: int, n_stages: int, groups: int, rounds: int) -> list[Action]:
    """``stage``'s actions for ``rounds`` x ``groups`` decode steps; step k = round * groups + group.

    Stage 0 computes step k from the tokens of step k - groups (its receive slot k % groups).
    Every stage waits on the send of step k - groups just before sending step k (slot k % groups)."""
    last = n_stages - 1
    steps = groups * rounds
    nxt = (stage + 1) % n_stages

    def send(k: int) -> list[Action]:
        wait = [Action(stage, WAIT_SEND, k - groups, k % groups, nxt)] if k >= groups else []
        return wait + [Action(stage, POST_SEND, k, k % groups, nxt)]

    drain = [Action(stage, WAIT_SEND, k, k % groups, nxt) for k in range(max(0, steps - groups), steps)]
    if stage > 0:
        acts = []
        for k in range(steps):
            acts += [Action(stage, POST_RECV, k, 0, stage - 1), Action(stage, WAIT_RECV, k, 0, stage - 1),
                     Action(stage, COMPUTE, k, 0), *send(k)]
        return acts + drain
    acts = []
    for k in range(steps + groups):
        if k >= groups:  # the tokens of step k - groups, then step k of that group
            acts.append(Action(0, WAIT_RECV, k - groups, (k - groups) % groups, last))
        acts.append(Action(0, COMPUTE, k, k % groups))
        if k >= steps:
            continue  # only completing the last round's tokens
        acts += [*send(k), Action(0, POST_RECV, k, k % groups, last)]
    return acts + drain
