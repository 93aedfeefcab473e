"""A PEFT LoRA adapter directory (``adapter_config.json`` + ``adapter_model.safetensors``) read
and checked against the base model's `Arch` (`read_adapter`), one layer range at a time.

The maths is PEFT's ``y = W x + scaling * B (A x)``, scaling = lora_alpha / r, or
lora_alpha / sqrt(r) with ``use_rslora``; ``rank_pattern`` / ``alpha_pattern`` give a module
its own r / alpha (PEFT's rule: a key matches a module name that is it or ends in ``.key``,
as a regular expression); ``layers_to_transform`` only changes which tensors the file holds.
A tensor is named ``base_model.model.model.layers.{n}.{self_attn|mlp}.{module}.lora_{A|B}.weight``.

Note: what is refused, and why by name. Options that change the maths beyond the formula above
(DoRA's magnitude vector, trained biases, whole modules saved beside the adapter, fan-in/fan-out
storage of GPT-2's Conv1D, layer replication, adapters on parameters) are refused with their
key, never ignored: an adapter that loads but computes something else is the worst outcome.
Keys that only describe how the adapter was initialised or trained (``init_lora_weights``,
``lora_dropout``, ``loftq_config``, ...) do not matter at inference and are not read. A tensor
of a module this decoder does not have (another family's model: GPT-2's ``c_attn``, Phi-3's
fused ``qkv_proj``) or of a shape the base model does not take is refused with its name.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ...errors import CheckpointError, ConfigError, json_type
from ..decoder.arch import Arch
from .safetensors import _read_safetensors_header, _read_tensor

__all__ = ["LoraModule", "AdapterConfig", "read_adapter_config", "read_adapter", "adapter_digest", "stacked_layer_bytes",
           "check_base_family", "MODULES"]

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
# our projection -> (its HF module path under a layer, whether TP splits its output (column-parallel))
MODULES = {"q_proj": ("self_attn.q_proj", True), "k_proj": ("self_attn.k_proj", True),
           "v_proj": ("self_attn.v_proj", True), "o_proj": ("self_attn.o_proj", False),
           "gate_proj": ("mlp.gate_proj", True), "up_proj": ("mlp.up_proj", True), "down_proj": ("mlp.down_proj", False)}
# keys whose non-default value changes the maths: refused, named (the module note)
_REFUSED = {"use_dora": (False, None), "modules_to_save": (None, []), "lora_bias": (False, None),
            "bias": ("none", None), "fan_in_fan_out": (False, None), "layer_replication": (None, []),
            "target_parameters": (None, []), "use_qalora": (False, None), "alora_invocation_tokens": (None, []),
            "trainable_token_indices": (None, {}), "exclude_modules": (None, []), "use_bdlora": (None, False)}
_TENSOR = re.compile(r"^base_model\.model\.(?:model\.)?layers\.(\d+)\.(.+)\.lora_([AB])(?:\.default)?\.weight$")


@dataclass(frozen=True)
class AdapterConfig:
    """What of ``adapter_config.json`` the maths reads."""

    r: int
    alpha: float
    rslora: bool
    rank_pattern: dict
    alpha_pattern: dict
    target_modules: tuple[str, ...] | str

    def rank_alpha(self, module: str) -> tuple[int, float]:
        """A module's own r and alpha (``module``: its full name, ``model.layers.0.self_attn.q_proj``)."""
        return (int(_pattern(self.rank_pattern, module, self.r)), float(_pattern(self.alpha_pattern, module, self.alpha)))

    def targets(self, module: str) -> bool:
        """Does ``target_modules`` name this module (its full name)? PEFT's rule: a list entry is the
        name or its ending after a dot; a string is a regular expression the whole name matches."""
        if isinstance(self.target_modules, str):
            return re.fullmatch(self.target_modules, module) is not None
        return any(module == t or module.endswith("." + t) for t in self.target_modules)

    def scaling(self, module: str, r: int) -> float:
        _, alpha = self.rank_alpha(module)
        return alpha / math.sqrt(r) if self.rslora else alpha / r


def _shown(targets) -> str:
    return repr(targets if isinstance(targets, str) else list(targets))


def _pattern(patterns: dict, module: str, default):
    """PEFT's ``get_pattern_key``: the first key that is the module's name or its ending."""
    for key, value in patterns.items():
        if key == module or re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


@dataclass(frozen=True)
class LoraModule:
    """One projection's adapter on one layer: A (r, in) and B (out, r) float32, whole or this rank's
    TP slice, and its scaling."""

    layer: int
    module: str  # our name: q_proj ... down_proj
    a: np.ndarray
    b: np.ndarray
    scaling: float

    @property
    def nbytes(self) -> int:
        return self.a.nbytes + self.b.nbytes


