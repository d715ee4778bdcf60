// The operator schemas of rl_engine: the one contract shared by the CPU kernels (csrc/cpu) and the
// Hopper kernels (csrc/cuda). Every routed op in a model goes through one of these.
//
// Conventions for every op below:
// - Packed variable-length sequences: tokens of all sequences are concatenated along dim 0 with no
//   padding; `cu_seqlens_*` (int32, [B+1], starting at 0) gives each sequence's row range.
// - Absolute positions: `q_positions` (int64, one per query row) is the token's position in its own
//   sequence, counted from 0. Keys of a sequence always start at absolute position 0.
// - Accumulation is fp32 in one fixed order that depends only on the logical row and its absolute
//   position, never on how many rows share the call, on the row's index in the batch or on threads.
// - Inputs may be bf16, fp16 or fp32; outputs take the input dtype unless the comment says fp32.
#include <torch/library.h>

#include "ipc_layout.h"
#include "kernel_counters.h"

TORCH_LIBRARY(rl_engine, m) {
  // y[M,N] = x[M,K] @ w[N,K]^T (+ bias[N]); the shape of F.linear. Each y[m,n] is one dot product
  // over k in one fixed order whatever M is. Output dtype = x dtype.
  m.def("det_gemm(Tensor x, Tensor w, Tensor? bias) -> Tensor");
  // dx[M,K] = dy[M,N] @ w[N,K]; reduction over n in one fixed order. Output dtype = dy dtype.
  m.def("det_gemm_grad_input(Tensor grad_y, Tensor w) -> Tensor");
  // dw[N,K] = dy[M,N]^T @ x[M,K]; reduction over rows m in index order. Output fp32 (main grad).
  m.def("det_gemm_grad_weight(Tensor grad_y, Tensor x) -> Tensor");
  // Not routed: the hooks through which benchmarks/det_gemm_plans.py and the CUDA tests reach every
  // plan (tile, and where the K ranges meet) the sm_90a det_gemm could run for x [..., K] and
  // w [N, K]. _det_gemm_plans lists them, the one det_gemm picks first, as [bm, bn, swapped, across]
  // per plan, flattened; _det_gemm_on_plan is det_gemm (no bias) on one of them, counted as a
  // det_gemm launch. CUDA only, M >= 1.
  m.def("_det_gemm_plans(Tensor x, Tensor w) -> int[]");
  m.def("_det_gemm_on_plan(Tensor x, Tensor w, int[] plan) -> Tensor");

  // out[r,i] = x[r,i] * rstd[r] * w[i], rstd[r] = 1/sqrt(mean_i(x[r,i]^2) + eps), in fp32 with one
  // downcast. x is [R, H] (any leading dims flattened to rows); rstd is fp32 [R].
  m.def("rmsnorm(Tensor x, Tensor weight, float eps) -> (Tensor out, Tensor rstd)");
  // Returns dx (dtype of x) and dweight (fp32 [H], summed over rows in row order).
  m.def("rmsnorm_backward(Tensor grad_out, Tensor x, Tensor weight, Tensor rstd) -> (Tensor grad_x, Tensor grad_weight)");

  // Qwen3 / NeoX rotary embedding (rotate-half, not interleaved) of x[T, heads, D] at absolute
  // positions[T] (int64): inv_freq[i] = theta^(-2i/D), angle = pos * inv_freq[i] in fp32;
  // out[..., i] = x[i] cos - x[i + D/2] sin, out[..., i + D/2] = x[i + D/2] cos + x[i] sin.
  m.def("rope(Tensor x, Tensor positions, float theta) -> Tensor");
  // The inverse rotation applied to the incoming gradient.
  m.def("rope_backward(Tensor grad_out, Tensor positions, float theta) -> Tensor");

  // gate_up[T, 2I] holds [gate | up]; out[T, I] = silu(gate) * up, computed in fp32.
  m.def("swiglu(Tensor gate_up) -> Tensor");
  // Returns d gate_up[T, 2I] (dtype of gate_up).
  m.def("swiglu_backward(Tensor grad_out, Tensor gate_up) -> Tensor");

  // Causal prefill over packed sequences. q[Tq, Hq, D], k/v[Tk, Hkv, D] (GQA: Hq % Hkv == 0;
  // D % 8 == 0). Query row i of sequence b sees keys 0..q_positions[i] of that sequence. Keys are
  // visited in blocks of `kv_block_size` anchored at absolute position 0, merged in block order by
  // an fp32 online softmax (one downcast at the final write); no split-KV.
  // scores = softmax_scale * q.k. Returns out[Tq, Hq, D] and lse fp32 [Tq, Hq] (natural log).
  m.def("attention_fwd(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k, Tensor q_positions, float softmax_scale, int kv_block_size) -> (Tensor out, Tensor lse)");
  // One new query token per sequence against a paged KV cache: q[B, Hq, D];
  // k_cache/v_cache[num_pages, page_size, Hkv, D]; block_table int32 [B, max_pages] maps a
  // sequence's logical page to a physical page; seq_lens int32 [B] counts cached tokens including
  // the new one (its position is seq_lens[b] - 1). kv_block_size is a multiple of page_size and the
  // block walk and merge are those of attention_fwd, so decode of token t equals prefill row t.
  m.def("attention_decode(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_table, Tensor seq_lens, float softmax_scale, int kv_block_size) -> (Tensor out, Tensor lse)");
  // Backward of attention_fwd. dq (dtype of q) sums over key blocks in block order. dk/dv are fp32:
  // one partial per query chunk (queries with q_positions // q_chunk_size == c, in position order),
  // added in increasing global chunk order; so a caller that splits queries at chunk boundaries
  // and adds the returned dk/dv in chunk order gets the same bits as one call.
  m.def("attention_bwd(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor cu_seqlens_q, Tensor cu_seqlens_k, Tensor q_positions, float softmax_scale, int kv_block_size, int q_chunk_size) -> (Tensor grad_q, Tensor grad_k, Tensor grad_v)");

  // Selected-token log-prob partials of one vocab shard without materialising [T, V] logits.
  // hidden[T, H], weight[V_local, H] holds vocab rows vocab_start .. vocab_start + V_local - 1,
  // target int64 [T] (absolute vocab ids). The shard spans num_tiles tiles of vocab_tile ids
  // (num_tiles a power of two; tiles past V_local are padding: max -inf, sum 0). Each tile gives
  // (max, sum exp(logit - max)) in vocab order; tiles merge through one fixed binary tree, so a
  // 2^k-way split of the vocab is a split of that tree. Logits use det_gemm's dot-product order.
  // Returns fp32 [T] max, sumexp and target_logit (-inf where the target is outside the shard).
  m.def("linear_logp_partial(Tensor hidden, Tensor weight, Tensor target, int vocab_start, int vocab_tile, int num_tiles) -> (Tensor max, Tensor sumexp, Tensor target_logit)");
  // Merges R (a power of two) shard roots [R, T], in shard order, through the upper levels of the
  // same tree. Returns fp32 logp[T] = target_logit - lse and lse[T].
  m.def("logp_combine(Tensor max, Tensor sumexp, Tensor target_logit) -> (Tensor logp, Tensor lse)");
  // Backward of one shard: dlogit[t,v] = grad[t] * (1[v == target] - exp(logit - lse)).
  // grad_hidden fp32 [T, H] sums over the shard's vocab rows in index order; grad_weight fp32
  // [V_local, H] sums over tokens in row order.
  m.def("linear_logp_backward(Tensor grad_logp, Tensor hidden, Tensor weight, Tensor target, Tensor lse, int vocab_start) -> (Tensor grad_hidden, Tensor grad_weight)");

  // out = sum_r parts[r] in rank order r = 0..R-1, in fp32, elementwise; parts[R, ...]. The
  // payload sum of the CPU fixed-order collectives. Output fp32.
  m.def("rank_order_sum(Tensor parts) -> Tensor");

  // CUDA IPC collectives between the GPUs of one host (CUDA only; driven by
  // rl_engine/distributed/cuda_ipc.py). ipc_buffer: a zeroed uint8 [bytes] buffer on like's device,
  // an allocation of its own so that it can be shared; ipc_handle: its CUDA IPC handle as a CPU
  // uint8 tensor; ipc_open: a peer's buffer from its handle, mapped on like's device.
  m.def("ipc_buffer(Tensor like, int bytes) -> Tensor");
  m.def("ipc_handle(Tensor buffer) -> Tensor");
  m.def("ipc_open(Tensor handle, Tensor like, int bytes) -> Tensor");
  // The collectives: x contiguous bf16/fp16/fp32, the same shape on every rank; buffers: every
  // rank's buffer in rank order as mapped here; epochs: int64 [ipc_max_blocks] barrier counters of
  // this rank's communicator (zeroed with its buffer); max_blocks: the grid limit, equal on every
  // rank. Sums are in rank order 0..N-1 in fp32, rounded once to x's dtype. all_gather returns
  // [N * x.size(0), ...] in rank order; reduce_scatter this rank's share [x.size(0) / N, ...];
  // all_reduce x's shape.
  m.def("ipc_all_gather(Tensor x, Tensor(a!)[] buffers, int rank, Tensor(b!) epochs, int max_blocks) -> Tensor");
  m.def("ipc_reduce_scatter(Tensor x, Tensor(a!)[] buffers, int rank, Tensor(b!) epochs, int max_blocks) -> Tensor");
  m.def("ipc_all_reduce(Tensor x, Tensor(a!)[] buffers, int rank, Tensor(b!) epochs, int max_blocks) -> Tensor");
  // The flag-area bytes at the start of every buffer, the staging bytes after it that a collective
  // needs (kind 0 all_gather, 1 reduce_scatter, 2 all_reduce; numel per rank as its op takes x),
  // and the most ranks and grid blocks; 0 in a build without the sm_90a kernels.
  m.def("ipc_layout(int kind, int numel, int ranks, int element_size) -> int[]", &rl_engine::ipc_layout);

  // Per-kernel call counters, incremented inside each kernel launcher: int64 [num_kernels, 2]
  // (column 0 CPU, column 1 CUDA); rows follow include/rl_engine/kernel_ids.h.
  m.def("kernel_counters() -> Tensor", &rl_engine::kernel_counters);
  m.def("reset_kernel_counters() -> ()", &rl_engine::reset_kernel_counters);
  // Whether the SM90 (Hopper) kernels were compiled into this build.
  m.def("det_gemm_sm90_compiled() -> bool", &rl_engine::sm90_compiled);
  // The compiler flags of this build, for manifests.
  m.def("build_info() -> str", &rl_engine::build_info);
}
