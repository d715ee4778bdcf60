"""Per-kernel time of linear_logp_backward at the benchmark's shape, beside cuBLAS twins of its GEMMs.

    python benchmarks/logp_backward_kernels.py

prints torch.profiler's table of one backward call (8192 tokens, H = 4096, V = 151936, bf16), then
each of its three products on one full vocab chunk against cuBLAS on the same shape (hopper_ops'
time_pair: medians, timed alternately), then the whole backward.
"""

import torch
from torch.profiler import ProfilerActivity, profile

import rl_engine.ops  # noqa: F401  (loads the extension)
from hopper_ops import time_pair
from rl_engine.ops import _lib
from rl_engine.ops.logp import num_tiles

CHUNK = 8192  # the backward's vocab chunk (kBackwardChunk in csrc/cuda/linear_logp.cu)


def main() -> None:
    ops = _lib.ops()
    t, h, v, dev, bf = 8192, 4096, 151936, "cuda", torch.bfloat16
    torch.manual_seed(0)
    hidden = torch.randn(t, h, device=dev, dtype=bf)
    weight = (torch.randn(v, h, device=dev) * 0.02).to(bf)
    target = torch.randint(0, v, (t,), device=dev)
    m, s, tl = ops.linear_logp_partial(hidden, weight, target, 0, 256, num_tiles(v, 256))
    lse = ops.logp_combine(m[None], s[None], tl[None])[1]
    grad = torch.randn(t, device=dev)

    def backward():
        return ops.linear_logp_backward(grad, hidden, weight, target, lse, 0)

    for _ in range(2):
        backward()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        backward()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=90))

    dl, wc = torch.randn(t, CHUNK, device=dev, dtype=bf), weight[:CHUNK]
    products = {
        "logits": (lambda: ops.det_gemm(hidden, wc, None), lambda: hidden @ wc.t()),
        "grad_hidden": (lambda: ops.det_gemm_grad_input(dl, wc), lambda: dl @ wc),
        "grad_weight": (lambda: ops.det_gemm_grad_weight(dl, hidden), lambda: dl.t() @ hidden),
    }
    for name, (ours, cublas) in products.items():
        r_ms, p_ms = time_pair(ours, cublas, 10)
        print(f"cublas {name} chunk {p_ms:.3f} ms, ours {r_ms:.3f}")
    print(f"whole backward {time_pair(backward, lambda: None, 3)[0]:.3f} ms")


if __name__ == "__main__":
    main()
