"""A worker's binding to the run: its router, its TP group, and which module each layer belongs to.

`attach` runs once in every vLLM worker (through collective_rpc) after vLLM has built and loaded
the model. It names each replaced layer's module from its place in the model (`rlk_module`),
checks that every layer of every module is one rl_engine replaced (else the plugin did not take
effect there, or the model has a layer it cannot route), counts the P modules' calls with forward
hooks, and wraps vLLM's sampler so that under logp R the reported log-prob of each sampled token is
rl_engine's selected-token log-prob. Until then the replacements run vLLM's own code.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from rl_engine.errors import BadInput
from rl_engine.models.tp import TPGroup, selected_logp
from rl_engine.ops import logp as logp_ops
from rl_engine.runtime.plan import MODULES
from rl_engine.runtime.routing import RouteUnavailable, Router


class PluginNotInEffect(BadInput, RuntimeError):
    """A layer the plugin must replace is vLLM's own: the plugin was not loaded there."""


@dataclass(kw_only=True, slots=True)
class Binding:
    router: Router
    tp: TPGroup
    vocab: int
    lm_head: torch.Tensor | None = None       # rl_engine's vocab shard of the LM head (logp R)
    last_hidden: torch.Tensor | None = None   # the rows whose logits were last computed
    hooks: list[Any] = field(default_factory=list)


_current: Binding | None = None


def current() -> Binding | None:
    return _current


def module_of(layer) -> str | None:
    return getattr(layer, "rlk_module", None)


# Where each routed piece of a Qwen3 decoder sits, by the end of its name in vLLM's model.
_PLACES = {
    "attention": (".input_layernorm", ".self_attn.qkv_proj", ".self_attn.q_norm",
                  ".self_attn.k_norm", ".self_attn.rotary_emb", ".self_attn.attn",
                  ".self_attn.o_proj"),
    "ffn": (".post_attention_layernorm", ".mlp.gate_up_proj", ".mlp.act_fn", ".mlp.down_proj"),
}
_FINAL = {"model.norm": "logp", "lm_head": "logp", "logits_processor": "logp"}
# vLLM's stock computation of each piece, as counted on a P route.
_PRODUCTION = {"RMSNorm": "rms_norm", "RotaryEmbedding": "rotary_embedding",
               "SiluAndMul": "silu_and_mul", "Attention": "cpu_attn", "LogitsProcessor": "logits",
               "ParallelLMHead": "lm_head"}


def _production_id(layer) -> str:
    for cls in type(layer).__mro__:
        if cls.__name__ in _PRODUCTION:
            return f"production.vllm.{_PRODUCTION[cls.__name__]}"
    return "production.vllm.linear"


def _places(model: torch.nn.Module, layers: int) -> dict[str, tuple[str, torch.nn.Module]]:
    """{name: (module, layer)} of every routed piece, or PluginNotInEffect naming what is absent."""
    named = dict(model.named_modules(remove_duplicate=False))
    out = {}
    for i in range(layers):
        for module, ends in _PLACES.items():
            for end in ends:
                name = f"model.layers.{i}{end}"
                if name not in named:
                    raise RouteUnavailable(f"the vLLM model has no {name}: rl_engine routes Qwen3 "
                                           "dense decoder layers only")
                out[name] = (module, named[name])
    for name, module in _FINAL.items():
        if name not in named:
            raise RouteUnavailable(f"the vLLM model has no {name}")
        out[name] = (module, named[name])
    return out


def _check(name: str, layer) -> str | None:
    """Why this layer cannot be routed (or is not the plugin's), else None."""
    from rl_engine.adapters.vllm import attention, layers as ours

    if type(layer).__name__ == "ParallelLMHead":
        return None if getattr(layer, "bias", None) is None else "an LM head with a bias"
    if type(layer).__name__ == "Attention":
        impl = getattr(layer, "impl", None)
        if not isinstance(impl, attention.RlkCPUAttentionImpl):
            return f"PLUGIN: its attention backend is {type(impl).__name__}"
        return attention.unroutable(impl)
    if not isinstance(layer, ours.REPLACEMENTS):
        return f"PLUGIN: it is vLLM's {type(layer).__name__}"
    if isinstance(layer, ours.RlkRMSNorm) and (layer.variance_size_override is not None
                                               or not layer.has_weight):
        return "an RMSNorm over part of its width or without a weight"
    if isinstance(layer, ours.RlkRotaryEmbedding) and (
            not layer.is_neox_style or layer.rotary_dim != layer.head_size):
        return "a partial or interleaved rotary embedding"
    if getattr(layer, "bias", None) is not None or getattr(layer, "gather_output", False) \
            or getattr(layer, "input_is_parallel", True) is False:
        return "a linear with a bias or a gathered output"
    if isinstance(layer, ours.RlkLogitsProcessor) and (layer.scale != 1.0 or layer.soft_cap
                                                       or layer.logits_as_input):
        return "scaled or soft-capped logits"
    return None


