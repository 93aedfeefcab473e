"""A layer range of any `Arch` decoder as a pipeline `Stage`, sharded under tensor parallelism.

Note: sharding (one rule for every family). q/k/v (with their biases) and gate/up are
column-parallel (each TP rank holds whole attention heads and a slice of the MLP's inner
width); o_proj and down_proj are row-parallel and their partial outputs are summed by an
all-reduce over the TP group. With fewer kv heads than TP ranks (tp a multiple of them) each
rank holds the one kv head its query heads read, replicated (as Megatron does). With experts, a rank holds E/tp *whole* experts instead
(expert parallelism, `decoder.moe`) and the same all-reduce sums their partial outputs.
Norms, per-head q/k norms and the router are replicated (OLMo 2's whole-projection q/k norm is
sliced with its heads, and its sums of squares all-reduced: `model.projection_norm_`); the input embedding too (a lookup costs no
FLOPs, and replication avoids a collective); the LM head is vocab-sharded (the largest
matrix) and its logits are all-gathered. Fused Hugging Face tensors (Phi-3's qkv_proj and
gate_up_proj) are split at convert time, so a shard never straddles q/k/v or gate/up; after
sharding, each rank fuses its own q/k/v rows (and biases) and gate/up rows (each expert's too)
into one matrix (`weights.fuse`), so decode runs one matvec for each.
"""

from __future__ import annotations

import numpy as np

from ... import kernels
from ...model.checkpoint import part_bounds
from ...comm.collectives import ReduceKind, all_reduce, world_ranks
from ...model.kv_cache import (ATTACH, SAVE, SET, KvSpec, LayerCache, block_pool_caches, copy_blocks, paged_caches,
                               prefix_cacheable)
from ...model.stage import ParamSource, Stage, StageCaps, StepBatch, TensorParallel
from . import lora, model, ops
from .arch import Arch
from .rope import Rope
from .weights import PRECISIONS, Experts, ExpertStack, LayerWeights, MlaWeights, Mlp, read_linear

__all__ = ["DecoderStage", "warm_up"]

_MLP = {"gate_proj": 0, "up_proj": 0, "down_proj": 1}  # dense: column-, column-, row-parallel


def warm_up(cfg: Arch, precision: str = "f32", tp: int = 1, decode: bool = False) -> None:
    """Load (or compile) the kernels a stage of ``cfg`` runs at ``precision`` under ``tp``; with
    ``decode`` also the one-call decode layer that generation uses where `model.fused_decode_rows`
    allows it. A stage calls it as it is built; the cluster calls it before (the family's
    ``warm_up``) so that a node compiles each kernel once (`Cluster.build`)."""
    kernels.warm_up()
    ops.warm_up()
    if precision != "f32":
        kernels.warm_up_lowp()
    if cfg.num_experts and cfg.activation in kernels.EXPERT_ACTIVATIONS:  # the experts' decode kernel
        kernels.warm_up_experts(precision)
    if decode and model.fused_decode_rows(cfg, precision, tp):
        kernels.warm_up_decode_layer(precision)


