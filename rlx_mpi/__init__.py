"""rlx_mpi: pipeline- and tensor-parallel inference of Llama-family decoders over MPI.

Importing this package does not initialise MPI; `Cluster` and the collectives do, on first use.
"""

from .caps import NodeCaps
from .cluster import Cluster
from .collectives import ReduceKind, all_reduce
from .config import JobConfig, KvPolicy, PlacementPolicy, load_job
from .errors import (CheckpointError, ConfigError, DeadlineExpired, FitError, InputError, RankFault,
                     RlxError)
from .placement import Assignment, ModelCost, plan_placement
from .stage import ModelFamily, ParamSource, Stage, TensorParallel, register_family
from .stats import ClusterRun, StageTiming

__all__ = ["Cluster", "ClusterRun", "StageTiming", "JobConfig", "load_job", "PlacementPolicy", "KvPolicy",
           "NodeCaps", "ModelCost", "Assignment", "plan_placement", "all_reduce", "ReduceKind", "Stage",
           "ParamSource", "ModelFamily", "TensorParallel", "register_family", "RlxError", "ConfigError",
           "CheckpointError", "InputError", "FitError", "RankFault", "DeadlineExpired"]
__version__ = "0.1.0"
