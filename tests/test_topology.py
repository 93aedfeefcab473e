"""Rank arithmetic of the stages x tp grid, and the schedule as plain data."""

import pytest

from rlx_mpi.errors import ConfigError
from rlx_mpi.comm.schedule import forward_schedule, format_grid
from rlx_mpi.comm.topology import locate, make_grid


def test_block_mapping():
    assert make_grid(["a"] * 4 + ["b"] * 4, 2) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert make_grid(["a"] * 4, 1) == [[0], [1], [2], [3]]
    assert make_grid(["a"] * 4, 4) == [[0, 1, 2, 3]]


def test_round_robin_launch_keeps_tp_groups_on_one_host():
    assert make_grid(["a", "b", "a", "b"], 2) == [[0, 2], [1, 3]]


def test_uneven_hosts_pool_leftovers():
    # host a has 3 ranks, b has 1: one group on a, the leftovers (2 of a, 3 of b) together
    assert make_grid(["a", "a", "a", "b"], 2) == [[0, 1], [2, 3]]


def test_every_rank_once():
    hosts = ["x", "y", "z", "x", "y", "z", "x", "y", "z", "x", "y", "z"]
    for tp in (1, 2, 3, 4, 6, 12):
        grid = make_grid(hosts, tp)
        assert sorted(r for g in grid for r in g) == list(range(12))
        assert all(len(g) == tp for g in grid)
        for r in range(12):
            stage, tp_rank = locate(grid, r)
            assert grid[stage][tp_rank] == r


def test_tp_must_divide_ranks():
    with pytest.raises(ConfigError, match="tp = 4 does not divide the 6 launched ranks"):
        make_grid(["a"] * 6, 4)


def test_schedule_actions():
    assert [str(a) for a in forward_schedule(0, 3, 2)] == ["0F0", "0pS0", "0F1", "0pS1", "0wS0", "0wS1"]
    assert [str(a) for a in forward_schedule(1, 3, 3)] == [
        "1pR0", "1pR1", "1wR0", "1F0", "1pR2", "1pS0", "1wR1", "1F1", "1pS1", "1wR2", "1F2", "1wS0", "1pS2",
        "1wS1", "1wS2"]
    assert [str(a) for a in forward_schedule(2, 3, 1)] == ["2pR0", "2wR0", "2F0"]
    assert [str(a) for a in forward_schedule(0, 1, 1)] == ["0F0"]


def test_schedule_grid():
    assert [row.split() for row in format_grid(2, 2).splitlines()] == [
        ["stage", "0:", "0F0", "0F1", "."], ["stage", "1:", ".", "1F0", "1F1"]]
