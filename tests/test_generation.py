"""Generation in one process: the KV cache against recomputing the prefix, the window against a
direct masked reference, mixed prompt lengths, the sampler and the scheduler."""

import json
from pathlib import Path

import numpy as np
import pytest

from rlx_mpi import kernels
from rlx_mpi.model.checkpoint import H5ParamSource
from rlx_mpi.errors import ConfigError
from rlx_mpi.engine.scheduler import DECODE, PREFILL, Scheduler, chunk_start, read_header
from rlx_mpi.model.kv_cache import KvSpec
from rlx_mpi.families.llama import PRESETS
from rlx_mpi.families.decoder.stage import DecoderStage as LlamaStage
from rlx_mpi.families import convert_hf
from rlx_mpi.engine.sampling import SamplingParams, prompt_key, sample

FIXTURES = Path(__file__).parent / "fixtures"


@pytest.fixture(scope="module")
def stage(tiny_ckpt):
    with H5ParamSource(tiny_ckpt) as src:
        return LlamaStage(PRESETS["tiny"], src, range(8), True, True)


def forward_greedy(stage, prompt, n):
    """The reference: a plain forward of the whole sequence for every new token (no cache)."""
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(stage.forward(np.array([ids]))[0, -1].argmax()))
    return ids[len(prompt):]


def chunked_prefill(stage, x, slots, lengths, chunk):
    """`stage.prefill` of right-padded rows ``chunk`` positions at a time (a row leaves once its
    prompt is in); each row's logits come from the chunk holding its last position."""
    logits = [None] * len(x)
    for start in range(0, int(lengths.max()), chunk):
        live = np.flatnonzero(lengths > start)
        T = min(chunk, int(lengths[live].max()) - start)
        out = stage.prefill(x[live, start:start + T], slots[live], lengths[live], start=start)
        for i, b in enumerate(live):
            if lengths[b] <= start + T:
                logits[b] = out[i]
    return np.stack(logits)


def cached_greedy(stage, prompts, n, spec, slots=None, max_seq=64, chunk=0):
    """Prefill all prompts as one right-padded group (``chunk`` > 0: that many positions per
    prefill call), then decode n-1 tokens per row."""
    B = len(prompts)
    slots = np.arange(B) if slots is None else np.asarray(slots)
    stage.reset(max(slots) + 1, max_seq, spec)
    lengths = np.array([len(p) for p in prompts])
    x = np.zeros((B, lengths.max()), np.int64)
    for b, p in enumerate(prompts):
        x[b, :len(p)] = p
    out = [[] for _ in prompts]
    logits = chunked_prefill(stage, x, slots, lengths, chunk) if chunk else stage.prefill(x, slots, lengths)
    for i in range(n):
        tok = logits.argmax(-1)
        for b in range(B):
            out[b].append(int(tok[b]))
        if i + 1 < n:
            if spec.recompute:  # kv none: prefill the sequence so far again
                seqs = [list(p) + o for p, o in zip(prompts, out)]
                x = np.zeros((B, max(map(len, seqs))), np.int64)
                for b, s in enumerate(seqs):
                    x[b, :len(s)] = s
                logits = stage.prefill(x, slots, np.array([len(s) for s in seqs]))
            else:
                logits = stage.decode(tok[:, None], slots, lengths + i)
    return out


PROMPTS = [[5, 17, 300, 2, 9], [44, 1, 1, 250, 13, 8, 99, 402, 7], [3, 3, 3]]


def test_cached_decode_equals_recomputing_forward(stage):
    want = [forward_greedy(stage, p, 10) for p in PROMPTS]
    assert cached_greedy(stage, PROMPTS, 10, KvSpec("full")) == want
    assert cached_greedy(stage, PROMPTS, 10, KvSpec("none")) == want


def test_mixed_lengths_in_one_group_equal_each_alone(stage):
    together = cached_greedy(stage, PROMPTS, 8, KvSpec("full"), slots=[5, 2, 0], max_seq=32)
    alone = [cached_greedy(stage, [p], 8, KvSpec("full"))[0] for p in PROMPTS]
    assert together == alone


