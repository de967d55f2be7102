"""tests.support.helpers.run_on_ranks: the session's rank processes run each function on every rank, and a
rank that fails is named and its pool replaced (the other ranks may be stuck in a collective)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.support import helpers
from tests.support.helpers import run_on_ranks


def _write_pid_and_env(rank: int, out: Path) -> None:
    (out / f"rank{rank}").write_text(f"{os.getpid()} {os.environ['RANK']} {os.environ['WORLD_SIZE']}")


def _fail_on_rank_one(rank: int) -> None:
    if rank == 1:
        raise ValueError("rank one refuses")


def _read(out: Path) -> dict[int, list[str]]:
    return {rank: (out / f"rank{rank}").read_text().split() for rank in range(2)}


def test_the_ranks_persist_across_calls_and_a_failure_names_its_rank_and_starts_over(tmp_path):
    first, second, third = (tmp_path / name for name in ("first", "second", "third"))
    for out in (first, second, third):
        out.mkdir()
    run_on_ranks(_write_pid_and_env, first)
    run_on_ranks(_write_pid_and_env, second)
    assert [fields[1:] for fields in _read(first).values()] == [["0", "2"], ["1", "2"]]
    assert _read(first) == _read(second)  # the same processes
    with pytest.raises(RuntimeError, match=r"rank 1 failed in _fail_on_rank_one:(.|\n)*rank one refuses"):
        run_on_ranks(_fail_on_rank_one)
    assert 2 not in helpers._POOLS
    run_on_ranks(_write_pid_and_env, third)
    assert all(_read(third)[r][0] != _read(first)[r][0] for r in range(2))  # new processes
