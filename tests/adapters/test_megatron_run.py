"""`rlk run --trainer megatron` end to end on CPU ranks against the built-in rollout engine: R/R is
bitwise (0 mismatches, max |diff| 0.0, no fallback) over 2 steps with weight sync at TP=1, TP=2,
CP=2 and TP=2 x CP=2, on the tiny preset and on a Qwen3 folder written by transformers with sizes
unlike the presets; all-P gives mismatches."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

_PLAN_VARS = ("RL_KERNEL_ATTENTION_CASE", "RL_KERNEL_FFN_CASE", "RL_KERNEL_LOGP_CASE",
              "RL_KERNEL_RUN_ID", "RL_KERNEL_ARTIFACT_DIR", "CI_TEST", "VALIDATE_ARTIFACTS",
              "MODEL_ROOT", "PROMPT_DATA", "TP_SIZE", "CP_SIZE", "ACTOR_GPUS", "ROLLOUT_GPUS",
              "ROLLOUT_GPUS_PER_ENGINE", "GLOBAL_BATCH_SIZE", "MAX_RESPONSE_LEN", "RLK_TRAINER",
              "RLK_ROLLOUT_ENGINE")
# Sizes of no preset: 6 query / 2 KV heads of 32, 3 layers, FFN 320, a vocab of 17 tiles of 256
# (padded to 32: at TP=2 rl_engine's LM-head shards are 4096 and 256 rows, Megatron's embedding
# shards 2176 each), tied to nothing.
HF_SIZES = dict(vocab_size=4352, hidden_size=192, intermediate_size=320, num_hidden_layers=3,
                num_attention_heads=6, num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-6,
                rope_theta=10000.0, tie_word_embeddings=False, max_position_embeddings=2048)


@pytest.fixture(scope="module")
def state_dir(tmp_path_factory) -> Path:
    from rl_engine.models.generate import init_model

    state = tmp_path_factory.mktemp("state")
    init_model("tiny", state / "models" / "tiny", seed=0)
    return state


@pytest.fixture(scope="module")
def hf_folder(state_dir) -> Path:
    """A Qwen3 folder saved by transformers (bf16, random init of a fixed seed) with the tiny
    preset's tokenizer files beside it."""
    return write_hf_folder(state_dir / "models" / "hf", state_dir / "models" / "tiny")


def write_hf_folder(out: Path, tokenizer_from: Path, dtype: str = "bfloat16", **sizes) -> Path:
    import shutil

    import torch
    import transformers

    torch.manual_seed(7)
    config = transformers.Qwen3Config(**{**HF_SIZES, **sizes})
    model = transformers.Qwen3ForCausalLM(config).to(getattr(torch, dtype))
    with torch.no_grad():  # norms away from 1, so a norm weight applied wrongly shows
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn_like(p))
    model.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_from / name, out / name)
    return out


def rlk(state_dir: Path, cwd: Path, *args: str, env: dict[str, str] | None = None):
    base = {k: v for k, v in os.environ.items() if k not in _PLAN_VARS}
    base.update(RLK_STATE_DIR=str(state_dir), RLK_RUNS_ROOT=str(cwd / "runs"),
                PYTHONUNBUFFERED="1", **(env or {}))
    return subprocess.run([sys.executable, "-m", "rl_engine.cli", *args], cwd=cwd, env=base,
                          capture_output=True, text=True, timeout=900)


def layout_env(tp: int, cp: int) -> dict[str, str]:
    return {"TP_SIZE": str(tp), "CP_SIZE": str(cp), "ACTOR_GPUS": str(tp * cp),
            "ROLLOUT_GPUS": str(tp), "ROLLOUT_GPUS_PER_ENGINE": str(tp)}


