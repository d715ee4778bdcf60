"""Fake (meta) kernels: shapes and dtypes of every op's outputs, for torch.compile and opcheck."""

from __future__ import annotations

import torch

from rl_engine.ops import _lib

_lib.load()
_F32 = torch.float32


@torch.library.register_fake("rl_engine::det_gemm")
def _det_gemm(x, w, bias):
    return x.new_empty((*x.shape[:-1], w.shape[0]))


@torch.library.register_fake("rl_engine::det_gemm_grad_input")
def _det_gemm_grad_input(grad_y, w):
    return grad_y.new_empty((*grad_y.shape[:-1], w.shape[1]))


@torch.library.register_fake("rl_engine::det_gemm_grad_weight")
def _det_gemm_grad_weight(grad_y, x):
    return grad_y.new_empty((grad_y.shape[-1], x.shape[-1]), dtype=_F32)


@torch.library.register_fake("rl_engine::rmsnorm")
def _rmsnorm(x, weight, eps):
    return x.new_empty(x.shape), x.new_empty(x.shape[:-1], dtype=_F32)


@torch.library.register_fake("rl_engine::rmsnorm_backward")
def _rmsnorm_backward(grad_out, x, weight, rstd):
    return x.new_empty(x.shape), x.new_empty(weight.shape, dtype=_F32)


@torch.library.register_fake("rl_engine::rope")
def _rope(x, positions, theta):
    return x.new_empty(x.shape)


@torch.library.register_fake("rl_engine::rope_backward")
def _rope_backward(grad_out, positions, theta):
    return grad_out.new_empty(grad_out.shape)


@torch.library.register_fake("rl_engine::swiglu")
def _swiglu(gate_up):
    return gate_up.new_empty((*gate_up.shape[:-1], gate_up.shape[-1] // 2))


@torch.library.register_fake("rl_engine::swiglu_backward")
def _swiglu_backward(grad_out, gate_up):
    return gate_up.new_empty(gate_up.shape)


@torch.library.register_fake("rl_engine::attention_fwd")
def _attention_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, q_positions, softmax_scale, kv_block_size):
    return q.new_empty(q.shape), q.new_empty(q.shape[:2], dtype=_F32)


@torch.library.register_fake("rl_engine::attention_decode")
def _attention_decode(q, k_cache, v_cache, block_table, seq_lens, softmax_scale, kv_block_size):
    return q.new_empty(q.shape), q.new_empty(q.shape[:2], dtype=_F32)


@torch.library.register_fake("rl_engine::attention_bwd")
def _attention_bwd(grad_out, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, q_positions,
                   softmax_scale, kv_block_size, q_chunk_size):
    return q.new_empty(q.shape), k.new_empty(k.shape, dtype=_F32), v.new_empty(v.shape, dtype=_F32)


@torch.library.register_fake("rl_engine::linear_logp_partial")
def _linear_logp_partial(hidden, weight, target, vocab_start, vocab_tile, num_tiles):
    t = hidden.shape[0]
    return (hidden.new_empty((t,), dtype=_F32), hidden.new_empty((t,), dtype=_F32),
            hidden.new_empty((t,), dtype=_F32))


@torch.library.register_fake("rl_engine::logp_combine")
def _logp_combine(max, sumexp, target_logit):
    t = max.shape[1]
    return max.new_empty((t,), dtype=_F32), max.new_empty((t,), dtype=_F32)


@torch.library.register_fake("rl_engine::linear_logp_backward")
def _linear_logp_backward(grad_logp, hidden, weight, target, lse, vocab_start):
    return hidden.new_empty(hidden.shape, dtype=_F32), weight.new_empty(weight.shape, dtype=_F32)


@torch.library.register_fake("rl_engine::rank_order_sum")
def _rank_order_sum(parts):
    return parts.new_empty(parts.shape[1:], dtype=_F32)
