"""Inside the `rlk.<module>` range of a module the plan routes R, no production kernel family may
run. Each fixture is an all-R trace that passes the control plan, plus one production kernel (CUDA)
or op (CPU) of one family: the gate must fail it naming that family and the module."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from rl_engine.cli import main
from rl_engine.trace import families, gate

from fixtures.chrome_trace import Trace

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "traces"
H200_TWINS = FIXTURES / "training-rank0-production-twins-h200.json.gz"

# Real kernel names of the production twins (recorded on an H200, torch 2.11), a few more that
# cuBLAS picks at other shapes, and the CPU op events of the twins.
CUDA_NAMES = {
    "cublas_gemm": [
        "nvjet_sm90_tst_64x8_64x16_2x4_h_bz_NNT",
        "sm80_xmma_gemm_f32f32_f32f32_f32_nn_n_tilesize32x32x8_stage3_warpsize1x2x1_ffma_aligna4_"
        "alignc4_execute_kernel__5x_cublas",
        "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_"
        "segment_k_off_kernel__5x_cublas",
        "void cutlass::Kernel2<cutlass_75_tensorop_bf16_s1688gemm_bf16_64x64_nn_align1>"
        "(cutlass_75_tensorop_bf16_s1688gemm_bf16_64x64_nn_align1::Params)",
        "ampere_bf16_s16816gemm_bf16_128x64_ldg8_f2f_stages_64x3_tn",
        "void gemv2T_kernel_val<int, int, float, float, float, float, 128, 16, 4, 4, false, false>"
        "(float const*, float*)"],
    "cudnn_sdpa": [
        "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7_64x128x64_4x1x1_"
        "cga1x1x1_kernel0_0",
        "cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26_64x64x64_1x4x1_"
        "cga1x1x1_kernel0_0",
        "void cudnn::fusion::compute_dot_do_o_specialized<true, 64>(void const*, void const*)"],
    "flash_sdpa": [
        "void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64, 128, 128, 4, false, "
        "false, cutlass::bfloat16_t, Flash_kernel_traits<64, 128, 128, 4, cutlass::bfloat16_t> >, "
        "false, true, false, false, true, true, false, false>(pytorch_flash::Flash_fwd_params)",
        "void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<Flash_bwd_kernel_traits"
        "<64, 128, 128, 8, 4, 4, 4, false, false, cutlass::bfloat16_t> >(pytorch_flash::"
        "Flash_bwd_params)"],
    "efficient_sdpa": [
        "fmha_cutlassF_bf16_aligned_64x64_rf_sm80(PyTorchMemEffAttention::AttentionKernel<cutlass"
        "::bfloat16_t, cutlass::arch::Sm80, true, 64, 64, 64, true, true>::Params)"],
    "torch_norm": [
        "void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<c10::BFloat16, float,"
        " true>(int, float, c10::BFloat16 const*, c10::BFloat16 const*, c10::BFloat16 const*, "
        "float*, float*, c10::BFloat16*)",
        "void at::native::(anonymous namespace)::GammaBetaBackwardCUDAKernelTemplate<c10::BFloat16,"
        " float, 32u, 8u, 64u, false, true, true>(long, long)"],
    "torch_softmax": [
        "void (anonymous namespace)::softmax_warp_forward<float, float, float, 9, true, false>"
        "(float*, float const*, int, int, int, bool const*, int, bool)",
        "void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float, float, float, "
        "at::native::(anonymous namespace)::LogSoftMaxForwardEpilogue>(float*, float const*, int)"],
}
CPU_NAMES = {
    "aten_gemm": [("aten::linear", "aten::matmul", "aten::mm"), ("aten::addmm",), ("aten::bmm",)],
    "aten_sdpa": [("aten::scaled_dot_product_attention",
                   "aten::_scaled_dot_product_flash_attention_for_cpu")],
    "aten_norm": [("aten::rms_norm", "aten::_fused_rms_norm"), ("aten::layer_norm",
                                                               "aten::native_layer_norm")],
    "aten_softmax": [("aten::log_softmax", "aten::_log_softmax"), ("aten::softmax",
                                                                   "aten::_softmax")],
}
# What each module's R route launches, on CUDA (kernels) and on the CPU (op events).
R_CUDA = {"attention": ("rlk_det_gemm_sm90_kernel", "rlk_attention_fwd_wgmma_kernel",
                        "rlk_attention_decode_split_kernel"),
          "ffn": ("rlk_det_gemm_sm90_kernel", "rlk_swiglu_kernel"),
          "logp": ("rlk_linear_logp_subtile_kernel",)}
R_CUDA_BWD = ("rlk_attention_bwd_dq_kernel",)
R_CPU = {"attention": ("rl_engine::rmsnorm", "rl_engine::det_gemm", "rl_engine::rope",
                       "rl_engine::attention_fwd", "rl_engine::attention_decode"),
         "ffn": ("rl_engine::rmsnorm", "rl_engine::det_gemm", "rl_engine::swiglu"),
         "logp": ("rl_engine::rmsnorm", "rl_engine::linear_logp_partial")}
R_CPU_BWD = ("rl_engine::attention_bwd",)


P_CPU = {"attention": (("aten::rms_norm", "aten::_fused_rms_norm"),
                       ("aten::linear", "aten::matmul", "aten::mm"),
                       ("aten::scaled_dot_product_attention",
                        "aten::_scaled_dot_product_flash_attention_for_cpu"))}


def r_trace(device: str, extra: dict[str, list] | None = None, backward_extra=(),
            p_modules=()) -> Trace:
    """An all-R step; extra[module] adds ops (cpu: name chains) or kernels (cuda) to its range;
    backward_extra goes into the backward node of the attention core; a CPU module in p_modules
    runs its production twins instead."""
    t = Trace()
    for module in ("attention", "ffn", "logp"):
        with t.range(module):
            if module in p_modules:
                for chain in P_CPU[module]:
                    t.op(chain[0], children=chain[1:])
            elif device == "cuda":
                for kernel in R_CUDA[module]:
                    t.op(f"rl_engine::{module}_op", kernels=(kernel,))
                if module == "attention":
                    t.op("rl_engine::attention_fwd", kernels=(),
                         backward=("GeneratedBackwardFor_rl_engine_attention_fwd_defaultBackward",
                                   (), (*R_CUDA_BWD, *backward_extra)))
            else:
                for name in R_CPU[module]:
                    t.op(name)
                if module == "attention":
                    t.op("rl_engine::attention_fwd",
                         backward=("GeneratedBackwardFor_rl_engine_attention_fwd_defaultBackward",
                                   (*R_CPU_BWD, *backward_extra), ()))
            for item in (extra or {}).get(module, ()):
                if device == "cuda":
                    t.op("aten::some_op", kernels=(item,))
                else:
                    t.op(item[0], children=item[1:])
    # Outside every range: the sampler's full logits, always production.
    t.op("aten::linear", children=("aten::matmul", "aten::mm"),
         kernels=("nvjet_sm90_tst_8x64_64x16_4x1_v_bz_TNN",))
    t.run_backward()
    return t


def judge(path: Path, device: str, plan: str = "control", sides=("training", "rollout")) -> dict:
    return gate.gate(gate.count([path], device, sides), plan, device=device, sides=sides)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_the_all_r_fixture_passes_with_production_work_outside_the_ranges(tmp_path, device):
    report = judge(r_trace(device).write(tmp_path / "step.json"), device)
    assert report["passed"], report["problems"]
    # The sampler's GEMM outside every range counts, and is allowed; CPU: linear > matmul > mm is
    # one call.
    family = "cublas_gemm" if device == "cuda" else "aten_gemm"
    assert report["production_outside_ranges"] == {family: 1}
    row = next(r for r in report["modules"] if r["module"] == "attention")
    bwd = "attention_bwd"
    assert row["rl_engine"][bwd] == 1 and row["side"] == "unknown" and row["ranges"] == 1


CASES = [("cuda", f, n) for f, names in CUDA_NAMES.items() for n in names] + \
        [("cpu", f, n) for f, names in CPU_NAMES.items() for n in names]


@pytest.mark.parametrize("device,family,name", CASES, ids=lambda v: v if isinstance(v, str) and
                         len(v) < 20 else None)
def test_each_production_family_inside_an_r_range_fails_named(tmp_path, device, family, name):
    assert families.production_family(name if device == "cuda" else name[0], device) == family
    module = {"gemm": "ffn", "sdpa": "attention", "norm": "logp", "softmax": "logp"}[
        family.split("_")[-1]]
    report = judge(r_trace(device, {module: [name]}).write(tmp_path / "step.json"), device)
    assert not report["passed"] and gate.exit_code(report) == 1
    assert report["problems"] == [f"{module} (unknown side): 1 launches of production family "
                                  f"{family} inside rlk.{module}; the plan needs R"]
    # The same launch in a plan where that module is P on both sides is allowed.
    p_plan = judge(tmp_path / "step.json", device, f"{module}:P/P")
    assert p_plan["problems"] and not any("production family" in p for p in p_plan["problems"])


@pytest.mark.parametrize("device,name", [("cuda", CUDA_NAMES["cublas_gemm"][0]),
                                         ("cpu", "aten::mm")])
def test_a_production_launch_in_the_backward_of_an_r_op_fails(tmp_path, device, name):
    """Backward ops run outside every range; the gate holds them to their forward op's module."""
    report = judge(r_trace(device, backward_extra=(name,)).write(tmp_path / "step.json"), device)
    family = families.production_family(name, device)
    assert report["problems"] == [f"attention (unknown side): 1 launches of production family "
                                  f"{family} inside rlk.attention; the plan needs R"]


