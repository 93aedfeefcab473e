"""``rlx-mpi probe``: every launched rank's hardware (CPUs, memory, affinity, optionally its
matmul speed), under the MPI lifecycle but without the shared start-up (`Cluster.start`):
it plans and builds nothing. The probe itself is `caps.probe_local`.
"""

from __future__ import annotations

import json

__all__ = ["probe"]


def probe(args) -> int:
    """Every launched rank's hardware, gathered to rank 0 and printed (``--json``: as JSON)."""
    from mpi4py import MPI

    from ..comm import transport
    from ..cluster.caps import NodeCaps, format_caps, probe_local
    from ..cluster.start import gather_local_affinity
    from ..lifecycle.faults import RankContext, agree

    from ..lifecycle.logdir import setup_logging

    world = MPI.COMM_WORLD
    setup_logging(world, args.debug, args.log_dir, args.command)
    ctx = RankContext(rank=world.rank, size=world.size, debug=args.debug)
    ckpt = None
    if args.job:
        from ..config import load_job

        ckpt = agree(world, ctx, 60.0, lambda: load_job(args.job)).model.checkpoint
    local = world.Split_type(MPI.COMM_TYPE_SHARED)
    affinity = gather_local_affinity(local, 120.0, ctx)
    mine = agree(world, ctx, 120.0, lambda: probe_local(world.rank, local.rank, local.size, ckpt, args.gflops,
                                                        affinity))
    rows = transport.gather_json(world, mine.to_dict(), 0, 120.0, ctx, "the probe")
    if rows is not None:
        caps = [NodeCaps.from_dict(r) for r in rows]
        print(json.dumps([c.to_dict() for c in caps], indent=2) if args.json else format_caps(caps))
    return 0
