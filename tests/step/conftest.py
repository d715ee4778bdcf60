"""A state folder with the embedded tiny model, shared by the step tests (generated once)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_PLAN_VARS = ("RL_KERNEL_ATTENTION_CASE", "RL_KERNEL_FFN_CASE", "RL_KERNEL_LOGP_CASE",
              "RL_KERNEL_RUN_ID", "RL_KERNEL_ARTIFACT_DIR", "CI_TEST", "VALIDATE_ARTIFACTS",
              "MODEL_ROOT", "PROMPT_DATA", "TP_SIZE", "CP_SIZE", "ACTOR_GPUS", "ROLLOUT_GPUS",
              "ROLLOUT_GPUS_PER_ENGINE", "GLOBAL_BATCH_SIZE", "MAX_RESPONSE_LEN")


@pytest.fixture(scope="session")
def state_dir(tmp_path_factory) -> Path:
    from rl_engine.models.generate import init_model

    state = tmp_path_factory.mktemp("state")
    init_model("tiny", state / "models" / "tiny", seed=0)
    return state


@pytest.fixture
def rlk(state_dir, tmp_path):
    """rlk(*args, env=...) runs the CLI in a fresh process; returns the CompletedProcess."""

    def run(*args: str, env: dict[str, str] | None = None, timeout: float = 600):
        base = {k: v for k, v in os.environ.items() if k not in _PLAN_VARS}
        base.update(RLK_STATE_DIR=str(state_dir), RLK_RUNS_ROOT=str(tmp_path / "runs"),
                    PYTHONUNBUFFERED="1")
        base.update(env or {})
        return subprocess.run([sys.executable, "-m", "rl_engine.cli", *args], cwd=tmp_path,
                              env=base, capture_output=True, text=True, timeout=timeout)

    return run
