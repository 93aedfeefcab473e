"""The arithmetic this process's kernels use, chosen once per process (issue 41).

``arithmetic()`` -> ``"amx" | "avx512" | "avx2" | "generic"``: what the products use. ``detect()``
-> `Isa`, the record `probe` prints: what the host offers (CPU flags and, for AMX, Linux's
permission) beside what the kernels use, the flags seen and the reason for the choice.

The decision itself is `decide(flags, env, permit)`, a pure function of the flag set, the
environment and the permission request, so a test can fake an AMX host, a host whose kernel
refuses AMX, an AVX2-only host or a bad RLX_MPI_ARITHMETIC. `host_flags()` and
`request_amx_permission()` are the two facts read from this host.

Note: levels. ``avx512`` is x86-64-v4's set (AVX512 F, BW, CD, DQ, VL, with AVX2 and FMA below
it), ``avx2`` x86-64-v3's vector part (AVX2, FMA), ``amx`` ``avx512`` plus AMX-TILE, AMX-BF16 and
AMX-INT8 and the kernel's permission for the tile data (below). The float kernels decide their
width by llvm_ir's `target_has("avx512f")` (the host's LLVM features, or NUMBA_CPU_NAME /
NUMBA_CPU_FEATURES), so a CPU with AVX512F but not BW (Knights Landing, none in service) would
be called ``avx2`` here while those kernels take 16 lanes.

Note: where the flags come from. Both sources are read and a feature counts only where every
source available says so: /proc/cpuinfo (the Linux kernel's view: it clears a flag whose state
it does not enable in XCR0) and llvmlite's ``get_host_cpu_features()`` (what numba compiles
for; LLVM checks XCR0 too, e.g. bits 17-18 for AMX). Names are compared without ``_`` and ``-``
(``amx_tile`` / ``amx-tile``, ``avx512_bf16`` / ``avx512bf16``). Off Linux only LLVM's are read.

Note: AMX permission. Linux (5.16 on) starts every process with the AMX tile data (XSAVE
feature 18, XTILEDATA, 8 kB of state) disabled by XFD: the first tile instruction then raises
SIGILL unless the process asked for it with ``arch_prctl(ARCH_REQ_XCOMP_PERM, 18)`` (x86-64
syscall 158, ``0x1023``), which the kernel may refuse (no AMX, an old kernel, a sigaltstack
too small for the larger signal frame). CPU flags alone are not enough: LLVM reports
``amx-tile`` from CPUID and XCR0 whether or not this process may use it. `detect()` asks once
per process, only where the flags offer AMX; the request grants, it allocates nothing until a
tile instruction runs. Measured here (2-core AMD EPYC znver4 VM, Linux 6.18): ARCH_GET_XCOMP_SUPP
gives 0xe7 (x87, SSE, AVX, the three AVX-512 states; no bit 17-18) and the request returns -1,
errno 95 (EOPNOTSUPP).

Note: offered and used. No AMX kernel exists yet, so an AMX host's products still run the
AVX-512 kernels: ``offered`` is ``amx`` and ``used`` ``avx512``, with the reason "AMX detected,
no AMX kernels yet". Both are kept so that `probe` can say what the hardware could do and the
job's identity what the products did (the bits of a row depend on the second:
docs/invariance.md). RLX_MPI_ARITHMETIC=avx2 / generic / avx512 forces a lower ``used`` (never
a higher one than ``offered``: refused with the variable, the value and the values allowed
here). The kernels do not read it yet: until the integration applies it to their compile
target (docs/amx.md), ``used`` below the kernels' own width is a decision not yet carried out,
and its reason says so.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import os
import platform
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Mapping

__all__ = ["ARITHMETICS", "ENV", "KERNELS", "Isa", "arithmetic", "decide", "detect", "host_flags", "offered_level",
           "request_amx_permission"]

ARITHMETICS = ("generic", "avx2", "avx512", "amx")  # lowest to highest
ENV = "RLX_MPI_ARITHMETIC"  # "auto" (or unset / empty) or one of ARITHMETICS at most the offered one
KERNELS = "avx512"  # the highest arithmetic that has kernels (no AMX kernels yet: issue 41)

# The flags each level needs on top of the one below (the levels note), canonical names
_NEEDS = {"avx2": ("avx2", "fma"),
          "avx512": ("avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"),
          "amx": ("amxtile", "amxbf16", "amxint8")}
# Every flag the record lists: the levels' and the ones the kernels gate on (rowdot, quant, q4gemm)
WATCHED = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl", "avx512vnni",
           "avx512bf16", "avx512fp16", "amxtile", "amxbf16", "amxint8", "amxfp16")

SYS_ARCH_PRCTL = 158  # x86-64
ARCH_GET_XCOMP_SUPP = 0x1021
ARCH_REQ_XCOMP_PERM = 0x1023
XFEATURE_XTILEDATA = 18


def canonical(flag: str) -> str:
    """A flag's name as compared here: lower case, no ``_`` or ``-`` (cpuinfo's and LLVM's agree)."""
    return flag.strip().lower().replace("_", "").replace("-", "")


