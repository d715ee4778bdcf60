"""Megatron-core's DistributedDataParallel over the trainer's GPTModel, for runs whose every
training route is P: the production gradient reduction a Megatron user runs.

The trainer's step stays the built-in one; only the gradients' path changes. DDP's hooks add each
micro-batch's gradient into the parameter's fp32 `main_grad` (grad_reduce_in_fp32) and
`finish_grad_sync` all-reduces the buffers over Megatron's DP x CP group. The loss is already
normalised by the global batch's token count, so the reduction must be a plain sum:
`calculate_per_token_loss` tells DDP not to scale by 1 / (DP x CP).
"""

from __future__ import annotations

import torch
from torch import nn

BACKEND = "production.megatron.ddp"


def wrap(model: nn.Module) -> nn.Module:
    """DDP over `model` (its parameters get `main_grad`; the model itself is still called
    directly: DDP works through gradient hooks, not through its forward)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    config = model.config
    config.calculate_per_token_loss = True
    return DistributedDataParallel(
        config=config, module=model,
        ddp_config=DistributedDataParallelConfig(grad_reduce_in_fp32=True,
                                                 overlap_grad_reduce=False,
                                                 use_distributed_optimizer=False))


def sum_over_dp_cp(ddp: nn.Module, params: dict[str, nn.Parameter],
                   main: dict[str, torch.Tensor], *, skip: tuple[str, ...] = ()) -> None:
    """Sums the accumulated main grads over DP x CP into `main` (fp32, copies) and zeroes the
    buffers for the next step. `skip` names parameters this rank adds nothing for (the trainer's
    `_not_counted_here`)."""
    for name in skip:
        params[name].main_grad.zero_()
    ddp.finish_grad_sync()
    for name, p in params.items():
        main[name] = p.main_grad.detach().clone()
    ddp.zero_grad_buffer()
