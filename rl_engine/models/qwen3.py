"""Qwen3 dense, one tensor-parallel shard of it, built only from routed ops.

Activations are packed tokens [T, hidden] with absolute positions [T]; the attention core is
supplied by the engine (an AttentionBackend), since training, prefill and paged decode keep their
keys differently while everything around the core is the same code on both sides.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from rl_engine.models.config import Qwen3Config
from rl_engine.models.tp import TPGroup, copy_to_tp, reduce_from_tp, selected_logp
from rl_engine.ops import logp as logp_ops
from rl_engine.runtime.routing import Router


class AttentionBackend(Protocol):
    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [T, Hq_local, D], k/v [T, Hkv_local, D] of the new tokens -> out [T, Hq_local, D]."""


class Qwen3(nn.Module):
    def __init__(self, config: Qwen3Config, router: Router, tp: TPGroup = TPGroup()):
        super().__init__()
        config.check_tp(tp.size)
        self.config, self.router, self.tp = config, router, tp
        c, dt = config, config.dtype
        self.hq, self.hkv = c.num_attention_heads // tp.size, c.num_key_value_heads // tp.size
        self.ffn_local = c.intermediate_size // tp.size
        start, stop, _ = logp_ops.shard_range(c.vocab_size, tp.rank, tp.size)
        self.vocab_start, self.vocab_stop = start, stop
        d, h = c.head_dim, c.hidden_size
        # The weights live on the router's device, where every routed op of this shard runs.
        dev = router.device
        p = lambda *shape: nn.Parameter(torch.empty(*shape, dtype=dt, device=dev))  # noqa: E731
        self.embed = p(c.vocab_size, h)
        self.layers = nn.ModuleList()
        for _ in range(c.num_hidden_layers):
            layer = nn.Module()
            layer.input_norm = p(h)
            layer.qkv = p((self.hq + 2 * self.hkv) * d, h)
            layer.q_norm, layer.k_norm = p(d), p(d)
            layer.o_proj = p(h, self.hq * d)
            layer.post_norm = p(h)
            layer.gate_up = p(2 * self.ffn_local, h)
            layer.down = p(h, self.ffn_local)
            self.layers.append(layer)
        self.final_norm = p(h)
        self.lm_head = p(stop - start, h)

    # -- forward ------------------------------------------------------------------------------
    def hidden(self, tokens: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend) -> torch.Tensor:
        """Final-normed hidden states [T, hidden] of packed tokens at absolute positions."""
        c, r, tp = self.config, self.router, self.tp
        x = F.embedding(tokens, self.embed)
        for i, layer in enumerate(self.layers):
            h = copy_to_tp(r.rmsnorm("attention", x, layer.input_norm, c.rms_norm_eps), r, "attention", tp)
            qkv = r.linear("attention", h, layer.qkv)
            d = c.head_dim
            q, k, v = qkv.split([self.hq * d, self.hkv * d, self.hkv * d], dim=-1)
            q = r.rmsnorm("attention", q.reshape(-1, self.hq, d), layer.q_norm, c.rms_norm_eps)
            k = r.rmsnorm("attention", k.reshape(-1, self.hkv, d), layer.k_norm, c.rms_norm_eps)
            q = r.rope("attention", q, positions, c.rope_theta)
            k = r.rope("attention", k, positions, c.rope_theta)
            o = attn.attend(i, q, k, v.reshape(-1, self.hkv, d).contiguous())
            y = r.linear("attention", o.reshape(o.shape[0], self.hq * d), layer.o_proj)
            x = x + reduce_from_tp(y, r, "attention", tp)
            h = copy_to_tp(r.rmsnorm("ffn", x, layer.post_norm, c.rms_norm_eps), r, "ffn", tp)
            a = r.swiglu("ffn", r.linear("ffn", h, layer.gate_up))
            x = x + reduce_from_tp(r.linear("ffn", a, layer.down), r, "ffn", tp)
        return self.router.rmsnorm("logp", x, self.final_norm, c.rms_norm_eps)

    def selected_logp(self, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """fp32 log p(targets[t] | prefix) for each row of hidden (vocab-parallel under TP). The
        vocab-parallel backward already sums grad_hidden over TP (in fp32), so no copy_to_tp here:
        a second sum would double the gradient."""
        return selected_logp(self.router, hidden, self.lm_head, targets,
                             vocab=self.config.vocab_size, tp=self.tp)

    # -- weights ------------------------------------------------------------------------------
    @torch.no_grad()
    def load_full(self, state: dict[str, torch.Tensor]) -> None:
        """Loads this rank's shard from Hugging Face Qwen3 names (model.layers.N.self_attn...)."""
        tp = self.tp
        rows = lambda t: t.chunk(tp.size, dim=0)[tp.rank]  # noqa: E731  (column-parallel rows)
        self.embed.copy_(state["model.embed_tokens.weight"])
        for i, layer in enumerate(self.layers):
            pre = f"model.layers.{i}."
            q = rows(state[pre + "self_attn.q_proj.weight"])
            k = rows(state[pre + "self_attn.k_proj.weight"])
            v = rows(state[pre + "self_attn.v_proj.weight"])
            layer.qkv.copy_(torch.cat([q, k, v]))
            layer.q_norm.copy_(state[pre + "self_attn.q_norm.weight"])
            layer.k_norm.copy_(state[pre + "self_attn.k_norm.weight"])
            layer.o_proj.copy_(state[pre + "self_attn.o_proj.weight"].chunk(tp.size, dim=1)[tp.rank])
            layer.input_norm.copy_(state[pre + "input_layernorm.weight"])
            layer.post_norm.copy_(state[pre + "post_attention_layernorm.weight"])
            gate = rows(state[pre + "mlp.gate_proj.weight"])
            up = rows(state[pre + "mlp.up_proj.weight"])
            layer.gate_up.copy_(torch.cat([gate, up]))
            layer.down.copy_(state[pre + "mlp.down_proj.weight"].chunk(tp.size, dim=1)[tp.rank])
        self.final_norm.copy_(state["model.norm.weight"])
        head = state.get("lm_head.weight", state["model.embed_tokens.weight"])
        self.lm_head.copy_(head[self.vocab_start:self.vocab_stop])
