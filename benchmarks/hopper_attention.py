"""Speed of rl_engine's Hopper attention kernels against the fastest scaled_dot_product_attention
backend measured in the same process (bf16, causal, 32 query / 8 KV heads, head_dim 128 and 64).

Prefill forward and backward at 4k and 8k tokens (one sequence): TFLOP/s counted as causal
(half of 4 T^2 D H for the forward, 2.5 times that for the backward) and ratio = median SDPA time /
median rl_engine time. Paged decode (batch 64, 4k context, page 16, shuffled page table): bytes of
K and V read (plus q and out) over time, against the card's datasheet HBM figure and the measured
device-to-device copy; SDPA decode runs on contiguous KV for comparison. CUDA events, warm-up,
median of --repeats. `met` says which of the targets (TARGETS) every row reaches; the JSON records
the commit it measured (provenance.py). Each head_dim runs with the block a model of it runs with
(kv_block_size: 128 keys at head_dim 64 and 128), and the backward's query chunks with the same;
--kv-block-size times every head_dim at one other size instead.

    python benchmarks/hopper_attention.py [--out results.json] [--repeats 20] [--kv-block-size 64]
        [--commit C --dirty 0]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import rl_engine.ops  # noqa: F401  (loads the extension and its fake kernels)
from rl_engine.artifacts.files import write_text
from rl_engine.ops import _lib
from rl_engine.ops.attention import kv_block_size
from hopper_targets import datasheet_tbs
from provenance import add_source_args, source_of

RESULT = Path(__file__).resolve().parent / "results" / "hopper_attention.json"
HQ, HKV, PAGE = 32, 8, 16
HEAD_DIMS = (128, 64)
# Against SDPA in the same run: forward and backward time ratios, paged decode in TB/s read.
TARGETS = {"forward_ratio": 0.9, "backward_ratio": 0.75, "decode_tbs": 3.6}
BACKENDS = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION}


def median_ms(fn, repeats, warmup=3):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
          for _ in range(repeats)]
    for start, end in ev:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in ev)


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def best_sdpa(make_call, repeats):
    """(name, ms, output) of the fastest SDPA backend / GQA form that runs; make_call(gqa) -> fn."""
    best = None
    for name, backend in BACKENDS.items():
        for gqa in (True, False):
            try:
                with sdpa_kernel([backend]):
                    fn = make_call(gqa)
                    out = fn()
                    ms = median_ms(fn, repeats)
            except Exception:  # a backend that does not take this shape is skipped
                continue
            if best is None or ms < best[1]:
                best = (f"{name}{'+gqa' if gqa else '+expanded_kv'}", ms, out)
    return best


def prefill(ops, t, D, block, repeats):
    dev, dt = "cuda", torch.bfloat16
    q, k, v = (torch.randn(t, h, D, device=dev).to(dt) for h in (HQ, HKV, HKV))
    do = torch.randn(t, HQ, D, device=dev).to(dt)
    cu = torch.tensor([0, t], dtype=torch.int32, device=dev)
    pos = torch.arange(t, device=dev)
    scale = D ** -0.5
    out, lse = ops.attention_fwd(q, k, v, cu, cu, pos, scale, block)
    r_fwd = median_ms(lambda: ops.attention_fwd(q, k, v, cu, cu, pos, scale, block), repeats)
    r_bwd = median_ms(lambda: ops.attention_bwd(do, q, k, v, out, lse, cu, cu, pos, scale, block,
                                                block), repeats)

    def heads(x, gqa, grad=True):  # [T, H, D] -> [1, H', T, D], GQA expanded unless SDPA groups
        x = x if gqa or x.shape[1] == HQ else x.repeat_interleave(HQ // HKV, dim=1)
        return x.transpose(0, 1)[None].detach().requires_grad_(grad)

    def fwd_call(gqa):
        q4, k4, v4 = (heads(x, gqa, grad=False) for x in (q, k, v))
        return lambda: F.scaled_dot_product_attention(q4, k4, v4, is_causal=True, scale=scale,
                                                      enable_gqa=gqa)

    def bwd_call(gqa):
        q4, k4, v4 = heads(q, gqa), heads(k, gqa), heads(v, gqa)
        o4 = F.scaled_dot_product_attention(q4, k4, v4, is_causal=True, scale=scale, enable_gqa=gqa)
        do4 = do.transpose(0, 1)[None]
        return lambda: torch.autograd.grad(o4, (q4, k4, v4), do4, retain_graph=True)

    p_fwd_name, p_fwd, p_out = best_sdpa(fwd_call, repeats)
    p_bwd_name, p_bwd, _ = best_sdpa(bwd_call, repeats)
    flop = 2 * t * t * D * HQ  # causal: half of 4 T^2 D H
    return dict(tokens=t, head_dim=D, kv_block_size=block, r_fwd_ms=r_fwd, p_fwd_ms=p_fwd,
                p_fwd_backend=p_fwd_name, r_fwd_tflops=flop / r_fwd / 1e9, p_fwd_tflops=flop / p_fwd / 1e9,
                forward_ratio=p_fwd / r_fwd, r_bwd_ms=r_bwd, p_bwd_ms=p_bwd, p_bwd_backend=p_bwd_name,
                r_bwd_tflops=2.5 * flop / r_bwd / 1e9, p_bwd_tflops=2.5 * flop / p_bwd / 1e9,
                backward_ratio=p_bwd / r_bwd,
                out_rel_err_vs_sdpa=rel(out, p_out[0].transpose(0, 1)))


def decode(ops, D, block, hbm_tbs, repeats, batch=64, context=4096):
    dev, dt = "cuda", torch.bfloat16
    pages = batch * context // PAGE
    k_cache = torch.randn(pages, PAGE, HKV, D, device=dev).to(dt)
    v_cache = torch.randn(pages, PAGE, HKV, D, device=dev).to(dt)
    table = torch.randperm(pages, device=dev).to(torch.int32).view(batch, context // PAGE)
    lens = torch.full((batch,), context, dtype=torch.int32, device=dev)
    q = torch.randn(batch, HQ, D, device=dev).to(dt)
    scale = D ** -0.5
    out, _ = ops.attention_decode(q, k_cache, v_cache, table, lens, scale, block)
    r_ms = median_ms(lambda: ops.attention_decode(q, k_cache, v_cache, table, lens, scale, block),
                     repeats)
    # The same keys contiguous per sequence for SDPA: [B, Hkv, context, D].
    flat = table.long().view(-1)
    k4 = k_cache[flat].view(batch, context, HKV, D).transpose(1, 2).contiguous()
    v4 = v_cache[flat].view(batch, context, HKV, D).transpose(1, 2).contiguous()

    def call(gqa):
        kk = k4 if gqa else k4.repeat_interleave(HQ // HKV, dim=1)
        vv = v4 if gqa else v4.repeat_interleave(HQ // HKV, dim=1)
        return lambda: F.scaled_dot_product_attention(q[:, :, None], kk, vv, scale=scale,
                                                      enable_gqa=gqa)

    p_name, p_ms, p_out = best_sdpa(call, repeats)
    nbytes = 2 * batch * context * HKV * D * 2 + 2 * batch * HQ * D * 2
    return dict(head_dim=D, kv_block_size=block, batch=batch, context=context, page_size=PAGE,
                bytes=nbytes, r_ms=r_ms, r_tbs=nbytes / r_ms / 1e9,
                hbm_fraction=nbytes / r_ms / 1e9 / hbm_tbs,
                p_ms=p_ms, p_backend=p_name, p_tbs=nbytes / p_ms / 1e9,
                out_rel_err_vs_sdpa=rel(out, p_out[:, :, 0]))


def copy_tbs(repeats):
    x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    return 2 * x.numel() / median_ms(lambda: x.clone(), repeats) / 1e9


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=RESULT)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--kv-block-size", type=int, default=None, choices=(16, 32, 64, 128),
                    help="keys a block (and query rows a backward chunk) at every head_dim, instead "
                         "of each head_dim's kv_block_size; a multiple of the page, 16")
    add_source_args(ap)
    args = ap.parse_args()
    hbm_tbs = datasheet_tbs(torch.cuda.get_device_name())
    ops = _lib.ops()
    blocks = {d: args.kv_block_size or kv_block_size(d) for d in HEAD_DIMS}
    rows = [prefill(ops, t, d, blocks[d], args.repeats) for d in HEAD_DIMS for t in (4096, 8192)]
    dec = [decode(ops, d, blocks[d], hbm_tbs, args.repeats) for d in HEAD_DIMS]
    met = {"forward_ratio": min(r["forward_ratio"] for r in rows) >= TARGETS["forward_ratio"],
           "backward_ratio": min(r["backward_ratio"] for r in rows) >= TARGETS["backward_ratio"],
           "decode_tbs": min(r["r_tbs"] for r in dec) >= TARGETS["decode_tbs"]}
    result = dict(source=source_of(args, Path(__file__).resolve().parent),
                  device=torch.cuda.get_device_name(), torch=torch.__version__, cuda=torch.version.cuda,
                  build=json.loads(ops.build_info()),
                  kernels=("wgmma m64nNk16 with bulk tensor copies: prefill (a producer warpgroup "
                           "fills a 3-stage K/V ring, two consumer warpgroups of 64 query rows), "
                           "backward dq (two warpgroups of 64 rows) and dk/dv (two warpgroups of 64 "
                           "keys, 64-row query steps of two heads at head_dim 64 where the group "
                           "splits in pairs, else one, steps whose rows see every key unmasked, "
                           "chunk partials added in chunk order); paged "
                           "decode on mma.sync, each block's scores, softmax and P.V done once, "
                           "spread over D/16 warps, pages looked up a block ahead"),
                  shape=dict(hq=HQ, hkv=HKV, head_dims=HEAD_DIMS,
                             kv_block_size={str(d): b for d, b in blocks.items()},
                             q_chunk_size={str(d): b for d, b in blocks.items()}),
                  ratio="median SDPA time / median rl_engine time (above 1: rl_engine faster)",
                  copy_tbs=copy_tbs(args.repeats), datasheet_tbs=hbm_tbs,
                  prefill=rows, decode=dec, targets=TARGETS, met=met)
    write_text(args.out, json.dumps(result, indent=1) + "\n")
    print(f"{'D':>4} {'block':>5} {'T':>6} {'fwd ms':>8} {'sdpa':>8} {'ratio':>6} {'bwd ms':>8} {'sdpa':>8} {'ratio':>6}")
    for r in rows:
        print(f"{r['head_dim']:>4} {r['kv_block_size']:>5} {r['tokens']:>6} {r['r_fwd_ms']:8.3f} {r['p_fwd_ms']:8.3f} {r['forward_ratio']:6.2f} "
              f"{r['r_bwd_ms']:8.3f} {r['p_bwd_ms']:8.3f} {r['backward_ratio']:6.2f}  "
              f"({r['r_fwd_tflops']:.0f}/{r['r_bwd_tflops']:.0f} TFLOP/s; sdpa {r['p_fwd_backend']}, "
              f"{r['p_bwd_backend']})")
    for r in dec:
        print(f"decode D={r['head_dim']} block {r['kv_block_size']}: {r['r_ms']:.3f} ms {r['r_tbs']:.2f} TB/s ({100 * r['hbm_fraction']:.0f}% "
              f"of {hbm_tbs}); sdpa {r['p_backend']} {r['p_tbs']:.2f} TB/s")
    print(f"targets {TARGETS}: met {met}")


if __name__ == "__main__":
    main()
