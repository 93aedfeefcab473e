"""The one decoder every built-in family runs, described by data (as llama.cpp's graph
builder over per-architecture hyper-parameters).

    arch.py     `Arch`: the checkpoint's config: what differs between families, validated,
                the tensor names (`expected_shapes`) and the planner's cost (MoE: bytes of
                every expert, FLOPs of the top-k)
    rope.py     inverse frequencies and cos/sin for default, linear, llama3, longrope
    model.py    the numpy blocks (norm, attention with bias / q-k norm / window / soft-cap,
                gated MLP, experts, head), nanoGPT-style
    moe.py      router and expert dispatch (only the chosen experts compute)
    ops.py      njit kernels only some families need (GeGLU tanh, soft-cap)
    weights.py  `Linear` in f32 / bf16 / f16 / int8, the layer records
    stage.py    `DecoderStage`: one stage, KV cache (a ring for window layers), TP sharding
    family.py   `DecoderFamily`: the whole `ModelFamily` contract over an `Arch`

A family (``rlx_mpi/families/<name>.py``) is then only its Hugging Face ``model_type``s,
its config translation into an `Arch` (refusing what the decoder does not compute, naming
key and value), its tensor-name map (`families.hf`) and presets.
"""