@dataclass(frozen=True)
class Isa:
    """What `probe` prints about this process's arithmetic."""

    offered: str  # the highest level the CPU and the OS allow this process (one of ARITHMETICS)
    used: str  # what the kernels use: offered, capped at KERNELS, lowered by RLX_MPI_ARITHMETIC
    features: tuple[str, ...]  # the WATCHED flags present (canonical names)
    amx_permitted: bool | None  # Linux's answer to the AMX request; None: not asked (no AMX flags)
    reason: str  # why ``used`` is what it is, and the permission's answer where asked
    forced: str | None = None  # RLX_MPI_ARITHMETIC's value when it lowered ``used``

    @property
    def products(self) -> str:
        """What the products really run today: the offered level capped at KERNELS. A forced
        ``used`` below it is not yet applied (the offered-and-used note), so the run identity
        records this, not ``used``."""
        return min(self.offered, KERNELS, key=_rank)

    def describe(self) -> str:
        """One line: ``avx512 (offered amx: AMX detected, no AMX kernels yet)``."""
        return f"{self.used} (offered {self.offered}: {self.reason})"


def offered_level(flags: Iterable[str]) -> str:
    """The highest of ARITHMETICS whose flags (and every lower level's) are all in ``flags``,
    before AMX's permission: ``offered_level({"avx2", "fma"})`` -> ``"avx2"``."""
    have = {canonical(f) for f in flags}
    level = "generic"
    for name in ARITHMETICS[1:]:
        if not all(f in have for f in _NEEDS[name]):
            break
        level = name
    return level


_SHORT = {"avx512": "no AMX flags", "avx2": "no AVX-512 (x86-64-v4) flags", "generic": "no AVX2 / FMA flags"}


def _rank(name: str) -> int:
    return ARITHMETICS.index(name)


def decide(flags: Iterable[str], env: Mapping[str, str],
           permit: Callable[[], tuple[bool, str]]) -> Isa:
    """The record for a host with CPU ``flags`` (any spelling), environment ``env`` and the AMX
    permission request ``permit`` (called only where the flags offer AMX; returns granted and a
    detail for the reason). ValueError when ``env[ENV]`` is not an arithmetic at most the
    offered one."""
    have = {canonical(f) for f in flags}
    features = tuple(f for f in WATCHED if f in have)
    level = offered_level(have)
    permitted, why = None, ""
    if level == "amx":
        permitted, detail = permit()
        if not permitted:
            level = "avx512"
            why = f"AMX flags present, permission refused: {detail}"
    allowed = ARITHMETICS[:_rank(level) + 1]
    raw = env.get(ENV, "")
    value = raw.strip().lower()
    if value not in ("", "auto") and value not in allowed:
        raise ValueError(f"{ENV}={raw!r} is not allowed here: this host offers {level} at most"
                         f"{f' ({why})' if why else ''}; use one of auto, {', '.join(reversed(allowed))} (or unset it)")
    used, forced = min(level, KERNELS, key=_rank), None
    if value not in ("", "auto") and _rank(value) < _rank(used):
        used, forced = value, value
    if forced:
        reason = (f"forced by {ENV}={forced} (not yet applied to the kernels' compile target)"
                  + (f"; {why}" if why else ""))
    elif level == "amx":
        reason = "AMX detected, no AMX kernels yet"
    elif why:
        reason = why
    else:
        reason = _SHORT[level]
    return Isa(offered=level, used=used, features=features, amx_permitted=permitted, reason=reason, forced=forced)