def attach(model: torch.nn.Module, *, router: Router, tp: TPGroup, layers: int, vocab: int,
           lm_head: torch.Tensor | None, sampler) -> Binding:
    """Binds this worker's model to the router (see the module's docstring); idempotent per model."""
    global _current
    if _current is not None:
        for h in _current.hooks:
            h.remove()
    places = _places(model, layers)
    for name, (module, layer) in places.items():
        why = _check(name, layer)
        if why is not None and why.startswith("PLUGIN: "):
            raise PluginNotInEffect(f"{name}: {why[8:]}; the rl_engine vLLM plugin is not in "
                                    "effect in this worker (is VLLM_PLUGINS excluding rl_engine, "
                                    "or is rl_engine installed without its entry point?)")
        if why is not None and router.is_r(module):
            raise RouteUnavailable(f"module {module}: {name} is {why}, which rl_engine cannot route")
    b = Binding(router=router, tp=tp, vocab=vocab)
    if router.is_r("logp"):
        b.lm_head = shard_lm_head(lm_head, tp)
    seen: set[int] = set()
    for name, (module, layer) in places.items():
        layer.rlk_module = module
        if not router.is_r(module) and id(layer) not in seen:
            seen.add(id(layer))
            b.hooks.append(layer.register_forward_hook(_counter(router, module,
                                                                _production_id(layer))))
    _wrap_sampler(sampler)
    _current = b
    return b


def shard_lm_head(full: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """This rank's shard of the full LM head as rl_engine splits the vocab (tile-aligned
    subtrees of its log-sum-exp tree; vLLM's own split differs whenever padding shows)."""
    start, stop, _ = logp_ops.shard_range(full.shape[0], tp.rank, tp.size)
    return full[start:stop].contiguous()


def _counter(router: Router, module: str, backend: str):
    def hook(_layer, _inputs, _output):
        router.records[module].call_counts[backend] += 1
    return hook


def _wrap_sampler(sampler) -> None:
    """vLLM's sampler picks every token (temperature 1, each request's own seed); afterwards, on a
    logp R route, the reported log-prob of the sampled token is replaced by rl_engine's."""
    if getattr(sampler, "rlk_wrapped", False):
        return
    stock = sampler.forward

    def forward(logits, sampling_metadata, *args, **kwargs):
        out = stock(logits, sampling_metadata, *args, **kwargs)
        b = _current
        if b is not None and out.logprobs_tensors is not None:
            report_logprobs(b, out)
        return out

    sampler.forward = forward
    sampler.rlk_wrapped = True


@torch.no_grad()
def report_logprobs(b: Binding, out) -> None:
    router = b.router
    if not router.is_r("logp"):
        router.records["logp"].call_counts["production.vllm.sampler_logprobs"] += 1
        return
    tokens = out.sampled_token_ids[:, 0].long()
    ids = out.logprobs_tensors.logprob_token_ids
    if b.last_hidden is None or b.last_hidden.shape[0] != tokens.shape[0] \
            or ids[:, 0].long().ne(tokens).any():
        raise RuntimeError("the sampler's rows are not the rows whose logits were computed; "
                           "rl_engine cannot report their log-probs")
    logp = selected_logp(router, b.last_hidden.contiguous(), b.lm_head, tokens, vocab=b.vocab,
                         tp=b.tp)
    out.logprobs_tensors.logprobs[:, 0] = logp.float()
    router.note("logp", "sampled_rows", tokens.shape[0])


def module_records(b: Binding) -> list[dict[str, Any]]:
    return b.router.module_records()


__all__ = ["MODULES", "Binding", "attach", "current", "module_of"]