def read_adapter_config(path: Path, name: str) -> AdapterConfig:
    """``path/adapter_config.json``, checked: the refused keys (the module note) named."""
    where = f"adapter {name!r} ({path / CONFIG})"
    if not path.is_dir():
        raise ConfigError(f"adapter {name!r}", f"{path} is not a directory",
                          f"pass a PEFT adapter directory (holding {CONFIG} and {WEIGHTS})")
    try:
        raw = json.loads((path / CONFIG).read_text())
    except FileNotFoundError:
        raise ConfigError(where, "file not found", f"pass a PEFT adapter directory (holding {CONFIG} and {WEIGHTS})") from None
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ConfigError(where, f"not valid JSON ({e})", "save the adapter again with save_pretrained") from None
    if not isinstance(raw, dict):
        raise ConfigError(where, f"holds a {json_type(raw)}, not an object", "save the adapter again with save_pretrained")
    kind = raw.get("peft_type", "LORA")
    if kind != "LORA":
        raise ConfigError(where, f"peft_type {kind!r} is not supported", "only LoRA adapters (peft_type LORA) are")
    for key, allowed in _REFUSED.items():
        if key in raw and raw[key] not in allowed:
            raise ConfigError(f"{where}: {key}", f"{raw[key]!r} is not supported",
                              "merge the adapter into the base model (PEFT's merge_and_unload) and convert that")
    try:
        r, alpha = raw["r"], raw.get("lora_alpha", 8)
        if not (isinstance(r, int) and r > 0 and isinstance(alpha, (int, float)) and not isinstance(alpha, bool)):
            raise ValueError(f"r {r!r}, lora_alpha {alpha!r}")
        targets = raw.get("target_modules")
        if isinstance(targets, list):
            targets = tuple(str(t) for t in targets)
            bad = [t for t in targets if t.rsplit(".", 1)[-1] not in MODULES]  # (PEFT matches a name's ending)
            if bad:
                raise ConfigError(f"{where}: target_modules", f"unknown target module {bad[0]!r}",
                                  f"this decoder's adapters take {sorted(MODULES)}")
        elif not isinstance(targets, str):
            raise ValueError(f"target_modules {targets!r}")
        ranks, alphas = raw.get("rank_pattern") or {}, raw.get("alpha_pattern") or {}
        if not isinstance(ranks, dict) or not isinstance(alphas, dict):
            raise ValueError("rank_pattern / alpha_pattern")
    except KeyError as e:
        raise ConfigError(where, f"no {e.args[0]!r}", "save the adapter again with save_pretrained") from None
    except ValueError as e:
        raise ConfigError(where, f"bad value: {e}", "r must be a positive integer, lora_alpha a number, "
                          "target_modules a list or a regular expression") from None
    return AdapterConfig(r, float(alpha), bool(raw.get("use_rslora", False)), ranks, alphas, targets)


def check_base_family(path: Path, name: str, model_types: tuple[str, ...], family: str) -> None:
    """Refuse an adapter whose ``base_model_name_or_path`` is a local model directory of another
    family (its config.json's ``model_type`` not in ``model_types``). A Hub name, or a directory
    not on this machine, says nothing checkable: the shapes are then the check (`read_adapter`)."""
    try:
        base = json.loads((path / CONFIG).read_text()).get("base_model_name_or_path")
    except (OSError, ValueError, AttributeError):
        return  # (read_adapter_config names it)
    if not isinstance(base, str) or not base or not model_types:
        return
    for root in (Path(base), path / base):
        try:
            kind = json.loads((root / "config.json").read_text()).get("model_type")
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(kind, str) and kind not in model_types:
            raise ConfigError(f"adapter {name!r} ({path / CONFIG}): base_model_name_or_path",
                              f"{base!r} is a {kind!r} model; this job's is of family {family!r} ({', '.join(model_types)})",
                              "use an adapter trained on this job's base model")
        return


def adapter_digest(path: Path, name: str = "") -> str:
    """blake2b of the adapter's two files (the run identity covers it: `io.identity`)."""
    h = hashlib.blake2b(digest_size=16)
    for f in (CONFIG, WEIGHTS):
        try:
            with open(path / f, "rb") as fh:
                for chunk in iter(lambda: fh.read(1 << 20), b""):
                    h.update(chunk)
        except OSError as e:
            raise ConfigError(f"adapter {name!r} ({path / f})", f"cannot read ({e.strerror or e})",
                              "pass a PEFT adapter directory") from None
    return h.hexdigest()