def test_reused_slot_sees_no_stale_keys(stage):
    """A long sequence fills slot 0, then a short prompt takes it: stale positions stay hidden."""
    cached_greedy(stage, [list(range(1, 30))], 5, KvSpec("full"), max_seq=40)
    want = forward_greedy(stage, PROMPTS[2], 6)
    B = 1
    slots = np.array([0])
    logits = stage.prefill(np.array([PROMPTS[2]]), slots, np.array([3]))  # cache not reset
    got = []
    for i in range(6):
        tok = logits.argmax(-1)
        got.append(int(tok[0]))
        logits = stage.decode(tok[:, None], slots, np.array([3 + i]))
    assert got == want and B == 1


def windowed_greedy(stage, prompt, n, window):
    """Direct reference for window:W: a full forward per token through the model functions,
    with kernels.attend's explicit window mask (no cache, no ring)."""
    from rlx_mpi.families.decoder import model
    from rlx_mpi.families.decoder.rope import Rope

    cfg = stage.cfg
    ids = list(prompt)
    for _ in range(n):
        T = len(ids)
        cos, sin = Rope(cfg, T).prefix(T)
        h = model.embed(np.array([ids]), stage.embed_tokens)
        orig = kernels.attend
        model.kernels.attend = lambda q, k, v, q_pos=None, w=0, **kw: orig(q, k, v, np.arange(T)[None], window, **kw)
        try:
            for w in stage.blocks:
                h = model.block(h, w, cfg, cos, sin)
        finally:
            model.kernels.attend = orig
        ids.append(int(model.lm_head(h, stage.norm, stage.head, cfg)[0, -1].argmax()))
    return ids[len(prompt):]


@pytest.mark.parametrize("window", [2, 4, 7])
@pytest.mark.parametrize("chunk", [0, 3])
def test_window_equals_direct_masked_reference(stage, window, chunk):
    """kv_cache window:W (a ring of W) against a direct masked forward; with chunked prefill
    (3 positions per call) a chunk also reads the ring's positions before it."""
    prompts = [PROMPTS[0], PROMPTS[1]]  # lengths 5 and 9: shorter and longer than some windows
    got = cached_greedy(stage, prompts, 9, KvSpec("window", window), chunk=chunk)
    assert got == [windowed_greedy(stage, p, 9, window) for p in prompts]


def test_chunked_prefill_equals_recomputing_forward(stage):
    want = [forward_greedy(stage, p, 6) for p in PROMPTS]
    for chunk in (1, 2, 4):
        assert cached_greedy(stage, PROMPTS, 6, KvSpec("full"), slots=[4, 0, 2], chunk=chunk) == want


def test_window_is_a_different_model(stage):
    full = cached_greedy(stage, [PROMPTS[1]], 9, KvSpec("full"))
    assert cached_greedy(stage, [PROMPTS[1]], 9, KvSpec("window", 3)) != full
    assert cached_greedy(stage, [PROMPTS[1]], 9, KvSpec("window", 64)) == full  # W past the sequence: the same


@pytest.mark.parametrize("name", ["hf_tiny_llama", "hf_tiny_llama_tied"])
def test_greedy_equals_transformers_generate(tmp_path, name):
    ref = json.loads((FIXTURES / name / "generate.json").read_text())
    out = tmp_path / "m.h5"
    cfg = convert_hf(FIXTURES / name, out)
    with H5ParamSource(out) as src:
        st = LlamaStage(cfg, src, range(cfg.num_hidden_layers), True, True)
    n = ref["max_new_tokens"]
    assert cached_greedy(st, ref["prompts"], n, KvSpec("full")) == ref["tokens"]


def test_kv_spec_parsing():
    assert KvSpec.parse("window:16", "w") == KvSpec("window", 16)
    assert str(KvSpec.parse("none", "w")) == "none" and KvSpec("full").cache_len(10) == 10
    assert KvSpec("window", 4).cache_len(10) == 4 and KvSpec("none").cache_len(10) == 0
    for bad in ("window:0", "window:", "window:-1", "ful", 3, "window:x"):
        with pytest.raises(ConfigError, match="window:W"):
            KvSpec.parse(bad, "job: [run] kv_cache")


# -- sampler --------------------------------------------------------------------------------


def naive_top_p_support(row, temperature, top_k, top_p):
    z = row / temperature
    order = sorted(range(len(row)), key=lambda i: (-z[i], i))[:top_k or len(row)]
    p = np.exp(z[order] - z[order[0]])
    p /= p.sum()
    keep, mass = [], 0.0
    for i, q in zip(order, p):
        keep.append(i)
        mass += q
        if mass >= top_p:
            break
    return set(keep)


