"""How often the rollout makes the host wait for the GPU: CUDA's synchronisation warnings counted
over one generate() of the built-in engine (tiny preset, random weights, R/R), at two lengths. A
loop that reads the device back per token syncs in proportion to the tokens; ours only in its one
copy-out at the end, so the count must not grow with the length.

    python benchmarks/decode_syncs.py [--out benchmarks/results/h200/decode_syncs.json]
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

import torch

from rl_engine.artifacts import files, provenance
from rl_engine.engines.rollout import RolloutEngine
from rl_engine.models.config import PRESETS
from rl_engine.models.qwen3 import Qwen3
from rl_engine.runtime.plan import Plan
from rl_engine.runtime.routing import Router


def engine() -> RolloutEngine:
    config = PRESETS["tiny"]
    router = Router(Plan(), side="rollout", engine="builtin", device="cuda")
    model = Qwen3(config, router)
    g = torch.Generator(device="cuda").manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g, device="cuda", dtype=torch.float32) * 0.05)
    return RolloutEngine(model, router, max_batch=4)


def syncs(eng: RolloutEngine, new_tokens: int) -> int:
    prompts = [[1, 2, 3, 4, 5, 6, 7], [8, 9, 10]]
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            eng.generate(prompts, 2, new_tokens, seeds=0)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    eng = engine()
    eng.generate([[1, 2, 3]], 1, 4, seeds=0)  # first-call work (allocations, kernel loads)
    counts = {n: syncs(eng, n) for n in (16, 64)}
    print(f"host syncs per generate(): {counts[16]} at 16 new tokens, {counts[64]} at 64")
    src = provenance.source()
    result = {"benchmark": "decode_syncs", "commit": src["commit"], "dirty": src["dirty"],
              "gpu": torch.cuda.get_device_name(), "syncs_by_new_tokens": counts,
              "grows_with_length": counts[64] > counts[16]}
    if args.out:
        files.write_json(args.out, result)
    return 1 if result["grows_with_length"] else 0


if __name__ == "__main__":
    sys.exit(main())
