"""A Megatron-core layer spec whose submodules run each module's training side as the run's plan
says: on R, subclasses of Megatron's modules that call the router (rl_engine's kernels and their
backward, the fixed-order TP reduction); on P, Megatron-core's own local-spec modules.

The spec starts from `get_gpt_layer_local_spec(qk_layernorm=True, normalization="RMSNorm")` and
replaces submodules only, so Megatron's TransformerLayer, SelfAttention, MLP and TransformerBlock
run as they are. The model is built with position_embedding_type="none": RoPE is applied by the
core attention given here, which runs over packed sequences (PackedSeqParams, qkv_format "thd")
and, under CP, over Megatron's load-balanced chunks. Megatron's own core attention needs
TransformerEngine for packed sequences and CUDA for its rotary tables, so attention-P is the
production twin (torch RoPE + SDPA) given through the spec on every device.

Submodules are classes (Megatron 0.16 builds some with build_module, 0.19 calls them), so the
router reaches them as a class attribute of a subclass made per model (`bind`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.tensor_parallel import (ColumnParallelLinear, RowParallelLinear,
                                          VocabParallelEmbedding)
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from torch import nn

from rl_engine.models.tp import TPGroup, copy_to_tp, reduce_from_tp
from rl_engine.runtime.routing import Router, trace_range


@dataclasses.dataclass
class RoutedPackedSeqParams(PackedSeqParams):
    """Megatron's packed-sequence parameters plus what the routed core attention needs: the
    micro-batch's attention backend (whole sequences, or this CP rank's chunks) and the absolute
    position of each local row. Megatron passes the object through every layer unchanged."""

    attention: Any = None
    positions: torch.Tensor | None = None
    rows: int = 0  # this rank's rows; the model feeds one extra zero row when it holds none


class _Bound:
    """Class attributes set by `bind`: the router, the routed module name, the TP group."""

    router: Router
    route: str
    tp: TPGroup


def bind(cls: type, router: Router, route: str, tp: TPGroup, **extra: Any) -> type:
    return type(cls.__name__, (cls,), {"router": router, "route": route, "tp": tp, **extra})


class RoutedRMSNorm(_Bound, nn.Module):
    """``out[i] = x[i] / RMS(x) * w[i]`` through the router (input, pre-MLP, q/k and final norm)."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-6, **_: Any):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(hidden_size, dtype=config.params_dtype,
                                               device=self.router.device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.router.rmsnorm(self.route, x, self.weight, self.eps)


class RoutedColumnParallelLinear(_Bound, ColumnParallelLinear):
    """Megatron's column-parallel linear (its weight shard as allocated by Megatron) whose forward
    is the routed linear behind rl_engine's copy-to-TP (fixed-order gradient sum over TP)."""

    def forward(self, x: torch.Tensor, weight: torch.Tensor | None = None, **_: Any):
        x = copy_to_tp(x, self.router, self.route, self.tp)
        return self.router.linear(self.route, x, self.weight if weight is None else weight), None


class RoutedRowParallelLinear(_Bound, RowParallelLinear):
    """Megatron's row-parallel linear whose partials are summed over TP in rank order."""

    def forward(self, x: torch.Tensor, **_: Any):
        y = self.router.linear(self.route, x, self.weight)
        return reduce_from_tp(y, self.router, self.route, self.tp), None