def test_sampler_greedy_reproducible_and_within_support():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(6, 50)).astype(np.float32) * 3
    keys = np.array([prompt_key(f"p{i}") for i in range(6)])
    steps = np.arange(6)
    assert (sample(logits, keys, steps, SamplingParams()) == logits.argmax(-1)).all()
    p = SamplingParams(temperature=0.8, top_k=10, top_p=0.7, seed=3)
    a, b = sample(logits, keys, steps, p), sample(logits, keys, steps, p)
    assert (a == b).all()
    for row, t in zip(logits, a):
        assert t in naive_top_p_support(row, 0.8, 10, 0.7)
    # a draw depends on (seed, prompt, step) only: the same row alone gives the same token
    assert sample(logits[3:4], keys[3:4], steps[3:4], p)[0] == a[3]
    wide = rng.normal(size=(64, 50)).astype(np.float32)  # flat rows: another seed must change some draws
    k64, s64 = np.arange(64), np.zeros(64, np.int64)
    assert (sample(wide, k64, s64, SamplingParams(1.0, seed=3)) != sample(wide, k64, s64, SamplingParams(1.0, seed=4))).any()


def test_sampler_frequencies_follow_the_distribution():
    logits = np.log(np.array([[0.5, 0.3, 0.15, 0.05]], np.float32))
    p = SamplingParams(temperature=1.0, seed=0)
    draws = [int(sample(logits, np.array([7]), np.array([s]), p)[0]) for s in range(4000)]
    freq = np.bincount(draws, minlength=4) / len(draws)
    assert np.allclose(freq, [0.5, 0.3, 0.15, 0.05], atol=0.03)
    nucleus = SamplingParams(temperature=1.0, top_p=0.75, seed=0)  # keeps tokens 0 and 1
    draws = {int(sample(logits, np.array([7]), np.array([s]), nucleus)[0]) for s in range(500)}
    assert draws == {0, 1}


def test_sampling_params_checked():
    for kw, key in (({"temperature": -1.0}, "temperature"), ({"top_k": -2}, "top_k"), ({"top_p": 0.0}, "top_p"),
                    ({"top_p": 1.5}, "top_p")):
        with pytest.raises(ConfigError, match=key):
            SamplingParams(**kw).check("generate")


def test_prompt_key_is_stable():
    import hashlib

    assert prompt_key("a") == prompt_key("a") != prompt_key("b")
    assert prompt_key("a") == int.from_bytes(hashlib.sha256(b"a").digest()[:8], "little") >> 1 < 2**63


# -- scheduler ------------------------------------------------------------------------------


def test_scheduler_prefills_new_prompts_then_decodes_and_reuses_slots():
    prompts = [(i, f"p{i}", tuple(range(1, 2 + i))) for i in range(5)]
    s = Scheduler(prompts, groups=2, batch=2, max_new_tokens=2, eos_ids=frozenset({99, 98}),
                  recompute=False)
    a = s.next_step(0)
    assert a.kind == PREFILL and [r.id for r in a.rows] == ["p0", "p1"] and a.ids.shape == (2, 2)
    kind, g, n, T, rows = read_header(a.header)
    assert (kind, g, n, T) == (PREFILL, 0, 2, 2) and rows[:, 0].tolist() == [0, 1] and rows[:, 1].tolist() == [1, 2]
    b = s.next_step(1)
    assert [r.slot for r in b.rows] == [2, 3]
    assert s.complete(a, np.array([99, 5])) and a.rows[0].finish_reason == "stop"  # eos frees slot 0
    assert s.complete(b, np.array([4, 98])) and b.rows[1].finish_reason == "stop"  # so does the other eos id
    c = s.next_step(0)  # p4 takes slot 0 and is prefilled; p1 waits a turn
    assert c.kind == PREFILL and [(r.id, r.slot) for r in c.rows] == [("p4", 0)]
    s.complete(c, np.array([7]))
    d = s.next_step(0)
    assert d.kind == DECODE and [r.id for r in d.rows] == ["p4", "p1"]
    assert read_header(d.header)[4][:, 1].tolist() == [5, 2]  # positions of the tokens fed: len - 1
    done = s.complete(d, np.array([1, 2]))
    assert {r.id: r.finish_reason for r in done} == {"p4": "length", "p1": "length"}
    assert s.next_step(0) is None and not s.idle  # group 1 still holds p2, p3
    s.stopping = True
    assert s.next_step(1) is None