def test_rl_engine_names_are_never_production():
    for name in ("rlk_rmsnorm_fwd_kernel", "rlk_det_gemm_sm90_kernel", "rlk_linear_logp_tree_kernel",
                 "rlk_rank_order_sum_kernel", "rlk_attention_fwd_wgmma_kernel"):
        assert families.production_family(name, "cuda") is None, name
    for name in ("void at::native::elementwise_kernel<128, 4>(int, Func)",
                 "ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)"):
        assert families.production_family(name, "cuda") is None, name
    assert families.production_family("rl_engine::det_gemm", "cpu") is None
    assert families.production_family("aten::to", "cpu") is None


def test_real_h200_production_twins_fail_an_r_plan_by_family_and_module():
    """The production twins recorded on an H200, forward and backward, every kernel attributed
    through its launch (backward ones from the autograd thread)."""
    report = judge(H200_TWINS, "cuda", sides=("training",))
    assert report["unattributed_kernels"] == 0 and report["production_outside_ranges"] == {}
    forbidden = {r["module"]: r["forbidden"] for r in report["modules"]}
    assert forbidden == {
        "attention": {"cublas_gemm": 6, "cudnn_sdpa": 4, "efficient_sdpa": 2, "flash_sdpa": 4,
                      "torch_softmax": 2},
        "ffn": {"cublas_gemm": 6, "torch_norm": 5},
        "logp": {"torch_softmax": 4}}
    assert ("attention (training): 4 launches of production family cudnn_sdpa inside "
            "rlk.attention; the plan needs R") in report["problems"]
    # The file's name says training: attention P on that side allows them there.
    pr = judge(H200_TWINS, "cuda", "attention-PR", sides=("training",))
    assert not any(p.startswith("attention") for p in pr["problems"])
    assert any(p.startswith("ffn (training)") for p in pr["problems"])
    baseline = judge(H200_TWINS, "cuda", "baseline", sides=("training",))
    assert baseline["passed"], baseline["problems"]