def _cpuinfo_flags(path: Path = Path("/proc/cpuinfo")) -> set[str] | None:
    """The first CPU's ``flags`` line of /proc/cpuinfo, canonical; None where there is none."""
    try:
        for line in path.read_text().splitlines():
            if line.startswith("flags"):
                return {canonical(f) for f in line.split(":", 1)[1].split()}
    except OSError:
        pass
    return None


def _llvm_flags() -> set[str] | None:
    """llvmlite's host features that are on, canonical; None where llvmlite cannot say."""
    try:
        from llvmlite import binding

        return {canonical(k) for k, on in binding.get_host_cpu_features().items() if on}
    except Exception:  # llvmlite raises RuntimeError where LLVM knows no features for the host
        return None


def host_flags() -> frozenset[str]:
    """This host's WATCHED flags that every available source reports (the flags note)."""
    sources = [s for s in (_cpuinfo_flags(), _llvm_flags()) if s is not None]
    if not sources:
        return frozenset()
    return frozenset(f for f in WATCHED if all(f in s for s in sources))


def _arch_prctl(code: int, arg) -> tuple[int, int]:
    """(return value, errno) of ``syscall(SYS_arch_prctl, code, arg)``."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    ctypes.set_errno(0)
    rc = libc.syscall(ctypes.c_long(SYS_ARCH_PRCTL), ctypes.c_long(code), arg)
    return rc, ctypes.get_errno()


@functools.cache
def request_amx_permission() -> tuple[bool, str]:
    """Ask Linux once per process for the AMX tile data (the permission note): (granted, detail),
    the detail naming the call's result, errno and the kernel's supported-feature mask."""
    if sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64"):
        return False, f"not Linux x86-64 ({sys.platform} {platform.machine()})"
    try:
        mask = ctypes.c_uint64(0)
        rc, err = _arch_prctl(ARCH_GET_XCOMP_SUPP, ctypes.byref(mask))
        supp = f"supported xfeatures {mask.value:#x}" if rc == 0 else f"ARCH_GET_XCOMP_SUPP errno {err}"
        rc, err = _arch_prctl(ARCH_REQ_XCOMP_PERM, ctypes.c_ulong(XFEATURE_XTILEDATA))
    except (OSError, AttributeError) as e:  # no libc.syscall to call
        return False, f"arch_prctl unavailable: {e}"
    if rc == 0:
        return True, f"arch_prctl(ARCH_REQ_XCOMP_PERM, XTILEDATA) = 0; {supp}"
    return False, (f"arch_prctl(ARCH_REQ_XCOMP_PERM, XTILEDATA) = {rc}, errno {err} "
                   f"({errno.errorcode.get(err, '?')}: {os.strerror(err)}); {supp}")


@functools.cache
def detect() -> Isa:
    """This process's record: `decide` on this host's flags, environment and permission, once
    (later changes to RLX_MPI_ARITHMETIC are not seen: every kernel of a process takes one path)."""
    return decide(host_flags(), os.environ, request_amx_permission)


def arithmetic() -> str:
    """What this process's products use: ``"avx512"`` on AVX-512 and on AMX hosts (no AMX kernels
    yet), ``"avx2"``, ``"generic"``, or lower where RLX_MPI_ARITHMETIC says so."""
    return detect().used
