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
import importlib.abc
import importlib.machinery
import sys

# public name -> the module that defines it
_HOME = {
    "NodeCaps": "cluster.caps",
    "Cluster": "cluster.start",
    "ReduceKind": "comm.collectives", "all_reduce": "comm.collectives",
    "JobConfig": "config", "PlacementPolicy": "config", "load_job": "config",
    "CheckpointError": "errors", "ConfigError": "errors", "DeadlineExpired": "errors", "FitError": "errors",
    "InputError": "errors", "RankFault": "errors", "RlxError": "errors",
    "Assignment": "cluster.placement", "ModelCost": "model.cost", "plan_placement": "cluster.placement",
    "ModelFamily": "model.stage", "ParamSource": "model.stage", "Stage": "model.stage", "TensorParallel": "model.stage",
    "register_family": "families", "ModelDims": "model.stage",
    "ClusterRun": "io.stats", "StageTiming": "io.stats",
    "drive": "drivers.run",
}

__all__ = ["Cluster", "drive", "ClusterRun", "StageTiming", "JobConfig", "load_job", "PlacementPolicy",
           "NodeCaps", "ModelCost", "Assignment", "plan_placement", "all_reduce", "ReduceKind", "Stage",
           "ParamSource", "ModelFamily", "ModelDims", "TensorParallel", "register_family", "RlxError", "ConfigError",
           "CheckpointError", "InputError", "FitError", "RankFault", "DeadlineExpired"]
__version__ = "0.1.0"


# Note: moved modules. The flat modules of 0.1 live in layer folders now (ARCHITECTURE.md);
# their old paths (`import rlx_mpi.stage`, `from rlx_mpi.scheduler import Scheduler`) still
# import the same module object, so a plugin written against them keeps working and a
# monkeypatch through either path patches the one module. New code imports the new paths.
_MOVED = {old: f"{layer}.{old}" for layer, olds in {
    "lifecycle": "launch supervisor watcher faults signals logdir progress",
    "comm": "transport collectives wire schedule executor topology replicas",
    "model": "stage checkpoint kv_cache",
    "engine": "scheduler admission block_pool sampling",
    "io": "prompts batch_io scoring tokenizer journal identity shards stats trace",
    "cluster": "caps placement inputs",
    "drivers": "precompile",
}.items() for old in olds.split()}


class _MovedFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds ``rlx_mpi.<old>`` for a moved module and hands back the module at its new home."""

    def find_spec(self, fullname, path=None, target=None):
        head, _, old = fullname.rpartition(".")
        if head != __name__ or old not in _MOVED:
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec):
        return None  # a blank module; exec_module swaps in the real one

    def exec_module(self, module) -> None:
        old = module.__name__.rpartition(".")[2]
        sys.modules[module.__name__] = importlib.import_module(f"{__name__}.{_MOVED[old]}")


if not any(isinstance(f, _MovedFinder) for f in sys.meta_path):
    sys.meta_path.append(_MovedFinder())


def __getattr__(name: str):
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module 'rlx_mpi' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{home}", __name__), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