class RoutedVocabParallelEmbedding(_Bound, VocabParallelEmbedding):
    """Megatron's vocab-parallel embedding (its even shard of the rows) with two changes on the
    attention route's R: the rows of other shards are zeroed out of place, so the CP weight
    gradient's tap (engines/train/context_parallel.py) sees a plain F.embedding; and the TP sum
    (each row is one shard's row plus zeros, so exact either way) is the fixed-order one."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        outside = (ids < self.vocab_start_index) | (ids >= self.vocab_end_index)
        local = (ids - self.vocab_start_index).masked_fill(outside, 0)
        rows = F.embedding(local, self.weight).masked_fill(outside[..., None], 0.0)
        return reduce_from_tp(rows, self.router, self.route, self.tp)


class RoutedSwiGLU(_Bound, nn.Module):
    """``silu(gate) * up`` of the fused [gate | up] fc1 output (MLP's activation submodule)."""

    def __init__(self, config=None, **_: Any):
        super().__init__()

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self.router.swiglu(self.route, gate_up)


class RoutedCoreAttention(_Bound, nn.Module):
    """RoPE of q and k at absolute positions, then causal attention over packed sequences, both
    through the router; q [T, Hq, D], k/v [T, Hkv, D] (Megatron squeezes the batch dim for thd)."""

    theta: float  # the RoPE base, bound with the router

    def __init__(self, config, layer_number: int, **_: Any):
        super().__init__()
        self.layer = layer_number - 1

    def forward(self, query, key, value, attention_mask=None, *, attn_mask_type=None,
                attention_bias=None, packed_seq_params: RoutedPackedSeqParams | None = None,
                **_: Any):
        if not isinstance(packed_seq_params, RoutedPackedSeqParams):
            raise TypeError("the routed core attention runs over packed sequences: pass "
                            "RoutedPackedSeqParams (qkv_format 'thd') to the model")
        r, pos, n = self.router, packed_seq_params.positions, packed_seq_params.rows
        q = r.rope(self.route, query[:n], pos, self.theta)
        k = r.rope(self.route, key[:n], pos, self.theta)
        out = packed_seq_params.attention.attend(self.layer, q, k, value[:n].contiguous())
        out = out.reshape(n, out.shape[1] * out.shape[2])
        if n < query.shape[0]:  # the filler row of a CP rank without rows attends to nothing
            out = torch.cat([out, out.new_zeros((query.shape[0] - n, out.shape[1]))])
        return out


def count_stock_modules(model: nn.Module, router: Router) -> None:
    """Puts each stock Megatron module of a P route inside its module's profiler range and counts
    its calls (forward hooks): a P route has no kernel counter, so the readback names the Megatron
    modules that ran and how often, and the trace sees their kernels in the module's range."""
    stock: list[tuple[nn.Module, str]] = []
    for layer in model.decoder.layers:
        att = layer.self_attention
        if not router.is_r("attention"):
            stock += [(m, "attention") for m in (layer.input_layernorm, att.linear_qkv,
                                                 att.q_layernorm, att.k_layernorm, att.linear_proj)]
        if not router.is_r("ffn"):
            stock += [(layer.pre_mlp_layernorm, "ffn"), (layer.mlp, "ffn")]
    if not router.is_r("logp"):
        stock.append((model.decoder.final_layernorm, "logp"))
    for module, route in stock:
        backend = f"production.megatron.{type(module).__name__}"
        module.register_forward_pre_hook(functools.partial(_enter, route))
        module.register_forward_hook(functools.partial(_leave, router, route, backend))


def _enter(route: str, module: nn.Module, args) -> None:
    module._rlk_range = trace_range(route)
    module._rlk_range.__enter__()


def _leave(router: Router, route: str, backend: str, module: nn.Module, args, output) -> None:
    module._rlk_range.__exit__(None, None, None)
    router.count_production(route, backend)


def layer_spec(router: Router, tp: TPGroup, num_layers: int,
               theta: float) -> TransformerBlockSubmodules:
    """The decoder's spec: every layer from Megatron's local spec with routed submodules where the
    training side of their module is R, and the final norm of the logp module."""
    base = get_gpt_layer_local_spec(qk_layernorm=True, normalization="RMSNorm")
    layer = base.submodules
    attn, mlp = layer.self_attention, layer.mlp
    a, f = router.is_r("attention"), router.is_r("ffn")
    b = lambda cls, route: bind(cls, router, route, tp)  # noqa: E731
    attn_sub = attn.submodules
    attn_sub = dataclasses.replace(
        attn_sub, core_attention=bind(RoutedCoreAttention, router, "attention", tp, theta=theta),
        **({"linear_qkv": b(RoutedColumnParallelLinear, "attention"),
            "linear_proj": b(RoutedRowParallelLinear, "attention"),
            "q_layernorm": b(RoutedRMSNorm, "attention"),
            "k_layernorm": b(RoutedRMSNorm, "attention")} if a else {}))
    mlp_sub = _mlp_submodules(mlp)
    if f:
        mlp_sub = dataclasses.replace(mlp_sub, linear_fc1=b(RoutedColumnParallelLinear, "ffn"),
                                      linear_fc2=b(RoutedRowParallelLinear, "ffn"),
                                      activation_func=b(RoutedSwiGLU, "ffn"))
    layer = dataclasses.replace(
        layer, self_attention=ModuleSpec(module=attn.module, params=dict(attn.params),
                                         submodules=attn_sub),
        mlp=_with_mlp_submodules(mlp, mlp_sub),
        **({"input_layernorm": b(RoutedRMSNorm, "attention")} if a else {}),
        **({"pre_mlp_layernorm": b(RoutedRMSNorm, "ffn")} if f else {}))
    final_norm = b(RoutedRMSNorm, "logp") if router.is_r("logp") else layer_norm_of(base)
    one = ModuleSpec(module=base.module, submodules=layer)
    return TransformerBlockSubmodules(layer_specs=[one] * num_layers, layer_norm=final_norm)


def _mlp_submodules(mlp):
    """The MLP's submodules: 0.16 gives the MLP as a ModuleSpec, 0.19 as a partial of
    MLP.as_mlp_submodule with its submodules as a keyword."""
    if isinstance(mlp, functools.partial):
        return mlp.keywords["submodules"]
    return mlp.submodules


def _with_mlp_submodules(mlp, submodules):
    """The same MLP builder, in the same form, over other submodules."""
    if isinstance(mlp, functools.partial):
        return functools.partial(mlp.func, *mlp.args, **{**mlp.keywords, "submodules": submodules})
    return ModuleSpec(module=mlp.module, params=dict(mlp.params), submodules=submodules)


def layer_norm_of(base: ModuleSpec):
    """The local spec's own norm class (torch RMSNorm where Apex is absent)."""
    return base.submodules.input_layernorm
