"""`rlk attention-gate`: strict attention sharded over TP x CP x replicas equals the one-rank
computation bit for bit on 2, 4 and 8 CPU ranks with both CP transports, and the gate notices when
dK/dV partials are added in any other order than global chunk order. On CUDA (skipped without two
Hopper GPUs) the same holds on 1 and 2 GPUs with both CUDA transports; a transport of the other
device, a shape the CUDA kernels do not take, or a machine without a GPU is refused (exit 2)."""

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
BOTH_CUDA = ("p2p_reference", "cuda_ag_rs")
# What each (device, transport) records as its exchange: NCCL point to point, or the fixed-order
# all-gather's CUDA IPC kernels.
EXCHANGE_BACKEND = {("cpu", "p2p_reference"): "p2p_reference.gloo",
                    ("cpu", "cpu_ag_rs"): "rlkernel.collective.all_gather.cpu.v1",
                    ("cuda", "p2p_reference"): "p2p_reference.nccl",
                    ("cuda", "cuda_ag_rs"): "rlkernel.collective.all_gather.cuda_ipc.v1"}
HOPPER_PAIR = (torch.cuda.is_available() and torch.cuda.device_count() >= 2
               and all(torch.cuda.get_device_capability(i) == (9, 0) for i in range(2)))


def assert_bitwise(report: dict) -> None:
    for name in gate.TENSORS:
        t = report["tensors"][name]
        assert t == {"max_abs_diff": 0.0, "bitwise": True, "run_to_run_bitwise": True}, name
    assert report["passed"] and report["replicas_agree"] and report["reference_agrees_across_ranks"]
    assert report["fallback"] is False and report["fallback_allowed"] is False
    device = report["device"]
    assert report["core"] == gate.CORE_IDS[device]
    assert report["communication_backend"] == report["transport"]
    calls = report["call_counts"]
    exchange = EXCHANGE_BACKEND[(device, report["transport"])]
    assert calls[report["core"]] > 0 and calls[exchange] > 0, calls
    other = {"cpu": "cuda", "cuda": "cpu"}[device]
    assert gate.CORE_IDS[other] not in calls, calls


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
        assert report["device"] == "cpu" and report["process_group_backend"] == "gloo"
        assert report["communication_backend"] == transport
        assert report["core"] == "rlkernel.attention.cpu.v1"
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


@pytest.mark.parametrize("args,message", [
    (["--transport", "cuda_ag_rs"],
     "transport cuda_ag_rs: with --device cpu use p2p_reference or cpu_ag_rs (cuda_ag_rs needs "
     "--device cuda)"),
    (["--device", "cuda", "--transport", "p2p_reference,cpu_ag_rs"],
     "transport cpu_ag_rs: with --device cuda use p2p_reference or cuda_ag_rs (cpu_ag_rs needs "
     "--device cpu)"),
    (["--device", "cuda", "--head-dim", "32"],
     "--head-dim 32: the CUDA attention kernels take 64 or 128"),
    (["--device", "cuda", "--dtype", "fp32"], "--dtype fp32: the CUDA attention kernels take bf16 or fp16"),
    (["--device", "tpu"], "--device 'tpu': use cpu or cuda"),
])
def test_a_transport_or_shape_the_device_cannot_run_exits_2(args, message, capsys, tmp_path):
    from rl_engine.cli import main

    out = tmp_path / "gate"
    assert main(["attention-gate", "--world-size", "2", "--cp", "2", *args,
                 "--output-dir", str(out)]) == 2
    assert message in capsys.readouterr().err
    assert not out.exists()


def test_each_device_defaults_to_its_own_transports_and_head_dim():
    cpu, cuda = gate.GateConfig(world_size=1), gate.GateConfig(world_size=1, device="cuda")
    assert (cpu.transports, cpu.head_dim, cpu.core) == (BOTH, 32, "rlkernel.attention.cpu.v1")
    assert (cuda.transports, cuda.head_dim, cuda.core) == (BOTH_CUDA, 64,
                                                           "rlkernel.attention.sm90.v1")


