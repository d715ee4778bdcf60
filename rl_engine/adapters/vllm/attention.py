"""vLLM's CPU attention backend with an R route: rl_engine's block-ordered attention over the
paged KV cache that vLLM allocates and schedules.

On R a layer's cache block holds its keys and values as [kv_heads, block_size, 2 x head_dim] (the
shape vLLM gives it): keys in the first head_dim, values in the second, written by plain copies.
Each request's keys are read back through its block table in position order, and every query row
(prefill or decode, whatever else shares the batch) is one row of rl_engine's attention over keys
0..its position: the same bits as the trainer's row. On P, and in every worker not bound to a plan,
vLLM's own backend runs unchanged. The choice is fixed per run, so a cache is never read in the
other route's layout.
"""

from __future__ import annotations

import torch
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend, CPUAttentionBackendImpl

from rl_engine.adapters.vllm import binding

PATH = f"{__name__}.RlkCPUAttentionBackend"


def _r_route(layer) -> tuple[binding.Binding, str] | tuple[None, None]:
    b = binding.current()
    module = binding.module_of(layer)
    if b is None or module is None or not b.router.is_r(module):
        return None, None
    return b, module


def unroutable(impl: CPUAttentionBackendImpl) -> str | None:
    """Why rl_engine's attention cannot stand in for this layer's, else None."""
    if impl.alibi_slopes is not None or impl.sinks is not None:
        return "attention with ALiBi slopes or sinks"
    if impl.sliding_window != -1 or impl.logits_soft_cap:
        return "sliding-window or soft-capped attention"
    if impl.is_fp8_kv_cache or impl.attn_type != "decoder":
        return f"{impl.attn_type} attention or an fp8 KV cache"
    return None


class RlkCPUAttentionImpl(CPUAttentionBackendImpl):
    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
        b, _ = _r_route(layer)
        if b is None:
            return super().do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)
        n = slot_mapping.shape[0]
        keep = slot_mapping >= 0  # padding tokens have no slot
        slots = slot_mapping[keep].long()
        block_size, d = kv_cache.shape[2], key.shape[-1]
        blocks, offsets = slots // block_size, slots % block_size
        kv_cache[blocks, :, offsets, :d] = key[:n][keep]
        kv_cache[blocks, :, offsets, d:] = value[:n][keep]

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output,
                output_scale=None, output_block_scale=None):
        b, module = _r_route(layer)
        if b is None or attn_metadata is None:
            return super().forward(layer, query, key, value, kv_cache, attn_metadata, output,
                                   output_scale, output_block_scale)
        n = attn_metadata.num_actual_tokens
        seq_lens = attn_metadata.seq_lens.tolist()
        starts = attn_metadata.query_start_loc[: len(seq_lens) + 1].tolist()
        table = attn_metadata.block_table
        block_size, d = kv_cache.shape[2], query.shape[-1]
        keys, positions, cu_k = [], [], [0]
        for i, length in enumerate(seq_lens):
            q_len = starts[i + 1] - starts[i]
            pages = table[i, : -(-length // block_size)].long()
            # [blocks, heads, slot, 2d] -> [positions, heads, 2d] in position order
            keys.append(kv_cache[pages].transpose(1, 2).reshape(-1, kv_cache.shape[1], 2 * d)[:length])
            positions.append(torch.arange(length - q_len, length))
            cu_k.append(cu_k[-1] + length)
        kv = torch.cat(keys)
        k, v = kv[..., :d].contiguous(), kv[..., d:].contiguous()
        cu_q = torch.tensor(starts, dtype=torch.int32)
        b.router.note(module, "batch_requests", len(seq_lens))
        out = b.router.attention(module, query[:n].contiguous(), k, v, cu_q,
                                 torch.tensor(cu_k, dtype=torch.int32), torch.cat(positions),
                                 self.scale)
        output[:n] = out.view(output[:n].shape)
        return output


class RlkCPUAttentionBackend(CPUAttentionBackend):
    @staticmethod
    def get_impl_cls() -> type[RlkCPUAttentionImpl]:
        return RlkCPUAttentionImpl


def register() -> None:
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    register_backend(AttentionBackendEnum.CPU_ATTN, PATH)
