"""start(..., wait=False) lets two groups build at once (how `rlk run` starts its trainer and its
rollout engine): each rank below finishes building only once the other group's rank has begun,
which no start that waits for one group's build before the next can satisfy. A group is not called
before ready(), and a build that fails still fails its group, naming its rank."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from rl_engine.engines.launch import WorkerFailed, start
from rl_engine.errors import InfrastructureError


class _Meet:
    """Writes `mine`, then builds only once `other` exists (within `patience` seconds)."""

    def __init__(self, rank: int, world: int, mine: str, other: str, patience: float = 120.0):
        Path(mine).touch()
        deadline = time.monotonic() + patience
        while not Path(other).exists():
            if time.monotonic() > deadline:
                raise RuntimeError(f"{other} never appeared")
            time.sleep(0.05)

    def pid(self) -> int:
        return os.getpid()


def test_two_groups_started_without_waiting_build_at_once(tmp_path):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    with start(_Meet, 1, args=(a, b), name="first", wait=False) as first, \
            start(_Meet, 1, args=(b, a), name="second", wait=False) as second:
        first.ready()
        second.ready()
        assert first.call("pid") != second.call("pid")


def test_a_group_that_waits_for_its_build_cannot_meet_a_later_one(tmp_path):
    # The same pair with the default start: the first group's build waits for a rank that is not
    # started until that build is over.
    with pytest.raises(WorkerFailed, match="first rank 0 of 1 failed: .*never appeared"):
        start(_Meet, 1, args=(str(tmp_path / "a"), str(tmp_path / "b"), 3.0), name="first")


def test_a_group_is_called_only_after_ready(tmp_path):
    alone = str(tmp_path / "alone")
    with start(_Meet, 2, args=(alone, alone), name="pair", wait=False) as pair:
        with pytest.raises(InfrastructureError, match="pair ranks were called before ready"):
            pair.call("pid")
        assert len(set(pair.ready().call("pid"))) == 2