def test_scheduler_chunks_a_new_groups_prefill_and_samples_at_each_rows_end():
    """prefill_chunk 4: a group whose rows are all new takes its prompts 4 positions per turn;
    a row's token is kept only from the chunk with its last position; a row admitted beside a
    row still mid-prefill catches up first; rows joining decoding rows are prefilled whole."""
    prompts = [(0, "a", tuple(range(1, 11))), (1, "b", (5, 6, 7)), (2, "c", tuple(range(20, 26))),
               (3, "d", (9, 9))]
    s = Scheduler(prompts, groups=1, batch=2, max_new_tokens=1, eos_ids=frozenset(), recompute=False,
                  prefill_chunk=4)
    a = s.next_step(0)  # a (10 tokens) and b (3): positions 0..3
    kind, g, n, T, rows = read_header(a.header)
    assert (kind, n, T, chunk_start(a.header)) == (PREFILL, 2, 4, 0) and rows[:, 1].tolist() == [10, 3]
    assert a.ids.tolist() == [[1, 2, 3, 4], [5, 6, 7, 0]]
    done = s.complete(a, np.array([50, 51]))  # b ended in this chunk (one new token: done); a did not
    assert [r.id for r in done] == ["b"] and a.rows[0].new == [] and a.rows[0].filled == 4
    c = s.next_step(0)  # c took b's slot at position 0; a waits at 4 until c catches up
    assert [r.id for r in c.rows] == ["c"] and chunk_start(c.header) == 0 and c.ids.tolist() == [[20, 21, 22, 23]]
    s.complete(c, np.array([0]))
    e = s.next_step(0)  # both at 4: a's 4..7, c's 4..5 padded
    assert [r.id for r in e.rows] == ["a", "c"] and chunk_start(e.header) == 4
    assert e.ids.tolist() == [[5, 6, 7, 8], [24, 25, 0, 0]]
    assert [r.id for r in s.complete(e, np.array([60, 61]))] == ["c"]
    f = s.next_step(0)  # d joins beside a, still mid-prefill: d catches up from 0, alone
    assert [r.id for r in f.rows] == ["d"] and (chunk_start(f.header), f.ids.shape[1]) == (0, 2)
    s.complete(f, np.array([3]))
    g8 = s.next_step(0)  # a's last chunk (8..9): its token is kept
    assert [r.id for r in g8.rows] == ["a"] and chunk_start(g8.header) == 8 and g8.ids.tolist() == [[9, 10]]
    assert [r.new for r in s.complete(g8, np.array([70]))] == [[70]]

    mixed = Scheduler([(0, "a", (1, 2)), (1, "b", (3, 4)), (2, "c", tuple(range(1, 10)))], groups=1, batch=2,
                      max_new_tokens=3, eos_ids=frozenset({99}), recompute=False, prefill_chunk=4)
    first = mixed.next_step(0)
    mixed.complete(first, np.array([99, 5]))  # a ends at once (eos); b decodes from here
    second = mixed.next_step(0)  # c joins beside b: prefilled whole (b waits one turn, not three)
    assert [r.id for r in second.rows] == ["c"] and second.ids.shape == (1, 9) and chunk_start(second.header) == 0


