"""``plan --simulate`` against the real run (issue 45): predicted vs measured, generate and score.

One calibration (``mpiexec -n 2 rlx-mpi probe --calibrate``, or ``--calibration FILE``), then each
case: ``rlx-mpi plan JOB --simulate ... --json`` (no MPI) and the same job run for real under
mpiexec (``--json``: its in-job wall, the driver's loop; and the whole process's time). Cases:
generate and score; 1 rank, 2 stages, TP 2, 2 replicas; short (32-token) and long (1,024-token)
prompts; a shared-prefix file; f32 and q4 (``[run] precision``), on the medium preset.

    python bench/bench_simulate.py [--calibration CAL.json] [--cases a,b] [--json OUT] [--trials 1]

Prints one row a case: predicted and measured in-job seconds, their ratio, and the whole job's
(start-up included) beside. The time here: ~21 min with ``--trials 3``, ~34 with 5 (the figures of
record since run AC: a case's own runs spread 15-40 % on the 2-core VM, and a median of 3 still
moved a case by ~10 %).

The runs are taken round-robin (trial 1 of every case, then trial 2, ...), so that a case's
median is of runs minutes apart, and each after ``--rest`` seconds idle, as a queued job starts
on a node at rest: on the 2-core Firecracker VM, memory freed in the last seconds faults in
~10-30x faster than memory the host has taken back (`rlx_mpi.drivers.calibrate.measure_load`'s
note), and the host takes longer the more was freed (after 3 GB freed, 0.9 GB of fresh memory
touched in 0.07 s 3 s later, 1.4 s at 12 s, 2.5-2.8 s from 20 s on). With 3 s of rest a job's
start-up depended on the job before it: the medium model's 1-rank build took 1.3-1.7 s after an
f32 job (1.2-2.4 GB freed) and 2.6-2.8 s after a q4 job, and the case after a q4 job in every
trial (gen-1-short) spent 0.6-1.8 s longer outside its loop than its twin gen-1-long in each of
five bench runs (O-S; their medians). 20 s of rest puts every run on a node that has given its
memory back.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _cli import default_mpiexec, ensure_checkpoint  # noqa: E402
from _machine import header, loadavg, machine, save_json  # noqa: E402

VOCAB = 16384
# name: (command, ranks, replicas, tp, prompt file, precision, max_new_tokens)
CASES = {
    "gen-1-short": ("generate", 1, 1, 1, "short", "f32", 32),
    "gen-pp2-short": ("generate", 2, 1, 1, "short", "f32", 32),
    "gen-tp2-short": ("generate", 2, 1, 2, "short", "f32", 32),
    "gen-rep2-short": ("generate", 2, 2, 1, "short", "f32", 32),
    "gen-1-long": ("generate", 1, 1, 1, "long", "f32", 16),
    "gen-pp2-shared": ("generate", 2, 1, 1, "shared", "f32", 16),
    "gen-1-short-q4": ("generate", 1, 1, 1, "short", "q4", 32),
    "gen-pp2-short-q4": ("generate", 2, 1, 1, "short", "q4", 32),
    "score-1-short": ("score", 1, 1, 1, "short", "f32", 0),
    "score-pp2-long": ("score", 2, 1, 1, "long", "f32", 0),
    "score-rep2-shared": ("score", 2, 2, 1, "shared", "f32", 0),
    "score-1-long-q4": ("score", 1, 1, 1, "long", "q4", 0),
}


def prompt_files(folder: Path) -> dict[str, Path]:
    import numpy as np

    rng = np.random.default_rng(45)
    out = {}
    shapes = {"short": [rng.integers(1, VOCAB, 32).tolist() for _ in range(16)],
              "long": [rng.integers(1, VOCAB, 1024).tolist() for _ in range(4)]}
    prefix = rng.integers(1, VOCAB, 512).tolist()
    shapes["shared"] = [prefix + rng.integers(1, VOCAB, 32).tolist() for _ in range(16)]
    for name, rows in shapes.items():
        p = folder / f"{name}.jsonl"
        p.write_text("".join(json.dumps({"id": f"{name}{i}", "tokens": t}) + "\n" for i, t in enumerate(rows)))
        out[name] = p
    return out


def write_job(folder: Path, name: str, ckpt: Path, precision: str, replicas: int, tp: int, new: int) -> Path:
    p = folder / f"{name}.toml"
    p.write_text(f"""[model]
checkpoint = "{ckpt}"
preset = "medium"

[run]
precision = "{precision}"
timeout_s = 600.0
startup_timeout_s = 600.0

[placement]
replicas = {replicas}
tp = {tp}
reserve_ram_gb = 0.5

