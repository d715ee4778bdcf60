"""`rlk attention-gate`: strict attention sharded over TP x CP x replicas equals the one-rank
computation bit for bit on 2, 4 and 8 CPU ranks with both CP transports, and the gate notices when
dK/dV partials are added in any other order than global chunk order."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from rl_engine.distributed import collectives
from rl_engine.engines.launch import launch
from rl_engine.validation import attention_gate as gate

BOTH = ("p2p_reference", "cpu_ag_rs")
EXCHANGE_BACKEND = {"p2p_reference": "p2p_reference.gloo",
                    "cpu_ag_rs": "rlkernel.collective.all_gather.cpu.v1"}


def assert_bitwise(report: dict) -> None:
    for name in gate.TENSORS:
        t = report["tensors"][name]
        assert t == {"max_abs_diff": 0.0, "bitwise": True, "run_to_run_bitwise": True}, name
    assert report["passed"] and report["replicas_agree"] and report["reference_agrees_across_ranks"]
    assert report["fallback"] is False and report["fallback_allowed"] is False
    calls = report["call_counts"]
    assert calls["rlkernel.attention.cpu.v1"] > 0 and calls[EXCHANGE_BACKEND[report["transport"]]] > 0


@pytest.mark.slow
def test_cli_two_ranks_both_transports_write_their_evidence(tmp_path):
    out = tmp_path / "gate"
    proc = subprocess.run(
        [sys.executable, "-m", "rl_engine.cli", "attention-gate", "--world-size", "2", "--tp", "1",
         "--cp", "2", "--transport", ",".join(BOTH), "--output-dir", str(out)],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
        env={**os.environ, "RLK_LAUNCHER": "local"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    for transport in BOTH:
        report = json.loads((out / f"attention-gate-w2-tp1-cp2-{transport}-bf16.json").read_text())
        assert_bitwise(report)
        assert report["schema_version"] == 1 and report["commit"]
        assert report["communication_backend"] == transport and report["core"] == gate.CORE_ID
        assert report["split_kv"] is False and report["dtype"] == "bf16"
        assert report["merge_order"] == {"forward": "global block order",
                                         "dk_dv": "global query-chunk order"}
        assert report["kv_blocks"] == {"block_size": 64, "anchor": 0, "query_chunk_size": 64,
                                       "blocks_per_sequence": [2, 4]}
        assert [(r["cp_rank"], r["replica"]) for r in report["ranks"]] == [(0, 0), (1, 0)]
        # Megatron's load balancing: CP rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2.
        assert sum(r["query_rows"] for r in report["ranks"]) == 328


@pytest.mark.slow
@pytest.mark.parametrize("world,tp,cp", [(4, 2, 2), (8, 2, 2)])
def test_tp_cp_and_replicas_are_bitwise_equal_to_one_rank(world, tp, cp):
    cfg = gate.GateConfig(world_size=world, tp=tp, cp=cp, transports=BOTH)
    reports = gate.run(cfg, timeout=240)
    assert [r["transport"] for r in reports] == list(BOTH)
    for report in reports:
        assert_bitwise(report)
        assert report["topology"]["replicas"] == world // (tp * cp)
        assert report["shape"]["heads_per_rank"] == 4 and report["shape"]["kv_heads_per_rank"] == 2
        coords = [(r["tp_rank"], r["cp_rank"], r["replica"]) for r in report["ranks"]]
        assert coords == [(t, c, d) for d in range(world // 4) for c in range(2) for t in range(2)]


def reversed_merge_worker(rank, world, cfg):
    """The gate once as built, once with dK/dV partials added in reverse chunk order."""
    honest = gate.gate_worker(rank, world, cfg)
    ordered_sum = collectives.sum_in_order
    collectives.sum_in_order = lambda parts: ordered_sum(parts[::-1])
    try:
        return honest, gate.gate_worker(rank, world, cfg)
    finally:
        collectives.sum_in_order = ordered_sum


@pytest.mark.slow
def test_three_cp_ranks_pass_and_a_wrong_merge_order_fails():
    # CP=3 exchanges over an odd ring and leaves some chunks of the 128-token sequence empty.
    cfg = gate.GateConfig(world_size=3, tp=1, cp=3, transports=BOTH, repeats=1)
    results = launch(reversed_merge_worker, 3, args=(cfg,), timeout=240)
    for transport in BOTH:
        assert_bitwise(gate._topology_report(cfg, [h for h, _ in results], transport))
        broken = gate._topology_report(cfg, [b for _, b in results], transport)
        assert not broken["passed"]
        assert [n for n in gate.TENSORS if not broken["tensors"][n]["bitwise"]] == ["dk", "dv"]
        assert 0 < broken["tensors"]["dk"]["max_abs_diff"] < 1e-4


@pytest.mark.parametrize("args,message", [
    (["--world-size", "6", "--tp", "2", "--cp", "2"], "not TP x CP x replicas"),
    (["--world-size", "3", "--tp", "3", "--cp", "1"], "cannot be split over TP=3"),
    (["--world-size", "2", "--cp", "2", "--kv-heads", "3"], "not a multiple of 3 kv heads"),
    (["--world-size", "2", "--cp", "2", "--seq-lens", "128,x"], "comma-separated integers"),
])
def test_a_topology_that_cannot_be_built_exits_2(args, message, capsys):
    from rl_engine.cli import main

    assert main(["attention-gate", *args, "--transport", "p2p_reference"]) == 2
    assert message in capsys.readouterr().err


def test_compare_sees_one_ulp_and_the_sign_of_zero():
    a = torch.tensor([1.0, 0.0, 2.0], dtype=torch.bfloat16)
    assert gate.compare(a, a.clone()) == (0.0, True)
    assert gate.compare(a, torch.tensor([1.0, -0.0, 2.0], dtype=torch.bfloat16)) == (0.0, False)
    ulp = a.clone()
    ulp.view(torch.int16)[2] += 1  # the next bf16 after 2.0
    diff, same = gate.compare(ulp, a)
    assert not same and diff == pytest.approx(2 ** -6)
    assert gate.compare(a[:2], a) == (float("inf"), False)