def side_traces(root: Path, training_p=()) -> list[Path]:
    """A training and a rollout file of an all-R step, as `rlk run --trace` names them; the
    modules in training_p run their production twins in the training file."""
    root.mkdir()
    return [r_trace("cpu", p_modules=training_p).write(root / "training-rank0-11.json"),
            r_trace("cpu").write(root / "rollout-rank0-12.json")]


def test_a_module_p_on_one_side_allows_production_there_only(tmp_path):
    paths = side_traces(tmp_path / "t", training_p=("attention",))
    report = gate.gate(gate.count(paths, "cpu"), "attention-PR", device="cpu")
    assert report["passed"], report["problems"]  # attention P/R: production allowed in training
    rows = {(r["module"], r["side"]): r for r in report["modules"]}
    assert rows["attention", "training"]["production"] == {"aten_gemm": 1, "aten_norm": 1,
                                                           "aten_sdpa": 1}
    assert rows["attention", "training"]["impl"] == "P" and rows["attention", "rollout"]["impl"] == "R"
    training = [f"attention (training): 1 launches of production family {f} inside rlk.attention; "
                f"the plan needs R" for f in ("aten_gemm", "aten_norm", "aten_sdpa")]
    assert gate.gate(gate.count(paths, "cpu"), "control", device="cpu")["problems"] == training
    # attention-RP: R in training, and P in the rollout, whose file ran R.
    rp = gate.gate(gate.count(paths, "cpu"), "attention-RP", device="cpu")["problems"]
    assert rp[:3] == training and rp[3:] and all(p.startswith("attention (rollout)") for p in rp[3:])
    # A file whose name gives no side could be either: attention is not R on every side of
    # attention-PR, so its production launches are allowed there, and not under the control.
    unnamed = r_trace("cpu", {"attention": P_CPU["attention"]}).write(tmp_path / "step.json")
    assert gate.gate(gate.count([unnamed], "cpu"), "attention-PR", device="cpu")["passed"]
    assert not gate.gate(gate.count([unnamed], "cpu"), "control", device="cpu")["passed"]


