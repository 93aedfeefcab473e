"""The registry of model families: the one door through which the core reaches a family.

A checkpoint's ``family`` attribute names the family that reads it; ``convert`` picks the
family whose ``hf_model_types`` holds the Hugging Face ``config.json`` ``model_type``; a preset
name (``init-model --preset``, ``[model] preset``, ``plan --preset``) belongs to the family that
lists it. The core imports only this module, never a family's own, so adding a family is a
line in `_BUILTIN` (or a plug-in calling `register_family`), not an edit of the core.

Note: built-in families are imported lazily by module name (`importlib`), so importing the
registry costs nothing, a family's module may import the core freely (no import cycle), and
a plug-in registered first under a built-in's name is not replaced.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["register_family", "get_family", "family_names", "family_for_model_type", "find_preset",
           "preset_names"]

# family name -> the module that defines it as ``FAMILY`` (or ``module:ATTR``), imported on
# first use. Every built-in family is the one decoder (`families.decoder`) over an `Arch`.
_BUILTIN: dict[str, str] = {
    "llama": "rlx_mpi.families.llama",
    "mistral": "rlx_mpi.families.mistral",
    "qwen2": "rlx_mpi.families.qwen:QWEN2",
    "qwen3": "rlx_mpi.families.qwen:QWEN3",
    "phi3": "rlx_mpi.families.phi",
    "gemma2": "rlx_mpi.families.gemma",
    "mixtral": "rlx_mpi.families.mixtral",
}

_FAMILIES: dict[str, Any] = {}


def register_family(family: Any) -> None:
    """Make ``family`` (a `rlx_mpi.stage.ModelFamily`) loadable by its ``name``."""
    _FAMILIES[family.name] = family


def get_family(name: str) -> Any | None:
    """The family registered as ``name``, importing a built-in one on first use; None if unknown."""
    if name not in _FAMILIES and name in _BUILTIN:
        module, _, attr = _BUILTIN[name].partition(":")
        _FAMILIES.setdefault(name, getattr(importlib.import_module(module), attr or "FAMILY"))
    return _FAMILIES.get(name)


def family_names() -> list[str]:
    """Every family known now: the built-in ones and those plug-ins registered."""
    return sorted(set(_BUILTIN) | set(_FAMILIES))


def _all() -> list[Any]:
    return [f for f in (get_family(n) for n in family_names()) if f is not None]


def family_for_model_type(model_type: str) -> Any | None:
    """The family that converts Hugging Face checkpoints of ``model_type``; None if none does."""
    for family in _all():
        if model_type in getattr(family, "hf_model_types", ()):
            return family
    return None


def preset_names() -> list[str]:
    """Every preset name of every family, sorted."""
    return sorted(n for f in _all() for n in getattr(f, "presets", {}))


def find_preset(name: str) -> tuple[Any, Any] | None:
    """(family, config) of the preset ``name``; None if no family has it."""
    for family in _all():
        presets = getattr(family, "presets", {})
        if name in presets:
            return family, presets[name]
    return None