def test_scheduler_mixes_new_rows_chunks_into_the_decoding_rows_steps():
    """With ``mixed``, a row admitted beside a decoding row is prefilled 4 positions per step in
    the decoding row's own steps (MIXED: the decode token first, then the chunk, right-padded);
    the decoding row gets a token every step, the new row only from its last chunk."""
    from rlx_mpi.engine.scheduler import MIXED, decode_rows

    s = Scheduler([(0, "a", (1, 2)), (1, "b", (3, 4)), (2, "c", tuple(range(1, 10)))], groups=1, batch=2,
                  max_new_tokens=4, eos_ids=frozenset({99}), recompute=False, prefill_chunk=4, mixed=True)
    s.complete(s.next_step(0), np.array([99, 5]))  # a ends at once (eos); b decodes from here; c takes a's slot
    want = [(0, [[5, 1, 2, 3, 4]]), (4, [[6, 5, 6, 7, 8]]), (8, [[7, 9]])]  # (start, ids): T 4, 4, then 1
    for k, (start, ids) in enumerate(want):
        step = s.next_step(0)
        kind, _, n, T, rows = read_header(step.header)
        assert (kind, n, decode_rows(step.header), chunk_start(step.header)) == (MIXED, 2, 1, start)
        assert [r.id for r in step.rows] == ["b", "c"] and step.ids.tolist() == ids
        assert rows[:, 0].tolist() == [1, 0] and rows[:, 1].tolist() == [2 + k, 9]  # b's position; c's length
        s.complete(step, np.array([6 + k, 50 + k]))
    b, c = step.rows
    assert b.new == [5, 6, 7, 8] and c.new == [52] and c.prefilled  # c's token: its last chunk's
    assert s.next_step(0).kind == DECODE and s.prefill_steps == 4
    one = Scheduler([(0, "a", (1, 2, 3))], groups=1, batch=1, max_new_tokens=2, eos_ids=frozenset(), recompute=False,
                    prefill_chunk=2, mixed=True)
    assert one.next_step(0).kind == PREFILL  # nothing decoding beside it: a plain chunk


def test_scheduler_bounds_a_mixed_steps_prefill_positions_by_the_chunk():
    """Three rows joining one decoding row share a budget of ``prefill_chunk`` positions a step
    (the rows furthest behind first, at least one), so the decoding row's step never grows past one
    chunk; the three start decoding together once all are prefilled, and every token is kept."""
    from rlx_mpi.engine.scheduler import MIXED

    prompts = [(0, "a", (1,)), (1, "b", (2,)), (2, "c", (3,)), (3, "d", (4,)),
               (4, "e", tuple(range(10, 16))), (5, "f", tuple(range(20, 26))), (6, "g", tuple(range(30, 36)))]
    s = Scheduler(prompts, groups=1, batch=4, max_new_tokens=9, eos_ids=frozenset({99}), recompute=False,
                  prefill_chunk=4, mixed=True)
    s.complete(s.next_step(0), np.array([5, 99, 99, 99]))  # b, c, d end at once; a decodes; e, f, g join
    want = [(["e"], 0, [10, 11, 12, 13]), (["f"], 0, [20, 21, 22, 23]), (["g"], 0, [30, 31, 32, 33]),
            (["e", "f"], 4, [14, 15, 24, 25]), (["g"], 4, [34, 35])]  # (chunk rows, start, their ids)
    for k, (ids, start, chunk) in enumerate(want):
        step = s.next_step(0)
        assert step.kind == MIXED and [r.id for r in step.rows] == ["a", *ids] and step.start == start
        assert step.ids.tolist() == [[5 + k, *chunk]]  # a's newest token, then at most 4 positions
        s.complete(step, np.array([6 + k] + [50 + k] * len(ids)))
    step = s.next_step(0)
    assert step.kind == DECODE and [r.id for r in step.rows] == ["a", "e", "f", "g"]
    assert [r.new for r in step.rows] == [[5, 6, 7, 8, 9, 10], [53], [53], [54]]


def drive_in_order(s):
    """Stage 0's loop (`DecodeRing.drive`) with a fake model: steps complete first-in first-out,
    then the step's group and every other group are offered a turn. Returns (steps, rows done)."""
    from collections import deque

    fifo, steps, done = deque(), [], []

    def issue(g):
        if (step := s.next_step(g)) is not None:
            fifo.append(step)
            steps.append(step)

    for g in range(s.groups):
        issue(g)
    while fifo:
        step = fifo.popleft()
        done += s.complete(step, np.array([100 + len(r.new) for r in step.rows]))
        for g in [step.group, *range(s.groups)]:
            issue(g)
    return steps, done