def test_the_runbooks_name_of_the_point_to_point_transport_is_accepted():
    cfg = gate.GateConfig(world_size=2, cp=2, transports=("p2p_nccl_reference", "cpu_ag_rs"))
    assert cfg.transports == ("p2p_reference", "cpu_ag_rs")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without a CUDA GPU")
def test_cuda_without_a_gpu_exits_2_before_any_rank_starts(capsys, tmp_path):
    from rl_engine.cli import main

    out = tmp_path / "gate"
    assert main(["attention-gate", "--world-size", "2", "--cp", "2", "--device", "cuda",
                 "--output-dir", str(out)]) == 2
    assert "--device cuda: no CUDA device is visible; use --device cpu" in capsys.readouterr().err
    assert not out.exists()


@pytest.mark.cuda
@pytest.mark.skipif(not HOPPER_PAIR, reason="needs two Hopper (sm_90) CUDA GPUs")
def test_cuda_more_ranks_than_gpus_is_refused_before_any_rank_starts(capsys, tmp_path):
    from rl_engine.cli import main

    gpus = torch.cuda.device_count()
    world = 2 * gpus  # CP=2 x gpus replicas
    assert main(["attention-gate", "--world-size", str(world), "--cp", "2", "--device", "cuda",
                 "--output-dir", str(tmp_path / "gate")]) == 2
    assert f"world {world} needs {world} GPUs, {gpus} visible" in capsys.readouterr().err
    assert not (tmp_path / "gate").exists()


@pytest.mark.cuda
@pytest.mark.slow
@pytest.mark.skipif(not HOPPER_PAIR, reason="needs two Hopper (sm_90) CUDA GPUs")
@pytest.mark.parametrize("world,tp,cp", [(2, 1, 2), (2, 2, 1), (1, 1, 1)])
def test_cuda_shards_are_bitwise_equal_to_one_gpu(world, tp, cp):
    cfg = gate.GateConfig(world_size=world, tp=tp, cp=cp, device="cuda", transports=BOTH_CUDA)
    reports = gate.run(cfg, timeout=300)
    assert [r["transport"] for r in reports] == list(BOTH_CUDA)
    for report in reports:
        assert_bitwise(report)
        assert report["device"] == "cuda" and report["shape"]["head_dim"] == 64
        assert "nccl" in str(report["process_group_backend"])
        assert [r["device"] for r in report["ranks"]] == [f"cuda:{i}" for i in range(world)]
        assert [(r["tp_rank"], r["cp_rank"]) for r in report["ranks"]] == [
            (i % tp, i // tp) for i in range(world)]


@pytest.mark.cuda
@pytest.mark.slow
@pytest.mark.skipif(not HOPPER_PAIR, reason="needs two Hopper (sm_90) CUDA GPUs")
def test_cuda_cli_runs_both_cuda_transports_by_default(tmp_path):
    out = tmp_path / "gate"
    proc = subprocess.run(
        [sys.executable, "-m", "rl_engine.cli", "attention-gate", "--world-size", "2", "--cp", "2",
         "--device", "cuda", "--output-dir", str(out)],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
        env={**os.environ, "RLK_LAUNCHER": "local"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    for transport in BOTH_CUDA:
        report = json.loads((out / f"attention-gate-cuda-w2-tp1-cp2-{transport}-bf16.json")
                            .read_text())
        assert_bitwise(report)
        assert report["core"] == "rlkernel.attention.sm90.v1" and report["dtype"] == "bf16"
        assert sum(r["query_rows"] for r in report["ranks"]) == 328


def test_compare_sees_one_ulp_and_the_sign_of_zero():
    a = torch.tensor([1.0, 0.0, 2.0], dtype=torch.bfloat16)
    assert gate.compare(a, a.clone()) == (0.0, True)
    assert gate.compare(a, torch.tensor([1.0, -0.0, 2.0], dtype=torch.bfloat16)) == (0.0, False)
    ulp = a.clone()
    ulp.view(torch.int16)[2] += 1  # the next bf16 after 2.0
    diff, same = gate.compare(ulp, a)
    assert not same and diff == pytest.approx(2 ** -6)
    assert gate.compare(a[:2], a) == (float("inf"), False)
