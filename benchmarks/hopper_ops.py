"""Speed of rl_engine's Hopper kernels (R) against their production twins (P) on one GPU.

Each pair runs in this one process: warm-up, then R and P timed alternately with CUDA events, and a
ratio is median(P) / median(R) (1.0 = as fast as production, above 1 = faster). Memory-bound ops
also report bytes moved (inputs read once, outputs written once) over time, against the measured
device-to-device copy and the 4.8 TB/s datasheet figure. Shapes are Qwen3-8B-like (bf16, hidden
4096, 32 query / 8 KV heads of 128, intermediate 12288, vocab 151936).

    python benchmarks/hopper_ops.py [--out results.json] [--repeats 15] [--quick]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch
import torch.nn.functional as F

import rl_engine.ops  # noqa: F401  (loads the extension and its fake kernels)
from rl_engine.ops import _lib
from rl_engine.ops.logp import num_tiles, production_selected_logp
from rl_engine.ops.rope import production_rope

SCHEMA_VERSION = 1
RESULT = Path(__file__).resolve().parent / "results" / "hopper_ops.json"
DT = torch.bfloat16
DATASHEET_TBS = 4.8
GEMM_NK = [(4096, 4096), (12288, 4096), (4096, 12288)]
GEMM_M = [1, 16, 128, 1024, 4096, 8192]


def randn(*shape, scale=1.0, dtype=DT):
    return (torch.randn(*shape, device="cuda") * scale).to(dtype)


def time_pair(r, p, repeats, warmup=3):
    """(median ms of r, median ms of p), timed alternately."""
    for _ in range(warmup):
        r(), p()
    torch.cuda.synchronize()
    ev = [[torch.cuda.Event(enable_timing=True) for _ in range(4)] for _ in range(repeats)]
    for e in ev:
        e[0].record(), r(), e[1].record()
        e[2].record(), p(), e[3].record()
    torch.cuda.synchronize()
    return (statistics.median(e[0].elapsed_time(e[1]) for e in ev),
            statistics.median(e[2].elapsed_time(e[3]) for e in ev))


def copy_tbs(repeats):
    x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    ms, _ = time_pair(lambda: x.clone(), lambda: None, repeats)
    return 2 * x.numel() / ms / 1e9


def gemm_rows(ops, repeats, quick):
    rows = []
    for n, k in GEMM_NK[:1] if quick else GEMM_NK:
        x, w = randn(max(GEMM_M), k), randn(n, k, scale=0.02)
        for m in GEMM_M:
            xm = x[:m]
            r_ms, p_ms = time_pair(lambda: ops.det_gemm(xm, w, None), lambda: F.linear(xm, w), repeats)
            flop = 2 * m * n * k
            rows.append(dict(op="det_gemm", m=m, n=n, k=k, r_ms=r_ms, p_ms=p_ms,
                             r_tflops=flop / r_ms / 1e9, p_tflops=flop / p_ms / 1e9, ratio=p_ms / r_ms))
    m, n, k = 4096, 4096, 4096
    x, w, dy = randn(m, k), randn(n, k, scale=0.02), randn(m, n)
    for name, r, p in [
        ("det_gemm_grad_input", lambda: ops.det_gemm_grad_input(dy, w), lambda: dy @ w),
        ("det_gemm_grad_weight", lambda: ops.det_gemm_grad_weight(dy, x), lambda: dy.T @ x),
    ]:
        r_ms, p_ms = time_pair(r, p, repeats)
        flop = 2 * m * n * k
        rows.append(dict(op=name, m=m, n=n, k=k, r_ms=r_ms, p_ms=p_ms, r_tflops=flop / r_ms / 1e9,
                         p_tflops=flop / p_ms / 1e9, ratio=p_ms / r_ms))
    return rows


def grad_of(fn, *inputs):
    """The production backward: autograd through fn, timed without its forward."""
    leaves = [t.detach().requires_grad_() for t in inputs]
    out = fn(*leaves)
    g = torch.randn_like(out)
    return lambda: torch.autograd.grad(out, leaves, g, retain_graph=True)


def memory_rows(ops, repeats, copy):
    t, h, hq, d, inter, eps = 8192, 4096, 32, 128, 12288, 1e-6
    x, w = randn(t, h), randn(h)
    qk = randn(t * hq, d)
    q, pos = randn(t, hq, d), torch.arange(t, device="cuda")
    gu = randn(t, 2 * inter)
    _, rstd = ops.rmsnorm(x, w, eps)
    g = randn(t, h)
    cases = [
        ("rmsnorm", 2 * x.nbytes, lambda: ops.rmsnorm(x, w, eps), lambda: F.rms_norm(x, (h,), w, eps)),
        ("rmsnorm_qk_norm", 2 * qk.nbytes, lambda: ops.rmsnorm(qk, w[:d], eps),
         lambda: F.rms_norm(qk, (d,), w[:d], eps)),
        ("rmsnorm_backward", 3 * x.nbytes, lambda: ops.rmsnorm_backward(g, x, w, rstd),
         grad_of(lambda a, b: F.rms_norm(a, (h,), b, eps), x, w)),
        ("rope", 2 * q.nbytes, lambda: ops.rope(q, pos, 1e6), lambda: production_rope(q, pos, 1e6)),
        ("rope_backward", 2 * q.nbytes, lambda: ops.rope_backward(q, pos, 1e6),
         grad_of(lambda a: production_rope(a, pos, 1e6), q)),
        ("swiglu", gu.nbytes * 3 // 2, lambda: ops.swiglu(gu),
         lambda: F.silu(gu[:, :inter]) * gu[:, inter:]),
        ("swiglu_backward", gu.nbytes * 5 // 2, lambda: ops.swiglu_backward(gu[:, :inter].contiguous(), gu),
         grad_of(lambda a: F.silu(a[:, :inter]) * a[:, inter:], gu)),
    ]
    rows = []
    for name, nbytes, r, p in cases:
        r_ms, p_ms = time_pair(r, p, repeats)
        tbs = nbytes / r_ms / 1e9
        rows.append(dict(op=name, bytes=nbytes, r_ms=r_ms, p_ms=p_ms, ratio=p_ms / r_ms, r_tbs=tbs,
                         p_tbs=nbytes / p_ms / 1e9, frac_of_datasheet=tbs / DATASHEET_TBS,
                         frac_of_copy=tbs / copy))
    return rows


def peak_extra(fn):
    """(result, extra peak bytes above what was allocated before the call)."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = fn()
    torch.cuda.synchronize()
    return out, torch.cuda.max_memory_allocated() - base


