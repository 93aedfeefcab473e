"""Compatibility names for code written before `rlx_mpi.families`: the Llama family is now
`rlx_mpi.families.llama` over the one decoder (`rlx_mpi.families.decoder`).

Note: only re-exports, kept while the core (cli.py, cluster.py) still imports ``rlx_mpi.llama``;
delete this package once the core goes through the family contract only.
``LlamaConfig`` is `Arch` (its first eleven fields are the old config's), ``LlamaStage`` the
`DecoderStage`.
"""

from __future__ import annotations

from ..families.decoder.arch import Arch as LlamaConfig
from ..families.decoder.arch import expected_shapes
from ..families.decoder.family import DecoderFamily as LlamaFamily
from ..families.llama import FAMILY, PRESETS

__all__ = ["LlamaConfig", "LlamaStage", "PRESETS", "FAMILY", "LlamaFamily", "expected_shapes"]


def __getattr__(name: str):
    # The stage pulls in numba (about a second to import): only ranks that build one pay it.
    if name == "LlamaStage":
        from ..families.decoder.stage import DecoderStage

        return DecoderStage
    raise AttributeError(name)
