"""start(..., wait=False) lets two groups build at once (how `rlk run` starts its trainer and its
rollout engine): each rank below finishes building only once the other group's rank has begun,
which no start that waits for one group's build before the next can satisfy. ready_all waits on
both together: a build that fails on one side stops the other at once and is the error raised. A
group is not called before ready(), nor readied once stopped."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from rl_engine.engines.launch import WorkerFailed, ready_all, start
from rl_engine.errors import InfrastructureError


class _Meet:
    """Writes `mine`, then builds only once `other` exists (within `patience` seconds)."""

    def __init__(self, rank: int, world: int, mine: str, other: str, patience: float = 20.0):
        Path(mine).touch()
        deadline = time.monotonic() + patience
        while not Path(other).exists():
            if time.monotonic() > deadline:
                raise RuntimeError(f"{other} never appeared")
            time.sleep(0.05)

    def pid(self) -> int:
        return os.getpid()


class _Refuse:
    def __init__(self, rank: int, world: int):
        raise ValueError("no model here")


def test_two_groups_started_without_waiting_build_at_once(tmp_path):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    with start(_Meet, 1, args=(a, b), name="first", wait=False) as first, \
            start(_Meet, 2, args=(b, a), name="second", wait=False) as second:
        ready_all(first, second)
        assert first.call("pid")[0] not in second.call("pid")


def test_a_group_that_waits_for_its_build_cannot_meet_a_later_one(tmp_path):
    # The same pair with the default start: the first group's build waits for a rank that is not
    # started until that build is over.
    with pytest.raises(WorkerFailed, match="first rank 0 of 1 failed: .*never appeared"):
        start(_Meet, 1, args=(str(tmp_path / "a"), str(tmp_path / "b"), 3.0), name="first")


def test_a_failed_build_stops_the_group_building_beside_it(tmp_path):
    never = str(tmp_path / "never")
    t0 = time.monotonic()
    waits = str(tmp_path / "waits")
    with start(_Meet, 1, args=(waits, never, 600.0), name="waiting", wait=False) as waiting, \
            start(_Refuse, 2, name="refusing", wait=False) as refusing:
        with pytest.raises(WorkerFailed, match="refusing rank [01] of 2 failed: ValueError: no model here"):
            ready_all(waiting, refusing)
        # not held back by the other build (600 s), which is stopped: its rank is gone
        assert time.monotonic() - t0 < 120
        assert waiting.closed and refusing.closed
        assert not any(p.is_alive() for p in waiting.backend.procs)
        with pytest.raises(InfrastructureError, match="waiting ranks were already stopped"):
            waiting.ready()


def test_a_group_is_called_only_after_ready(tmp_path):
    alone = str(tmp_path / "alone")
    with start(_Meet, 2, args=(alone, alone), name="pair", wait=False) as pair:
        with pytest.raises(InfrastructureError, match="pair ranks were called before ready"):
            pair.call("pid")
        assert len(set(pair.ready().call("pid"))) == 2
