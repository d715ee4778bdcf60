"""rl_engine's replacements of vLLM's layer classes, registered by their in-tree names.

Each replacement subclasses vLLM's class and runs vLLM's own forward unless the worker is bound to
a plan (binding.attach) and the layer's module is R there; then it runs the same routed ops as
rl_engine's Qwen3 (rl_engine/models/qwen3.py), in the same order and dtypes, so its bits are the
trainer's. The linears keep their plain weight next to vLLM's packed CPU copy: R multiplies by the
plain one, P by vLLM's, and a weight update reaches both (`repack`).
"""

from __future__ import annotations

import torch
from vllm.model_executor.custom_op import CustomOp, PluggableLayer, op_registry_oot
from vllm.model_executor.layers.activation import SiluAndMul
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import (ColumnParallelLinear, MergedColumnParallelLinear,
                                               QKVParallelLinear, ReplicatedLinear,
                                               RowParallelLinear, UnquantizedLinearMethod)
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding
from vllm.platforms import current_platform

from rl_engine.adapters.vllm import binding


class KeepWeightLinearMethod(UnquantizedLinearMethod):
    """vLLM's unquantized linear, except that on the CPU the plain weight stays after vLLM packs
    its copy (vLLM's own method frees it, and a freed weight can neither be reloaded nor feed
    det_gemm). R layers multiply by the plain weight through the router."""

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        if current_platform.is_cpu():
            from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

            dispatch_cpu_unquantized_gemm(layer, remove_weight=False)
        else:
            super().process_weights_after_loading(layer)

    def apply(self, layer, x, bias=None):
        b = binding.current()
        module = binding.module_of(layer)
        if b is not None and module is not None and b.router.is_r(module):
            return b.router.linear(module, x, layer.weight, bias)
        return super().apply(layer, x, bias)


def _keep_weights(layer) -> None:
    if type(layer.quant_method) is UnquantizedLinearMethod:
        layer.quant_method = KeepWeightLinearMethod()


def _linear(base: type) -> type:
    def __init__(self, *args, **kwargs):
        base.__init__(self, *args, **kwargs)
        _keep_weights(self)

    return type(f"Rlk{base.__name__}", (base,), {"__init__": __init__, "__module__": __name__})


class RlkRowParallelLinear(RowParallelLinear):
    """On R: det_gemm of this rank's input shard, then rl_engine's fixed-order all-reduce over the
    TP ranks (rank-order fp32 sum, one rounding), where vLLM would use its own communicator."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        _keep_weights(self)

    def forward(self, input_):
        b = binding.current()
        module = binding.module_of(self)
        if b is None or module is None or not b.router.is_r(module):
            return super().forward(input_)
        out = self.quant_method.apply(self, input_, None)
        if b.tp.size > 1:
            out = b.router.collective(module, "all_reduce", out, b.tp.group)
        return (out, None) if self.return_bias else out


class RlkRMSNorm(RMSNorm):
    """On R: rl_engine's rmsnorm; the fused residual form adds in the activation dtype first, as
    rl_engine's model does (`x = x + y`, then the norm of x)."""

    def forward(self, x, residual=None):
        b = binding.current()
        module = binding.module_of(self)
        if b is None or module is None or not b.router.is_r(module):
            return super().forward(x, residual)
        if residual is not None:
            x = x + residual
        out = b.router.rmsnorm(module, x.contiguous(), self.weight, self.variance_epsilon)
        return out if residual is None else (out, x)


class RlkSiluAndMul(SiluAndMul):
    def forward(self, x):
        b = binding.current()
        module = binding.module_of(self)
        if b is None or module is None or not b.router.is_r(module):
            return super().forward(x)
        return b.router.swiglu(module, x.contiguous())


class RlkRotaryEmbedding(RotaryEmbedding):
    """On R: rl_engine's rope (fp32 angles, one rounding) of q and k at their absolute positions."""

    def forward(self, positions, query, key=None):
        b = binding.current()
        module = binding.module_of(self)
        if b is None or module is None or not b.router.is_r(module):
            return super().forward(positions, query, key)
        pos = positions.flatten().long()
        d = self.head_size

        def rotate(x):
            return b.router.rope(module, x.reshape(pos.shape[0], -1, d).contiguous(), pos,
                                 float(self.base)).reshape(x.shape)

        return rotate(query), (None if key is None else rotate(key))


class RlkLogitsProcessor(LogitsProcessor):
    """On R: the sampling logits by det_gemm (a row's logits, and so its sampled token, do not
    depend on the rows beside it), vocab shards gathered in rank order by rl_engine's all-gather;
    the final hidden rows are kept for the sampled token's log-prob (binding.selected_logp)."""

    def forward(self, lm_head, hidden_states, embedding_bias=None, skip_gather=False):
        b = binding.current()
        module = binding.module_of(self)
        if b is None or module is None or not b.router.is_r(module):
            return super().forward(lm_head, hidden_states, embedding_bias, skip_gather)
        b.last_hidden = hidden_states
        local = b.router.logits(module, hidden_states, lm_head.weight)
        if b.tp.size > 1:
            parts = b.router.collective(module, "all_gather", local.contiguous(), b.tp.group)
            local = torch.cat(parts.split(local.shape[0]), dim=1)
        return local[..., : self.org_vocab_size]


LINEARS = tuple(_linear(c) for c in (ReplicatedLinear, ColumnParallelLinear,
                                     MergedColumnParallelLinear, QKVParallelLinear))
_PLUGGABLE = {**{c.__mro__[1].__name__: c for c in LINEARS},
              "RowParallelLinear": RlkRowParallelLinear, "LogitsProcessor": RlkLogitsProcessor}
_CUSTOM = {"RMSNorm": RlkRMSNorm, "SiluAndMul": RlkSiluAndMul,
           "RotaryEmbedding": RlkRotaryEmbedding}
REPLACEMENTS: tuple[type, ...] = (*_PLUGGABLE.values(), *_CUSTOM.values())


def register() -> None:
    for kind, table in ((PluggableLayer, _PLUGGABLE), (CustomOp, _CUSTOM)):
        for name, cls in table.items():
            if name not in op_registry_oot:
                # Registering renames the class's op; keep vLLM's name, which decides (through
                # enabled()) which of vLLM's forwards the P route runs.
                in_tree = getattr(cls.__mro__[1], "name", name)
                kind.register_oot(cls, name=name)
                cls.name = in_tree


@torch.no_grad()
def repack(model: torch.nn.Module) -> None:
    """After new weights were loaded into the plain tensors: rebuild vLLM's packed CPU copies, so
    that P layers multiply by the new weights too."""
    for layer in model.modules():
        method = getattr(layer, "quant_method", None)
        if isinstance(method, UnquantizedLinearMethod) or type(method).__name__ == \
                "UnquantizedEmbeddingMethod":
            method.process_weights_after_loading(layer)
