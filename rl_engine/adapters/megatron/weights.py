"""Hugging Face Qwen3 tensors into a RoutedGPTModel's shard and back.

QKV fusion: Megatron's linear_qkv holds one block per KV group, [the group's query heads | its key
head | its value head], and a TP rank holds whole groups; HF keeps q_proj, k_proj and v_proj apart
with query head h in group h // (Hq / Hkv). fc1 is [gate | up] of this rank's FFN columns;
linear_proj and fc2 are split along their input. The embedding is split evenly over TP (Megatron's
VocabParallelEmbedding); the LM head as the model's logp route holds it (model.py).
"""

from __future__ import annotations

import torch

from rl_engine.adapters.megatron.model import RoutedGPTModel
from rl_engine.models.unshard import gather_tp

_ATTN = "decoder.layers.{}.self_attention."
_MLP = "decoder.layers.{}.mlp."
_LAYER = "decoder.layers.{}."


def _fuse_qkv(q, k, v, groups: int) -> torch.Tensor:
    h = q.shape[-1]
    return torch.cat([q.reshape(groups, -1, h), k.reshape(groups, -1, h),
                      v.reshape(groups, -1, h)], dim=1).reshape(-1, h)


def _split_qkv(qkv, groups: int, per_group: int, d: int):
    h = qkv.shape[-1]
    blocks = qkv.reshape(groups, (per_group + 2) * d, h)
    q, k, v = blocks.split([per_group * d, d, d], dim=1)
    return q.reshape(-1, h), k.reshape(-1, h), v.reshape(-1, h)


def hf_to_megatron(model: RoutedGPTModel, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """This rank's tensors of the HF state under Megatron's parameter names."""
    c, tp = model.qwen, model.tp
    rows = lambda t: t.chunk(tp.size, dim=0)[tp.rank]  # noqa: E731
    cols = lambda t: t.chunk(tp.size, dim=1)[tp.rank]  # noqa: E731
    groups = c.num_key_value_heads // tp.size
    out = {"embedding.word_embeddings.weight": rows(state["model.embed_tokens.weight"]),
           "decoder.final_layernorm.weight": state["model.norm.weight"]}
    for i in range(c.num_hidden_layers):
        hf, a, m, lay = f"model.layers.{i}.", _ATTN.format(i), _MLP.format(i), _LAYER.format(i)
        q, k, v = (rows(state[hf + f"self_attn.{n}_proj.weight"]) for n in "qkv")
        out.update({
            lay + "input_layernorm.weight": state[hf + "input_layernorm.weight"],
            a + "linear_qkv.weight": _fuse_qkv(q, k, v, groups),
            a + "q_layernorm.weight": state[hf + "self_attn.q_norm.weight"],
            a + "k_layernorm.weight": state[hf + "self_attn.k_norm.weight"],
            a + "linear_proj.weight": cols(state[hf + "self_attn.o_proj.weight"]),
            lay + "pre_mlp_layernorm.weight": state[hf + "post_attention_layernorm.weight"],
            m + "linear_fc1.weight": torch.cat([rows(state[hf + "mlp.gate_proj.weight"]),
                                                rows(state[hf + "mlp.up_proj.weight"])]),
            m + "linear_fc2.weight": cols(state[hf + "mlp.down_proj.weight"]),
        })
    head = state.get("lm_head.weight", state["model.embed_tokens.weight"])
    out["output_layer.weight"] = head[model.vocab_start:model.vocab_stop]
    return out


@torch.no_grad()
def load_hf(model: RoutedGPTModel, state: dict[str, torch.Tensor]) -> None:
    params = dict(model.named_parameters())
    mine = hf_to_megatron(model, state)
    if set(mine) != set(params):
        raise ValueError(f"the Megatron model's parameters {sorted(set(params) - set(mine))[:3]} "
                         f"have no Hugging Face source (and {sorted(set(mine) - set(params))[:3]} "
                         "no parameter): the layer spec and the weight map disagree")
    for name, p in params.items():
        if tuple(p.shape) != tuple(mine[name].shape):
            raise ValueError(f"{name}: the shard has shape {tuple(p.shape)}, the checkpoint gives "
                             f"{tuple(mine[name].shape)}")
        p.copy_(mine[name])


def megatron_to_hf(model: RoutedGPTModel, source: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Full HF-named tensors of `source` (this rank's tensors under Megatron's names), gathered
    over TP: a collective of the TP group."""
    c, tp, r, d = model.qwen, model.tp, model.router, model.qwen.head_dim
    rows = lambda t, sizes=None: gather_tp(t, tp, 0, sizes, router=r)  # noqa: E731
    cols = lambda t: gather_tp(t, tp, 1, router=r)  # noqa: E731
    groups = c.num_key_value_heads // tp.size
    per_group = c.num_attention_heads // c.num_key_value_heads
    ffn = c.intermediate_size // tp.size
    state = {"model.embed_tokens.weight": rows(source["embedding.word_embeddings.weight"]),
             "model.norm.weight": source["decoder.final_layernorm.weight"]}
    for i in range(c.num_hidden_layers):
        hf, a, m, lay = f"model.layers.{i}.", _ATTN.format(i), _MLP.format(i), _LAYER.format(i)
        q, k, v = _split_qkv(source[a + "linear_qkv.weight"], groups, per_group, d)
        gate, up = source[m + "linear_fc1.weight"].split([ffn, ffn])
        state.update({
            hf + "self_attn.q_proj.weight": rows(q), hf + "self_attn.k_proj.weight": rows(k),
            hf + "self_attn.v_proj.weight": rows(v),
            hf + "self_attn.q_norm.weight": source[a + "q_layernorm.weight"],
            hf + "self_attn.k_norm.weight": source[a + "k_layernorm.weight"],
            hf + "self_attn.o_proj.weight": cols(source[a + "linear_proj.weight"]),
            hf + "input_layernorm.weight": source[lay + "input_layernorm.weight"],
            hf + "post_attention_layernorm.weight": source[lay + "pre_mlp_layernorm.weight"],
            hf + "mlp.gate_proj.weight": rows(gate), hf + "mlp.up_proj.weight": rows(up),
            hf + "mlp.down_proj.weight": cols(source[m + "linear_fc2.weight"]),
        })
    sizes = model.head_sizes()
    state["lm_head.weight"] = rows(source["output_layer.weight"], sizes)
    return state
