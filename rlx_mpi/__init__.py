"""rlx_mpi: pipeline- and tensor-parallel inference of Llama-family decoders over MPI.

Importing this package does not initialise MPI; `Cluster` and the collectives do, on first use.

Note: lazy names. Importing the package imports nothing heavy: each public name below is
loaded from its module on first use (PEP 562). The console script forks its supervisor
before numpy, numba, h5py or mpi4py is imported, so a rank whose node has a broken numpy
(or a hung file system under site-packages) is still watched and named, not left to hang
the launcher; and `rlx-mpi --help` answers without loading numba.
"""

from __future__ import annotations

import importlib

# public name -> the module that defines it
_HOME = {
    "NodeCaps": "caps",
    "Cluster": "cluster",
    "ReduceKind": "collectives", "all_reduce": "collectives",
    "JobConfig": "config", "PlacementPolicy": "config", "load_job": "config",
    "CheckpointError": "errors", "ConfigError": "errors", "DeadlineExpired": "errors", "FitError": "errors",
    "InputError": "errors", "RankFault": "errors", "RlxError": "errors",
    "Assignment": "placement", "ModelCost": "placement", "plan_placement": "placement",
    "ModelFamily": "stage", "ParamSource": "stage", "Stage": "stage", "TensorParallel": "stage",
    "register_family": "families", "ModelDims": "stage",
    "ClusterRun": "stats", "StageTiming": "stats",
}

__all__ = ["Cluster", "ClusterRun", "StageTiming", "JobConfig", "load_job", "PlacementPolicy",
           "NodeCaps", "ModelCost", "Assignment", "plan_placement", "all_reduce", "ReduceKind", "Stage",
           "ParamSource", "ModelFamily", "ModelDims", "TensorParallel", "register_family", "RlxError", "ConfigError",
           "CheckpointError", "InputError", "FitError", "RankFault", "DeadlineExpired"]
__version__ = "0.1.0"


def __getattr__(name: str):
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module 'rlx_mpi' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{home}", __name__), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
