"""The block table's cost at decode (issue 33): a decode step's attention over a paged cache (a row's
blocks read in place through its table, with the slot kernel's arithmetic: attention_cache.py's
paged-rows note) against the slot cache, in one process, the same rows and the same numbers.

    python bench/bench_paged.py [--positions 2048] [--batches 1,8] [--heads 16 --kv-heads 4 --head-dim 64]
                                [--threads 2] [--rounds 15] [--json bench/results/paged.json]

Method: ``--batches`` rows at ``--positions`` positions each (the medium preset's heads by default),
the slot cache (rows, nkv, positions, hs) and the same keys in a pool of scrambled blocks of 16
through a block table; each round times one `kernels.decode_attention` (RoPE, the store, the
attention) of each, alternating which goes first; the report is the median of each and the ratio
paged / slot (1.00: the table costs nothing). The outputs must be equal bit for bit.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from _machine import add_common_args, fmt_table, header, machine, save_json, wait_quiet


def case(rows: int, S: int, nh: int, nkv: int, hs: int, rounds: int) -> dict:
    from rlx_mpi.kernels import decode_attention

    rng = np.random.default_rng(0)
    size = 16
    nb = -(-(S + 1) // size)
    ck = rng.standard_normal((rows, nkv, nb * size, hs)).astype(np.float32)
    cv = rng.standard_normal(ck.shape).astype(np.float32)
    table = rng.permutation(rows * nb).reshape(rows, nb).astype(np.int32)
    pk = np.empty((1, nkv, rows * nb * size, hs), np.float32)
    pv = np.empty_like(pk)
    for r in range(rows):
        for j in range(nb):
            b = table[r, j]
            pk[0, :, b * size:(b + 1) * size] = ck[r, :, j * size:(j + 1) * size]
            pv[0, :, b * size:(b + 1) * size] = cv[r, :, j * size:(j + 1) * size]
    qkv = rng.standard_normal((rows, (nh + 2 * nkv) * hs)).astype(np.float32)
    cos, sin = (rng.standard_normal((rows, hs)).astype(np.float32) for _ in range(2))
    slots, pos = np.arange(rows), np.full(rows, S)
    slot = lambda: decode_attention(qkv, nh * hs, cos, sin, ck, cv, slots, pos)  # noqa: E731
    paged = lambda: decode_attention(qkv, nh * hs, cos, sin, pk, pv, slots, pos, table=table, size=size)  # noqa: E731
    if not np.array_equal(slot(), paged()):
        raise SystemExit(f"batch {rows}: the paged cache's output differs from the slot cache's")
    times: dict[str, list[float]] = {"slot": [], "paged": []}
    for i in range(rounds):
        for name, f in (("slot", slot), ("paged", paged))[::1 if i % 2 else -1]:
            t0 = time.perf_counter()
            f()
            times[name].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    return {"slot_ms": med["slot"], "paged_ms": med["paged"], "ratio": med["paged"] / med["slot"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--positions", type=int, default=2048)
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=15)
    add_common_args(ap, quiet_wait_s=60)
    args = ap.parse_args()
    from rlx_mpi import kernels

    kernels.set_threads(args.threads)
    info = machine()
    print(header("Paged KV cache: decode attention through a block table against slot rows (issue 33)", info))
    results = {}
    for b in map(int, args.batches.split(",")):
        wait_quiet(args.quiet, args.quiet_wait)
        results[f"batch {b}"] = case(b, args.positions, args.heads, args.kv_heads, args.head_dim, args.rounds)
    print(f"{args.positions} positions, {args.heads} heads / {args.kv_heads} kv heads of {args.head_dim}, "
          f"{args.threads} threads, median of {args.rounds}")
    print(fmt_table(["rows", "slot ms", "paged ms", "paged / slot"],
                    [[k, f"{v['slot_ms']:.3f}", f"{v['paged_ms']:.3f}", f"{v['ratio']:.2f}"] for k, v in results.items()]))
    save_json(args.json, {"machine": info, "args": vars(args), "results": results})


if __name__ == "__main__":
    main()
