"""benchmarks/attention_bwd_schedule.py models dk/dv's grid with dQ added in a fixed order of key
tiles: the walk as today makes each tile start a chunk behind the one before it (a quarter longer
at the 8k benchmark shape), a walk from the last chunk back only serialises the flushes, and turns
in reverse key order cost no waits but need the short tiles launched first."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("schedule", ROOT / "benchmarks" / "attention_bwd_schedule.py")
schedule = importlib.util.module_from_spec(spec)
spec.loader.exec_module(schedule)


def test_the_walks_visit_the_rows_that_see_the_tile():
    # 512 tokens: 8 blocks of 64 rows, chunks of two; key tile 1 is seen from block 2 on
    assert schedule.walk(1, 8, descending=False) == [2, 3, 4, 5, 6, 7]
    assert schedule.walk(1, 8, descending=True) == [6, 7, 4, 5, 2, 3]
    assert schedule.walk(3, 8, descending=True) == [6, 7]


def test_without_turns_a_grid_that_fits_at_once_takes_its_longest_tile():
    # 4 tiles on 4 SMs, one head of one q head: tile 0 walks all 8 blocks
    assert schedule.makespan(512, 1, 1, 4, order=None) == 8.0
    # one SM: every step of every tile, one after the other
    assert schedule.makespan(512, 1, 1, 1, order=None) == 8 + 6 + 4 + 2


def test_turns_in_key_order_lag_a_chunk_a_tile_on_todays_walk_and_not_on_the_reversed_one():
    shape = dict(tokens=8192, kv_heads=8, group=4, sms=132)
    today = schedule.makespan(**shape, order=None)
    ascending = schedule.makespan(**shape, order="ascending")
    descending = schedule.makespan(**shape, order="descending")
    assert ascending / today > 1.2
    assert today <= descending <= 1.01 * today
    # with every tile on an SM at once the lag is plain: tile j starts j chunks' steps late, and
    # ends when tile 0 does, its own walk being that much shorter
    small = dict(tokens=1024, kv_heads=1, group=1, sms=8)
    assert schedule.makespan(**small, order=None) == 16.0
    assert schedule.makespan(**small, order="ascending") == pytest.approx(16.0 + 7 * 0.05)


def test_turns_from_the_last_tile_never_wait_but_launch_the_longest_walk_last():
    # every tile on an SM at once: tile j + 1 reaches each block one step before tile j does
    small = dict(tokens=1024, kv_heads=1, group=1, sms=8)
    assert schedule.makespan(**small, order="last_tile_first") == 16.0
    # two SMs for four tiles of 8, 6, 4 and 2 steps: from tile 0, tiles 0 and 1 first, then 2 after
    # tile 1 (6 + 4) and 3 after tile 0 (8 + 2); from the last tile, 3 and 2 first, then 1 after
    # tile 3 (2 + 6) and 0 after tile 2 (4 + 8), never waiting on tile 1, which reaches each of
    # their common blocks 4 steps before tile 0 does
    two = dict(tokens=512, kv_heads=1, group=1, sms=2)
    assert schedule.makespan(**two, order=None) == 10.0
    assert schedule.makespan(**two, order="last_tile_first") == 12.0
    shape = dict(tokens=8192, kv_heads=8, group=4, sms=132)
    assert schedule.makespan(**shape, order="last_tile_first") / schedule.makespan(**shape, order=None) > 1.2


def test_the_command_prints_and_writes_the_ratios(tmp_path, capsys):
    out = tmp_path / "model.json"
    assert schedule.main(["--tokens", "1024", "--kv-heads", "1", "--group", "1", "--sms", "8",
                          "--out", str(out)]) == 0
    assert "fused dQ, ascending: 1.022 of that time" in capsys.readouterr().out
    data = json.loads(out.read_text())
    assert data["kind"] == "model" and data["dkdv_steps"] == 16.0
    assert set(data["fused_over_dkdv"]) == {"ascending", "descending", "last_tile_first"}
    with pytest.raises(SystemExit) as e:
        schedule.main(["--tokens", "1000"])
    assert e.value.code == 2
    assert "positive multiple of 128" in capsys.readouterr().err
