"""Time of rl_engine's CPU kernels (R) against their production twins (P), as R/P ratios.

Shapes are the `tiny` preset's (bf16, hidden 256, 8 query / 4 KV heads of 64, intermediate 768,
vocab 4096) at 256 tokens, forward only; plus det_gemm at 1024 x 4096 x 4096 against F.linear,
and the extra peak memory of the selected-token log-prob at 4096 tokens x hidden 256 x vocab 32768
(measured by linear_logp_memory.py, each variant in a fresh interpreter).

Each pair is warmed up, then R and P are timed alternately in this one process, so a change of
machine load during the run falls on both; a ratio is median(R) / median(P). The tiny-shape pairs
and the large det_gemm run once per thread count (default: 1 and torch's default), since on a busy
machine a thread pool can cost more than the work of these calls.

    python benchmarks/cpu_ops.py [--repeats 11] [--threads 1,2] [--skip-large] [--skip-memory]
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import rl_engine.ops  # noqa: F401  (loads the extension and its fake kernels)
from rl_engine.artifacts import files
from rl_engine.ops import attention, linear, logp, norm, rope, swiglu

SCHEMA_VERSION = 1
HERE = Path(__file__).resolve().parent
RESULT = HERE / "results" / "cpu_ops.json"
TOKENS, HIDDEN, HQ, HKV, D, INTER, VOCAB = 256, 256, 8, 4, 64, 768, 4096
DECODE_BATCH = 8
DTYPE = torch.bfloat16
LARGE = (1024, 4096, 4096)  # M, K, N
SLOW_CALL_S = 60.0  # above this, the large det_gemm is timed once


def randn(*shape, scale=1.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(DTYPE)


def time_pair(r_fn, p_fn, repeats: int, warmup: int = 2) -> dict:
    for _ in range(warmup):
        r_fn()
        p_fn()
    r_times, p_times = [], []
    for _ in range(repeats):
        for fn, times in ((r_fn, r_times), (p_fn, p_times)):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
    r_med, p_med = statistics.median(r_times), statistics.median(p_times)
    return {"r_ms": r_med * 1e3, "p_ms": p_med * 1e3, "ratio_r_over_p": r_med / p_med,
            "repeats": repeats}


def tiny_cases() -> dict:
    """name -> (shape note, R call, P call) at the tiny preset's shapes."""
    x = randn(TOKENS, HIDDEN, seed=1)
    cases = {}
    projections = {"qkv_proj": (HIDDEN, (HQ + 2 * HKV) * D), "o_proj": (HQ * D, HIDDEN),
                   "gate_up_proj": (HIDDEN, 2 * INTER), "down_proj": (INTER, HIDDEN)}
    for i, (name, (k, n)) in enumerate(projections.items()):
        xi, w = randn(TOKENS, k, seed=10 + i), randn(n, k, scale=k ** -0.5, seed=20 + i)
        cases[f"det_gemm.{name}"] = (f"{TOKENS}x{k}x{n}", lambda xi=xi, w=w: linear.det_linear(xi, w),
                                     lambda xi=xi, w=w: F.linear(xi, w))

    nw = randn(HIDDEN, seed=2)
    cases["rmsnorm"] = (f"{TOKENS}x{HIDDEN}", lambda: norm.det_rmsnorm(x, nw, 1e-6),
                        lambda: F.rms_norm(x, (HIDDEN,), nw, 1e-6))
    q = randn(TOKENS, HQ, D, seed=3)
    pos = torch.arange(TOKENS)
    cases["rope"] = (f"{TOKENS}x{HQ}x{D}", lambda: rope.det_rope(q, pos, 1e6),
                     lambda: rope.production_rope(q, pos, 1e6))
    gu = randn(TOKENS, 2 * INTER, seed=4)
    cases["swiglu"] = (f"{TOKENS}x{2 * INTER}", lambda: swiglu.det_swiglu(gu),
                       lambda: swiglu.production_swiglu(gu))

    k, v = randn(TOKENS, HKV, D, seed=5), randn(TOKENS, HKV, D, seed=6)
    cu = torch.tensor([0, TOKENS], dtype=torch.int32)
    scale = D ** -0.5
    cases["attention_prefill"] = (
        f"1 sequence of {TOKENS}, {HQ}/{HKV} heads of {D}",
        lambda: attention.det_attention(q, k, v, cu, cu, pos, scale),
        lambda: attention.production_attention(q, k, v, cu, cu, pos, scale))

    # DECODE_BATCH sequences of TOKENS cached tokens each, pages of PAGE_SIZE in order.
    page = attention.PAGE_SIZE
    pages = math.ceil(TOKENS / page)
    k_cache = randn(DECODE_BATCH * pages, page, HKV, D, seed=7)
    v_cache = randn(DECODE_BATCH * pages, page, HKV, D, seed=8)
    table = torch.arange(DECODE_BATCH * pages, dtype=torch.int32).view(DECODE_BATCH, pages)
    lens = torch.full((DECODE_BATCH,), TOKENS, dtype=torch.int32)
    qd = randn(DECODE_BATCH, HQ, D, seed=9)
    cases["attention_decode"] = (
        f"batch {DECODE_BATCH}, context {TOKENS}, page {page}",
        lambda: attention.det_attention_decode(qd, k_cache, v_cache, table, lens, scale),
        lambda: attention.production_attention_decode(qd, k_cache, v_cache, table, lens, scale))

    lm = randn(VOCAB, HIDDEN, scale=HIDDEN ** -0.5, seed=30)
    target = torch.randint(0, VOCAB, (TOKENS,), generator=torch.Generator().manual_seed(31))
    cases["selected_logp"] = (f"{TOKENS}x{HIDDEN}, vocab {VOCAB}",
                              lambda: logp.det_selected_logp(x, lm, target),
                              lambda: logp.production_selected_logp(x, lm, target))
    return cases


