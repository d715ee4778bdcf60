"""Per-kernel time of linear_logp_backward at the benchmark's shape, beside cuBLAS twins of its GEMMs.

    python benchmarks/logp_backward_kernels.py

prints torch.profiler's table of one backward call (8192 tokens, H = 4096, V = 151936, bf16), then
each of its three products on one full vocab chunk against cuBLAS on the same shape (hopper_ops'
time_pair: medians, timed alternately), then the whole backward. Last, where the time between those
goes: the kernels' summed time against the span from the first kernel's start to the last one's end
over three calls (a gap is time the GPU waited on the host), and eight calls back to back, each
timed, with the SM clock and power nvidia-smi samples meanwhile (a clock that falls as the calls go
on is the card's power limit, not the kernels).
"""

import shutil
import statistics
import subprocess
import time

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
    kernel_span(backward)
    back_to_back(backward)


def _number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def kernel_span(fn, calls: int = 3) -> None:
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                   if e.device_type == torch.autograd.DeviceType.CUDA)
    if not spans:
        print(f"{calls} calls: the profiler recorded no kernel")
        return
    # The union of the kernels' intervals: det_gemm's launches overlap their neighbours (programmatic
    # dependent launch), so a plain sum could exceed the span and hide a gap.
    busy, end = 0.0, spans[0][0]
    for start, stop in spans:
        busy += max(0.0, stop - max(start, end))
        end = max(end, stop)
    span = end - spans[0][0]  # end: the last kernel's end, from the loop
    print(f"{calls} calls: {len(spans)} kernels, some kernel running for {busy / 1e3:.2f} ms of a span "
          f"of {span / 1e3:.2f} ms")


def back_to_back(fn, calls: int = 8) -> None:
    smi = shutil.which("nvidia-smi")
    bus = torch.cuda.get_device_properties(torch.cuda.current_device())
    card = f"{bus.pci_domain_id:08x}:{bus.pci_bus_id:02x}:{bus.pci_device_id:02x}.0"
    sampler = subprocess.Popen([smi, f"--id={card}", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits",
                                "-lms", "50"], stdout=subprocess.PIPE, text=True) if smi else None
    time.sleep(2)  # the card idles first, as before a training step's backward (and the sampler starts)
    events = [torch.cuda.Event(enable_timing=True) for _ in range(calls + 1)]
    events[0].record()
    for e in events[1:]:
        fn()
        e.record()
    torch.cuda.synchronize()
    ms = [round(a.elapsed_time(b), 2) for a, b in zip(events, events[1:])]
    print(f"{calls} calls back to back, ms each: {ms}")
    if sampler:
        sampler.terminate()
        rows = [line.split(",") for line in sampler.communicate()[0].splitlines() if line.count(",") == 1]
        rows = [(c, w) for c, w in rows if _number(c) and _number(w)]  # "[N/A]" where a card lacks one
        clock = [float(c) for c, _ in rows]
        power = [float(w) for _, w in rows]
        if clock:
            print(f"meanwhile: SM clock MHz min {min(clock):.0f}, median {statistics.median(clock):.0f}, "
                  f"max {max(clock):.0f}; power W median {statistics.median(power):.0f}, max {max(power):.0f} "
                  f"({len(clock)} samples)")


if __name__ == "__main__":
    main()
