"""The inverse of Qwen3.load_full: a whole model's tensors under Hugging Face names, gathered from
every TP rank's shard, and the checksum that weight sync is verified with on both sides."""

from __future__ import annotations

import functools
import hashlib

import torch

from rl_engine.models.qwen3 import Qwen3
from rl_engine.models.tp import TPGroup
from rl_engine.ops import logp as logp_ops
from rl_engine.runtime.routing import Router


def gather_tp(t: torch.Tensor, tp: TPGroup, dim: int, sizes: list[int] | None = None, *,
            router: Router) -> torch.Tensor:
    """The TP shards of t concatenated along dim in rank order (sizes: uneven shard lengths); the
    router picks the transport (bytes only, the same result either way)."""
    if tp.size == 1:
        return t
    t = t.movedim(dim, 0).contiguous()
    width = max(sizes) if sizes else t.shape[0]
    padded = t.new_zeros((width, *t.shape[1:]))
    padded[:t.shape[0]] = t
    parts = router.gather_bytes(padded, tp.group).split(width)
    parts = [p[:n] for p, n in zip(parts, sizes)] if sizes else parts
    return torch.cat(parts).movedim(0, dim)


def full_state(model: Qwen3, source: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """Hugging Face-named full tensors of `source` (per-rank tensors keyed like
    model.named_parameters(); default: the model's own weights). A collective over TP."""
    src = {n: p.detach() for n, p in model.named_parameters()} if source is None else source
    c, tp, d = model.config, model.tp, model.config.head_dim
    gather = functools.partial(gather_tp, router=model.router)
    state = {"model.embed_tokens.weight": src["embed"], "model.norm.weight": src["final_norm"]}
    for i in range(c.num_hidden_layers):
        pre, s = f"model.layers.{i}.", (lambda n, i=i: src[f"layers.{i}.{n}"])
        q, k, v = s("qkv").split([model.hq * d, model.hkv * d, model.hkv * d])
        gate, up = s("gate_up").split([model.ffn_local, model.ffn_local])
        state.update({
            pre + "self_attn.q_proj.weight": gather(q, tp, 0),
            pre + "self_attn.k_proj.weight": gather(k, tp, 0),
            pre + "self_attn.v_proj.weight": gather(v, tp, 0),
            pre + "self_attn.q_norm.weight": s("q_norm"),
            pre + "self_attn.k_norm.weight": s("k_norm"),
            pre + "self_attn.o_proj.weight": gather(s("o_proj"), tp, 1),
            pre + "input_layernorm.weight": s("input_norm"),
            pre + "post_attention_layernorm.weight": s("post_norm"),
            pre + "mlp.gate_proj.weight": gather(gate, tp, 0),
            pre + "mlp.up_proj.weight": gather(up, tp, 0),
            pre + "mlp.down_proj.weight": gather(s("down"), tp, 1),
        })
    sizes = [stop - start for start, stop, _ in
             (logp_ops.shard_range(c.vocab_size, r, tp.size) for r in range(tp.size))]
    state["lm_head.weight"] = gather(src["lm_head"], tp, 0, sizes)
    return state


def state_checksum(state: dict[str, torch.Tensor]) -> str:
    """sha256 over name, dtype, shape and bytes of each tensor, in sorted name order. A state
    without lm_head.weight has a tied head, as in Qwen3.load_full."""
    if "lm_head.weight" not in state:
        state = {**state, "lm_head.weight": state["model.embed_tokens.weight"]}
    h = hashlib.sha256()
    for name in sorted(state):
        t = state[name].detach().cpu().contiguous().reshape(-1)
        h.update(f"{name}|{t.dtype}|{tuple(state[name].shape)}|".encode())
        h.update(t.view(torch.uint8).numpy().tobytes())
    return h.hexdigest()
