"""Mistral: Hugging Face ``model_type = "mistral"``: Llama's layer with a sliding window on
every layer (``sliding_window``, null for v0.2+) and head_dim that may differ from
hidden / heads (Mistral-Nemo). Covers Mistral-7B-v0.1/v0.2/v0.3, Mistral-Nemo-12B."""

from __future__ import annotations

from .decoder.arch import Arch
from .decoder.family import DecoderFamily
from .hf import rope_fields, sizes, sliding_windows, standard_names
from .llama import no_biases, silu_only

__all__ = ["FAMILY", "arch_from_hf"]


def arch_from_hf(raw: dict, where: str) -> Arch:
    no_biases(raw, where)
    silu_only(raw, where)
    shape = sizes(raw, where, max_positions_default=32768)
    return Arch(**shape, **rope_fields(raw, where, ("default", "linear", "llama3")),
                layer_windows=sliding_windows(raw, where, shape["num_hidden_layers"], all_layers=True))


FAMILY = DecoderFamily("mistral", ("mistral",), arch_from_hf, standard_names)
