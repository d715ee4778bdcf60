"""The matrix on vLLM: `rlk matrix run --workload ci --rollout-engine vllm` (one engine of TP=1 and
a TP=1 trainer, 2 steps of 2 samples x 8 tokens, the baseline included) runs every cell with
complete evidence and attribution; the control (every module R on both sides) is bitwise over both
steps with the weight sync between them and no route falling back; the baseline (stock vLLM
against the trainer's production twins) is not bitwise.

Then, with the same prompts and seeds, a vLLM engine on the unchanged checkpoint (this file run as
a script, one process) shows that under R a request's log-probs are the same bits alone and
inside a batch of 5, that it draws the control's step-0 tokens again, and that the control's
step-1 log-probs are not what the checkpoint gives with step 1's seeds: the second step ran on
the synced weights.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow
_RUN_VARS = ("RL_KERNEL_", "TP_SIZE", "CP_SIZE", "ACTOR_GPUS", "ROLLOUT_", "GLOBAL_BATCH_SIZE",
             "MAX_RESPONSE_LEN", "MODEL_ROOT", "PROMPT_DATA", "N_SAMPLES_PER_PROMPT", "RLK_")
LAYOUT = ("--workload", "ci", "--tp", "1", "--actor-gpus", "1", "--rollout-gpus", "1",
          "--rollout-gpus-per-engine", "1", "--max-response-len", "8", "--steps", "2")


def _env(tmp_path: Path) -> dict[str, str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith(_RUN_VARS)}
    base.update(RLK_STATE_DIR=str(tmp_path / "state"), RLK_RUNS_ROOT=str(tmp_path / "runs"),
                PYTHONUNBUFFERED="1")
    return base


def test_the_matrix_on_vllm_runs_every_cell_with_attribution(tmp_path):
    root = tmp_path / "matrix"
    proc = subprocess.run([sys.executable, "-m", "rl_engine.cli", "matrix", "run", *LAYOUT,
                           "--rollout-engine", "vllm", "--baseline", "--no-history",
                           "--matrix-root", str(root)],
                          cwd=tmp_path, env=_env(tmp_path), capture_output=True, text=True,
                          timeout=1500)
    report = json.loads((root / "matrix-report.json").read_text())
    cells = {c["cell"]: c for c in report["cells"]}
    assert proc.returncode == 0, (proc.stderr[-3000:], {c: v["reasons"] for c, v in cells.items()})
    assert sorted(cells) == sorted(["control", "baseline"] + [f"{m}-{c}" for m in
                                    ("attention", "ffn", "logp") for c in ("PR", "RP", "PP")])
    for name, cell in cells.items():
        assert cell["evidence_complete"] and not cell["latest"]["fallbacks"], (name, cell["reasons"])
        assert cell["latest"]["numel"] == 2 * 2 * 8
    control = cells["control"]
    assert control["passed"] and control["bitwise"] and control["latest"]["max_abs_diff"] == 0.0
    assert not cells["baseline"]["bitwise"] and cells["baseline"]["latest"]["mismatch_count"] > 0
    attribution = report["attribution"]
    assert attribution["conclusive"], attribution["notes"]
    assert all(m["pp_reintroduces_mismatch"] is not None for m in attribution["modules"].values())

    run_dir = root / "control" / control["latest"]["attempt_id"]
    steps = [torch.load(run_dir / "train-data" / f"rollout-000{s}.rank0.pt", weights_only=True)
             for s in (0, 1)]
    out = tmp_path / "alone.json"
    script = subprocess.run([sys.executable, __file__, str(out)], cwd=tmp_path,
                            env=_env(tmp_path), capture_output=True, text=True, timeout=600)
    assert script.returncode == 0, script.stderr[-3000:]
    seen = json.loads(out.read_text())
    bits = lambda lp: torch.tensor(lp, dtype=torch.float32).view(torch.int32)  # noqa: E731
    assert seen["alone"]["tokens"] == seen["in_batch_of_5"]["tokens"]
    assert torch.equal(bits(seen["alone"]["logprobs"]), bits(seen["in_batch_of_5"]["logprobs"]))
    assert seen["step0"]["tokens"] == steps[0]["tokens"].tolist()
    assert torch.equal(bits(seen["step0"]["logprobs"]), steps[0]["rollout_logprobs"].view(torch.int32))
    # One optimizer step rarely moves a sampled token of 8; it moves every log-prob's bits.
    unsynced = bits(seen["step1_seeds_on_the_checkpoint"]["logprobs"])
    assert not torch.equal(unsynced, steps[1]["rollout_logprobs"].view(torch.int32))


def _engine_on_the_checkpoint(out: Path) -> None:
    """One vLLM engine (every module R) on the embedded tiny checkpoint the matrix ran on."""
    from rl_engine.adapters.vllm.rank import VllmRank
    from rl_engine.engines.rollout.worker import RolloutJob
    from rl_engine.runtime.plan import Plan
    from rl_engine.step import inputs

    model = inputs.embedded_model()
    first = inputs.load(model, None, count=1).prompts
    five = inputs.load(model, None, count=5).prompts
    job = RolloutJob(config=inputs.load(model, None, count=1).config, state=None,
                     model_root=model, plan=Plan(), prompts=five, n_samples=2, max_new_tokens=8,
                     seed=0)
    rank = VllmRank(0, 1, job)
    try:
        def request(prompts, seed, n=1):
            return rank.generate(prompts, n, 8, seed, step=0)["samples"]

        alone = request(first, 0)[0]
        batch = request(five, 0)
        assert len(batch) == 5 and batch[0]["prompt_index"] == 0
        pick = lambda s: {"tokens": s["tokens"], "logprobs": s["logprobs"]}  # noqa: E731
        both = lambda ss: {"tokens": [s["tokens"] for s in ss],  # noqa: E731
                           "logprobs": [s["logprobs"] for s in ss]}
        result = {"alone": pick(alone), "in_batch_of_5": pick(batch[0]),
                  "step0": both(request(first, 0, n=2)),
                  "step1_seeds_on_the_checkpoint": both(request(first, 1000, n=2))}
    finally:
        rank.close()
    out.write_text(json.dumps(result))


if __name__ == "__main__":
    _engine_on_the_checkpoint(Path(sys.argv[1]))
