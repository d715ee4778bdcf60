"""Every setting rl-engine reads from the environment, typed and documented in one place.

Values are read lazily, when asked for (`envs.RLK_LAUNCHER`), so a test or a launcher can set a
variable after import. Unset and empty differ: an empty string is a value and is validated as one.
`RLK_*` settings are rl-engine's own; the others are the runbook variables users already set.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable


class SettingError(ValueError):
    """A setting holds a value that cannot be used; the message names the variable and the fix.
    A ValueError, not errors.BadInput: this module sits above errors.py and imports nothing of the
    project; exit_code_for maps any ValueError to exit code 2."""


def _choice(name: str, default: str, allowed: tuple[str, ...]) -> Callable[[], str]:
    def read() -> str:
        value = os.environ.get(name, default)
        if value not in allowed:
            raise SettingError(f"{name}={value!r} is not one of {', '.join(allowed)}")
        return value
    return read


def _int(name: str, default: int | None) -> Callable[[], int | None]:
    def read() -> int | None:
        raw = os.environ.get(name)
        if raw is None:
            return default
        try:
            value = int(raw)
        except ValueError:
            raise SettingError(f"{name}={raw!r} is not an integer") from None
        if value < 0:
            raise SettingError(f"{name}={value} must not be negative")
        return value
    return read


def _str(name: str, default: str | None) -> Callable[[], str | None]:
    return lambda: os.environ.get(name, default)


def _path(name: str, default: Callable[[], Path] | None) -> Callable[[], Path | None]:
    def read() -> Path | None:
        raw = os.environ.get(name)
        if raw is None:
            return default() if default else None
        if not raw:
            raise SettingError(f"{name} is set but empty; unset it or give a folder")
        return Path(raw)
    return read


def _flag(name: str) -> Callable[[], bool]:
    def read() -> bool:
        raw = os.environ.get(name, "0")
        if raw not in {"0", "1"}:
            raise SettingError(f"{name}={raw!r}: use 0 or 1")
        return raw == "1"
    return read


def _float(name: str, default: float) -> Callable[[], float]:
    def read() -> float:
        raw = os.environ.get(name)
        try:
            return default if raw is None else float(raw)
        except ValueError:
            raise SettingError(f"{name}={raw!r} is not a number") from None
    return read


def _state_dir() -> Path:
    return Path.cwd() / ".state"


_SETTINGS: dict[str, Callable[[], Any]] = {
    # How worker ranks are started: local processes, or Ray actors in a placement group.
    "RLK_LAUNCHER": _choice("RLK_LAUNCHER", "local", ("local", "ray")),
    # Project-local state: the embedded Airflow home, the Ray head's files, the generated model.
    "RLK_STATE_DIR": _path("RLK_STATE_DIR", _state_dir),
    # Build the sm_90a kernels: auto (when a CUDA torch and toolkit exist), 1 (must) or 0 (never).
    "RLK_BUILD_CUDA": _choice("RLK_BUILD_CUDA", "auto", ("auto", "0", "1")),
    # Address of the Ray cluster for the ray launcher and the Airflow tasks (ray://... or http://...).
    "RLK_RAY_ADDRESS": _str("RLK_RAY_ADDRESS", None),
    # Where `rlk run` puts run directories when RL_KERNEL_ARTIFACT_DIR is not given.
    "RLK_RUNS_ROOT": _path("RLK_RUNS_ROOT", lambda: Path.cwd() / "runs"),
    # Where `rlk matrix run` creates matrix roots when --matrix-root is not given.
    "RLK_MATRIX_ROOT": _path("RLK_MATRIX_ROOT", lambda: Path.cwd() / "matrix-runs"),
    # strict (an R route that cannot run fails before work) or audit (it runs the production twin
    # and records fallback=true; an audit run never passes a strict validation).
    "RLK_MODE": _choice("RLK_MODE", "strict", ("strict", "audit")),
    # The engines of each side (`rlk run --trainer / --rollout-engine`): their ids go into the
    # manifest and name every readback file.
    "RLK_TRAINER": _choice("RLK_TRAINER", "builtin", ("builtin", "megatron")),
    "RLK_ROLLOUT_ENGINE": _choice("RLK_ROLLOUT_ENGINE", "builtin", ("builtin", "vllm")),
    # Seconds a worker group may take to start before the launcher gives up (exit 3).
    "RLK_WORKER_START_TIMEOUT": _int("RLK_WORKER_START_TIMEOUT", 300),
    # Runbook variables: the operator plan, one case per module (P/P, P/R, R/P, R/R).
    "RL_KERNEL_ATTENTION_CASE": _str("RL_KERNEL_ATTENTION_CASE", None),
    "RL_KERNEL_FFN_CASE": _str("RL_KERNEL_FFN_CASE", None),
    "RL_KERNEL_LOGP_CASE": _str("RL_KERNEL_LOGP_CASE", None),
    "RL_KERNEL_RUN_ID": _str("RL_KERNEL_RUN_ID", None),
    "RL_KERNEL_ARTIFACT_DIR": _path("RL_KERNEL_ARTIFACT_DIR", None),
    # Layout and workload (see ARCHITECTURE.md, "Layout and workload").
    "TP_SIZE": _int("TP_SIZE", None),
    "CP_SIZE": _int("CP_SIZE", None),
    "ACTOR_GPUS": _int("ACTOR_GPUS", None),
    "ROLLOUT_GPUS": _int("ROLLOUT_GPUS", None),
    "ROLLOUT_GPUS_PER_ENGINE": _int("ROLLOUT_GPUS_PER_ENGINE", None),
    "ROLLOUT_BATCH_SIZE": _int("ROLLOUT_BATCH_SIZE", None),
    "N_SAMPLES_PER_PROMPT": _int("N_SAMPLES_PER_PROMPT", None),
    "MAX_RESPONSE_LEN": _int("MAX_RESPONSE_LEN", None),
    "GLOBAL_BATCH_SIZE": _int("GLOBAL_BATCH_SIZE", None),
    "MAX_TOKENS_PER_GPU": _int("MAX_TOKENS_PER_GPU", None),
    "MODEL_ROOT": _path("MODEL_ROOT", None),
    "PROMPT_DATA": _path("PROMPT_DATA", None),
    # CI gate: with CI_TEST=1 a log-prob mismatch above the threshold (0 = bitwise) exits 1.
    "CI_TEST": _flag("CI_TEST"),
    "CI_LOGP_ABS_DIFF_THRESHOLD": _float("CI_LOGP_ABS_DIFF_THRESHOLD", 0.0),
    "VALIDATE_ARTIFACTS": _flag("VALIDATE_ARTIFACTS"),
}


def __getattr__(name: str) -> Any:
    if name in _SETTINGS:
        return _SETTINGS[name]()
    raise AttributeError(f"module {__name__!r} has no setting {name!r}")


def __dir__() -> list[str]:
    return list(_SETTINGS)


def is_set(name: str) -> bool:
    return name in os.environ
