"""Warm forwards through the real stack: start-up once, then ``--reps`` `drivers.run.drive` calls.

    mpiexec -n N python bench/_drive.py JOB.toml --reps 4 --out RUNS.json

Used by bench_overlap.py and bench_torch_pipe.py so that ours, like torch's, is timed warm
(the CLI does one cold forward per launch). Rank 0 writes the list of `ClusterRun.to_dict()`,
the first (cold) one included and marked.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("job")
    ap.add_argument("--reps", type=int, default=4)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    from rlx_mpi.cluster.start import Cluster
    from rlx_mpi.drivers.run import drive

    cx = Cluster.from_path(args.job)
    ids = cx.load_inputs(None)
    cx.probe()
    cx.plan()
    cx.build()
    runs = []
    for i in range(args.reps + 1):
        run = drive(cx, ids)
        if run is not None:
            runs.append({**run.to_dict(), "cold": i == 0})
    if runs:
        Path(args.out).write_text(json.dumps(runs))
    cx.close()
    sys.stdout.flush()


if __name__ == "__main__":
    main()