[generate]
max_new_tokens = {max(1, new)}
ignore_eos = true
""")
    return p


def run(cmd: list[str], timeout: float = 1800.0) -> tuple[subprocess.CompletedProcess, float]:
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    took = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"`{' '.join(map(str, cmd))}` exited {proc.returncode}:\n{(proc.stdout + proc.stderr)[-2000:]}")
    return proc, took


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calibration", help="an existing calibration (default: measure one with 2 ranks)")
    ap.add_argument("--cases", default=",".join(CASES), help="comma list of " + ", ".join(CASES))
    ap.add_argument("--trials", type=int, default=1, help="real runs a case (the median is compared)")
    ap.add_argument("--rest", type=float, default=20.0,
                    help="seconds idle before each real run and the calibration, so that each starts as a queued "
                         "job does, on a node at rest (the module note; default 20)")
    ap.add_argument("--workdir", default="/tmp/rlx_bench_simulate")
    ap.add_argument("--checkpoint", default="/tmp/rlx_bench_medium.h5")
    ap.add_argument("--mpiexec", default=default_mpiexec())
    ap.add_argument("--json", help="write the table as JSON here")
    args = ap.parse_args()
    py, mpiexec = sys.executable, args.mpiexec
    folder = Path(args.workdir)
    folder.mkdir(parents=True, exist_ok=True)
    ckpt = Path(args.checkpoint)
    ensure_checkpoint(ckpt, "medium")
    info = machine()
    print(header("plan --simulate against the real run", info))
    files = prompt_files(folder)
    cal = Path(args.calibration) if args.calibration else folder / "calibration.json"
    if not args.calibration:
        cal.unlink(missing_ok=True)
        time.sleep(args.rest)
        _, took = run([mpiexec, "-n", "2", py, "-m", "rlx_mpi", "probe", "--calibrate", str(cal)])
        print(f"calibration: {took:.1f} s (2 ranks), load {loadavg()}")
    names = args.cases.split(",")
    preds, runs = {}, {name: [] for name in names}
    for name in names:
        command, ranks, replicas, tp, which, precision, new = CASES[name]
        job = write_job(folder, name, ckpt, precision, replicas, tp, new)
        sim_cmd = [py, "-m", "rlx_mpi", "plan", str(job), "--ranks", str(ranks), "--replicas", str(replicas),
                   "--tp", str(tp), "--simulate", command, "--prompts", str(files[which]), "--calibration", str(cal),
                   "--json"]
        t0 = time.perf_counter()
        preds[name] = (json.loads(run(sim_cmd)[0].stdout), time.perf_counter() - t0)
    for trial in range(args.trials):  # (round-robin: a case's runs minutes apart, not in one regime of the host)
        for name in names:
            command, ranks, replicas, tp, which, precision, new = CASES[name]
            out, stats = folder / f"{name}.out.jsonl", folder / f"{name}.stats.json"
            out.unlink(missing_ok=True)
            Path(str(out) + ".meta.json").unlink(missing_ok=True)
            time.sleep(args.rest)
            _, whole = run([mpiexec, "-n", str(ranks), py, "-m", "rlx_mpi", command, str(folder / f"{name}.toml"),
                            "--prompts", str(files[which]), "--out", str(out), "--json", str(stats)])
            doc = json.loads(stats.read_text())
            runs[name].append((doc["wall_s"] if command == "generate" else doc["total_forward_ms"] / 1e3, whole))
            print(f"  trial {trial + 1}/{args.trials} {name}: {runs[name][-1][0]:.3f} s in the job, "
                  f"{whole:.2f} s whole", flush=True)
    rows = []
    for name in names:
        command, ranks, replicas, tp, which, precision, new = CASES[name]
        pred, sim_s = preds[name]
        wall, whole = (statistics.median(r[i] for r in runs[name]) for i in (0, 1))
        row = {"case": name, "command": command, "ranks": ranks, "layout": pred["layout"], "prompts": which,
               "precision": precision, "predicted_s": pred["predicted_wall_s"], "measured_s": round(wall, 4),
               "ratio": round(pred["predicted_wall_s"] / wall, 3), "predicted_job_s": pred["job_s"],
               "measured_job_s": round(whole, 3), "job_ratio": round(pred["job_s"] / whole, 3),
               "runs": [[round(a, 3), round(b, 3)] for a, b in runs[name]],
               "simulate_s": round(sim_s, 2), "load": loadavg()}
        rows.append(row)
        print(f"{name:<20} {pred['layout']:<28} predicted {row['predicted_s']:8.3f} s  measured {wall:8.3f} s  "
              f"ratio {row['ratio']:.3f}   job {row['predicted_job_s']:.2f} / {whole:.2f} s  "
              f"ratio {row['job_ratio']:.3f}", flush=True)
    errs = [abs(r["ratio"] - 1) for r in rows]
    jobs = [abs(r["job_ratio"] - 1) for r in rows]
    print(f"in-job: worst {100 * max(errs):.1f} %, median {100 * statistics.median(errs):.1f} %; whole job: worst "
          f"{100 * max(jobs):.1f} %, median {100 * statistics.median(jobs):.1f} %, {sum(e <= 0.15 for e in jobs)} of "
          f"{len(rows)} cases within 15 %")
    save_json(args.json, {"machine": info, "calibration": str(cal), "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
