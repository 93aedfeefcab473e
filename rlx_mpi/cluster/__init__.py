"""Start-up that every MPI command shares: `Cluster` (`start`), each rank's capabilities
(`caps`), the layer plan (`placement`, pure) and the inputs every rank must see alike.

``from rlx_mpi.cluster import Cluster`` keeps working: the names of `start` are loaded from it
on first use, so importing `cluster.placement` alone imports no MPI."""

from __future__ import annotations

import importlib


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    return getattr(importlib.import_module(".start", __name__), name)