def test_scheduler_rides_a_new_groups_chunks_in_other_groups_decode_steps():
    """A group whose rows are all new parks while 2 (= stages) other groups decode, and its
    chunks ride in their decode steps, one in flight at a time; with fewer decoding it prefills
    in its own steps (a stage would idle). Every prompt still gets all its tokens, in order."""
    from rlx_mpi.engine.scheduler import MIXED

    prompts = [(0, "a", (1,)), (1, "b", (2,)), (2, "c", (3, 4, 5, 6, 7)), (3, "d", (8, 9, 10, 11, 12, 13))]
    s = Scheduler(prompts, groups=3, batch=1, max_new_tokens=4, eos_ids=frozenset(), recompute=False,
                  prefill_chunk=2, mixed=True, stages=2)
    steps, done = drive_in_order(s)
    assert sorted((r.id, r.new) for r in done) == [(i, [100, 101, 102, 103]) for i in "abcd"]
    rides = [st for st in steps if st.kind == MIXED and st.rows[-1].slot != st.group]
    assert rides and all(st.n_decode == 1 and len(st.rows) == 2 for st in rides)
    assert [st.start for st in rides if st.rows[-1].id == "c"] == [2, 4]  # c's own step took 0..1
    assert [st.start for st in rides if st.rows[-1].id == "d"] == [0]  # d took a's slot while b and c decoded;
    assert [st.start for st in steps if st.kind == PREFILL and st.rows[0].id == "d"] == [2, 4]  # b ended: own steps
    alone = Scheduler(prompts, groups=3, batch=1, max_new_tokens=4, eos_ids=frozenset(), recompute=False,
                      prefill_chunk=2, mixed=True, stages=3)  # never 3 other groups decoding: no rides
    steps, done = drive_in_order(alone)
    assert len(done) == 4 and not [st for st in steps if st.kind == MIXED and st.rows[-1].slot != st.group]


def test_scheduler_recompute_prefills_whole_sequences():
    s = Scheduler([(0, "a", (1, 2, 3))], groups=1, batch=1, max_new_tokens=3, eos_ids=frozenset(),
                  recompute=True)
    step = s.next_step(0)
    s.complete(step, np.array([9]))
    step = s.next_step(0)
    assert step.kind == PREFILL and step.ids.tolist() == [[1, 2, 3, 9]]


def test_planner_sees_the_kv_cache():
    """KV bytes per layer are 2 (K, V) x slots x positions kept x kv width x 4 bytes, and a
    plan that fits without the cache does not fit with it."""
    from rlx_mpi.cluster.caps import NodeCaps
    from rlx_mpi.config import PlacementPolicy
    from rlx_mpi.errors import FitError
    from rlx_mpi.model.cost import kv_cost
    from rlx_mpi.cluster.placement import plan_placement

    cfg = PRESETS["small"]
    slots, seq = 16, 1024
    base = cfg.cost(slots, seq)
    per_layer = 2 * slots * seq * cfg.kv_dim * 4
    assert kv_cost(base, [KvSpec("full")], seq).kv_bytes_per_layer == per_layer
    assert kv_cost(base, [KvSpec("window", 128), KvSpec("window", 256)], seq).kv_bytes_per_layer == per_layer // 4
    assert kv_cost(base, [KvSpec("none")], seq).kv_bytes_per_layer == 0
    none, full = kv_cost(base, [KvSpec("none")], seq), kv_cost(base, [KvSpec("full")], seq)
    need = none.stage_bytes(range(cfg.num_hidden_layers), True, True)
    assert full.stage_bytes(range(cfg.num_hidden_layers), True, True) - need == cfg.num_hidden_layers * per_layer
    caps = [NodeCaps(rank=0, host="h", local_rank=0, local_size=1, cpus=2, ram_total_bytes=need + 10**6,
                     ram_available_bytes=need + 10**6)]
    plan_placement(none, caps, PlacementPolicy.BALANCED, 0, grid=[[0]])
    with pytest.raises(FitError):
        plan_placement(full, caps, PlacementPolicy.BALANCED, 0, grid=[[0]])


