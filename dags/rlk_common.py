"""Pieces shared by the rl-engine DAGs: settings, the cell catalogue, params and their use.

Standard library only (Airflow's ``Param`` aside), so a DAG file that imports this parses in
milliseconds: torch, Ray and rl_engine are imported inside tasks, if at all. The cell names and
``sanitize`` repeat rl_engine's (``rl_engine.runtime.plan``, ``rl_engine.artifacts.ids``) so that
parsing never needs rl_engine; tests/dags checks that the copies agree.

Settings: the environment variable first, then the Airflow Variable of the same name in lower case,
then the default. Settings read at parse time (schedule, time zone, cell concurrency) are best set
in the environment: a Variable costs one lookup per parse.
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path
from typing import Any

from airflow.sdk import Param

log = logging.getLogger(__name__)

CONTROL = "control"
ISOLATION_CELLS: tuple[str, ...] = tuple(
    f"{module}-{case}" for module in ("attention", "ffn", "logp") for case in ("PR", "RP", "PP"))
SELECTABLE_CELLS: tuple[str, ...] = (*ISOLATION_CELLS, "baseline")
WORKLOADS = ("ci", "default")
LAYOUT_FIELDS = ("tp", "cp", "actor_gpus", "rollout_gpus", "rollout_gpus_per_engine")
HISTORY_FOLDER = "history"


def setting(name: str, default: str) -> str:
    """``name`` from the environment, else the Variable ``name.lower()``, else ``default``."""
    value = os.environ.get(name)
    if value:
        return value
    try:
        from airflow.sdk import Variable

        value = Variable.get(name.lower(), default=None)
    except Exception as exc:  # noqa: BLE001 - no metadata database (a bare parse): use the default
        log.debug("Variable %s not readable (%s); using %r", name.lower(), exc, default)
        value = None
    return str(value) if value not in (None, "") else default


def int_setting(name: str, default: int, minimum: int = 1) -> int:
    raw = setting(name, str(default))
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not an integer") from None
    if value < minimum:
        raise ValueError(f"{name}={value} must be at least {minimum}")
    return value


def sanitize(value: str) -> str:
    """Any string (an Airflow run id) as an id ``[A-Za-z0-9._-]+`` (as rl_engine.artifacts.ids)."""
    cleaned = re.sub(r"[^A-Za-z0-9._-]+", "_", value).strip("._") or "run"
    return cleaned.replace("..", "_")


def matrix_base() -> Path:
    """The folder holding one matrix root per DAG run and the nightly history; it must be shared by
    the Ray workers and the Airflow workers (they read the report)."""
    return Path(setting("RLK_MATRIX_ROOT", str(Path.cwd() / "matrix-runs"))).expanduser().resolve()


def matrix_root(base: Path, run_id: str) -> Path:
    """One root per DAG run: clearing a cell, or re-running it, adds an attempt under it."""
    name = sanitize(run_id)
    if name == HISTORY_FOLDER:
        raise ValueError(f"run id {run_id!r} would share its folder with the nightly history")
    return base / name


def params() -> dict[str, Param]:
    """The trigger form; every value is checked by its JSON schema before a run is created."""
    layout = {
        name: Param(None, type=["null", "integer"], minimum=1, section="Layout",
                    title=name.upper(), description=f"{name.upper()}; empty: the workload's value")
        for name in LAYOUT_FIELDS
    }
    return {
        "cells": Param(
            list(ISOLATION_CELLS), type="array", uniqueItems=True,
            items={"type": "string", "enum": list(SELECTABLE_CELLS)}, examples=list(SELECTABLE_CELLS),
            title="Cells", description="Isolation cells to run after the control, which always runs. "
                                       "baseline (every module P/P) is optional."),
        "workload": Param("default", type="string", enum=list(WORKLOADS), title="Workload",
                          description="default: the runbook's; ci: fewer tokens and ranks"),
        "model": Param("tiny", type="string", pattern=r"^(tiny|/[^\r\n]+)$", title="Model",
                       description="tiny (the embedded preset, generated from a fixed seed) or the "
                                   "absolute path of a Qwen3 folder visible to the Ray workers"),
        "device": Param("cpu", type="string", enum=["cpu", "cuda"], title="Device"),
        "trainer": Param("builtin", type="string", enum=["builtin", "megatron"], title="Trainer",
                         description="builtin (rl_engine's Megatron-style trainer) or megatron "
                                     "(Megatron-core, installed on the Ray workers)"),
        "rollout_engine": Param("builtin", type="string", enum=["builtin", "vllm"],
                                title="Rollout engine",
                                description="builtin (rl_engine's vLLM-style engine) or vllm "
                                            "(vLLM, installed on the Ray workers)"),
        "launcher": Param("ray", type="string", enum=["ray", "local"], title="Rank launcher",
                          description="ray: each rank is a Ray actor (placed by the cluster); "
                                      "local: ranks are processes of the cell's job"),
        "resume": Param(False, type="boolean", title="Resume",
                        description="keep cells whose latest attempt in this run's root is complete"),
        "rerun_failed": Param(False, type="boolean", title="Rerun failed",
                              description="as resume, and run again complete cells that did not pass"),
        "append_history": Param(True, type="boolean", title="Append to the nightly history"),
        "cell_timeout_s": Param(3600, type=["null", "integer"], minimum=60, title="Cell timeout (s)",
                                description="a cell still running after this is stopped (exit 3, retried)"),
        **layout,
    }


def check_keys(conf: dict[str, Any], declared: dict[str, Any]) -> None:
    """Refuse keys the trigger form does not declare: Airflow merges any conf key into the params,
    so a misspelt one (``cell`` for ``cells``) would otherwise be ignored and the run use defaults."""
    unknown = sorted(set(conf) - set(declared))
    if unknown:
        raise ValueError(f"unknown conf keys {unknown}; the keys are {', '.join(sorted(declared))}")


def layout_gpus(conf: dict[str, Any]) -> int:
    """The GPUs one cell's ranks take on one host: the trainer's and the rollout's, which share
    them when colocated (the default). Imports rl_engine, so it is for tasks, never parsing."""
    from rl_engine.step.config import StepConfig

    overrides = {name: int(conf[name]) for name in LAYOUT_FIELDS if conf.get(name) is not None}
    layout = StepConfig.resolve(conf.get("workload") or "default", **overrides)
    return max(layout.actor_gpus, layout.rollout_gpus)


def job_resources(conf: dict[str, Any], gpus: int) -> dict[str, Any]:
    """What a job running ``gpus`` CUDA ranks asks of Ray, as RayJobOperator arguments.

    launcher local: the ranks are processes of the job, so the job itself asks for the GPUs (and
    Ray places it on a node that has them). launcher ray: each rank is an actor that asks for its
    own GPU, so the job's driver asks for none (it would hold them from its ranks), but one node
    must still hold them all (the CUDA ranks of a cell share memory, so they share a host).
    """
    # 0 and {}, never None: a task's None XCom is not stored, and pulling it fails.
    if (conf.get("device") or "cpu") != "cuda":
        return {"num_gpus": 0, "cluster_needs": {}}
    if (conf.get("launcher") or "ray") == "local":
        return {"num_gpus": gpus, "cluster_needs": {}}
    return {"num_gpus": 0, "cluster_needs": {"GPU": gpus}}


def selected_cells(conf: dict[str, Any]) -> list[str]:
    """The cells after the control, in catalogue order, each once."""
    chosen = set(conf.get("cells") or ())
    unknown = chosen - set(SELECTABLE_CELLS)
    if unknown:
        raise ValueError(f"unknown cells {sorted(unknown)}; choose from {', '.join(SELECTABLE_CELLS)}")
    return [c for c in SELECTABLE_CELLS if c in chosen]


def run_options(conf: dict[str, Any], root: Path, cell: str) -> dict[str, Any]:
    """The options of ``rlk matrix run`` for one cell (see rlk_ray.entrypoint for the spelling)."""
    options: dict[str, Any] = {
        "matrix-root": str(root), "case": cell, "workload": conf["workload"],
        "device": conf.get("device") or "cpu",
        "trainer": conf.get("trainer") or "builtin",
        "rollout-engine": conf.get("rollout_engine") or "builtin",
        "resume": bool(conf.get("resume")), "rerun-failed": bool(conf.get("rerun_failed")),
        # The aggregate task appends the history once, after every cell.
        "no-history": True,
    }
    if conf.get("cell_timeout_s"):
        options["cell-timeout"] = int(conf["cell_timeout_s"])
    if conf.get("model") and conf["model"] != "tiny":
        options["model-root"] = conf["model"]
    for name in LAYOUT_FIELDS:
        if conf.get(name) is not None:
            options[name.replace("_", "-")] = int(conf[name])
    return options


def runtime_env(conf: dict[str, Any]) -> dict[str, Any]:
    """The Ray runtime environment of every job of a run: only what the params decide. Everything
    else (RLK_STATE_DIR, PATH) is the Ray cluster's own environment."""
    return {"env_vars": {"RLK_LAUNCHER": conf.get("launcher") or "ray", "PYTHONUNBUFFERED": "1"}}


def notify_failure(context: dict[str, Any]) -> None:
    """The DAG's failure callback: ``RLK_FAILURE_NOTIFIER`` (a dotted path to a callable taking the
    context, or to a class whose instances are) if set, else one clear log line."""
    dag_run = context.get("dag_run")
    run_id = getattr(dag_run, "run_id", "?")
    run_type = getattr(dag_run, "run_type", "?")
    path = os.environ.get("RLK_FAILURE_NOTIFIER")
    if path:
        import importlib

        module, _, name = path.rpartition(".")
        target = getattr(importlib.import_module(module), name)
        notifier = target() if isinstance(target, type) else target
        notifier(context)
        return
    reason = context.get("reason") or "a task failed"
    log.error("rl-engine matrix run %s (%s) FAILED: %s; the report, if written, is under %s",
              run_id, run_type, reason, matrix_base() / sanitize(str(run_id)))
