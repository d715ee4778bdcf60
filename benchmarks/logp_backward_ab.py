"""linear_logp_backward of two builds of the extension, on one CUDA GPU, in two processes (one build
a process: both register the same operators):

    python benchmarks/logp_backward_ab.py save --dir D     # with the base build installed
    python benchmarks/logp_backward_ab.py compare --dir D  # with the new build installed

A build of a commit comes from `benchmarks/device_ext.sh` (a .so.gz), and is installed with
`RLK_PREBUILT_EXTENSION=<the .so> pip install --no-deps --no-build-isolation -e .` or by copying it
over rl_engine/_C*.so. `save` writes the gradients of two cases to D (about 2.6 GB: Qwen3's
grad_weight is 151936 x 4096 fp32, also held in host memory); `compare` holds its own to them with
torch.equal and exits 3 where any differs. Both print the backward's median time at Qwen3's vocab
(8192 tokens, H = 4096, V = 151936) beside the production backward's (autograd through plain
logits), timed alternately in the same process (hopper_ops.time_pair: four rounds after two
untimed ones)."""
import argparse
import sys
from pathlib import Path

import torch

from hopper_ops import time_pair
from rl_engine.ops import _lib
from rl_engine.ops.logp import num_tiles, production_selected_logp

CASES = {"qwen3": (8192, 4096, 151936), "odd": (1000, 520, 20011)}  # odd: chunk tails, padded rows


def inputs(ops, t, h, v):
    g = torch.Generator(device="cuda").manual_seed(7)
    hidden = torch.randn(t, h, device="cuda", generator=g).bfloat16()
    weight = (torch.randn(v, h, device="cuda", generator=g) * 0.02).bfloat16()
    target = torch.randint(0, v, (t,), device="cuda", generator=g)
    grad = torch.randn(t, device="cuda", generator=g)
    m, s, tl = ops.linear_logp_partial(hidden, weight, target, 0, 256, num_tiles(v, 256))
    return hidden, weight, target, grad, ops.logp_combine(m[None], s[None], tl[None])[1]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=("save", "compare"))
    ap.add_argument("--dir", type=Path, required=True, help="where `save` writes the gradients")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("logp_backward_ab: needs a CUDA GPU and a CUDA build of the extension (see the docstring)")
    if args.mode == "compare" and not all((args.dir / f"{n}.pt").exists() for n in CASES):
        sys.exit(f"logp_backward_ab: no saved gradients in {args.dir}; run `save` with the base build first")
    args.dir.mkdir(parents=True, exist_ok=True)
    ops = _lib.ops()
    x = torch.randn(8192, 8192, device="cuda").bfloat16()
    for _ in range(200):  # clocks up before anything is timed
        x @ x
    differ = False
    for name, shape in CASES.items():
        hidden, weight, target, grad, lse = inputs(ops, *shape)
        ours = lambda: ops.linear_logp_backward(grad, hidden, weight, target, lse, 0)  # noqa: E731
        gh, gw = (g.cpu() for g in ours())
        path = args.dir / f"{name}.pt"
        if args.mode == "save":
            torch.save((gh, gw), path)
        else:
            rh, rw = torch.load(path)
            same = torch.equal(gh, rh) and torch.equal(gw, rw)
            differ |= not same
            print(f"{name}: gradients {'equal' if same else 'DIFFER'} to the saved build's")
            for what, a, b in (("grad_hidden", gh, rh), ("grad_weight", gw, rw)):
                if not torch.equal(a, b):
                    d = (a - b).abs()
                    print(f"  {what}: {int((a != b).sum())} of {a.numel()} differ, max |diff| {d.max().item():.3g}")
        if name == "qwen3":
            leaves = [hidden.detach().requires_grad_(), weight.detach().requires_grad_()]
            out = production_selected_logp(*leaves, target)
            plain = lambda: torch.autograd.grad(out, leaves, grad, retain_graph=True)  # noqa: E731
            r_ms, p_ms = time_pair(ours, plain, repeats=4, warmup=2)
            print(f"{name}: backward {r_ms:.2f} ms, production {p_ms:.2f} ms, ratio {p_ms / r_ms:.3f}")
    sys.exit(3 if differ else 0)


if __name__ == "__main__":
    main()