def test_rl_engine_kernels_inside_a_p_range_fail(tmp_path):
    paths = side_traces(tmp_path / "t")
    report = gate.gate(gate.count(paths, "cpu"), "attention-PR", device="cpu")
    assert ("attention (training): 1 launches of rl_engine family det_gemm inside rlk.attention; "
            "the plan needs P") in report["problems"]
    assert ("attention (training): 1 launches of rl_engine family attention_bwd inside "
            "rlk.attention; the plan needs P") in report["problems"]
    assert not any("(rollout)" in p for p in report["problems"])
    assert gate.exit_code(report) == 1


def test_missing_ranges_and_sides_are_incomplete_evidence(tmp_path):
    t = Trace()
    for module in ("attention", "logp"):  # the ffn's launches ran outside any range
        with t.range(module):
            for name in R_CPU[module]:
                t.op(name)
    for name in R_CPU["ffn"]:
        t.op(name)
    t.op("rl_engine::attention_bwd")
    path = t.write(tmp_path / "training-rank0-1.json")
    report = judge(path, "cpu", sides=("training",))
    assert report["problems"] == ["ffn (training): no rlk.ffn range in the trace, so what the "
                                  "module launched is unknown; the plan routes it R"]
    assert not report["evidence_complete"] and gate.exit_code(report) == 3
    # A P module needs no range; both sides asked of a training file alone: no rollout trace.
    p_ffn = judge(path, "cpu", "ffn-PP", sides=("training",))
    assert p_ffn["evidence_complete"] and not any("range" in p for p in p_ffn["problems"])
    both = judge(path, "cpu", "ffn-PP")
    assert both["problems"][0].startswith("rollout: no trace file of this side")
    assert gate.exit_code(both) == 3


def test_command_reads_sides_from_names_and_leaves_out_other_sides(tmp_path):
    paths = side_traces(tmp_path / "t", training_p=("attention",))
    out = tmp_path / "tg.json"
    args = ["trace", "gate", "--trace", str(tmp_path / "t"), "--output", str(out)]
    assert main([*args, "--plan", "control"]) == 1
    assert json.loads(out.read_text())["problems"][0] == (
        "attention (training): 1 launches of production family aten_gemm inside rlk.attention; "
        "the plan needs R")
    assert main([*args, "--plan", "attention:P/R"]) == 0
    assert main([*args, "--plan", "control", "--side", "rollout"]) == 0
    body = json.loads(out.read_text())
    assert body["trace_files_left_out"] == [str(paths[0])]
    assert {r["side"] for r in body["modules"]} == {"rollout"}
