"""The trace check counts launches by kernel family in real torch.profiler traces recorded here on
the CPU and in an Nsight Systems export, and holds each plan to the families it needs and forbids.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from rl_engine.cli import main
from rl_engine.ops import _lib, attention, linear, logp, norm, rope, swiglu
from rl_engine.trace import families, gate
from rl_engine.runtime.routing import trace_range
from rl_engine.runtime.trace_record import record

import seeded
from fixtures import nsys_export

HQ, HKV, D = 4, 2, 16


def randn(*shape, seed):
    return seeded.randn(*shape, seed=seed).requires_grad_()


def step(*, r_swiglu: bool = True, r_ops: bool = True, collective: bool = True) -> None:
    """One tiny forward and backward through every routed op, on rl_engine's kernels (r_ops) or the
    production twins, each inside its module's range as the router runs it; r_swiglu=False runs
    only swiglu (the ffn range's one op here) on its twin, as an ffn P/P cell would."""
    pick = (lambda r, p: r) if r_ops else (lambda r, p: p)
    x, w, g = randn(6, 32, seed=1), randn(64, 32, seed=2), randn(32, seed=3)
    with trace_range("attention"):
        h = pick(norm.det_rmsnorm, norm.production_rmsnorm)(x, g, 1e-6)
        gate_up = pick(linear.det_linear, linear.production_linear)(h, w)
    with trace_range("ffn"):
        act = (swiglu.det_swiglu if r_swiglu and r_ops else swiglu.production_swiglu)(gate_up)
    q = act.reshape(6, 1, 32)[..., :D].expand(6, HQ, D).contiguous()
    k = act.reshape(6, 1, 32)[..., D:].expand(6, HKV, D).contiguous()
    pos = torch.arange(6)
    cu = torch.tensor([0, 6], dtype=torch.int32)
    with trace_range("attention"):
        q = pick(rope.det_rope, rope.production_rope)(q, pos, 10_000.0)
        if r_ops:
            out = attention.det_attention(q, k, k, cu, cu, pos, D ** -0.5)[0]
        else:
            out = attention.production_attention(q, k, k, cu, cu, pos, D ** -0.5)
    head = randn(300, HQ * D, seed=4)
    target = torch.tensor([1, 5, 299, 7, 0, 42])
    with trace_range("logp"):
        lp = pick(logp.det_selected_logp, logp.production_selected_logp)(out.reshape(6, -1), head,
                                                                        target)
    lp.sum().backward()
    page = 2  # 6 tokens fill 3 pages
    cache = k.detach().reshape(-1, page, HKV, D)
    table = torch.arange(math.ceil(6 / page), dtype=torch.int32)[None]
    decode = attention.det_attention_decode if r_ops else attention.production_attention_decode
    with trace_range("attention"):
        decode(q.detach()[-1:], cache, cache, table, torch.tensor([6], dtype=torch.int32), D ** -0.5)
        if collective and r_ops:
            _lib.ops().rank_order_sum(torch.randn(2, 8))


@pytest.fixture(scope="module")
def traces(tmp_path_factory) -> dict[str, Path]:
    """Real CPU profiler traces, written by rl_engine.runtime.trace_record."""
    root = tmp_path_factory.mktemp("traces")
    out = {}
    for name, kwargs in {"all_r": {}, "no_swiglu": dict(r_swiglu=False),
                         "no_collective": dict(collective=False),
                         "production": dict(r_ops=False)}.items():
        with record(root / name, name=name) as path:
            step(**kwargs)
        out[name] = path
    return out


def verdict(trace: Path, plan: str, device: str = "cpu", world: int = 1, sides=("training", "rollout")):
    return gate.gate(gate.count([trace], device), plan, device=device, world_size=world, sides=sides)


def failing(report: dict) -> dict[str, int]:
    return {c["family"]: c["count"] for c in report["checks"] if not c["ok"]}


def test_record_writes_a_chrome_trace_with_rl_engine_op_events(traces):
    counts = gate.count([traces["all_r"]], "cpu").families
    for family in ("det_gemm", "rmsnorm", "rope", "swiglu", "attention_fwd", "attention_bwd",
                   "attention_decode", "linear_logp", "rank_order_sum"):
        assert counts[family] > 0, family
    # Forward and the two backward GEMMs: one det_gemm op event each.
    assert counts["det_gemm"] == 3 and counts["linear_logp"] == 3
    assert not gate.count([traces["production"]], "cpu").families


def test_all_r_cpu_trace_passes_the_control_and_fails_the_baseline(traces):
    report = verdict(traces["all_r"], "control", world=2)
    assert report["passed"] and not report["problems"] and gate.exit_code(report) == 0
    baseline = verdict(traces["all_r"], "baseline")
    assert not baseline["passed"] and gate.exit_code(baseline) == 1
    assert set(failing(baseline)) == set(families.FAMILIES[:8]) | {"rank_order_sum"}
    assert failing(verdict(traces["all_r"], "ffn:P/P")) == {"swiglu": 2}  # forward, backward


def test_a_missing_family_fails_the_plan_that_needs_it(traces):
    assert failing(verdict(traces["no_swiglu"], "control")) == {"swiglu": 0}
    assert verdict(traces["no_swiglu"], "ffn-PP")["passed"]
    assert verdict(traces["no_swiglu"], "ffn:R/P", sides=("rollout",))["passed"]
    assert failing(verdict(traces["no_swiglu"], "ffn:R/P", sides=("training",))) == {"swiglu": 0}
    # Several ranks: the fixed-order reductions must have run.
    assert verdict(traces["no_collective"], "control", world=1)["passed"]
    assert failing(verdict(traces["no_collective"], "control", world=2)) == {"rank_order_sum": 0}


def test_production_trace_passes_only_the_baseline(traces):
    assert verdict(traces["production"], "baseline")["passed"]
    control = verdict(traces["production"], "control")
    assert set(failing(control)) == set(families.FAMILIES[:8])


RLK = [("void rl_engine::cuda::rlk_det_gemm_sm90_kernel<128, 64>(const float*, float*)",
        "rlk_det_gemm_sm90_kernel", 12),
       ("rlk_attention_fwd_sm90_kernel(Params)", "rlk_attention_fwd_sm90_kernel", 4),
       ("rlk_attention_bwd_sm90_kernel(Params)", "rlk_attention_bwd_sm90_kernel", 4),
       ("rlk_attention_decode_sm90_kernel(Params)", "rlk_attention_decode_sm90_kernel", 30),
       ("rlk_swiglu_kernel(float const*, float*, int)", "rlk_swiglu_kernel", 4),
       ("rlk_linear_logp_partial_kernel(Params)", "rlk_linear_logp_partial_kernel", 2)]
NAIVE = [("void rl_engine::cuda::rlk_det_gemm_f32_kernel<rl_engine::cuda::StoreEpilogue<float>>(Args)",
          "rlk_det_gemm_f32_kernel", 5)]
IPC = [(f"rlk_{f}_fixed_order_kernel(Args)", f"rlk_{f}_fixed_order_kernel", 3)
       for f in families.COLLECTIVE_FAMILIES]
NCCL = [("ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)",
         "ncclDevKernel_AllReduce_Sum_f32_RING_LL", 2)]
TORCH = [("void at::native::elementwise_kernel<128, 4>(int, Func)", "elementwise_kernel", 9),
         ("sm90_xmma_gemm_f32f32_tf32f32_f32_tn_n_tilesize128x128x32", "sm90_xmma_gemm", 7)]


def test_nsys_export_all_r_needs_ipc_collectives_and_no_nccl(tmp_path):
    good = nsys_export.build(tmp_path / "good.sqlite", RLK + IPC + TORCH)
    report = verdict(good, "control", device="cuda", world=2)
    assert report["passed"], report["problems"]
    # No record_function ranges in an export: nothing is judged by module, and the report says so.
    assert report["modules"] == [] and "no record_function ranges" in report["notes"][0]
    assert report["counts"]["ipc_all_reduce"] == 3 and report["counts"]["attention_decode"] == 30
    with_nccl = nsys_export.build(tmp_path / "nccl.sqlite", RLK + IPC + NCCL)
    report = verdict(with_nccl, "control", device="cuda", world=2)
    assert failing(report) == {"reference_collective": 2}
    assert report["reference_collectives"] == {NCCL[0][0]: 2}
    no_ipc = nsys_export.build(tmp_path / "no_ipc.sqlite", RLK + NCCL)
    # CP=2 (TP=1): gathers and the gradient reduce-scatter, no TP all-reduce to require.
    assert failing(verdict(no_ipc, "control", device="cuda", world=2)) == {
        "ipc_all_gather": 0, "ipc_reduce_scatter": 0, "reference_collective": 2}
    assert failing(gate.gate(gate.count([no_ipc], "cuda"), "control", device="cuda", world_size=4,
                             tp=2)) == {"ipc_all_gather": 0, "ipc_reduce_scatter": 0,
                                        "ipc_all_reduce": 0, "reference_collective": 2}
    assert verdict(no_ipc, "control", device="cuda", world=1)["passed"] is False  # NCCL payload
    # TP=2 alone has no gradient group to reduce-scatter over; it still needs AG and AR.
    assert failing(gate.gate(gate.count([no_ipc], "cuda"), "control", device="cuda", world_size=2,
                             tp=2)) == {"ipc_all_gather": 0, "ipc_all_reduce": 0,
                                        "reference_collective": 2}
    # The plain fp32 GEMM kernel is det_gemm_f32, not det_gemm: forbidden under R plans.
    assert families.cuda_family(NAIVE[0][0]) == "det_gemm_f32"
    assert families.cuda_family(RLK[0][0]) == "det_gemm"
    naive = nsys_export.build(tmp_path / "naive.sqlite", RLK + IPC + NAIVE)
    report = verdict(naive, "control", device="cuda", world=2)
    assert failing(report) == {"det_gemm_f32": 5} and report["counts"]["det_gemm"] == 12
    assert failing(verdict(naive, "ffn-PP", device="cuda", world=2)) == {"det_gemm_f32": 5,
                                                                          "swiglu": 4}
    production = nsys_export.build(tmp_path / "p.sqlite", TORCH + NCCL)
    assert verdict(production, "baseline", device="cuda", world=2)["passed"]
    assert failing(verdict(good, "baseline", device="cuda")) == {
        f: n for f, n in verdict(good, "control", device="cuda")["counts"].items() if n}


def test_trace_gate_command(tmp_path, traces, capsys):
    out = tmp_path / "trace-gate.json"
    args = ["trace", "gate", "--trace", str(traces["all_r"].parent), "--device", "cpu",
            "--world-size", "2", "--output", str(out)]
    assert main([*args, "--plan", "control"]) == 0
    body = json.loads(out.read_text())
    assert body["schema_version"] == 1 and body["passed"] and body["cell"] == "control"
    assert body["trace_files"] == [str(traces["all_r"])]
    assert main([*args, "--plan", "attention:P/P"]) == 1
    assert json.loads(out.read_text())["problems"][0].startswith("attention_bwd: ")
    sqlite = nsys_export.build(tmp_path / "k.sqlite", RLK)
    assert main(["trace", "gate", "--trace", str(sqlite), "--device", "cpu"]) == 2
    assert main(["trace", "gate", "--trace", str(tmp_path / "missing.json")]) == 2
    (tmp_path / "bad.json").write_text("{\"traceEvents\": [")
    assert main(["trace", "gate", "--trace", str(tmp_path / "bad.json")]) == 2
    (tmp_path / "empty.json").write_text("{\"traceEvents\": []}")
    assert main(["trace", "gate", "--trace", str(tmp_path / "empty.json"), "--plan", "baseline"]) == 3
    assert main([*args, "--plan", "attention:X/Y"]) == 2
