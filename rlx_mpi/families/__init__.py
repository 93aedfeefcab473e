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
           "preset_names", "require_preset", "hf_family", "convert_hf", "load_plugins"]

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
    "gemma3": "rlx_mpi.families.gemma3",
    "olmo2": "rlx_mpi.families.olmo",
    "granite": "rlx_mpi.families.granite",
    "qwen3_moe": "rlx_mpi.families.qwen_moe",
    "deepseek_v2": "rlx_mpi.families.deepseek:DEEPSEEK_V2",
    "deepseek_v3": "rlx_mpi.families.deepseek:DEEPSEEK_V3",
    "gpt_oss": "rlx_mpi.families.gpt_oss",
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
    """The family that converts Hugging Face checkpoints of ``model_type``; None if none does. A
    built-in family first: a plug-in that also lists the type (a wrapper such as the tests'
    ``faulty_llama``, which sorts before ``llama``) does not take over conversion."""
    builtin = [f for f in _all() if f.name in _BUILTIN]
    for family in builtin + [f for f in _all() if f not in builtin]:
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


def require_preset(name: str, where: str) -> tuple[Any, Any]:
    """(family, config) of the preset ``name``; the one `ConfigError` for an unknown preset name
    (``init-model --preset``, ``plan --preset``, ``[model] preset``)."""
    found = find_preset(name)
    if found is None:
        from ..errors import ConfigError

        raise ConfigError(where, f"got {name!r}", f"expected one of {preset_names()}")
    return found


def hf_family(hf_dir: Any, config_name: str = "config.json") -> tuple[Any, dict]:
    """(family, config.json as a dict) for the Hugging Face directory ``hf_dir``: the family whose
    ``hf_model_types`` holds its ``model_type``; a `CheckpointError` (exit 2) naming the
    supported types when none does."""
    from pathlib import Path

    from ..errors import CheckpointError
    from .hf import read_hf_config

    hf_dir = Path(hf_dir)
    if not hf_dir.is_dir():
        raise CheckpointError(str(hf_dir), "not a directory", "give the Hugging Face model directory")
    where = str(hf_dir / config_name)
    raw = read_hf_config(hf_dir / config_name)
    model_type = raw.get("model_type")
    family = family_for_model_type(model_type) if isinstance(model_type, str) else None
    if family is None:
        known = sorted(t for f in _all() for t in getattr(f, "hf_model_types", ()))
        raise CheckpointError(f"{where}: model_type", f"{model_type!r} is not a supported model type",
                              f"supported model types: {', '.join(known)}")
    return family, raw


def convert_hf(hf_dir: Any, out: Any, *, dtype: str = "float32", config_name: str = "config.json",
               **kw: Any) -> Any:
    """Convert the Hugging Face model in ``hf_dir`` to our checkpoint ``out`` with the family its
    ``model_type`` names (`hf_family`); returns the family's config. ``kw`` goes to the family's
    converter (e.g. ``tokenizer=False``)."""
    family, raw = hf_family(hf_dir, config_name)
    if config_name != "config.json":  # beyond the contract: only the built-in converter takes it
        kw["config_name"] = config_name
    return family.convert_hf(hf_dir, out, dtype=dtype, hf_config=raw, **kw)


def load_plugins(modules: Any, where: str) -> None:
    """Import the job's ``[model] plugins`` (modules that call `register_family`); a module that
    fails is one `ConfigError` naming it, not a traceback per rank."""
    from ..errors import ConfigError

    for module in modules:
        try:
            importlib.import_module(module)
        except ImportError as e:
            raise ConfigError(where, f"cannot import {module!r} ({e})",
                              "install the module or fix PYTHONPATH on every node") from None
        except Exception as e:  # the plug-in's own bug
            raise ConfigError(where, f"importing {module!r} raised {type(e).__name__}: {e}",
                              "fix the plug-in (run python -c 'import " + module + "' to see the traceback)") from None
