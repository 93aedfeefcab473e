"""A plug-in model family that injects faults, for the fault tests (and to exercise plug-ins).

Import it through a job file (``[model] plugins = ["faulty_family"]`` with ``tests/`` on
PYTHONPATH); it registers "faulty_llama", which is the Llama family except that the stage's
forward on one rank and microbatch does what the environment asks:

    RLX_TEST_FAULT             raise | kill | stop | hang | segv | exit0 | oom | nan   (unset: no fault)
    RLX_TEST_FAULT_RANK        world rank that misbehaves (default 1)
    RLX_TEST_FAULT_MICROBATCH  microbatch it misbehaves on (default 0)
    RLX_TEST_FAULT_STAMP       file to write time.time() to just before the fault (optional)

``raise`` raises RuntimeError, ``kill`` sends itself SIGKILL, ``stop`` SIGSTOP, ``segv``
SIGSEGV (a crash in native code), ``hang`` sleeps for ever inside the compute, ``exit0``
ends the process with status 0 (a library calling exit), and ``oom`` takes memory until the
OOM killer ends it (use it under a memory limit only), ``nan`` makes the stage's output all NaN
(a stage that produces a non-finite value: the one the non-finite rule must blame).
`write_checkpoint` writes a tiny checkpoint of the family.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from rlx_mpi.model import checkpoint
from rlx_mpi.families.llama import FAMILY as LLAMA
from rlx_mpi.families.llama import PRESETS
from rlx_mpi.families.decoder.family import random_tensors as _random_tensors
from rlx_mpi.families import register_family
from rlx_mpi.model.stage import Stage

__all__ = ["FaultyFamily", "FaultyStage", "write_checkpoint", "NAME"]

NAME = "faulty_llama"


def _fault() -> None:
    kind = os.environ.get("RLX_TEST_FAULT", "")
    stamp = os.environ.get("RLX_TEST_FAULT_STAMP")
    if stamp:
        Path(stamp).write_text(repr(time.time()))
    if kind == "raise":
        raise RuntimeError("injected fault (RLX_TEST_FAULT=raise)")
    if kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif kind == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
    elif kind == "segv":
        os.kill(os.getpid(), signal.SIGSEGV)
    elif kind == "exit0":
        os._exit(0)
    elif kind == "hang":
        while True:
            time.sleep(3600)
    elif kind == "oom":
        import numpy as np

        hoard = []
        for _ in range(4000):  # 200 GB at most: the limit ends it long before
            hoard.append(np.ones(50_000_000 // 8))
        raise RuntimeError("RLX_TEST_FAULT=oom: took 200 GB and no OOM kill came; run it under a memory limit")
    elif kind:
        raise ValueError(f"RLX_TEST_FAULT={kind!r}: expected raise, kill, stop, hang, segv, exit0 or oom")


class FaultyStage(Stage):
    """A Llama stage whose forward misbehaves on the chosen rank and microbatch."""

    def __init__(self, inner: Stage, ctx):
        self.inner, self.ctx = inner, ctx
        self.layers, self.first, self.last = inner.layers, inner.first, inner.last

    @property
    def weight_bytes(self) -> int:
        return self.inner.weight_bytes

    def forward(self, x):
        return self._poison(self._maybe_fault(), self.inner.forward(x))

    def _maybe_fault(self) -> bool:
        """Do the fault here, on the chosen rank and microbatch; True: poison the output (``nan``)."""
        rank = int(os.environ.get("RLX_TEST_FAULT_RANK", "1"))
        mb = int(os.environ.get("RLX_TEST_FAULT_MICROBATCH", "0"))
        if self.ctx is not None and self.ctx.rank == rank and self.ctx.microbatch == mb:
            if os.environ.get("RLX_TEST_FAULT") == "nan":
                return True
            _fault()
        return False

    @staticmethod
    def _poison(poison: bool, out):
        if poison:
            out = out.copy()
            out[...] = float("nan")
        return out

    # generation: the same faults in a step of group RLX_TEST_FAULT_MICROBATCH (a decode step
    # when RLX_TEST_FAULT_DECODE is set); RLX_TEST_NO_GENERATE=1 makes the family lack it

    def reset(self, slots, max_seq, kv):
        if os.environ.get("RLX_TEST_NO_GENERATE"):
            return super().reset(slots, max_seq, kv)
        return self.inner.reset(slots, max_seq, kv)

    def prefill(self, x, slots, lengths):
        poison = not os.environ.get("RLX_TEST_FAULT_DECODE") and self._maybe_fault()
        return self._poison(poison, self.inner.prefill(x, slots, lengths))

    def decode(self, x, slots, positions):
        return self._poison(self._maybe_fault(), self.inner.decode(x, slots, positions))


class FaultyFamily:
    """The Llama family under another name, with `FaultyStage` stages."""

    name = NAME

    def __getattr__(self, attr):  # load_config, cost, check_tp, check_inputs, expected_shapes...
        return getattr(LLAMA, attr)

    def build_stage(self, cfg, source, layers, first, last, tp, ctx=None):
        return FaultyStage(LLAMA.build_stage(cfg, source, layers, first, last, tp, ctx), ctx)


register_family(FaultyFamily())


def write_checkpoint(path: str | os.PathLike, preset: str = "tiny", seed: int = 0) -> Path:
    """A random checkpoint of ``preset``'s shape whose family attribute is "faulty_llama"."""
    cfg = PRESETS[preset]
    checkpoint.write_checkpoint(path, NAME, cfg.to_json(), _random_tensors(cfg, seed))
    return Path(path)
