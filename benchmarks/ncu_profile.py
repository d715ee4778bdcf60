"""Nsight Compute profiles of rl_engine's Hopper kernels at the shapes of the speed targets, reduced to
the figures that say what bounds a kernel: DRAM and SM throughput against their peaks, tensor pipe
use, achieved occupancy, and why warps stall.

    python benchmarks/ncu_profile.py --out ncu.json [--cases decode128,rmsnorm_bwd]

runs `ncu --set full` once per case on this same script (`--run CASE`), which sets the case up
unprofiled and then calls the op three times inside a profiler range; the third launch of each of
its kernels is the one kept. Needs `ncu` on PATH and a GPU; clocks are left as they are
(--clock-control none), as the timed benchmarks run.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from provenance import add_source_args, source_of  # noqa: E402
from rl_engine.artifacts import files  # noqa: E402

SCHEMA_VERSION = 1
# The figures kept from ncu's raw page, by metric name: what share of a unit's peak the kernel
# sustained, and its occupancy.
KEPT = {
    "gpu__time_duration.sum": "duration_ns",
    "dram__throughput.avg.pct_of_peak_sustained_elapsed": "dram_pct",
    "gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed": "dram_pct",
    "dram__bytes.sum.per_second": "dram_bytes_per_s",
    "sm__throughput.avg.pct_of_peak_sustained_elapsed": "sm_pct",
    "lts__throughput.avg.pct_of_peak_sustained_elapsed": "l2_pct",
    "l1tex__throughput.avg.pct_of_peak_sustained_active": "l1_pct",
    "sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active": "gmma_pct",
    "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active": "hmma_pct",
    "sm__inst_executed_pipe_lsu.avg.pct_of_peak_sustained_active": "lsu_pct",
    "smsp__issue_active.avg.pct_of_peak_sustained_active": "issue_pct",
    "sm__warps_active.avg.pct_of_peak_sustained_active": "achieved_occupancy_pct",
    "launch__occupancy_limit_shared_mem": "ctas_per_sm_by_smem",
    "launch__occupancy_limit_registers": "ctas_per_sm_by_registers",
    "launch__registers_per_thread": "registers",
    "launch__grid_size": "grid",
    "launch__waves_per_multiprocessor": "waves",
}
# Cycles a warp spent stalled for each reason per instruction it issued (ncu's warp state figures).
STALL, PER_ISSUE = "smsp__average_warps_issue_stalled_", "_per_issue_active.ratio"


def cases():
    import torch

    import rl_engine.ops  # noqa: F401  (loads the extension)
    from rl_engine.ops import _lib
    from rl_engine.ops.attention import kv_block_size

    ops, dev, dt = _lib.ops(), "cuda", torch.bfloat16

    def randn(*shape):
        return torch.randn(*shape, device=dev).to(dt)

    def decode(d):
        batch, context, page, hkv, hq = 64, 4096, 16, 8, 32
        pages = batch * context // page
        k, v = randn(pages, page, hkv, d), randn(pages, page, hkv, d)
        table = torch.randperm(pages, device=dev).to(torch.int32).view(batch, context // page)
        lens = torch.full((batch,), context, dtype=torch.int32, device=dev)
        q = randn(batch, hq, d)
        return lambda: ops.attention_decode(q, k, v, table, lens, d ** -0.5, kv_block_size(d))

    def prefill(t, d, backward):
        q, k, v, do = randn(t, 32, d), randn(t, 8, d), randn(t, 8, d), randn(t, 32, d)
        cu = torch.tensor([0, t], dtype=torch.int32, device=dev)
        pos, block = torch.arange(t, device=dev), kv_block_size(d)  # as a model of head_dim d runs
        out, lse = ops.attention_fwd(q, k, v, cu, cu, pos, d ** -0.5, block)
        if backward:
            return lambda: ops.attention_bwd(do, q, k, v, out, lse, cu, cu, pos, d ** -0.5, block, block)
        return lambda: ops.attention_fwd(q, k, v, cu, cu, pos, d ** -0.5, block)

    def rmsnorm_bwd():
        x, w, g = randn(32768, 4096), randn(4096), randn(32768, 4096)
        rstd = ops.rmsnorm(x, w, 1e-6)[1]
        return lambda: ops.rmsnorm_backward(g, x, w, rstd)

    def gemm(m, n, k, cublas=False):
        x, w = randn(m, k), randn(n, k) * k ** -0.5
        return (lambda: torch.nn.functional.linear(x, w)) if cublas else (lambda: ops.det_gemm(x, w, None))

    def linear_logp(backward, t=8192, h=4096, v=32768, tile=256):
        # A quarter of Qwen3's vocabulary: the same kernels and tiles, a quarter of the launches.
        from rl_engine.ops.logp import num_tiles

        hidden, weight = randn(t, h), randn(v, h) * 0.02
        target = torch.randint(0, v, (t,), device=dev)
        m, s, tl = ops.linear_logp_partial(hidden, weight, target, 0, tile, num_tiles(v, tile))
        if not backward:
            return lambda: ops.linear_logp_partial(hidden, weight, target, 0, tile, num_tiles(v, tile))
        lse, grad = ops.logp_combine(m[None], s[None], tl[None])[1], torch.randn(t, device=dev)
        return lambda: ops.linear_logp_backward(grad, hidden, weight, target, lse, 0)

    return {
        "decode128": lambda: decode(128),
        "decode64": lambda: decode(64),
        "attn_fwd128": lambda: prefill(8192, 128, False),
        "attn_bwd128": lambda: prefill(8192, 128, True),
        "attn_fwd64": lambda: prefill(8192, 64, False),
        "attn_bwd64": lambda: prefill(8192, 64, True),
        "linear_logp_fwd": lambda: linear_logp(False),
        "linear_logp_bwd": lambda: linear_logp(True),
        "rmsnorm_bwd": rmsnorm_bwd,
        "gemm_8b_kv_m8192": lambda: gemm(8192, 1024, 4096),
        "gemm_square_m8192": lambda: gemm(8192, 4096, 4096),
        "gemm_deep_m16": lambda: gemm(16, 4096, 12288),
        "gemm_8b_kv_m64": lambda: gemm(64, 1024, 4096),
        "gemm_4b_o_m128": lambda: gemm(128, 2560, 4096),
        "gemm_8b_kv_m1024": lambda: gemm(1024, 1024, 4096),
        # cuBLAS on the same shapes, for the figures of the kernel a det_gemm ratio is taken against.
        "cublas_square_m8192": lambda: gemm(8192, 4096, 4096, cublas=True),
        "cublas_4b_o_m128": lambda: gemm(128, 2560, 4096, cublas=True),
    }


def kernel_filter(name: str) -> str:
    """ncu's kernel-name filter of a case: rl_engine's kernels, or every kernel of a cuBLAS twin."""
    return "regex:." if name.startswith("cublas_") else "regex:rlk_"


LAUNCHES = 3  # of the op per case; the last is the one kept (the others warm caches and allocator)


def run_case(name: str) -> None:
    import torch

    fn = cases()[name]()  # the setup (inputs, a backward case's forward) runs unprofiled
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    for _ in range(LAUNCHES):
        fn()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


def number(text: str):
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return text


def profile(name: str, ncu: str) -> list[dict]:
    cmd = [ncu, "--set", "full", "--clock-control", "none", "--profile-from-start", "off",
           "-k", kernel_filter(name), "--csv", "--page", "raw", "--print-units", "base",
           sys.executable, __file__, "--run", name]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if done.returncode != 0 or '"ID"' not in done.stdout:
        # ncu's own errors (==ERROR==) go to stdout, the profiled program's to stderr.
        raise RuntimeError(f"ncu on case {name} gave rc {done.returncode} and no profile table:\n"
                           f"{done.stdout[-1500:]}\n{done.stderr[-1500:]}")
    return summarize(done.stdout, name)


def summarize(stdout: str, name: str) -> list[dict]:
    """The kept figures of the last launch of each kernel in ncu's `--csv --page raw` output: a
    header row of metric names, a row of units, then a row per profiled launch."""
    rows = list(csv.reader(io.StringIO(stdout[stdout.find('"ID"'):])))
    header, body = rows[0], [r for r in rows[2:] if len(r) == len(rows[0])]
    launches: dict[str, list[dict]] = {}
    for row in body:
        raw = dict(zip(header, row))
        kept = {short: number(raw[metric]) for metric, short in KEPT.items() if metric in raw}
        stalls = {k[len(STALL):-len(PER_ISSUE)]: number(v) for k, v in raw.items()
                  if k.startswith(STALL) and k.endswith(PER_ISSUE) and isinstance(number(v), float)}
        kept["top_stalls_cycles_per_issue"] = dict(sorted(stalls.items(), key=lambda kv: -kv[1])[:6])
        launches.setdefault(raw["Kernel Name"], []).append(dict(kernel=raw["Kernel Name"], **kept))
    if not launches:
        raise RuntimeError(f"ncu profiled no kernel of case {name} ({kernel_filter(name)}): did the op run on the GPU?")
    return [runs[-1] for runs in launches.values()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", help=argparse.SUPPRESS)
    parser.add_argument("--cases", default=None, help="comma-separated subset (default: all)")
    parser.add_argument("--out", type=Path, required=False)
    add_source_args(parser)
    args = parser.parse_args()
    if args.run:
        return run_case(args.run)
    toolkit_ncu = Path(os.environ.get("CUDA_HOME", "/usr/local/cuda")) / "bin" / "ncu"
    ncu = shutil.which("ncu") or (str(toolkit_ncu) if toolkit_ncu.exists() else None)
    if ncu is None:
        sys.exit("ncu_profile: no ncu on PATH or in $CUDA_HOME/bin; install Nsight Compute or add it to PATH")
    if args.out is None:
        sys.exit("ncu_profile: --out FILE is required")
    names = args.cases.split(",") if args.cases else list(cases())
    unknown = sorted(set(names) - set(cases()))
    if unknown:
        sys.exit(f"ncu_profile: unknown case(s) {unknown}; choose from {sorted(cases())}")
    source = source_of(args, Path(__file__).resolve().parent)
    from rl_engine.ops.attention import kv_block_size

    # The attention cases (decode128, attn_bwd64, ...) run each head_dim at its models' block.
    result = dict(schema_version=SCHEMA_VERSION, source=source,
                  kv_block_size={str(d): kv_block_size(d) for d in (128, 64)}, profiles={})
    for name in names:  # the file is rewritten after each case, so a run cut short keeps those done
        result["profiles"][name] = profile(name, ncu)
        print(json.dumps({name: result["profiles"][name]}, indent=1), flush=True)
        files.write_json(args.out, result)


if __name__ == "__main__":
    main()