def check_bitwise_run(proc, run_dir: Path, run_id: str, world: int) -> None:
    verdict = run_dir / "bitwise-validation.json"
    problems = json.loads(verdict.read_text())["problems"] if verdict.is_file() else None
    assert proc.returncode == 0, (problems, proc.stderr[-3000:])
    for step in (0, 1):
        assert (f"step {step}: train_current_rollout_logprob_numel=64 "
                "train_current_rollout_logprob_mismatch_count=0 "
                "train_current_rollout_logprob_max_abs_diff=0.0") in proc.stdout
    report = json.loads((run_dir / "bitwise-validation.json").read_text())
    assert report["passed"] and report["bitwise"] and report["evidence_complete"]
    assert report["numel"] == 128 and report["max_abs_diff"] == 0.0 and not report["fallbacks"]
    # Weight sync: each step changed the weights, which the rollout ranks loaded and checked.
    w0, w1 = (json.loads((run_dir / "weights" / f"step-000{s}.json").read_text()) for s in (0, 1))
    assert w0["checksum"] != w1["checksum"] and w1["optimizer_steps"] == 2
    # The training side's evidence comes from inside the Megatron ranks, one file per rank.
    training = sorted(p.name for p in (run_dir / "readbacks").glob("*-training-*.json"))
    assert training == [f"megatron-training-rank{r}.json" for r in range(world)]
    for name in training:
        rec = json.loads((run_dir / "readbacks" / name).read_text())
        assert rec["engine"] == "megatron" and rec["run_id"] == run_id
        assert rec["megatron_core"].split(".")[:2] in (["0", "16"], ["0", "19"])
        assert rec["gradient_reduction"] == "rlkernel.fixed_order"
        for m in rec["modules"]:
            assert m["actual"] == "R" and not m["fallback"], m
            assert all(b.startswith("rlkernel.") for b in m["call_counts"]), m["call_counts"]
    assert ("[rl-engine][route] engine=megatron side=training module=attention requested=R "
            "actual=R") in (run_dir / "run.log").read_text()


@pytest.mark.parametrize("tp,cp,model", [(1, 1, "tiny"), (2, 1, "hf"), (1, 2, "hf"),
                                         (2, 2, "tiny")])
def test_megatron_trainer_matches_the_builtin_rollout_bit_for_bit(state_dir, hf_folder, tmp_path,
                                                                  tp, cp, model):
    run_dir, run_id = tmp_path / "run", f"megatron-tp{tp}-cp{cp}-{model}"
    env = {**layout_env(tp, cp), "CI_TEST": "1"}
    if model == "hf":
        env["MODEL_ROOT"] = str(hf_folder)
    proc = rlk(state_dir, tmp_path, "run", "--workload", "ci", "--steps", "2", "--trainer",
               "megatron", "--artifact-dir", str(run_dir), "--run-id", run_id, env=env)
    check_bitwise_run(proc, run_dir, run_id, tp * cp)


def test_all_p_megatron_gives_mismatches(state_dir, tmp_path):
    """Megatron's stock modules (and the production attention) against the rollout's P: the
    run completes, the bits differ, and the training side launched none of rl_engine's kernels."""
    run_dir = tmp_path / "pp"
    pp = {"RL_KERNEL_ATTENTION_CASE": "P/P", "RL_KERNEL_FFN_CASE": "P/P",
          "RL_KERNEL_LOGP_CASE": "P/P", "VALIDATE_ARTIFACTS": "1", **layout_env(1, 1)}
    proc = rlk(state_dir, tmp_path, "run", "--workload", "ci", "--trainer", "megatron",
               "--artifact-dir", str(run_dir), env=pp)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((run_dir / "bitwise-validation.json").read_text())
    assert report["passed"] and not report["bitwise"] and report["mismatch_count"] > 0
    rec = json.loads((run_dir / "readbacks" / "megatron-training-rank0.json").read_text())
    counts = {m["module"]: m["call_counts"] for m in rec["modules"]}
    assert counts["attention"]["production.megatron.ColumnParallelLinear"] > 0
    assert counts["ffn"]["production.megatron.MLP"] > 0
    assert counts["logp"]["production.megatron.vocab_parallel_cross_entropy"] > 0
    assert not [k for k, n in rec["kernel_totals"].items() if k.startswith("rlkernel.") and n]
    # Megatron's DDP keeps its buffers on a CUDA device; on CPU ranks the process group sums.
    assert rec["gradient_reduction"] == "production.all_reduce"


def test_a_vocab_that_tp_does_not_divide_is_refused_before_anything_is_written(state_dir, tmp_path):
    """Megatron splits the embedding evenly over TP: vocab 4351 at TP=2 is bad input (exit 2,
    one line naming the fix), found before the run directory is made or any rank starts."""
    folder = write_hf_folder(tmp_path / "odd", state_dir / "models" / "tiny", vocab_size=4351)
    run_dir = tmp_path / "run"
    proc = rlk(state_dir, tmp_path, "run", "--workload", "ci", "--trainer", "megatron",
               "--artifact-dir", str(run_dir), env={**layout_env(2, 1), "MODEL_ROOT": str(folder)})
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert ("--trainer megatron: vocab_size=4351 is not a multiple of TP_SIZE=2 (Megatron splits "
            "the embedding evenly over TP); pad the vocab or choose another TP size") in proc.stderr
    assert "Traceback" not in proc.stderr and not run_dir.exists()
