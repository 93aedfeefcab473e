"""numba kernels vs the numpy they replace, a per-block profile of one layer, and blocked attention's
time and peak RSS vs the attention that materialises (B, nh, T, S) scores (same run, ratios).

    python bench/bench_kernels.py [--preset medium] [--shapes 1x512,16x128,8x512] [--threads 1,2]
                                  [--attn-seqs 512,2048,4096] [--json OUT]

1. Per block, for each thread count and batch x seq shape, one decoder layer of the preset with
   random weights: the time of each step of `model.block` (q/k/v, o, gate/up and down GEMMs,
   RoPE, attention, SiLU*up, RMSNorm, residual adds; the LM head for context), new kernel vs
   the numpy it replaced ("old"), and the whole layer with the new kernels vs with the old ones
   patched back in. Also the projections as one (B*T, C) GEMM vs the (B, T, C) @ W.T that
   numpy runs as B GEMMs (the call sites belong to the Linear objects of issue 10 section 1).
2. Attention alone at batch 1 x seq in --attn-seqs (the preset's heads; causal prefill), each
   variant in a fresh subprocess so its peak RSS (ru_maxrss) is its own: the peak, the rise
   over the process's peak before the call, and the best of --attn-reps calls, interleaved
   old/new --attn-trials times (medians reported).
BLAS and numba threads are pinned to t (threadpoolctl, kernels.set_threads).
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time

import numpy as np

from _machine import add_common_args, fmt_table, header, loadavg, machine, save_json, wait_quiet


def best_ms(fn, reps: int = 5) -> float:
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times) * 1e3


# -- the numpy each kernel replaced (main before issue 10), kept here as the baseline ----------

def old_attend(q, k, v, q_pos=None, window=0):
    """The materialising attention: (B, nkv, g, T, S) scores, causal softmax, probs @ v."""
    from rlx_mpi import kernels

    assert q_pos is None and window <= 0, "the baseline covers causal prefill only"
    B, nh, T, hs = q.shape
    nkv, S = k.shape[1], k.shape[2]
    g = nh // nkv
    qg = q.reshape(B, nkv, g * T, hs)
    scores = (qg @ k.transpose(0, 1, 3, 2)).reshape(B, nkv, g, T, S) * np.float32(hs ** -0.5)
    probs = kernels.causal_softmax_(np.ascontiguousarray(scores, dtype=np.float32), S - T)
    y = probs.reshape(B, nkv, g * T, S) @ v
    return np.ascontiguousarray(y.reshape(B, nh, T, hs).transpose(0, 2, 1, 3))


def old_rope(x, cos, sin):
    half = x.shape[-1] // 2
    rotated = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated * sin


def old_silu_mul_(gate, up):
    return gate / (1.0 + np.exp(-gate)) * up


def numpy_rms(x, w, eps):
    return w * (x / np.sqrt(np.mean(np.square(x), -1, keepdims=True) + np.float32(eps)))


# -- 1. per-block profile ----------------------------------------------------------------------

def layer_weights(cfg, rng):
    from rlx_mpi.families.decoder import model
    from rlx_mpi.families.decoder.weights import Mlp, make_linear

    C, I = cfg.hidden_size, cfg.intermediate_size

    def lin(o, i):  # a float32 Linear; .data is the (o, i) matrix the raw GEMM timings use
        return make_linear(rng.standard_normal((o, i), dtype=np.float32) * np.float32(i ** -0.5), "f32")

    return model.LayerWeights.of(
        input_layernorm=np.ones(C, np.float32), q_proj=lin(cfg.q_dim, C), k_proj=lin(cfg.kv_dim, C),
        v_proj=lin(cfg.kv_dim, C), o_proj=lin(C, cfg.q_dim), post_attention_layernorm=np.ones(C, np.float32),
        mlp=Mlp.of(gate_proj=lin(I, C), up_proj=lin(I, C), down_proj=lin(C, I)))


def profile(cfg, B: int, T: int, reps: int) -> dict:
    from rlx_mpi import kernels
    from rlx_mpi.families.decoder import model
    from rlx_mpi.families.decoder.rope import Rope

    rng = np.random.default_rng(0)
    w = layer_weights(cfg, rng)
    head = rng.standard_normal((cfg.vocab_size, cfg.hidden_size), dtype=np.float32) * np.float32(0.03)
    C, hs, nh, nkv = cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    x = rng.standard_normal((B, T, C), dtype=np.float32)
    x2 = x.reshape(B * T, C)
    cos, sin = Rope(cfg, T).prefix(T)
    q = (x @ w.q_proj.data.T).reshape(B, T, nh, hs).transpose(0, 2, 1, 3)
    k = (x @ w.k_proj.data.T).reshape(B, T, nkv, hs).transpose(0, 2, 1, 3)
    v = (x @ w.v_proj.data.T).reshape(B, T, nkv, hs).transpose(0, 2, 1, 3)
    qr, kr = kernels.rope(q, cos, sin), kernels.rope(k, cos, sin)
    y = kernels.attend(qr, kr, v).reshape(B, T, nh * hs)
    gate, up = x @ w.mlp.gate_proj.data.T, x @ w.mlp.up_proj.data.T
    gate2, up2 = gate.copy(), up.copy()
    eps = cfg.rms_norm_eps
    r = {
        "qkv_gemm": best_ms(lambda: (x @ w.q_proj.data.T, x @ w.k_proj.data.T, x @ w.v_proj.data.T), reps),
        "qkv_gemm_flat": best_ms(lambda: (x2 @ w.q_proj.data.T, x2 @ w.k_proj.data.T, x2 @ w.v_proj.data.T), reps),
        "rope": best_ms(lambda: (kernels.rope(q, cos, sin), kernels.rope(k, cos, sin)), reps),
        "rope_old": best_ms(lambda: (old_rope(q, cos, sin), old_rope(k, cos, sin)), reps),
        "attend": best_ms(lambda: kernels.attend(qr, kr, v), reps),
        "attend_old": best_ms(lambda: old_attend(qr, kr, v), reps),
        "o_gemm": best_ms(lambda: y @ w.o_proj.data.T, reps),
        "o_gemm_flat": best_ms(lambda: y.reshape(B * T, -1) @ w.o_proj.data.T, reps),
        "gate_up_gemm": best_ms(lambda: (x @ w.mlp.gate_proj.data.T, x @ w.mlp.up_proj.data.T), reps),
        "gate_up_gemm_flat": best_ms(lambda: (x2 @ w.mlp.gate_proj.data.T, x2 @ w.mlp.up_proj.data.T), reps),
        "silu_mul": best_ms(lambda: kernels.silu_mul_(gate2, up2), reps),  # in place: values drift, time doesn't
        "silu_mul_old": best_ms(lambda: old_silu_mul_(gate, up), reps),
        "down_gemm": best_ms(lambda: gate @ w.mlp.down_proj.data.T, reps),
        "down_gemm_flat": best_ms(lambda: gate.reshape(B * T, -1) @ w.mlp.down_proj.data.T, reps),
        "rms_norm_x2": 2 * best_ms(lambda: model.rms_norm(x, w.input_layernorm, eps), reps),
        "rms_norm_x2_old": 2 * best_ms(lambda: numpy_rms(x, w.input_layernorm, eps), reps),
        "residual_x2": 2 * best_ms(lambda: x + x, reps),
        "lm_head": best_ms(lambda: x @ head.T, max(1, reps // 2)),
        "lm_head_flat": best_ms(lambda: x2 @ head.T, max(1, reps // 2)),
    }
    new_layer = lambda: model.block(x, w, cfg, cos, sin)  # noqa: E731
    saved = (kernels.attend, kernels.rope, kernels.silu_mul_)
    times = {"layer": [], "layer_old": []}
    for _ in range(reps):  # interleaved: a burst of load hits both
        times["layer"].append(best_ms(new_layer, 1))
        kernels.attend, kernels.rope, kernels.silu_mul_ = old_attend, old_rope, old_silu_mul_
        try:
            times["layer_old"].append(best_ms(new_layer, 1))
        finally:
            kernels.attend, kernels.rope, kernels.silu_mul_ = saved
    r.update({k: min(v) for k, v in times.items()})
    return r


# -- 2. attention time and peak RSS, one fresh process per measurement ----------------------------

def attn_child(variant: str, preset: str, seq: int, threads: int, reps: int) -> None:
    from threadpoolctl import threadpool_limits

    from rlx_mpi import kernels
    from rlx_mpi.families.llama import PRESETS

    cfg = PRESETS[preset]
    kernels.set_threads(threads)
    threadpool_limits(limits=threads)
    fn = kernels.attend if variant == "new" else old_attend
    rng = np.random.default_rng(0)
    nh, nkv, hs = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    q = rng.standard_normal((1, nh, seq, hs), dtype=np.float32)
    k = rng.standard_normal((1, nkv, seq, hs), dtype=np.float32)
    v = rng.standard_normal((1, nkv, seq, hs), dtype=np.float32)
    fn(q[:, :, :8], k[:, :, :8], v[:, :, :8])  # compile / load kernels before the baseline
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn(q, k, v)
        times.append(time.perf_counter() - t0)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"best_ms": min(times) * 1e3, "peak_rss": peak, "rss_rise": peak - base}))


def attn_bench(args) -> list[dict]:
    rows = []
    for seq in args.attn_seqs:
        runs = {"old": [], "new": []}
        for _ in range(args.attn_trials):
            for variant in ("old", "new"):
                out = subprocess.run([sys.executable, __file__, "--child", variant, "--preset", args.preset,
                                      "--child-seq", str(seq), "--child-threads", str(args.attn_threads),
                                      "--attn-reps", str(args.attn_reps)],
                                     capture_output=True, text=True, timeout=600, check=True)
                runs[variant].append(json.loads(out.stdout.strip().splitlines()[-1]))
        med = {v: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for v, rs in runs.items()}
        rows.append({"seq": seq, "threads": args.attn_threads, "median": med, "runs": runs,
                     "time_new_over_old": med["new"]["best_ms"] / med["old"]["best_ms"],
                     "peak_rss_new_over_old": med["new"]["peak_rss"] / med["old"]["peak_rss"],
                     "rss_rise_new_over_old": med["new"]["rss_rise"] / max(med["old"]["rss_rise"], 1)})
        print(f"# attention seq {seq} done", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="medium")
    ap.add_argument("--shapes", default="1x512,16x128,8x512", help="BATCHxSEQ list for the profile ('' skips it)")
    ap.add_argument("--threads", default="1,2", help="thread counts for the profile")
    ap.add_argument("--reps", type=int, default=3, help="timed calls per profile step, best kept")
    ap.add_argument("--attn-seqs", default="512,2048,4096", help="attention-alone sequence lengths ('' skips)")
    ap.add_argument("--attn-threads", type=int, default=2)
    ap.add_argument("--attn-trials", type=int, default=3, help="fresh processes per variant and seq")
    ap.add_argument("--attn-reps", type=int, default=3, help="timed calls inside each process, best kept")
    ap.add_argument("--child", choices=["old", "new"], help=argparse.SUPPRESS)
    ap.add_argument("--child-seq", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--child-threads", type=int, help=argparse.SUPPRESS)
    add_common_args(ap, quiet_wait_s=0.0)
    args = ap.parse_args()
    if args.child:
        return attn_child(args.child, args.preset, args.child_seq, args.child_threads, args.attn_reps)
    args.attn_seqs = [int(s) for s in args.attn_seqs.split(",") if s]
    shapes = [tuple(int(n) for n in s.split("x")) for s in args.shapes.split(",") if s]
    threads = [int(t) for t in args.threads.split(",")]

    from threadpoolctl import threadpool_limits

    from rlx_mpi import kernels
    from rlx_mpi.families.llama import PRESETS

    cfg = PRESETS[args.preset]
    kernels.warm_up()
    info = machine()
    print(header(f"bench_kernels: {args.preset} preset, one layer per step; attention alone in fresh processes",
                 info, f"profile: best of {args.reps}; attention: median over {args.attn_trials} processes of "
                 f"the best of {args.attn_reps} calls"))
    # attention first: Linux carries a process's peak RSS across fork + exec, so children
    # spawned after the profile's large arrays would all report the parent's peak
    attn = attn_bench(args) if args.attn_seqs else []
    profiles = []
    for t in threads:
        for B, T in shapes:
            busy = wait_quiet(args.quiet, args.quiet_wait) if args.quiet_wait > 0 else None
            kernels.set_threads(t)
            with threadpool_limits(limits=t):
                r = profile(cfg, B, T, args.reps)
            profiles.append({"threads": t, "batch": B, "seq": T, "ms": r, "busy_before": busy})
            print(f"# profile threads {t}, {B}x{T} done", flush=True)
    if profiles:
        steps = [k for k in profiles[0]["ms"] if not k.endswith("_old") and not k.endswith("_flat")]
        head = ["step"] + [f"t{p['threads']} {p['batch']}x{p['seq']}" for p in profiles]
        rows = []
        for step in steps:
            rows.append([step] + [f"{p['ms'][step]:.1f}" for p in profiles])
            for alt in ("_old", "_flat"):
                if step + alt in profiles[0]["ms"]:
                    rows.append([f"  {step}{alt}/new"] + [f"{p['ms'][step + alt] / p['ms'][step]:.2f}"
                                                          for p in profiles])
        print("per-block profile, ms (one layer; ratios: old or flattened over new, > 1 = new is faster)")
        print(fmt_table(head, rows))
    if attn:
        rows = [[str(a["seq"]), f"{a['median']['old']['best_ms']:.0f}", f"{a['median']['new']['best_ms']:.0f}",
                 f"{a['time_new_over_old']:.2f}", f"{a['median']['old']['peak_rss'] / 2**20:.0f}",
                 f"{a['median']['new']['peak_rss'] / 2**20:.0f}", f"{a['peak_rss_new_over_old']:.2f}",
                 f"{a['median']['old']['rss_rise'] / 2**20:.0f}", f"{a['median']['new']['rss_rise'] / 2**20:.0f}",
                 f"{a['rss_rise_new_over_old']:.3f}"] for a in attn]
        print(f"attention alone, batch 1, {cfg.num_attention_heads} heads ({cfg.num_key_value_heads} kv) x "
              f"{cfg.head_dim}, causal prefill, {args.attn_threads} threads (old = materialised scores)")
        print(fmt_table(["seq", "old_ms", "new_ms", "new/old", "old_peak_MB", "new_peak_MB", "peak new/old",
                         "old_rise_MB", "new_rise_MB", "rise new/old"], rows))
    print(f"# load average at the end: {loadavg()}")
    save_json(args.json, {"bench": "kernels", "machine": info, "preset": args.preset,
                          "profile": profiles, "attention": attn})


if __name__ == "__main__":
    main()
