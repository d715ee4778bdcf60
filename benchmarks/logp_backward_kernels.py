"""Per-kernel time of linear_logp_backward at the benchmark's shape, beside cuBLAS twins of its GEMMs."""
import torch
import rl_engine.ops  # noqa: F401
from rl_engine.ops import _lib
from rl_engine.ops.logp import num_tiles
from torch.profiler import profile, ProfilerActivity

ops = _lib.ops()
t, h, v, dev, bf = 8192, 4096, 151936, "cuda", torch.bfloat16
torch.manual_seed(0)
hidden = torch.randn(t, h, device=dev, dtype=bf)
weight = (torch.randn(v, h, device=dev) * 0.02).to(bf)
target = torch.randint(0, v, (t,), device=dev)
m, s, tl = ops.linear_logp_partial(hidden, weight, target, 0, 256, num_tiles(v, 256))
lse = ops.logp_combine(m[None], s[None], tl[None])[1]
grad = torch.randn(t, device=dev)
f = lambda: ops.linear_logp_backward(grad, hidden, weight, target, lse, 0)
for _ in range(2):
    f()
torch.cuda.synchronize()
with profile(activities=[ProfilerActivity.CUDA]) as prof:
    f()
    torch.cuda.synchronize()
print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=90))


def timeit(fn, n=10):
    for _ in range(3):
        fn()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(n):
        fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / n


dl = torch.randn(t, 8192, device=dev, dtype=bf)
wc = weight[:8192]
print("cublas logits chunk %.3f ms, ours %.3f" % (timeit(lambda: hidden @ wc.t()), timeit(lambda: ops.det_gemm(hidden, wc, None))))
print("cublas grad_hidden chunk %.3f ms, ours %.3f" % (timeit(lambda: dl @ wc), timeit(lambda: ops.det_gemm_grad_input(dl, wc))))
print("cublas grad_weight chunk %.3f ms, ours %.3f" % (timeit(lambda: dl.t() @ hidden), timeit(lambda: ops.det_gemm_grad_weight(dl, hidden))))
print("whole backward %.3f ms" % timeit(f, 3))