class DecoderStage(Stage):
    """Layers ``layers`` of a decoder; embeds on the first stage, norm + head on the last.

    ``precision`` (f32 | bf16 | f16 | int8) is how this rank holds its projection, embedding
    and head matrices, converted tensor by tensor at load; norms, biases and activations stay f32
    (but for the decode products' own rounding: int8's to int16 blocks, bf16's few rows to bf16
    where the CPU multiplies bf16 pairs; `kernels.rowdot`).
    """

    caps = StageCaps(chunked_prefill=True, prefix_cache=True, paged=True, score_every=True, forward_window=True,
                     adapters=True)
    lora_layers: list | None = None  # per layer, the job's adapters (`load_adapters`)
    _row_adapters: np.ndarray | None = None  # the current step's rows' adapters (`step`)

    def __init__(self, cfg: Arch, source: ParamSource, layers: range, first: bool, last: bool,
                 tp: TensorParallel = TensorParallel(), ctx=None, precision: str = "f32"):
        if precision not in PRECISIONS:
            raise ValueError(f"DecoderStage: precision {precision!r} is not one of {PRECISIONS}")
        self.cfg, self.layers, self.first, self.last, self.tp, self.ctx = cfg, layers, first, last, tp, ctx
        self.precision = precision
        self._fused_rows = model.fused_decode_rows(cfg, precision, tp.size)  # 0: layer by layer
        warm_up(cfg, precision, tp.size)

        def shard(name: str, axis: int | None, part: tuple[int, int] = (tp.rank, tp.size)):
            return read_linear(source, name, precision, axis=axis, part=part[0], parts=part[1])

        nkv = cfg.num_key_value_heads
        # this rank's kv heads: a 1/tp slice, or (tp a multiple of nkv) the one head its queries read
        self.kv_part = (tp.rank, tp.size) if nkv % tp.size == 0 else (tp.rank * nkv // tp.size, nkv)

        self.embed_tokens = read_linear(source, "embed_tokens", precision) if first else None
        self.blocks = [self._layer(source, n, shard) for n in layers]
        self.norm = self._norm(source, "norm") if last else None
        head = "embed_tokens" if cfg.tie_word_embeddings else "lm_head"
        if last and cfg.tie_word_embeddings and first and tp.size == 1:
            self.head = self.embed_tokens  # one matrix serves both ends: hold it once
        else:
            self.head = shard(head, 0) if last else None  # (V/tp, C)

    def _norm(self, source: ParamSource, name: str, part: tuple[int, int] | None = None) -> np.ndarray:
        w = source.read(name) if part is None else source.read(name, axis=0, part=part[0], parts=part[1])
        return (w + np.float32(self.cfg.norm_offset)).astype(np.float32) if self.cfg.norm_offset else w

    def _layer(self, source: ParamSource, n: int, shard) -> LayerWeights:
        cfg, tp, p = self.cfg, self.tp, f"layers/{n}/"
        w = {"o_proj": shard(p + "o_proj", 1)}
        if not cfg.kv_lora_rank:
            w["q_proj"] = shard(p + "q_proj", 0)
            w.update({k: shard(p + k, 0, self.kv_part) for k in ("k_proj", "v_proj")})
        if cfg.o_bias:
            w["o_bias"] = source.read(p + "o_bias")
        if cfg.attention_sinks:  # this rank's query heads' sinks
            w["sinks"] = source.read(p + "sinks", axis=0, part=tp.rank, parts=tp.size)
        for k in ("input_layernorm", "post_attention_layernorm"):
            w[k] = self._norm(source, p + k) if cfg.pre_norms else None
        if cfg.qkv_bias:
            for k, (part, parts) in (("q", (tp.rank, tp.size)), ("k", self.kv_part), ("v", self.kv_part)):
                w[f"{k}_bias"] = source.read(f"{p}{k}_bias", axis=0, part=part, parts=parts)
        if cfg.qk_norm and cfg.qk_norm_scope == "projection":  # OLMo 2: this rank's heads' slice
            w["q_proj_norm"] = self._norm(source, p + "q_norm", (tp.rank, tp.size))
            w["k_proj_norm"] = self._norm(source, p + "k_norm", self.kv_part)
        elif cfg.qk_norm:
            w["q_norm"], w["k_norm"] = self._norm(source, p + "q_norm"), self._norm(source, p + "k_norm")
        if cfg.sandwich_norms:
            w["attn_out_norm"], w["mlp_out_norm"] = self._norm(source, p + "attn_out_norm"), self._norm(source, p + "mlp_out_norm")
        if cfg.moe(n):  # expert parallelism: this rank's experts whole
            a, b = part_bounds(cfg.num_experts, tp.rank, tp.size)
            biases = ("gate_bias", "up_bias", "down_bias") if cfg.expert_bias else ()
            experts, stack = ExpertStack.gather((Mlp.of(*(read_linear(source, f"{p}experts/{e}/{k}", self.precision)
                                                           for k in _MLP), *(source.read(f"{p}experts/{e}/{k}") for k in biases))
                                                  for e in range(a, b)), b - a)  # into the stack as each is read
            shared = Mlp.of(*(shard(f"{p}shared_{k}", axis) for k, axis in _MLP.items())) \
                if cfg.shared_intermediate_size else None  # sliced as a dense MLP
            w["mlp"] = Experts(source.read(p + "router"), a, experts,
                               source.read(p + "router_bias") if cfg.router_bias else None, shared, stack)
        else:
            w["mlp"] = Mlp.of(*(shard(p + k, axis) for k, axis in _MLP.items()))
        kind = dict(window=cfg.window(n), local_rope=cfg.local_rope(n), norm_group=tp.size)
        if cfg.kv_lora_rank:
            return LayerWeights.latent(self._mla(source, p, shard), **w, **kind)
        return LayerWeights.of(**w, **kind)  # q/k/v and gate/up fused after sharding

    @property
    def _rope_kinds(self) -> set[bool]:
        """Which RoPE tables this stage's layers read (local: Gemma 3's sliding layers)."""
        return {w.local_rope for w in self.blocks}

    def _mla(self, source: ParamSource, p: str, shard) -> MlaWeights:
        """This rank's heads of a latent-attention layer (q and kv_b by head rows); the latent's
        down-projection and norms replicated; kv_b's halves per head as float32 (absorbed at decode)."""
        cfg = self.cfg
        whole = (0, 1)  # every TP rank reads these whole
        q_a = shard(p + "q_a_proj", 0, whole) if cfg.q_lora_rank else None
        m = MlaWeights(q=shard(p + ("q_b_proj" if cfg.q_lora_rank else "q_proj"), 0),
                       kv_a=shard(p + "kv_a_proj", 0, whole), kv_a_norm=self._norm(source, p + "kv_a_norm"),
                       kv_b=shard(p + "kv_b_proj", 0), uk=None, uv=None, q_a=q_a,
                       q_a_norm=self._norm(source, p + "q_a_norm") if cfg.q_lora_rank else None)
        dn = cfg.qk_nope_head_dim
        per_head = m.kv_b.to_f32().reshape(-1, dn + cfg.v_head_dim, cfg.kv_lora_rank)  # (nh, dn + dv, r)
        # contiguous copies: the decode's per-head products read them every step (a strided view would be
        # copied each time); DeepSeek-V3: 64 MiB a layer in float32, split over the TP ranks
        m.uk, m.uv = np.ascontiguousarray(per_head[:, :dn]), np.ascontiguousarray(per_head[:, dn:])
        return m

    def load_adapters(self, adapters: list[tuple[str, str]]) -> int:
        """The job's LoRA adapters (name, PEFT directory), in order (index 0..K-1), for this stage's
        layers and this rank's TP shard (`decoder.lora`); their bytes."""
        if not adapters:
            self.lora_layers = None
            return 0
        kernels.warm_up_lora()
        shard = lora.shard_for(self.cfg, self.tp.rank, self.tp.size, self.kv_part)
        self.lora_layers = lora.load_layers(adapters, self.cfg, self.layers, shard)
        return self.adapter_bytes

    @property
    def adapter_bytes(self) -> int:
        return sum(s.nbytes for layer in self.lora_layers or () for s in layer.values())

    def step(self, x: np.ndarray, batch: StepBatch) -> np.ndarray:
        """`Stage.step`, with the rows' adapters (``batch.adapters``) held for the step's layers."""
        if batch.adapters is not None and self.lora_layers is None and (np.asarray(batch.adapters) >= 0).any():
            raise RuntimeError("a step names adapters but none were loaded on this stage (load_adapters)")
        self._row_adapters = batch.adapters
        try:
            return super().step(x, batch)
        finally:
            self._row_adapters = None

    def _lora(self, kind: str, T: int, n_decode: int = 0) -> "lora.LoraStep | None":
        rows = lora.token_rows(self._row_adapters, kind, T, n_decode)
        return None if rows is None else lora.LoraStep(rows, self.lora_layers)

    @property
    def weight_bytes(self) -> int:
        arrays = {id(a): a for a in (self.embed_tokens, self.norm, self.head) if a is not None}  # tied: once
        return sum(a.nbytes for a in arrays.values()) + sum(b.nbytes for b in self.blocks)

    def _reduce(self, partial: np.ndarray) -> np.ndarray:
        if self.tp.size == 1:
            return partial
        return all_reduce(np.ascontiguousarray(partial), ReduceKind.SUM, comm=self.tp.comm,
                          timeout_s=self.tp.timeout_s, ctx=self.ctx)

    def _embed(self, x: np.ndarray) -> np.ndarray:
        return model.embed(x, self.embed_tokens, self.cfg.embedding_multiplier) if self.first else x

    def forward(self, x: np.ndarray, window: int = 0) -> np.ndarray:
        """``window`` > 0: the job's ``kv_cache = "window:W"`` (a query sees the last W keys; a
        layer's own narrower window stays), the model ``generate`` runs under the same job: the
        attention of generate's prefill without a cache (``kv_cache = "none"``'s), so every
        kind of layer applies the window as generate does."""
        cfg = self.cfg
        h = self._embed(x)  # (B, T, C)
        rope, T = Rope(cfg, h.shape[1]), h.shape[1]
        tables = {local: rope.prefix(T, local) for local in self._rope_kinds}
        B = h.shape[0]
        step = model.KvStep([_layer_spec(KvSpec("window", window), w.window) for w in self.blocks], np.arange(B),
                            True, lengths=np.full(B, T), caches=None) if window else None
        for i, w in enumerate(self.blocks):
            if step is not None:
                step.layer = i
            h = model.block(h, w, cfg, *tables[w.local_rope], self._reduce, step)
        if not self.last:
            return h
        logits = model.lm_head(h, self.norm, self.head, cfg)  # (B, T, V/tp)
        return self._gather_vocab(logits)

    # -- generation: stateful prefill / decode over a per-stage KV cache ------------------------

    def reset(self, slots: int, max_seq: int, kv: KvSpec) -> int:
        """Allocate the cache for ``slots`` sequences of up to ``max_seq`` tokens; return its bytes.

        A sliding-window layer keeps only its window (a ring, as Mistral's rolling cache): the
        job's policy and the layer's own window, whichever is narrower."""
        cfg = self.cfg
        if self._fused_rows:  # generation only: `run` never compiles (or loads) the one-call layer
            kernels.warm_up_decode_layer(self.precision)
            for kinds in {tuple(x.kind for x in (b.qkv, b.o_proj, b.mlp.gate_up, b.mlp.down_proj)) for b in self.blocks}:
                kernels.warm_up_decode_layer(self.precision, kinds)  # a file's mixed storage (weights.Linear.kind)
        self.specs = [_layer_spec(kv, w.window) for w in self.blocks]
        self.caches, self.table, self._shape = None, None, (slots, max_seq)
        if not kv.recompute:
            self.caches = [LayerCache(slots, *self._entry(w, s.cache_len(max_seq))) for w, s in zip(self.blocks, self.specs)]
        self.rope = Rope(cfg, max_seq)
        return sum(c.nbytes for c in self.caches) if self.caches else 0

    def reset_prefix(self, blocks: int, size: int, paged: bool = False) -> int:
        """The prefix cache's pool (`kv_cache`'s prefix-cache note): ``blocks`` blocks of ``size``
        positions per layer; its bytes. 0 and no pool where a layer's cache cannot take part.
        ``paged``: the full-attention layers' slots become those blocks, read through a block table
        (`kv_cache`'s block-table note); the bytes are then the stage's whole cache's."""
        self.pool, self._saves = None, None
        if blocks and self.caches is not None and prefix_cacheable(self.specs, size):
            if paged:
                self.caches, self.table = paged_caches(self.caches, self.specs, *self._shape, blocks, size)
            self.pool = block_pool_caches(self.caches, blocks, size)
        if not self.pool:
            return 0
        pools = sum(p.nbytes for p in self.pool if p is not None)
        return pools + sum(c.nbytes for c in self.caches) if paged else pools

    def block_ops(self, ops: np.ndarray, before: bool) -> None:
        """A step's block ops (`scheduler.block_ops`): ``before`` it, its attaches are copied and
        its saves kept for its prefill (made layer by layer: `kv_cache.prefill_kv`); after it, none is left."""
        if getattr(self, "pool", None) is None:
            raise RuntimeError("block ops without a prefix-cache pool (reset_prefix)")
        if before:
            if self.table is not None:  # a row's blocks, cached (ATTACH) or its own (SET): its table entries
                set_ = ops[(ops[:, 0] == ATTACH) | (ops[:, 0] == SET)]
                self.table[set_[:, 1], set_[:, 2]] = set_[:, 3]
            copy_blocks(self.caches, self.pool, ops)
            saves = ops[ops[:, 0] == SAVE, 1:]  # (m, 3): slot, block, pool id
            self._saves = saves if len(saves) else None
        elif self._saves is not None:
            self._saves = None
            raise RuntimeError("a step's block saves were not made: the step had no prefill rows for them")

    def _step_saves(self, slots: np.ndarray) -> tuple[np.ndarray | None, list | None]:
        """The kept saves as (row in ``slots``, block, pool id), and the pool; (None, None) without."""
        saves, self._saves = getattr(self, "_saves", None), None
        if saves is None:
            return None, None
        row = {int(s): b for b, s in enumerate(slots)}
        return np.array([(row[s], j, i) for s, j, i in saves.tolist()], np.int64).reshape(-1, 3), self.pool

    def _entry(self, w: LayerWeights, length: int) -> tuple[int, int, int, int]:
        """Layer ``w``'s cache shape on this rank, (heads, positions, k width, v width): K and V of
        this rank's kv heads, or for a latent-attention layer one shared "head" holding the
        latent (kv_lora_rank, in ``k``) and the RoPE key (head_dim, in ``v``), the same on every
        TP rank (`decoder.mla`). The entry width is the layer's own (`LayerCache.entry_floats`)."""
        cfg = self.cfg
        if w.mla is not None:
            return 1, length, cfg.kv_lora_rank, cfg.head_dim
        return cfg.num_key_value_heads // self.kv_part[1], length, cfg.head_dim, cfg.head_dim

    def prefill(self, x: np.ndarray, slots: np.ndarray, lengths: np.ndarray, start: int = 0,
                every: bool = False) -> np.ndarray:
        """Positions start..start+T-1 of each row, filling the cache; a row's whole prompt is
        ``lengths`` long (right-padded past it). ``start`` > 0 is a later chunk of a chunked
        prefill: positions 0..start-1 are in the cache (every row has lengths > start).

        x: ids (B, T) on the first stage, else hidden (B, T, C). Returns hidden (B, T, C), or
        on the last stage the logits (B, V) of each row's last real token in the chunk; with
        ``every`` (``score`` after an attached prefix) those of every position, (B, T, V).
        """
        B, T = x.shape[:2]
        saves, pool = self._step_saves(slots)
        step = model.KvStep(self.specs, slots, True, lengths=lengths, caches=self.caches, start=start, saves=saves,
                            pool=pool, lora=self._lora("prefill", T))
        h = self._blocks(x, np.broadcast_to(start + np.arange(T), (B, T)), step, lengths)
        if not self.last:
            return h
        if every:
            return self._gather_vocab(model.lm_head(h, self.norm, self.head, self.cfg))  # (B, T, V)
        last = np.minimum(np.asarray(lengths) - start, T) - 1  # each row's last real token here
        return self._head(h[np.arange(B), last][:, None])  # (B, 1, C) -> (B, V)

    def decode(self, x: np.ndarray, slots: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """One new token per row at ``positions`` (B,): ids (B, 1) or hidden (B, 1, C) in;
        hidden (B, 1, C) or, on the last stage, logits (B, V) out."""
        if self.caches is None:
            raise RuntimeError("decode without a KV cache: kv_cache = none recomputes with prefill")
        step = model.KvStep(self.specs, slots, False, positions=positions, caches=self.caches,
                            lora=self._lora("decode", 1))
        h = self._blocks(x, positions[:, None], step)
        return self._head(h) if self.last else h

    def mixed(self, x: np.ndarray, slots: np.ndarray, pos: np.ndarray, n_decode: int, start: int) -> np.ndarray:
        """Rows 0..n_decode-1 decode one token at ``pos``; the others prefill positions
        start..start+T-1 of prompts ``pos`` long, in one pass over the weights (`model.MixedKv`).

        x: ids (1, N) on the first stage, else hidden (1, N, C), N = n_decode + rows x T (the
        decode rows' tokens, then each prefill row's T positions). Returns hidden (1, N, C), or on
        the last stage the logits (n, V) of each decode row and of each prefill row's last real
        token in the chunk."""
        nd, n = n_decode, len(slots)
        T = (x.shape[1] - nd) // (n - nd)
        positions = np.broadcast_to(start + np.arange(T), (n - nd, T))
        tables = {local: (*self.rope.at(pos[:nd, None], local=local),  # (nd, 1, 1, hs)
                          *self.rope.at(positions, pos[nd:], local)) for local in self._rope_kinds}  # (rows, 1, T, hs)
        saves, pool = self._step_saves(slots[nd:])
        step = model.MixedKv(model.KvStep(self.specs, slots[:nd], False, positions=pos[:nd], caches=self.caches),
                             model.KvStep(self.specs, slots[nd:], True, lengths=pos[nd:], caches=self.caches,
                                          start=start, saves=saves, pool=pool), T, *tables[self.blocks[0].local_rope],
                             lora=self._lora("mixed", T, nd))
        h = self._embed(x)  # (1, N, C)
        for i, w in enumerate(self.blocks):
            step.layer = i
            step.cos_d, step.sin_d, step.cos_p, step.sin_p = tables[w.local_rope]
            h = model.block(h, w, self.cfg, None, None, self._reduce, step)
        if not self.last:
            return h
        last = nd + np.arange(n - nd) * T + np.minimum(pos[nd:] - start, T) - 1  # each chunk row's last real token
        return self._head(h[0, np.concatenate([np.arange(nd), last])][:, None])  # (n, 1, C) -> (n, V)

    def _blocks(self, x: np.ndarray, positions: np.ndarray, step: "model.KvStep",
                lengths: np.ndarray | None = None) -> np.ndarray:
        h = self._embed(x)  # (B, T, C)
        tables = {local: self.rope.at(positions, lengths, local) for local in self._rope_kinds}  # (B, 1, T, hs)
        fused = not step.prefill and h.shape[0] <= self._fused_rows and step.lora is None  # (adapters: layer by layer)
        if fused:  # one numba call per layer (`model.decode_block`); one RoPE table (fused_decode_rows)
            cos, sin = (np.ascontiguousarray(t, np.float32) for t in tables[False])
        for i, w in enumerate(self.blocks):
            step.layer = i
            h = model.decode_block(h, w, self.cfg, cos, sin, step) if fused else \
                model.block(h, w, self.cfg, *tables[w.local_rope], self._reduce, step)
        return h

    def _head(self, h: np.ndarray) -> np.ndarray:
        logits = model.lm_head(h, self.norm, self.head, self.cfg)  # (B, 1, V/tp)
        return self._gather_vocab(logits)[:, 0]  # (B, V)

    def _gather_vocab(self, local: np.ndarray) -> np.ndarray:
        """All-gather the vocab-sharded logits so every TP rank holds (B, T, V)."""
        if self.tp.size == 1:
            return local
        from mpi4py import MPI

        from ...lifecycle.faults import RankContext, wait

        B, T, _ = local.shape
        V = self.cfg.vocab_size
        widths = [b - a for a, b in (part_bounds(V, r, self.tp.size) for r in range(self.tp.size))]
        counts = [w * B * T for w in widths]
        displs = np.concatenate([[0], np.cumsum(counts)[:-1]]).tolist()
        blocks = np.empty(B * T * V, dtype=np.float32)  # rank r's (B*T, V_r) block, row-major, in rank order
        request = self.tp.comm.Iallgatherv(np.ascontiguousarray(local), [blocks, counts, displs, MPI.FLOAT])
        ctx = self.ctx or RankContext(rank=self.tp.comm.rank, size=self.tp.comm.size)
        wait(request, self.tp.timeout_s, ctx, lambda: "the vocab-sharded logits of the tensor-parallel group",
             lambda: f"one of world ranks {world_ranks(self.tp.comm)}")
        parts = [blocks[d:d + c].reshape(B * T, w) for d, c, w in zip(displs, counts, widths)]
        return np.concatenate(parts, axis=1).reshape(B, T, V)  # one copy instead of two transposes


def _layer_spec(kv: KvSpec, window: int) -> KvSpec:
    """The cache policy of a layer whose model window is ``window`` (0: full attention)."""
    if not window or kv.recompute:
        return kv
    return KvSpec("window", min(window, kv.window) if kv.policy == "window" else window)