@pytest.mark.parametrize("n_stages, groups", [(2, 1), (2, 2), (3, 3), (4, 2), (4, 6)])
def test_decode_ring_never_deadlocks(n_stages, groups):
    """Under rendezvous semantics (a send completes only once its receive is posted) the ring
    completes every step; one group never overlaps with itself, and with g groups in flight
    min(g, stages) stages compute at once: a step's send is waited only when its group sends
    again, so a stage never sits in a rendezvous send while another group is ready for it (with
    the send waited at once, at most two stages computed together however many groups)."""
    from rlx_mpi.comm.schedule import COMPUTE, decode_ring, simulate

    rounds = 4
    steps = simulate([decode_ring(s, n_stages, groups, rounds) for s in range(n_stages)])
    computes = [{a.stage for a in step if a.kind == COMPUTE and not (a.stage == 0 and a.microbatch >= groups * rounds)}
                for step in steps]
    assert sum(len(c) for step in steps for c in [[a for a in step if a.kind == COMPUTE]]) == \
        n_stages * groups * rounds + groups  # + stage 0 completing the last round
    assert max(map(len, computes)) == min(groups, n_stages)


def test_generate_section_and_kv_cache_in_the_job_file(tmp_path):
    from rlx_mpi.config import parse_job

    raw = {"model": {"checkpoint": "m.h5"}, "run": {"kv_cache": "window:8"},
           "generate": {"prompts": "p.jsonl", "out": "out/c.jsonl", "max_new_tokens": 5, "temperature": 0.7,
                        "top_k": 3, "top_p": 0.9, "seed": 4, "eos_id": 2, "batch": 2, "groups": 3,
                        "logprobs": 5},
           "rank": [{"rank": 1, "kv_cache": "none"}]}
    job = parse_job(raw, tmp_path / "job.toml")
    g = job.generate
    assert g.prompts == tmp_path / "p.jsonl" and g.out == tmp_path / "out" / "c.jsonl"
    assert (g.max_new_tokens, g.temperature, g.top_k, g.top_p, g.seed, g.eos_id, g.batch, g.groups, g.logprobs) == \
        (5, 0.7, 3, 0.9, 4, 2, 2, 3, 5)
    assert job.kv_for(0) == KvSpec("window", 8) and job.kv_for(1) == KvSpec("none")
    assert parse_job({"model": {"checkpoint": "m.h5"}}, tmp_path / "j.toml").kv_for(0) == KvSpec("full")
    for section, key, value, needle in (("generate", "max_new_tokens", 0, "> 0"), ("generate", "top_k", -1, ">= 0"),
                                        ("generate", "logprobs", 21, "<= 20"), ("generate", "logprobs", -1, ">= 0"),
                                        ("generate", "what", 1, "unknown key"), ("run", "kv_cache", "all", "window:W")):
        with pytest.raises(ConfigError, match=needle):
            parse_job({"model": {"checkpoint": "m.h5"}, section: {key: value}}, tmp_path / "j.toml")


