"""A bf16 model never hands fp32 operands to rl_engine's GEMMs. On Hopper an fp32 GEMM runs the
plain fp32 kernel (rlk_det_gemm_f32_kernel, off the tensor cores), so the CUDA trace check forbids
that kernel under R plans; this test is the device-independent half of that rule: one R/R
training step of the tiny bf16 model (forward, backward, optimizer) in this process, every
rl_engine op call recorded with the dtypes of its tensor arguments."""


import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from rl_engine.engines.train import Sample, TrainConfig, Trainer
from rl_engine.models.checkpoint import load_config, load_state
from rl_engine.models.generate import init_model
from rl_engine.runtime.plan import Plan

GEMMS = ("det_gemm", "det_gemm_grad_input", "det_gemm_grad_weight", "linear_logp_partial",
         "linear_logp_backward")


class RecordOps(TorchDispatchMode):
    """(op name, dtypes of the tensor arguments) of every rl_engine op dispatched."""

    def __init__(self):
        super().__init__()
        self.calls: list[tuple[str, tuple[torch.dtype, ...]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name
        if name.startswith("rl_engine::"):
            tensors = [a for a in (*args, *(kwargs or {}).values()) if isinstance(a, torch.Tensor)]
            self.calls.append((name.split("::")[1], tuple(t.dtype for t in tensors)))
        return func(*args, **(kwargs or {}))


@pytest.fixture
def world_of_one(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_a_bf16_training_step_gives_the_gemms_bf16_operands(world_of_one, tmp_path):
    folder = init_model("tiny", tmp_path / "model", seed=0)
    config = load_config(folder)
    assert config.dtype == torch.bfloat16
    trainer = Trainer(config, load_state(folder), Plan(), TrainConfig())
    g = torch.Generator().manual_seed(0)
    ids = lambda n: tuple(torch.randint(0, config.vocab_size, (n,), generator=g).tolist())  # noqa: E731
    samples = [Sample(prompt=ids(40), response=ids(30), rollout_logp=-5.0 + torch.randn(30, generator=g),
                      group=0) for _ in range(2)]
    with RecordOps() as ops:
        trainer.step(samples)
    gemms = [(name, dtypes) for name, dtypes in ops.calls if name in GEMMS]
    assert {name for name, _ in gemms} >= {"det_gemm", "det_gemm_grad_input", "det_gemm_grad_weight",
                                           "linear_logp_partial", "linear_logp_backward"}
    # The weight and activation operands are bf16; only the fp32 gradient of the log-probs that
    # linear_logp_backward starts from is fp32.
    for name, dtypes in gemms:
        operands = dtypes[1:] if name == "linear_logp_backward" else dtypes
        assert torch.float32 not in operands[:2], (name, dtypes)
