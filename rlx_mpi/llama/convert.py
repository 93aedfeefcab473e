"""Compatibility: `convert_hf` converts any supported family, picked by ``model_type``."""

from __future__ import annotations

import os
from pathlib import Path

from ..errors import CheckpointError
from ..families.hf import TOKENIZER_FILES, copy_tokenizer, read_hf_config

__all__ = ["convert_hf", "copy_tokenizer", "hf_name", "TOKENIZER_FILES"]


def convert_hf(hf_dir: str | os.PathLike, out_path: str | os.PathLike, *, dtype: str = "float32",
               config_name: str = "config.json", tokenizer: bool = True):
    """Convert the Hugging Face model in ``hf_dir`` with the family its ``model_type`` names."""
    from ..families import family_for_model_type, family_names

    hf_dir = Path(hf_dir)
    where = str(hf_dir / config_name)
    raw = read_hf_config(hf_dir / config_name) if hf_dir.is_dir() else None
    if raw is None:
        raise CheckpointError(str(hf_dir), "not a directory", "give the Hugging Face model directory")
    model_type = raw.get("model_type")
    family = family_for_model_type(model_type) if isinstance(model_type, str) else None
    if family is None:
        from ..families import get_family

        known = sorted(t for n in family_names() for t in getattr(get_family(n), "hf_model_types", ()))
        raise CheckpointError(f"{where}: model_type", f"is {model_type!r}, not a supported architecture",
                              f"supported model types: {', '.join(known)}; an unknown type may differ in "
                              "ways the tensors do not show")
    return family.convert_hf(hf_dir, out_path, dtype=dtype, hf_config=raw, config_name=config_name,
                             tokenizer=tokenizer)


def hf_name(name: str) -> str:
    """The Hugging Face tensor name of our (Llama) checkpoint name (``layers/3/q_proj`` ->
    ``model.layers.3.self_attn.q_proj.weight``)."""
    from ..families.hf import _LAYER

    if name in ("embed_tokens", "norm"):
        return f"model.{name}.weight"
    if name == "lm_head":
        return "lm_head.weight"
    _, n, short = name.split("/")
    return f"model.layers.{n}.{_LAYER[short]}"
