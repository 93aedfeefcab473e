"""The block cache under a real mpiexec (the tiny preset): rows of mixed lengths share a KV budget
of --kv-rows full-length rows by the blocks they use, so more of them decode at once than the
budget's rows, and the rows equal the slot cache's (--no-prefix-cache keeps slots); long rows are
held to what the blocks fit, whatever --batch says."""

import json

import numpy as np
import pytest

from helpers import in_pairs, rows_of
from test_generate_mpi import generate, without_ms, write_prompts

pytestmark = pytest.mark.mpi

RNG = np.random.default_rng(21)
# 2 long prompts (4 blocks of 16 with their new tokens) and 10 short ones (1 block each), no shared prefix
PROMPTS = [(f"l{i}", RNG.integers(0, 512, 58)) for i in range(2)] + \
          [(f"s{i}", RNG.integers(0, 512, 3 + i % 5)) for i in range(10)]
FLAGS = ("--max-new-tokens", 4, "--batch", 8, "--temperature", 0.8, "--prefill-chunk", 16)


@pytest.mark.parametrize("ranks", [1, 2])
def test_mixed_lengths_decode_more_rows_than_the_budget_and_equal_slot_rows(tmp_path, tiny_ckpt, ranks):
    """--kv-rows 1: a budget of (1 + the prefix pool's 2) x 62 positions = 12 blocks. The short rows
    take a block each, so more rows than 3 run at once (one group of 8 slots on 1 rank; 2 groups of
    4 on 2 stages); the same 12 long prompts run at most 3 at once."""
    prompts = write_prompts(tmp_path / "p.jsonl", PROMPTS)
    longs = write_prompts(tmp_path / "l.jsonl", [(f"L{i}", RNG.integers(0, 512, 58)) for i in range(6)])
    paged, slots = in_pairs(
        lambda: generate(tmp_path, tiny_ckpt, ranks, prompts, tmp_path / "on.jsonl", *FLAGS, "--kv-rows", 1,
                         "--json", tmp_path / "on.json", name="on.toml"),
        lambda: generate(tmp_path, tiny_ckpt, ranks, prompts, tmp_path / "off.jsonl", *FLAGS, "--no-prefix-cache",
                         "--json", tmp_path / "off.json", name="off.toml"))
    assert paged.returncode == 0, paged.stderr
    assert slots.returncode == 0, slots.stderr
    a, b = rows_of(tmp_path / "on.jsonl"), rows_of(tmp_path / "off.jsonl")
    assert [r["tokens"] for r in a] == [r["tokens"] for r in b]
    if ranks == 1:
        assert without_ms(a) == without_ms(b)
    on = json.loads((tmp_path / "on.json").read_text())
    assert on["rows_at_once"] > 3, on["rows_at_once"]
    held = generate(tmp_path, tiny_ckpt, ranks, longs, tmp_path / "long.jsonl", *FLAGS, "--kv-rows", 1, "--json",
                    tmp_path / "long.json", name="long.toml")
    assert held.returncode == 0, held.stderr
    assert 1 <= json.loads((tmp_path / "long.json").read_text())["rows_at_once"] <= 3


def test_a_negative_kv_rows_is_one_line(tmp_path, tiny_ckpt):
    prompts = write_prompts(tmp_path / "p.jsonl", PROMPTS[:2])
    proc = generate(tmp_path, tiny_ckpt, 1, prompts, tmp_path / "o.jsonl", "--kv-rows", -1)
    assert proc.returncode != 0 and "--kv-rows" in proc.stderr and "Traceback" not in proc.stderr