def test_plan_kv_cache_flag(capsys, tmp_path):
    """`rlx-mpi plan --kv-cache` prices what generate keeps: none < window:W < full by exactly
    the KV bytes, the job's policy is the default, and a bad policy is one line, exit 2."""
    import re

    from rlx_mpi.cli import main

    cfg = PRESETS["medium"]
    batch, seq = 8, 2048
    per_layer = 2 * batch * seq * cfg.kv_dim * 4

    def total(*extra) -> tuple[float, str]:
        assert main(["plan", "--preset", "medium", "--ranks", "2", "--batch", str(batch), "--seq", str(seq),
                     *extra]) == 0
        out = capsys.readouterr().out
        return float(re.search(r"([\d.]+) GB estimated in total", out).group(1)), out.splitlines()[0]

    (full, head), (none, _), (window, _) = total(), total("--kv-cache", "none"), total("--kv-cache", "window:256")
    assert "kv cache full" in head
    layers = cfg.num_hidden_layers
    assert abs((full - none) - layers * per_layer / 1e9) < 0.011
    assert abs((window - none) - layers * per_layer / 8 / 1e9) < 0.011  # 256 of 2048 positions
    job = tmp_path / "job.toml"
    job.write_text(f'[model]\npreset = "medium"\ncheckpoint = "{tmp_path / "m.h5"}"\n'
                   f'[run]\nbatch = {batch}\nseq = {seq}\nkv_cache = "none"\n')
    assert main(["plan", str(job), "--ranks", "2"]) == 0
    assert "kv cache none" in capsys.readouterr().out
    assert main(["plan", "--preset", "medium", "--ranks", "2", "--kv-cache", "window"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("rlx-mpi: error: plan --kv-cache: got 'window'"), err


def test_scheduler_keeps_each_tokens_logprobs():
    s = Scheduler([(0, "a", (1, 2)), (1, "b", (3,))], groups=1, batch=2, max_new_tokens=2, eos_ids=frozenset(),
                  recompute=False)
    lp = lambda base: (np.array([base, base + 1], np.float32), np.array([[5], [6]]), np.array([[-.5], [-.6]], np.float32))  # noqa: E731
    step = s.next_step(0)
    s.complete(step, np.array([5, 6]), lp(-1.0))
    step = s.next_step(0)
    done = s.complete(step, np.array([7, 8]), lp(-3.0))
    a, b = done
    assert [float(v[0]) for v in a.logprobs] == [-1.0, -3.0] and [float(v[0]) for v in b.logprobs] == [0.0, -2.0]
    assert [v[1].tolist() for v in b.logprobs] == [[6], [6]]


def test_logprobs_flag_over_the_job_and_its_bounds(tmp_path):
    """--logprobs overrides [generate] logprobs; outside 0..20 it is one ConfigError naming the flag."""
    from argparse import Namespace

    from rlx_mpi.config import parse_job
    from rlx_mpi.drivers.generate import GenerateOptions

    job = parse_job({"model": {"checkpoint": "m.h5"}, "generate": {"prompts": "p", "out": "o", "logprobs": 3}},
                    tmp_path / "job.toml")
    flags = dict(prompts=None, out=None, max_new_tokens=None, temperature=None, top_k=None, top_p=None, seed=None,
                 eos_id=None, batch=None, groups=None, logprobs=None, prefill_chunk=None)
    opts = GenerateOptions.resolve(Namespace(**flags), job)
    assert opts.logprobs == 3 and opts.eos_where.endswith("[generate] eos_id")
    assert opts.prefill_chunk == 256  # the default; the flag overrides, < 0 is refused naming it
    assert GenerateOptions.resolve(Namespace(**{**flags, "prefill_chunk": 0}), job).prefill_chunk == 0
    with pytest.raises(ConfigError, match="give an integer >= 0") as e:
        GenerateOptions.resolve(Namespace(**{**flags, "prefill_chunk": -4}), job)
    assert e.value.where == "generate --prefill-chunk"
    assert GenerateOptions.resolve(Namespace(**{**flags, "logprobs": 0}), job).logprobs == 0
    assert GenerateOptions.resolve(Namespace(**{**flags, "eos_id": 2}), job).eos_where == "generate --eos-id"
    for bad, needle in ((21, "give at most 20"), (-1, "give an integer >= 0")):
        with pytest.raises(ConfigError, match=needle) as e:
            GenerateOptions.resolve(Namespace(**{**flags, "logprobs": bad}), job)
        assert e.value.where == "generate --logprobs"


def test_split_batch_gives_every_group_rows_when_few_are_queued():
    from rlx_mpi.engine.scheduler import split_batch

    assert split_batch(8, 2, 8) == 4  # the issue's case: one group of 8 became two of 4
    assert split_batch(9, 2, 8) == 5 and split_batch(4, 2, 4) == 2 and split_batch(1, 4, 8) == 1
    assert split_batch(16, 2, 8) == 8 and split_batch(100, 2, 8) == 8  # enough rows: the batch as given
    assert split_batch(8, 1, 8) == 8 and split_batch(3, 1, 8) == 3  # one group: never more slots than rows
    assert split_batch(0, 2, 8) == 8  # nothing queued: unchanged
    for rows in range(1, 40):
        for groups in range(1, 5):
            b = split_batch(rows, groups, 8)
            assert 1 <= b <= 8 and (b == 8 or groups * b >= rows > groups * (b - 1))


@pytest.mark.parametrize("batch", [4, 2])  # the job's batch, then what split_batch makes of 4 rows in 2 groups
def test_every_group_gets_rows_at_its_first_turn_only_with_the_split_batch(batch):
    prompts = [(i, f"p{i}", (1 + i, 2, 3)) for i in range(4)]
    s = Scheduler(prompts, groups=2, batch=batch, max_new_tokens=2, eos_ids=frozenset(), recompute=False)
    first = [s.next_step(g) for g in range(2)]
    sizes = [0 if st is None else len(st.rows) for st in first]
    assert sizes == ([4, 0] if batch == 4 else [2, 2])  # 4: the second stage idles until group 0 comes round