def large_gemm(repeats: int) -> dict:
    m, k, n = LARGE
    x, w = randn(m, k, seed=40), randn(n, k, scale=k ** -0.5, seed=41)
    start = time.perf_counter()
    linear.det_linear(x, w)
    first = time.perf_counter() - start
    if first > SLOW_CALL_S:
        start = time.perf_counter()
        F.linear(x, w)
        p = time.perf_counter() - start
        return {"shape": f"{m}x{k}x{n}", "r_ms": first * 1e3, "p_ms": p * 1e3,
                "ratio_r_over_p": first / p, "repeats": 1,
                "note": f"one R call took {first:.0f} s (> {SLOW_CALL_S:.0f} s): timed once, no warm-up"}
    # The first call above was R's warm-up.
    out = time_pair(lambda: linear.det_linear(x, w), lambda: F.linear(x, w),
                    repeats=min(repeats, 3), warmup=0)
    out["shape"] = f"{m}x{k}x{n}"
    out["first_r_call_s"] = first
    return out


def linear_logp_memory() -> dict:
    """Runs linear_logp_memory.py's two fresh-interpreter variants (without writing its file)."""
    path = HERE / "linear_logp_memory.py"
    if not path.exists():
        return {"skipped": f"{path.name} is missing"}
    spec = importlib.util.spec_from_file_location("linear_logp_memory", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    args = argparse.Namespace(tokens=4096, hidden=256, vocab=32768)
    r, p = mod._run_variant("R", args), mod._run_variant("P", args)
    # The children's records are kept whole: only extra_peak_mib is relied on here.
    return {"shape": {"tokens": args.tokens, "hidden": args.hidden, "vocab": args.vocab,
                      "dtype": "bfloat16", "vocab_tile": getattr(mod, "VOCAB_TILE", None)},
            "r_extra_peak_mib": r["extra_peak_mib"], "p_extra_peak_mib": p["extra_peak_mib"],
            "extra_peak_ratio_r_over_p": r["extra_peak_mib"] / p["extra_peak_mib"],
            "rl_engine": r, "production": p}


def machine() -> dict:
    return {"cpu_count": os.cpu_count(), "torch": torch.__version__,
            "default_threads": torch.get_num_threads(), "interop_threads": torch.get_num_interop_threads(),
            "processor": platform.processor() or platform.machine(), "python": platform.python_version(),
            "load_average_at_start": list(os.getloadavg())}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=11)
    parser.add_argument("--threads", default=f"1,{torch.get_num_threads()}",
                        help="comma-separated torch thread counts of the tiny-shape runs")
    parser.add_argument("--skip-large", action="store_true", help="skip the 1024x4096x4096 det_gemm")
    parser.add_argument("--skip-memory", action="store_true", help="skip the linear_logp peak memory")
    parser.add_argument("--out", type=Path, default=RESULT)
    args = parser.parse_args()
    thread_counts = list(dict.fromkeys(int(n) for n in args.threads.split(",")))

    info = machine()
    print(f"torch {info['torch']}, {info['cpu_count']} CPUs, load {info['load_average_at_start'][0]:.1f}")
    # First, while this process is small: a child's ru_maxrss starts from its parent's resident
    # set at fork, so a large parent would hide the child's own peak.
    memory = None
    if not args.skip_memory:
        memory = linear_logp_memory()
        if "skipped" in memory:
            print(f"linear_logp memory: {memory['skipped']}")
        else:
            print(f"linear_logp extra peak: R {memory['r_extra_peak_mib']:.1f} MiB, "
                  f"P {memory['p_extra_peak_mib']:.1f} MiB, R/P {memory['extra_peak_ratio_r_over_p']:.3f}")
    runs = []
    cases = tiny_cases()
    for threads in thread_counts:
        torch.set_num_threads(threads)
        kernels = {}
        print(f"-- {threads} thread(s)")
        for name, (shape, r_fn, p_fn) in cases.items():
            k = kernels[name] = {"shape": shape, **time_pair(r_fn, p_fn, args.repeats)}
            print(f"{name:24s} {shape:40s} R {k['r_ms']:9.3f} ms  P {k['p_ms']:9.3f} ms  "
                  f"R/P {k['ratio_r_over_p']:7.2f}")
        run = {"threads": threads, "load_average_at_end": list(os.getloadavg()), "kernels": kernels}
        if not args.skip_large:
            big = run["det_gemm_large"] = large_gemm(args.repeats)
            print(f"{'det_gemm.large':24s} {big['shape']:40s} R {big['r_ms']:9.1f} ms  "
                  f"P {big['p_ms']:9.1f} ms  R/P {big['ratio_r_over_p']:7.2f}  {big.get('note', '')}")
        runs.append(run)
    payload = {"schema_version": SCHEMA_VERSION, "benchmark": "cpu_ops", "machine": info,
               "dtype": "bfloat16", "tiny_preset": {"tokens": TOKENS, "hidden": HIDDEN, "heads": HQ,
                                                     "kv_heads": HKV, "head_dim": D,
                                                     "intermediate": INTER, "vocab": VOCAB},
               "runs": runs}
    if memory is not None:
        payload["linear_logp_memory"] = memory
    payload["machine"]["load_average_at_end"] = list(os.getloadavg())
    files.write_json(args.out, payload)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
