"""Convert a Hugging Face decoder directory (config.json + safetensors) to our HDF5 checkpoint:
the machinery every family shares (the family gives its config translation and name map).

Everything that could make the numbers wrong is checked before a byte is written: the family
refuses config keys it does not compute (naming key and value), and every tensor must be
present, mapped, of a supported dtype and of the shape the config implies.
What we do not support is refused with a `CheckpointError` naming the file, the key and the
value found, rather than converted into a model that silently computes something else.

One module a job: `names` (`Source` and the name maps), `config` (the config helpers every
family's translation is made of), `safetensors` (the reader and the packed formats it decodes),
`converter` (`convert`, `copy_tokenizer`).
"""

from __future__ import annotations

from .config import read_hf_config, refuse_if, rope_fields, sizes, sliding_windows
from .converter import TOKENIZER_FILES, convert, copy_tokenizer, write_through  # write_through: gguf's too
from .names import _LAYER, TEXT_TOWERS, Source, fused_expert_names, standard_names, text_tower  # _LAYER: tests
from .safetensors import fp8_block_decode, mxfp4_decode

__all__ = ["copy_tokenizer", "convert", "read_hf_config", "standard_names", "fused_expert_names", "text_tower",
           "TEXT_TOWERS", "Source", "TOKENIZER_FILES", "sizes", "rope_fields", "refuse_if", "sliding_windows",
           "mxfp4_decode", "fp8_block_decode"]
