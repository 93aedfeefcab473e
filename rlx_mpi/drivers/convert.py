"""``rlx-mpi convert`` and ``rlx-mpi init-model``: the two commands that write a checkpoint
(plain, no MPI). The readers are the families' (`families.convert_hf`, `families.gguf`); this
module checks the output path against the inputs and prints what was written.
"""

from __future__ import annotations

from pathlib import Path

from ..errors import ConfigError

__all__ = ["convert", "init_model"]


def convert(args) -> int:
    """A Hugging Face directory (its family's converter) or a .gguf file to ``args.out``."""
    from ..families import convert_hf, hf_family
    from ..outputs import check_output

    src = Path(args.hf_dir)
    if src.suffix.lower() == ".gguf" and not src.is_dir():
        return _convert_gguf(args, src)
    if args.dequantize:
        raise ConfigError("convert --dequantize", "applies to a .gguf source only", "drop the flag")
    inputs = {f"the source file {p.name}": p for p in (sorted(src.iterdir()) if src.is_dir() else []) if p.is_file()}
    check_output("convert OUT", args.out, inputs, stream_ok=False)
    family, _ = hf_family(src)
    cfg = convert_hf(src, args.out, dtype=args.dtype)
    print(f"wrote {args.out}: {family.describe(cfg)}")
    tok = Path(args.out).with_name(f"{Path(args.out).stem}.tokenizer.json")
    if tok.is_file():  # copied by the family's converter: text prompts work with `generate`
        print(f"wrote {tok}: the model's tokenizer")
    return 0


def _convert_gguf(args, src: Path) -> int:
    from ..families.gguf import convert_gguf
    from ..outputs import check_output

    check_output("convert OUT", args.out, {f"the source file {src.name}": src}, stream_ok=False)
    family, cfg, report = convert_gguf(src, args.out, dtype=args.dtype, dequantize=args.dequantize)
    for line in report.lines():
        print(f"  {line}")
    print(f"wrote {args.out}: {family.describe(cfg)}")
    for path in report.files:
        print(f"wrote {path}")
    return 0


def init_model(args) -> int:
    """A random checkpoint of a family's preset."""
    from ..families import require_preset
    from ..outputs import check_output

    family, cfg = require_preset(args.preset, "init-model --preset")
    out = Path(args.out)
    check_output("init-model OUT", out, stream_ok=False)
    family.init_random(out, cfg, seed=args.seed, dtype=args.dtype)
    print(f"wrote {out}: random {family.name} preset {args.preset!r}, seed {args.seed}")
    return 0