def logp_rows(ops, repeats, quick):
    t, h, v, tile = (2048 if quick else 8192), 4096, 151936, 256
    hidden, weight = randn(t, h), randn(v, h, scale=0.02)
    target = torch.randint(0, v, (t,), device="cuda")
    tiles = num_tiles(v, tile)

    def r():
        m, s, tl = ops.linear_logp_partial(hidden, weight, target, 0, tile, tiles)
        return ops.logp_combine(m[None], s[None], tl[None])[0]

    def p():
        return production_selected_logp(hidden, weight, target)

    r_ms, p_ms = time_pair(r, p, max(5, repeats // 3))
    (lp_r, r_mem), (lp_p, p_mem) = peak_extra(r), peak_extra(p)
    err = (lp_r - lp_p).abs().max().item()
    rows = [dict(op="linear_logp", t=t, h=h, v=v, r_ms=r_ms, p_ms=p_ms, ratio=p_ms / r_ms,
                 r_extra_peak_bytes=r_mem, p_extra_peak_bytes=p_mem, memory_fraction=r_mem / p_mem,
                 max_abs_diff_vs_production=err)]
    lse = ops.logp_combine(*(a[None] for a in ops.linear_logp_partial(hidden, weight, target, 0, tile, tiles)))[1]
    grad = torch.randn(t, device="cuda")
    rb = lambda: ops.linear_logp_backward(grad, hidden, weight, target, lse, 0)  # noqa: E731
    pb = grad_of(lambda a, b: production_selected_logp(a, b, target), hidden, weight)
    r_ms, p_ms = time_pair(rb, pb, 3, warmup=1)
    rows.append(dict(op="linear_logp_backward", t=t, h=h, v=v, r_ms=r_ms, p_ms=p_ms, ratio=p_ms / r_ms))
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=RESULT)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--quick", action="store_true", help="fewer shapes (a smoke run)")
    args = ap.parse_args()
    ops = _lib.ops()
    torch.manual_seed(0)
    copy = copy_tbs(args.repeats)
    result = dict(schema_version=SCHEMA_VERSION, device=torch.cuda.get_device_name(),
                  torch=torch.__version__, cuda=torch.version.cuda, build=json.loads(ops.build_info()),
                  ratio="median production time / median rl_engine time (above 1: rl_engine faster)",
                  copy_tbs=copy, datasheet_tbs=DATASHEET_TBS)
    result["gemm"] = gemm_rows(ops, args.repeats, args.quick)
    result["memory_bound"] = memory_rows(ops, args.repeats, copy)
    result["linear_logp"] = logp_rows(ops, args.repeats, args.quick)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"copy {copy:.2f} TB/s")
    for row in result["gemm"]:
        print(f"{row['op']:22s} m={row['m']:5d} n={row['n']:5d} k={row['k']:5d}  R {row['r_tflops']:6.1f} "
              f"P {row['p_tflops']:6.1f} TFLOP/s  ratio {row['ratio']:.3f}")
    for row in result["memory_bound"]:
        print(f"{row['op']:22s} R {row['r_tbs']:5.2f} TB/s ({100 * row['frac_of_datasheet']:4.1f}% of 4.8)"
              f"  P {row['p_tbs']:5.2f}  ratio {row['ratio']:.3f}")
    for row in result["linear_logp"]:
        extra = (f"  mem R {row['r_extra_peak_bytes'] / 2**20:.0f} MiB P {row['p_extra_peak_bytes'] / 2**20:.0f}"
                 f" MiB" if "memory_fraction" in row else "")
        print(f"{row['op']:22s} R {row['r_ms']:7.2f} ms  P {row['p_ms']:7.2f} ms  ratio {row['ratio']:.3f}{extra}")


if __name__ == "__main__":
    main()
