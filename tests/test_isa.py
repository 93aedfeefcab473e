"""kernels/isa.py: the arithmetic chosen from faked hosts and from this one, and (issue 41) the
AMX intrinsics compiled, never run, by llvmlite and by numba for a Sapphire Rapids target.

The AMX cases are compile-only: they run in a subprocess (this file run as a script) because
LLVM aborts the whole process (``LLVM ERROR: Cannot select``, SIGABRT) when a tile intrinsic
meets a target without AMX, and because numba reads NUMBA_CPU_NAME / NUMBA_CPU_FEATURES once, at
import. The IR and the numba intrinsic below are the starting point for AMX kernels on a host
that can run them (docs/amx.md).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

AVX2 = {"avx2", "fma", "f16c"}
AVX512 = AVX2 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl", "avx512vnni", "avx512bf16"}
AMX_CPUINFO = AVX512 | {"amx_tile", "amx_bf16", "amx_int8"}  # /proc/cpuinfo's spelling
AMX_LLVM = AVX512 | {"amx-tile", "amx-bf16", "amx-int8"}  # llvmlite's


def _granted():
    return True, "arch_prctl(ARCH_REQ_XCOMP_PERM, XTILEDATA) = 0"


def _refused():
    return False, "arch_prctl(ARCH_REQ_XCOMP_PERM, XTILEDATA) = -1, errno 95 (EOPNOTSUPP)"


def _never():
    raise AssertionError("the AMX permission was asked on a host without AMX flags")


# -- faked hosts -------------------------------------------------------------------------------


@pytest.mark.parametrize("flags", [AMX_CPUINFO, AMX_LLVM])
def test_amx_host_offers_amx_and_uses_avx512(flags):
    from rlx_mpi.kernels.isa import decide

    isa = decide(flags, {}, _granted)
    assert (isa.offered, isa.used, isa.amx_permitted) == ("amx", "avx512", True)
    assert isa.reason == "AMX detected, no AMX kernels yet"
    assert {"amxtile", "amxbf16", "amxint8", "avx512f"} <= set(isa.features)
    assert isa.describe() == "avx512 (offered amx: AMX detected, no AMX kernels yet)"


def test_amx_refused_falls_back_with_the_reason():
    from rlx_mpi.kernels.isa import decide

    isa = decide(AMX_CPUINFO, {}, _refused)
    assert (isa.offered, isa.used, isa.amx_permitted) == ("avx512", "avx512", False)
    assert "permission refused" in isa.reason and "errno 95" in isa.reason
    assert "amxtile" in isa.features  # the flags are still listed: the hardware has them


def test_avx2_and_generic_hosts_never_ask_for_amx():
    from rlx_mpi.kernels.isa import decide

    isa = decide(AVX2, {}, _never)
    assert (isa.offered, isa.used, isa.amx_permitted) == ("avx2", "avx2", None)
    assert isa.features == ("avx2", "fma", "f16c")
    isa = decide({"sse4_2", "avx"}, {}, _never)
    assert (isa.offered, isa.used) == ("generic", "generic")
    # AMX flags without AVX-512 beneath them (no such CPU) are not AMX either
    assert decide(AVX2 | {"amx_tile", "amx_bf16", "amx_int8"}, {}, _never).offered == "avx2"


def test_env_forces_a_lower_path():
    from rlx_mpi.kernels.isa import ENV, decide

    isa = decide(AMX_CPUINFO, {ENV: "avx2"}, _granted)
    assert (isa.offered, isa.used, isa.forced) == ("amx", "avx2", "avx2")
    assert f"{ENV}=avx2" in isa.reason
    assert decide(AVX512, {ENV: " Generic "}, _never).used == "generic"
    for same in ("", "auto", "avx512", "AVX512"):  # unset, auto and the level itself change nothing
        isa = decide(AVX512, {ENV: same}, _never)
        assert (isa.used, isa.forced) == ("avx512", None)
    assert decide(AMX_CPUINFO, {ENV: "amx"}, _granted).used == "avx512"  # allowed, still no AMX kernels


@pytest.mark.parametrize("flags, permit, value, offered", [
    (AVX512, _never, "amx", "avx512"),
    (AVX2, _never, "avx512", "avx2"),
    (AMX_CPUINFO, _refused, "amx", "avx512"),
    (AVX512, _never, "sse4", "avx512"),
])
def test_env_above_the_host_or_unknown_is_refused_in_one_line(flags, permit, value, offered):
    from rlx_mpi.kernels.isa import ENV, decide

    with pytest.raises(ValueError) as e:
        decide(flags, {ENV: value}, permit)
    msg = str(e.value)
    assert "\n" not in msg
    assert f"{ENV}={value!r}" in msg and f"offers {offered} at most" in msg
    allowed = {"avx512": "auto, avx512, avx2, generic", "avx2": "auto, avx2, generic"}[offered]
    assert f"use one of {allowed}" in msg


def test_host_flags_need_every_source(monkeypatch):
    from rlx_mpi.kernels import isa

    monkeypatch.setattr(isa, "_cpuinfo_flags", lambda: {isa.canonical(f) for f in AMX_CPUINFO})
    monkeypatch.setattr(isa, "_llvm_flags", lambda: {isa.canonical(f) for f in AVX512})  # LLVM: no AMX
    assert isa.offered_level(isa.host_flags()) == "avx512"
    monkeypatch.setattr(isa, "_llvm_flags", lambda: None)  # llvmlite cannot say: cpuinfo alone
    assert isa.offered_level(isa.host_flags()) == "amx"
    monkeypatch.setattr(isa, "_cpuinfo_flags", lambda: None)
    assert isa.host_flags() == frozenset()


# -- this host ---------------------------------------------------------------------------------


def test_this_host():
    """detect() agrees with the flags and with the width rowdot compiled for (16 lanes exactly
    when AVX-512); on the 2-core EPYC znver4 VM this was written on: avx512, AMX not offered."""
    from rlx_mpi.kernels import isa, rowdot

    flags = isa.host_flags()
    rec = isa.decide(flags, {}, isa.request_amx_permission)
    assert rec.offered == isa.offered_level(flags) or (rec.amx_permitted is False and rec.offered == "avx512")
    assert rec.used == ("avx512" if rec.offered in ("amx", "avx512") else rec.offered)
    if not any(os.environ.get(v) for v in ("NUMBA_CPU_NAME", "NUMBA_CPU_FEATURES", isa.ENV)):
        assert isa.detect() == rec and isa.arithmetic() == rec.used
        assert (rowdot.FLANES == 16) == ("avx512f" in flags)
    if "amxtile" not in flags:
        assert rec.amx_permitted is None and "permission" not in rec.reason
    if rec.offered == "avx512" and rec.amx_permitted is None:  # this VM (EPYC znver4): AVX-512, no AMX
        assert rec.describe() == "avx512 (offered avx512: no AMX flags)"


def test_the_real_permission_call_returns():
    """The syscall itself, whatever the host: on the AMD host this was written on it returns -1,
    errno 95 (EOPNOTSUPP; ARCH_GET_XCOMP_SUPP 0xe7: no XTILEDATA), recorded in the detail."""
    from rlx_mpi.kernels.isa import host_flags, request_amx_permission

    granted, detail = request_amx_permission()
    assert isinstance(granted, bool) and detail
    assert request_amx_permission() == (granted, detail)  # asked once per process
    if sys.platform == "linux" and "amxtile" not in host_flags():
        assert not granted and "errno" in detail and "supported xfeatures" in detail
        m = re.search(r"supported xfeatures (0x[0-9a-f]+)", detail)
        assert not int(m.group(1), 16) >> 18 & 1


# -- AMX, compile only (issue 41) --------------------------------------------------------------

AMX_FEATURES = "+amx-tile,+amx-bf16,+amx-int8"
AMX_INSTRUCTIONS = ("ldtilecfg", "tileloadd", "tdpbf16ps", "tdpbusd", "tilestored", "tilezero", "tilerelease")

# The "direct" intrinsics: tiles named by number (immediates), the configuration loaded by hand
# (64 bytes: palette 1, then colsb as 16 x u16 from byte 16, rows as 16 x u8 from byte 48)
DIRECT_IR = r"""
declare void @llvm.x86.ldtilecfg(ptr)
declare void @llvm.x86.tilerelease()
declare void @llvm.x86.tilezero(i8 immarg)
declare void @llvm.x86.tileloadd64(i8 immarg, ptr, i64)
declare void @llvm.x86.tdpbf16ps(i8 immarg, i8 immarg, i8 immarg)
declare void @llvm.x86.tdpbusd(i8 immarg, i8 immarg, i8 immarg)
declare void @llvm.x86.tilestored64(i8 immarg, ptr, i64)
define void @amx_direct(ptr %cfg, ptr %a, ptr %b, ptr %c, ptr %ai, ptr %bi, ptr %ci) {
  call void @llvm.x86.ldtilecfg(ptr %cfg)
  call void @llvm.x86.tileloadd64(i8 0, ptr %c, i64 64)
  call void @llvm.x86.tileloadd64(i8 1, ptr %a, i64 64)
  call void @llvm.x86.tileloadd64(i8 2, ptr %b, i64 64)
  call void @llvm.x86.tdpbf16ps(i8 0, i8 1, i8 2)
  call void @llvm.x86.tilestored64(i8 0, ptr %c, i64 64)
  call void @llvm.x86.tilezero(i8 3)
  call void @llvm.x86.tileloadd64(i8 4, ptr %ai, i64 64)
  call void @llvm.x86.tileloadd64(i8 5, ptr %bi, i64 64)
  call void @llvm.x86.tdpbusd(i8 3, i8 4, i8 5)
  call void @llvm.x86.tilestored64(i8 3, ptr %ci, i64 64)
  call void @llvm.x86.tilerelease()
  ret void
}
"""

# The ".internal" intrinsics: tiles as x86_amx values with their shapes (rows, bytes a row);
# LLVM's AMX passes allocate tmm registers and write and load the configuration themselves.
# One 16 x 16 float32 tile of C = A (16 x K bf16, row stride lda bytes) . B, B packed as
# K/2 rows of 16 bf16 pairs (64 bytes: row r holds w[n, 2r], w[n, 2r+1] for n = 0..15), the
# accumulator carried through the K loop by a phi (it stays in one tmm register).
INTERNAL_IR = r"""
declare x86_amx @llvm.x86.tileloadd64.internal(i16, i16, ptr, i64)
declare x86_amx @llvm.x86.tdpbf16ps.internal(i16, i16, i16, x86_amx, x86_amx, x86_amx)
declare x86_amx @llvm.x86.tdpbusd.internal(i16, i16, i16, x86_amx, x86_amx, x86_amx)
declare x86_amx @llvm.x86.tilezero.internal(i16, i16)
declare void @llvm.x86.tilestored64.internal(i16, i16, ptr, i64, x86_amx)
declare void @llvm.x86.tilerelease()
define void @amx_bf16_tile(ptr %a, i64 %lda, ptr %b, ptr %c, i64 %ldc, i64 %ksteps) {
entry:
  %z = call x86_amx @llvm.x86.tilezero.internal(i16 16, i16 64)
  br label %loop
loop:
  %i = phi i64 [0, %entry], [%inext, %loop]
  %acc = phi x86_amx [%z, %entry], [%acc2, %loop]
  %aoff = mul i64 %i, 64
  %boff = mul i64 %i, 1024
  %ap = getelementptr i8, ptr %a, i64 %aoff
  %bp = getelementptr i8, ptr %b, i64 %boff
  %ta = call x86_amx @llvm.x86.tileloadd64.internal(i16 16, i16 64, ptr %ap, i64 %lda)
  %tb = call x86_amx @llvm.x86.tileloadd64.internal(i16 16, i16 64, ptr %bp, i64 64)
  %acc2 = call x86_amx @llvm.x86.tdpbf16ps.internal(i16 16, i16 64, i16 64, x86_amx %acc, x86_amx %ta, x86_amx %tb)
  %inext = add i64 %i, 1
  %done = icmp eq i64 %inext, %ksteps
  br i1 %done, label %exit, label %loop
exit:
  call void @llvm.x86.tilestored64.internal(i16 16, i16 64, ptr %c, i64 %ldc, x86_amx %acc2)
  call void @llvm.x86.tilerelease()
  ret void
}
define void @amx_int8_tile(ptr %a, ptr %b, ptr %c) {
  %z = call x86_amx @llvm.x86.tilezero.internal(i16 16, i16 64)
  %ta = call x86_amx @llvm.x86.tileloadd64.internal(i16 16, i16 64, ptr %a, i64 64)
  %tb = call x86_amx @llvm.x86.tileloadd64.internal(i16 16, i16 64, ptr %b, i64 64)
  %d = call x86_amx @llvm.x86.tdpbusd.internal(i16 16, i16 64, i16 64, x86_amx %z, x86_amx %ta, x86_amx %tb)
  call void @llvm.x86.tilestored64.internal(i16 16, i16 64, ptr %c, i64 64, x86_amx %d)
  call void @llvm.x86.tilerelease()
  ret void
}
"""


def _llvmlite_asm(form: str, cpu: str, features: str) -> str:
    """Assembly of DIRECT_IR or INTERNAL_IR for an x86-64 target machine (llvmlite binding)."""
    import llvmlite.binding as llvm

    llvm.initialize_native_target()  # (llvmlite 0.50: still needed, initialize() itself is deprecated)
    llvm.initialize_native_asmprinter()
    triple = "x86_64-unknown-linux-gnu"
    mod = llvm.parse_assembly(f'target triple = "{triple}"\n' + {"direct": DIRECT_IR, "internal": INTERNAL_IR}[form])
    mod.verify()
    return llvm.Target.from_triple(triple).create_target_machine(cpu=cpu, features=features, opt=3).emit_assembly(mod)


def _numba_asm() -> dict:
    """Assembly of two numba functions whose intrinsics emit the .internal forms (a bf16 tile's K
    loop and an int8 tile's), compiled for NUMBA_CPU_NAME / NUMBA_CPU_FEATURES, never called."""
    import numba
    from llvmlite import ir
    from numba import types
    from numba.core import cgutils
    from numba.extending import intrinsic

    class X86Amx(ir.Type):
        """LLVM's x86_amx (llvmlite.ir has no such type): a tile's value."""

        def _to_string(self):
            return "x86_amx"

        def __eq__(self, other):
            return isinstance(other, X86Amx)

        def __hash__(self):
            return hash(X86Amx)

    amx, i16, i64, p8 = X86Amx(), ir.IntType(16), ir.IntType(64), ir.IntType(8).as_pointer()

    def fn(builder, name, ret, args):
        return cgutils.get_or_insert_function(builder.module, ir.FunctionType(ret, args), name)

    def make(op):
        @intrinsic
        def tile(typingctx, a, b, c, ksteps):
            """C (16 x 16, 32-bit) = sum over ksteps of A[:, 64 bytes] . B (16 rows x 64 bytes, packed)."""
            sig = types.none(a, b, c, ksteps)

            def codegen(context, builder, signature, args):
                arrs = [context.make_array(t)(context, builder, v) for t, v in zip(signature.args[:3], args[:3])]
                pa, pb, pc = (builder.bitcast(x.data, p8) for x in arrs)
                lda, ldc = (builder.extract_value(arrs[j].strides, 0) for j in (0, 2))
                n = context.cast(builder, args[3], signature.args[3], types.int64)

                def h(v):
                    return ir.Constant(i16, v)

                load = fn(builder, "llvm.x86.tileloadd64.internal", amx, [i16, i16, p8, i64])
                dot = fn(builder, f"llvm.x86.{op}.internal", amx, [i16, i16, i16, amx, amx, amx])
                zero = builder.call(fn(builder, "llvm.x86.tilezero.internal", amx, [i16, i16]), [h(16), h(64)])
                pre, body, done = builder.block, builder.append_basic_block("amx.k"), builder.append_basic_block("amx.done")
                builder.branch(body)
                builder.position_at_end(body)
                i, acc = builder.phi(i64), builder.phi(amx)
                i.add_incoming(ir.Constant(i64, 0), pre)
                acc.add_incoming(zero, pre)
                ta = builder.call(load, [h(16), h(64), builder.gep(pa, [builder.mul(i, ir.Constant(i64, 64))]), lda])
                tb = builder.call(load, [h(16), h(64), builder.gep(pb, [builder.mul(i, ir.Constant(i64, 1024))]),
                                         ir.Constant(i64, 64)])
                acc2 = builder.call(dot, [h(16), h(64), h(64), acc, ta, tb])
                i2 = builder.add(i, ir.Constant(i64, 1))
                i.add_incoming(i2, body)
                acc.add_incoming(acc2, body)
                builder.cbranch(builder.icmp_signed("<", i2, n), body, done)
                builder.position_at_end(done)
                builder.call(fn(builder, "llvm.x86.tilestored64.internal", ir.VoidType(), [i16, i16, p8, i64, amx]),
                             [h(16), h(64), pc, ldc, acc2])
                builder.call(fn(builder, "llvm.x86.tilerelease", ir.VoidType(), []), [])
                return context.get_dummy_value()

            return sig, codegen

        return tile

    bf16_tile, int8_tile = make("tdpbf16ps"), make("tdpbusd")

    def arr(dt):
        return types.Array(dt, 2, "C")

    @numba.njit(types.none(arr(types.uint16), arr(types.uint16), arr(types.float32), types.int64))
    def bf16(a, b, c, k):
        bf16_tile(a, b, c, k)

    @numba.njit(types.none(arr(types.uint8), arr(types.int8), arr(types.int32), types.int64))
    def int8(a, b, c, k):
        int8_tile(a, b, c, k)

    return {"numba": numba.__version__, **{f.__name__: f.inspect_asm(f.signatures[0]) for f in (bf16, int8)}}


def _run_self(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True, timeout=300,
                          env={**os.environ, **(env or {})})


def _found(asm: str) -> set[str]:
    return set(re.findall(r"\b(" + "|".join(AMX_INSTRUCTIONS) + r")\b", asm))


@pytest.mark.parametrize("form", ["direct", "internal"])
@pytest.mark.parametrize("cpu, features", [("sapphirerapids", ""), ("x86-64", AMX_FEATURES + ",+avx512f")])
def test_llvmlite_compiles_amx_intrinsics(form, cpu, features):
    """Hand-written IR through llvmlite's target machine (LLVM 22.1 here): every instruction of a
    tile product in the assembly, for Sapphire Rapids or any x86-64 with the AMX features."""
    p = _run_self("llvmlite", form, cpu, features)
    assert p.returncode == 0, p.stderr[-2000:]
    assert _found(json.loads(p.stdout)["asm"]) == set(AMX_INSTRUCTIONS)


def test_amx_intrinsics_abort_llvm_on_a_target_without_amx():
    """Why an AMX kernel must be defined only where the target has AMX (as BF16_TILES is {}
    without AVX512-BF16): LLVM does not raise, it aborts the process (SIGABRT). The direct forms
    stop at ``LLVM ERROR: Cannot select: intrinsic %llvm.x86.tilerelease``; the x86_amx phi of
    the internal forms at an assertion of this llvmlite's LLVM ("This value type is not natively
    supported!")."""
    for form in ("direct", "internal"):
        p = _run_self("llvmlite", form, "znver4", "")
        assert p.returncode != 0 and ("LLVM ERROR" in p.stderr or "Assertion" in p.stderr), (form, p.stderr[-500:])


def test_numba_compiles_an_amx_tile_loop():
    """numba (NUMBA_CPU_NAME=sapphirerapids and NUMBA_CPU_FEATURES with the AMX features: the CPU
    name alone keeps this host's features, which say -amx-tile) compiles intrinsics emitting the
    .internal forms, the accumulator tile carried through the K loop in one tmm register."""
    p = _run_self("numba", env={"NUMBA_CPU_NAME": "sapphirerapids", "NUMBA_CPU_FEATURES": AMX_FEATURES})
    assert p.returncode == 0, p.stderr[-2000:]
    out = json.loads(p.stdout)
    for name, op in (("bf16", "tdpbf16ps"), ("int8", "tdpbusd")):
        asm = out[name]
        assert {"ldtilecfg", "tilezero", "tileloadd", op, "tilestored", "tilerelease"} <= _found(asm)
        dots = re.findall(rf"{op}\s+%tmm(\d), %tmm(\d), %tmm(\d)", asm)
        assert dots and len({d[2] for d in dots}) == 1  # every product into the same accumulator


if __name__ == "__main__":  # the compile-only cases' subprocess: prints JSON
    if sys.argv[1] == "llvmlite":
        print(json.dumps({"asm": _llvmlite_asm(*sys.argv[2:5])}))
    elif sys.argv[1] == "numba":
        print(json.dumps(_numba_asm()))