def stacked_layer_bytes(adapters: list[tuple[str, Path]], cfg: Arch) -> int:
    """The bytes of the adapters on the layer that holds most, as a stage stacks them
    (`decoder.lora`: per projection, K adapters padded to the widest rank, float32), from the
    files' headers alone (what ``plan`` and the planner count)."""
    ranks: dict[tuple[int, str], dict[int, int]] = {}
    widths: dict[str, int] = {}
    for k, (name, path) in enumerate(adapters):
        for tname, entry in _read_safetensors_header(Path(path) / WEIGHTS).items():
            m = _TENSOR.match(tname)
            if m is None or len(entry.shape) != 2:
                continue  # (refused with its name when the stage loads it)
            module = next((ours for ours, (hf, _) in MODULES.items() if hf == m.group(2)), None)
            if module is None:
                continue
            layer = ranks.setdefault((int(m.group(1)), module), {})
            if m.group(3) == "A":
                layer[k] = entry.shape[0]
                widths[module + "A"] = entry.shape[1]
            else:
                widths[module + "B"] = entry.shape[0]
    per_layer: dict[int, int] = {}
    for (n, module), by in ranks.items():
        K, R = len(adapters), max(by.values())
        per_layer[n] = per_layer.get(n, 0) + 4 * K * R * (widths.get(module + "A", 0) + widths.get(module + "B", 0))
    return max(per_layer.values(), default=0)


def read_adapter(path: Path, name: str, cfg: Arch, layers: range | None = None,
                 shard=None) -> list[LoraModule]:
    """The adapter's modules on ``layers`` (None: all), checked against ``cfg``'s shapes; with
    ``shard(module, a, b) -> (a, b)`` each cut to this rank's TP slice. Only those layers'
    tensors are read from the file."""
    conf = read_adapter_config(path, name)
    if cfg.kv_lora_rank or cfg.num_experts:
        raise ConfigError(f"adapter {name!r}", "adapters on latent attention or expert layers are not supported",
                          "use a dense-attention, dense-MLP model (Llama, Qwen2/3, Mistral, ...)")
    fpath = path / WEIGHTS
    if not fpath.is_file():
        raise ConfigError(f"adapter {name!r} ({fpath})", "file not found",
                          "save the adapter with save_pretrained(..., safe_serialization=True)")
    entries = _read_safetensors_header(fpath)
    by_path = {hf: ours for ours, (hf, _) in MODULES.items()}
    pairs: dict[tuple[int, str], dict[str, object]] = {}
    for tname, entry in entries.items():
        m = _TENSOR.match(tname)
        if m is None or m.group(2) not in by_path:
            raise CheckpointError(f"adapter {name!r} ({fpath}): {tname}",
                                  "not a LoRA tensor of this decoder's q/k/v/o or MLP projections",
                                  "the adapter was trained on another family's model; use one made for this base model")
        n = int(m.group(1))
        if n >= cfg.num_hidden_layers:
            raise CheckpointError(f"adapter {name!r} ({fpath}): {tname}",
                                  f"layer {n} is past the base model's {cfg.num_hidden_layers} layers",
                                  "use an adapter made for this base model")
        if entry.dtype not in ("F32", "F16", "BF16") or len(entry.shape) != 2:
            raise CheckpointError(f"adapter {name!r} ({fpath}): {tname}", f"{entry.dtype} {list(entry.shape)}",
                                  "LoRA tensors are 2-D float32, float16 or bfloat16")
        pairs.setdefault((n, by_path[m.group(2)]), {})[m.group(3)] = entry
    shapes = {"q_proj": (cfg.q_dim, cfg.hidden_size), "k_proj": (cfg.kv_dim, cfg.hidden_size),
              "v_proj": (cfg.kv_dim, cfg.hidden_size), "o_proj": (cfg.hidden_size, cfg.q_dim),
              "gate_proj": (cfg.intermediate_size, cfg.hidden_size), "up_proj": (cfg.intermediate_size, cfg.hidden_size),
              "down_proj": (cfg.hidden_size, cfg.intermediate_size)}
    out = []
    with open(fpath, "rb") as f:
        for (n, module), ab in sorted(pairs.items()):
            full = f"model.layers.{n}.{MODULES[module][0]}"
            where = f"adapter {name!r} ({fpath}): {full}"
            if set(ab) != {"A", "B"}:
                raise CheckpointError(where, f"has lora_{'A' if 'A' in ab else 'B'} but not the other",
                                      "save the adapter again with save_pretrained")
            if not conf.targets(full):  # (PEFT would leave such a tensor unused: say so instead)
                raise CheckpointError(where, f"has LoRA tensors but target_modules {_shown(conf.target_modules)} does not "
                                      "name it", "save the adapter again with save_pretrained")
            r, _ = conf.rank_alpha(full)
            o, i = shapes[module]
            sa, sb = ab["A"].shape, ab["B"].shape
            if sa != (r, i) or sb != (o, r):
                raise CheckpointError(where, f"lora_A {list(sa)} and lora_B {list(sb)} do not fit the base model's "
                                      f"{module} ({o} x {i}) at rank {r}: expected lora_A {[r, i]}, lora_B {[o, r]}",
                                      "use an adapter made for this base model (and its adapter_config.json)")
            if layers is not None and n not in layers:
                continue
            a = _read_tensor(ab["A"], f).astype(np.float32)
            b = _read_tensor(ab["B"], f).astype(np.float32)
            if shard is not None:
                a, b = shard(module, a, b)
            out.append(LoraModule(n, module, np.ascontiguousarray(a), np.ascontiguousarray(b),
                                  conf.scaling(full, r)))
    return out
