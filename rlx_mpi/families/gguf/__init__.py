"""Convert a GGUF file (llama.cpp's format) to our HDF5 checkpoint: the second reader beside
`families.hf` (safetensors directories); both go through the family's config translation and
name map and end in `checkpoint.write_checkpoint`.

A GGUF holds the model's config as metadata (``general.architecture``, ``<arch>.block_count``,
...), its tensors under llama.cpp's names (``token_embd``, ``blk.N.attn_q``, ..., ``output``),
often quantized in blocks, and its tokenizer and chat template (``tokenizer.ggml.*``,
``tokenizer.chat_template``). Here the metadata becomes the Hugging Face config dict the family's
``arch_from_hf`` already reads and the family's name map (``hf_names``) gives each tensor's
Hugging Face name, found in the file through the ``gguf`` package's own name map; so a GGUF is
refused or accepted for the same reasons as the safetensors of the same model, and every tensor
is checked against the config before a byte is written (`converter._plan`, the GGUF twin of
`hf`'s check: the safetensors reader's plan is being reshaped by the MoE families, so this one
owns its own).

One module a job: `blocks` (the quantized groups GGML blocks become: the quant contract),
`reader` (the file, its metadata and tensors), `config` (metadata -> the Hugging Face config),
`tokenizer` (``tokenizer.ggml.*`` -> tokenizer files), `converter` (`convert_gguf` and its
`ConvertReport`).
"""

from __future__ import annotations

from .blocks import EXACT_TYPES, QuantGroups, quant_groups
from .config import ARCHITECTURES, hf_config
from .converter import ConvertReport, convert_gguf
from .reader import open_gguf, read_metadata
from .tokenizer import tokenizer_files

__all__ = ["QuantGroups", "ConvertReport", "EXACT_TYPES", "ARCHITECTURES", "open_gguf", "read_metadata",
           "hf_config", "tokenizer_files", "convert_gguf", "quant_groups"]
