"""Speed of rl_engine's Hopper kernels (R) against their production twins (P) on one GPU.

Each pair runs in this one process: warm-up, then R and P timed alternately with CUDA events, and a
ratio is median(P) / median(R) (1.0 = as fast as production, above 1 = faster). Memory-bound ops
also report bytes moved (inputs read once, outputs written once) over time, against the measured
device-to-device copy and the card's datasheet HBM figure (hopper_targets.HBM_TBS), at 32768
tokens. Shapes are Qwen3-8B-like (bf16, hidden 4096, 32 query heads of 128, intermediate 12288,
vocab 151936).

    python benchmarks/hopper_ops.py [--out results.json] [--repeats 15] [--quick]
                                    [--sections gemm,memory,logp]

The JSON records the commit of the checkout it ran from, whether tracked files differed from it
(dirty) and which ones (changed_files), so a result names the code it measured, and under
`targets` whether each speed target (benchmarks/hopper_targets.py) is met, by how many rows, and
the worst row.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch
import torch.nn.functional as F

import rl_engine.ops  # noqa: F401  (loads the extension and its fake kernels)
from hopper_targets import WEIGHT_STREAM_M, datasheet_tbs, judge
from provenance import add_source_args, source_of
from rl_engine.artifacts import files
from rl_engine.ops import _lib
from rl_engine.ops.logp import num_tiles, production_selected_logp
from rl_engine.ops.rope import production_rope

SCHEMA_VERSION = 1
RESULT = Path(__file__).resolve().parent / "results" / "hopper_ops.json"
DT = torch.bfloat16
# (name, N, K): the square and wide/deep cases, then the projections of Qwen3-4B and Qwen3-8B
# (q and kv alone, and fused as the model runs them; o; gate-up fused; down).
GEMM_SHAPES = [
    ("square", 4096, 4096), ("wide", 12288, 4096), ("deep", 4096, 12288),
    ("4b_q", 4096, 2560), ("4b_kv", 1024, 2560), ("4b_qkv", 6144, 2560), ("4b_o", 2560, 4096),
    ("4b_gate_up", 19456, 2560), ("4b_down", 2560, 9728),
    ("8b_kv", 1024, 4096), ("8b_qkv", 6144, 4096), ("8b_gate_up", 24576, 4096),
]  # 8B's q and o are "square", its down "deep"
GEMM_M = [1, 2, 4, 8, 16, 32, 64, 128, 256, 1024, 4096, 8192]
L2_BYTES = 60 * 2**20


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


def time_graphs(r_calls, p_calls, repeats):
    """(median ms per call of r, of p): each list of calls captured once as a CUDA graph (no launch
    gaps: a decode-size GEMM runs for less time than its launch takes on the host), replays timed
    alternately."""
    graphs = []
    for calls in (r_calls, p_calls):
        for c in calls:  # warm-up outside the capture: handles, workspaces, tensor-map encoder
            c()
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, capture_error_mode="relaxed"):
            for c in calls:
                c()
        graphs.append(g)
    for _ in range(2):
        graphs[0].replay(), graphs[1].replay()
    r_ms, p_ms = time_pair(graphs[0].replay, graphs[1].replay, repeats, warmup=0)
    return r_ms / len(r_calls), p_ms / len(p_calls)


def gemm_rows(ops, repeats, quick):
    """det_gemm against F.linear (cuBLAS) at every M and shape. Each graph cycles through enough
    copies of the weight that none is still in L2 when it comes round again, so small-M rows time the
    weight stream from HBM. Also checks that every M gives the rows of the M = 8192 call bit for bit."""
    rows = []
    for name, n, k in GEMM_SHAPES[:1] if quick else GEMM_SHAPES:
        wbytes = n * k * 2
        ws = [randn(n, k, scale=0.02) for _ in range(min(24, max(2, -(-3 * L2_BYTES // wbytes))))]
        x = randn(max(GEMM_M), k)
        y_all = ops.det_gemm(x, ws[0], None)
        for m in GEMM_M:
            xm = x[:m]
            same = torch.equal(ops.det_gemm(xm, ws[0], None), y_all[:m])
            calls = max(4, len(ws)) if m <= 1024 else 2
            r_ms, p_ms = time_graphs([lambda w=ws[i % len(ws)]: ops.det_gemm(xm, w, None) for i in range(calls)],
                                     [lambda w=ws[i % len(ws)]: F.linear(xm, w) for i in range(calls)],
                                     repeats)
            flop = 2 * m * n * k
            row = dict(op="det_gemm", shape=name, m=m, n=n, k=k, r_ms=r_ms, p_ms=p_ms,
                       r_tflops=flop / r_ms / 1e9, p_tflops=flop / p_ms / 1e9, ratio=p_ms / r_ms,
                       rows_equal_m8192=same)
            if m <= WEIGHT_STREAM_M:
                row["r_weight_tbs"] = wbytes / r_ms / 1e9
                row["p_weight_tbs"] = wbytes / p_ms / 1e9
            rows.append(row)
        del ws, x, y_all
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


def cycle(calls):
    """One closure that runs calls[0], calls[1], ... in turn."""
    state = [0]

    def run():
        state[0] += 1
        return calls[state[0] % len(calls)]()

    return run



def memory_rows(ops, repeats, copy, hbm_tbs):
    """32768 tokens: every tensor is several times the L2 (a 67 MB output at 8192 tokens partly stays
    in the write-back L2 past the timed window), and each case rotates input sets so consecutive
    calls never find their inputs in L2."""
    t, h, hq, d, inter, eps = 32768, 4096, 32, 128, 12288, 1e-6
    w, pos = randn(h), torch.arange(t, device="cuda")

    def rms_bwd_inputs():
        x = randn(t, h)
        return randn(t, h), x, ops.rmsnorm(x, w, eps)[1]

    def swiglu_bwd_inputs():
        return randn(t, inter), randn(t, 2 * inter)

    cases = [  # name, bytes moved, input maker, R(*inputs), P(*inputs) -> a call
        ("rmsnorm", 2 * t * h * 2, lambda: (randn(t, h),), lambda x: lambda: ops.rmsnorm(x, w, eps),
         lambda x: lambda: F.rms_norm(x, (h,), w, eps)),
        ("rmsnorm_qk_norm", 2 * t * hq * d * 2, lambda: (randn(t * hq, d),),
         lambda x: lambda: ops.rmsnorm(x, w[:d], eps), lambda x: lambda: F.rms_norm(x, (d,), w[:d], eps)),
        ("rmsnorm_backward", 3 * t * h * 2, rms_bwd_inputs,
         lambda g, x, r: lambda: ops.rmsnorm_backward(g, x, w, r),
         lambda g, x, r: grad_of(lambda a, b: F.rms_norm(a, (h,), b, eps), x, w)),
        ("rope", 2 * t * hq * d * 2, lambda: (randn(t, hq, d),), lambda q: lambda: ops.rope(q, pos, 1e6),
         lambda q: lambda: production_rope(q, pos, 1e6)),
        ("rope_backward", 2 * t * hq * d * 2, lambda: (randn(t, hq, d),),
         lambda q: lambda: ops.rope_backward(q, pos, 1e6),
         lambda q: grad_of(lambda a: production_rope(a, pos, 1e6), q)),
        ("swiglu", 3 * t * inter * 2, lambda: (randn(t, 2 * inter),), lambda gu: lambda: ops.swiglu(gu),
         lambda gu: lambda: F.silu(gu[:, :inter]) * gu[:, inter:]),
        ("swiglu_backward", 5 * t * inter * 2, swiglu_bwd_inputs,
         lambda dy, gu: lambda: ops.swiglu_backward(dy, gu),
         lambda dy, gu: grad_of(lambda a: F.silu(a[:, :inter]) * a[:, inter:], gu)),
    ]
    rows = []
    for name, nbytes, make, r_of, p_of in cases:
        sets = [make() for _ in range(max(2, -(-4 * L2_BYTES // nbytes)))]
        r_ms, p_ms = time_pair(cycle([r_of(*s) for s in sets]), cycle([p_of(*s) for s in sets]), repeats)
        diff = scale = float("nan")
        if not name.endswith("_backward"):  # a fast forward must also be a right one
            r_out, p_out = (o[0] if isinstance(o, tuple) else o for o in (r_of(*sets[0])(), p_of(*sets[0])()))
            diff = (r_out.float() - p_out.float()).abs().max().item()
            scale = p_out.float().abs().max().item()
        del sets
        tbs = nbytes / r_ms / 1e9
        rows.append(dict(op=name, bytes=nbytes, r_ms=r_ms, p_ms=p_ms, ratio=p_ms / r_ms, r_tbs=tbs,
                         p_tbs=nbytes / p_ms / 1e9, frac_of_datasheet=tbs / hbm_tbs,
                         frac_of_copy=tbs / copy, max_abs_diff_vs_production=diff,
                         max_abs_production=scale))
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
    # The forward's own target: no slower than cuBLAS's LM-head GEMM alone, timed in the same run.
    r2_ms, gemm_ms = time_pair(r, lambda: F.linear(hidden, weight), max(5, repeats // 3))
    (lp_r, r_mem), (lp_p, p_mem) = peak_extra(r), peak_extra(p)
    err = (lp_r - lp_p).abs().max().item()
    rows = [dict(op="linear_logp", t=t, h=h, v=v, r_ms=r_ms, p_ms=p_ms, ratio=p_ms / r_ms,
                 lm_head_gemm_ms=gemm_ms, ratio_vs_lm_head_gemm=gemm_ms / r2_ms,
                 r_extra_peak_bytes=r_mem, p_extra_peak_bytes=p_mem, memory_fraction=r_mem / p_mem,
                 max_abs_diff_vs_production=err)]
    lse = ops.logp_combine(*(a[None] for a in ops.linear_logp_partial(hidden, weight, target, 0, tile, tiles)))[1]
    grad = torch.randn(t, device="cuda")
    rb = lambda: ops.linear_logp_backward(grad, hidden, weight, target, lse, 0)  # noqa: E731
    pb = grad_of(lambda a, b: production_selected_logp(a, b, target), hidden, weight)
    r_ms, p_ms = time_pair(rb, pb, 3, warmup=1)
    rows.append(dict(op="linear_logp_backward", t=t, h=h, v=v, r_ms=r_ms, p_ms=p_ms, ratio=p_ms / r_ms))
    return rows


SECTIONS = ("gemm", "memory", "logp")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=RESULT)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--quick", action="store_true", help="fewer shapes (a smoke run)")
    add_source_args(ap)
    ap.add_argument("--sections", default=",".join(SECTIONS), help="which of gemm, memory, logp to run")
    args = ap.parse_args()
    sections = args.sections.split(",")
    if not set(sections) <= set(SECTIONS):
        raise ValueError(f"--sections {args.sections!r}: choose from {', '.join(SECTIONS)}")
    hbm_tbs = datasheet_tbs(torch.cuda.get_device_name())  # before minutes of timing, not after
    ops = _lib.ops()
    torch.manual_seed(0)
    x = randn(8192, 8192)
    for _ in range(200):  # ~1 s of matrix work first: clocks up before anything is timed
        x @ x
    copy = copy_tbs(args.repeats)
    source = source_of(args, Path(__file__).resolve().parent)
    result = dict(schema_version=SCHEMA_VERSION, source=source, device=torch.cuda.get_device_name(),
                  torch=torch.__version__, cuda=torch.version.cuda, build=json.loads(ops.build_info()),
                  ratio="median production time / median rl_engine time (above 1: rl_engine faster)",
                  copy_tbs=copy, datasheet_tbs=hbm_tbs)
    result["gemm"] = gemm_rows(ops, args.repeats, args.quick) if "gemm" in sections else []
    result["memory_bound"] = memory_rows(ops, args.repeats, copy, hbm_tbs) if "memory" in sections else []
    result["linear_logp"] = logp_rows(ops, args.repeats, args.quick) if "logp" in sections else []
    result["targets"] = judge(result)
    files.write_json(args.out, result)
    print(f"copy {copy:.2f} TB/s")
    for row in result["gemm"]:
        stream = f"  W {row['r_weight_tbs']:.2f} TB/s" if "r_weight_tbs" in row else ""
        same = "" if row.get("rows_equal_m8192", True) else "  ROWS DIFFER"
        print(f"{row['op']:20s} {row.get('shape', ''):10s} m={row['m']:5d} n={row['n']:5d} k={row['k']:5d} "
              f"R {row['r_ms'] * 1e3:8.1f} us P {row['p_ms'] * 1e3:8.1f} us  ratio {row['ratio']:.3f}{stream}{same}")
    for row in result["memory_bound"]:
        print(f"{row['op']:22s} R {row['r_tbs']:5.2f} TB/s ({100 * row['frac_of_datasheet']:4.1f}% of {hbm_tbs})"
              f"  P {row['p_tbs']:5.2f}  ratio {row['ratio']:.3f}  |R-P| {row['max_abs_diff_vs_production']:.3g}"
              f" of {row['max_abs_production']:.3g}")
    for row in result["linear_logp"]:
        extra = (f"  mem R {row['r_extra_peak_bytes'] / 2**20:.0f} MiB P {row['p_extra_peak_bytes'] / 2**20:.0f}"
                 f" MiB  vs the LM-head GEMM alone {row['ratio_vs_lm_head_gemm']:.3f}"
                 if "memory_fraction" in row else "")
        print(f"{row['op']:22s} R {row['r_ms']:7.2f} ms  P {row['p_ms']:7.2f} ms  ratio {row['ratio']:.3f}{extra}")
    for name, v in result["targets"].items():
        if v["met"] is not None:
            print(f"target {name} {v['target']:g}: {'met' if v['met'] else 'MISSED'} "
                  f"({v['rows_met']} of {v['rows']} rows; worst {v['worst']})")


if __name__ == "__main__":
    main()
