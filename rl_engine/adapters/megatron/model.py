"""A Megatron-core GPTModel of a Hugging Face Qwen3 folder, one TP shard per rank, whose
post-processing is the selected-token log-prob.

Names: Megatron's (`decoder.layers.N.self_attention.linear_qkv.weight`, ...). The QKV projection is
fused Megatron's way, one block per KV group holding that group's query heads, then its key and
its value head; fc1 is [gate | up] of this rank's FFN columns. On the logp route's R the LM head
holds rl_engine's vocab shard (an aligned subtree of the padded vocab tiles, ops/logp.py), on P
Megatron's own ColumnParallelLinear (an even split) and its vocab-parallel cross entropy.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.transformer_config import TransformerConfig
from torch import nn

from rl_engine.adapters.megatron import spec
from rl_engine.models.config import Qwen3Config
from rl_engine.models.tp import TPGroup, selected_logp
from rl_engine.ops import logp as logp_ops
from rl_engine.runtime.routing import Router


def transformer_config(c: Qwen3Config, *, tp: int, cp: int, ffn_r: bool,
                       device: torch.device) -> TransformerConfig:
    """Megatron's config of a Qwen3: RMSNorm, q/k norm, GQA, SwiGLU, no biases, no dropout.
    On the ffn route's R the activation is the spec's submodule (Megatron builds it only with
    use_te_activation_func); on P it is Megatron's own gated unit."""
    if c.vocab_size % tp:
        raise ValueError(f"vocab_size={c.vocab_size} is not a multiple of TP={tp}: Megatron splits "
                         "the embedding evenly over TP; pad the vocab or choose another TP size")
    return TransformerConfig(
        num_layers=c.num_hidden_layers, hidden_size=c.hidden_size,
        num_attention_heads=c.num_attention_heads, num_query_groups=c.num_key_value_heads,
        kv_channels=c.head_dim, ffn_hidden_size=c.intermediate_size,
        normalization="RMSNorm", layernorm_epsilon=c.rms_norm_eps, qk_layernorm=True,
        gated_linear_unit=True, activation_func=F.silu, use_te_activation_func=ffn_r,
        add_bias_linear=False, add_qkv_bias=False, hidden_dropout=0.0, attention_dropout=0.0,
        bias_activation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
        apply_rope_fusion=False, gradient_accumulation_fusion=False,
        params_dtype=c.dtype, bf16=c.dtype == torch.bfloat16,
        tensor_model_parallel_size=tp, context_parallel_size=cp,
        use_cpu_initialization=device.type == "cpu", perform_initialization=False)


class _VocabShardHead(nn.Module):
    """The LM head's rows of rl_engine's vocab shard [stop - start, hidden]."""

    def __init__(self, rows: int, hidden: int, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(rows, hidden, dtype=dtype, device=device))


class RoutedGPTModel(GPTModel):
    """GPTModel over packed tokens [T] whose output is log p(target) of the selected rows."""

    def __init__(self, qwen: Qwen3Config, router: Router, tp: TPGroup, cp: int):
        self.qwen, self.router, self.tp = qwen, router, tp
        config = transformer_config(qwen, tp=tp.size, cp=cp, ffn_r=router.is_r("ffn"),
                                    device=router.device)
        if hasattr(config, "position_embedding_type"):
            config.position_embedding_type = "none"
        super().__init__(config=config,
                         transformer_layer_spec=spec.layer_spec(router, tp, qwen.num_hidden_layers,
                                                                qwen.rope_theta),
                         vocab_size=qwen.vocab_size, max_sequence_length=qwen.max_position_embeddings,
                         position_embedding_type="none", share_embeddings_and_output_weights=False,
                         parallel_output=True)
        if router.is_r("attention"):
            self.embedding.word_embeddings = spec.bind(
                spec.RoutedVocabParallelEmbedding, router, "attention", tp)(
                num_embeddings=qwen.vocab_size, embedding_dim=qwen.hidden_size,
                init_method=config.init_method, config=config)
        self.vocab_start, self.vocab_stop, _ = logp_ops.shard_range(qwen.vocab_size, tp.rank,
                                                                     tp.size)
        if router.is_r("logp"):
            self.output_layer = _VocabShardHead(self.vocab_stop - self.vocab_start,
                                                qwen.hidden_size, qwen.dtype, router.device)
        else:
            self.vocab_start = tp.rank * qwen.vocab_size // tp.size
            self.vocab_stop = (tp.rank + 1) * qwen.vocab_size // tp.size
        self.to(router.device)
        spec.count_stock_modules(self, router)

    def head_sizes(self) -> list[int]:
        """Rows of the LM head on each TP rank."""
        v, n = self.qwen.vocab_size, self.tp.size
        if self.router.is_r("logp"):
            return [stop - start for start, stop, _ in
                    (logp_ops.shard_range(v, r, n) for r in range(n))]
        return [(r + 1) * v // n - r * v // n for r in range(n)]

    @property
    def embed(self) -> torch.Tensor:
        return self.embedding.word_embeddings.weight

    def hidden(self, tokens: torch.Tensor, positions: torch.Tensor, attention) -> torch.Tensor:
        """Final-normed hidden states [T, hidden] of packed tokens at absolute positions, with
        `attention` the micro-batch's attention over whole sequences or this CP rank's chunks."""
        cu_q = getattr(attention, "cu", None)
        cu_q = getattr(attention, "cu_q", cu_q)
        cu_k = getattr(attention, "cu_k", cu_q)
        rows = int(tokens.shape[0])
        params = spec.RoutedPackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_q,
                                            cu_seqlens_kv=cu_k, attention=attention,
                                            positions=positions, rows=rows)
        if rows == 0:
            # A CP rank can hold no row of a micro-batch (sequences shorter than the chunks); it
            # still takes part in every collective. Megatron's attention cannot reshape an empty
            # tensor, so the layers see one filler row (token 0) that the core attention leaves
            # out and that no gather, loss or gradient tap reads.
            tokens = tokens.new_zeros(1)
        # The vocab-parallel word embeddings of the packed rows, as [T, 1, hidden]: what
        # LanguageModelEmbedding returns for input [1, T] without position embeddings and with no
        # dropout, but looked up row-first, as the CP weight-gradient exchange gathers rows.
        x = self.embedding.word_embeddings(tokens)[:, None]
        x = self.decoder(hidden_states=x, attention_mask=None, packed_seq_params=params)
        return x[:rows, 0]

    def selected_logp(self, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """fp32 log p(targets[t]) of each row of hidden, vocab-parallel under TP."""
        if self.router.is_r("logp"):
            return selected_logp(self.router, hidden, self.output_layer.weight, targets,
                                 vocab=self.qwen.vocab_size, tp=self.tp)
        self.router.count_production("logp", "production.megatron.vocab_parallel_cross_entropy")
        with spec.trace_range("logp"):
            logits, _ = self.output_layer(hidden[:, None])
            loss = tensor_parallel.vocab_parallel_cross_entropy(logits.float(), targets[:, None])
        return -loss[:, 0]
