"""
### rl-engine clean-room gate

Proves one pinned commit from a clean checkout: it builds, its inputs are the recorded ones, its
targeted tests pass, the R/R control is bitwise equal (plain and traced), the P/P run is production
on every route, and the parity matrix passes. Triggered by hand (no schedule): give `commit`.
The repository is a setting, `RLK_GATE_REPO`, not a param: whoever may trigger the gate runs the
code it clones on the Ray workers, so only the configured origin is cloned.

| task | what it runs |
| --- | --- |
| `prepare` | turns the params into this run's gate folder and each step's options (no work); refuses unknown conf keys, a missing `RLK_GATE_REPO`, test paths outside the checkout |
| `checkout` | Ray job `rlk gate checkout`: clone, check out the commit, `git status --porcelain` empty |
| `build` | `rlk gate build`: `pip install -e` the checkout into the Ray job environment, preflight |
| `verify-inputs` | `rlk gate verify-inputs`: model and prompts against their recorded sha256 |
| `tests` | `rlk gate tests`: the selected pytest paths; `tests.log` and JUnit XML |
| `strict-run` | `rlk gate strict-run`: the R/R control with `CI_TEST=1 VALIDATE_ARTIFACTS=1` |
| `traced-run` | `rlk gate traced-run`: the control with `--trace`, then `rlk trace gate` per side |
| `production-run` | `rlk gate production-run --trace`: P/P; readbacks production, trace check baseline |
| `matrix` | triggers the `rlk_matrix` DAG (this run's conf) and waits for it, deferred |
| `archive` | `rlk gate archive`: `gate-archive.json` with every result, manifest, commit, environment |

Steps run in order; a failed step stops the chain, and `archive` still runs to record why. Each
step writes `<gate folder>/<step>.json`; a failure names its step (`gate step <name> failed: ...`).
Exit codes of every `rlk` verb: 0 ok, 1 parity or route failure, 2 bad input (a dirty checkout, an
unknown commit, changed inputs; neither 1 nor 2 is retried), 3 infrastructure (retried with backoff).

**Gate folder**: `<RLK_GATE_ROOT>/<run id, sanitised>/`, the checkout in its `checkout/`. It must be
shared by the Ray workers. The build installs the checkout into the Ray workers' Python environment
(`build` = `verify` instead requires the checkout's existing build to be newer than its sources), so
give the gate a Ray cluster of its own; one gate runs at a time. The matrix runs in the matrix
DAG's root `<RLK_MATRIX_ROOT>/gate__<run id>` and is not appended to the nightly history; it uses
the default prompts (the matrix DAG has no prompt parameter).

**Settings** (environment first, then the Airflow Variable of the same name in lower case):
`RLK_GATE_REPO` (the URL or path of the one repository the gate clones, as the Ray workers reach
it; required), `RLK_GATE_ROOT` (default `gate-runs` under the worker's working folder), `RLK_MATRIX_ROOT`. The Ray
cluster is the `ray_default` connection.
"""

from __future__ import annotations

import logging
from datetime import timedelta
from pathlib import Path, PurePosixPath

import pendulum
import rlk_common as common
from airflow.providers.standard.operators.trigger_dagrun import TriggerDagRunOperator
from airflow.sdk import DAG, Param, TriggerRule, task
from rlk_ray.operators import RayJobOperator

log = logging.getLogger(__name__)

# The steps of `rlk gate`, in order (rl_engine.gate.STEPS; tests/dags checks that they agree).
GATE_STEPS = ("checkout", "build", "verify-inputs", "tests", "strict-run", "traced-run",
              "production-run", "matrix", "archive")
MATRIX_DAG_ID = "rlk_matrix"
# Steps that use the device: with `device` cuda they ask Ray for GPUs (see rlk_common.job_resources).
GPU_STEPS = ("build", "tests", "strict-run", "traced-run", "production-run")
DEFAULT_TESTS = ["tests/runtime", "tests/validation", "tests/trace"]
RETRY = dict(retries=2, retry_delay=timedelta(seconds=30), retry_exponential_backoff=2.0,
             max_retry_delay=timedelta(minutes=10))
TIMEOUT = {"checkout": timedelta(hours=1), "build": timedelta(hours=2), "verify-inputs": timedelta(hours=1),
           "tests": timedelta(hours=2), "strict-run": timedelta(hours=6), "traced-run": timedelta(hours=6),
           "production-run": timedelta(hours=6), "matrix": timedelta(hours=48),
           "archive": timedelta(minutes=30)}
_ABSOLUTE = r"^/[^\r\n\x00]+$"
# A pytest path or node id inside the checkout: relative, no `..` segment, not an option.
_INSIDE = r"^(?!/)(?!-)(?!(.*/)?\.\.(/|::|$))[^\r\n\x00]+$"


def params() -> dict[str, Param]:
    """The trigger form; every value is checked by its JSON schema before a run is created."""
    return {
        "commit": Param(type="string", pattern=r"^[0-9a-fA-F]{7,40}$", title="Commit",
                        description="the pinned commit id; a branch or tag is not pinned"),
        "workload": Param("ci", type="string", enum=list(common.WORKLOADS), title="Workload",
                          description="ci: fewer tokens and ranks; default: the runbook's"),
        "model": Param("tiny", type="string", pattern=r"^(tiny|/[^\r\n\x00]+)$", title="Model",
                       description="tiny (the embedded preset) or the absolute path of a Qwen3 folder "
                                   "visible to the Ray workers; its manifest.sha256 is verified"),
        "prompt_data": Param(None, type=["null", "string"], pattern=_ABSOLUTE, title="Prompts",
                             description="absolute path of a JSONL prompt file; needs an input manifest"),
        "input_manifest": Param(None, type=["null", "string"], pattern=_ABSOLUTE, title="Input manifest",
                                description="a run's manifest or a sha256sum file the inputs must match"),
        "device": Param("cpu", type="string", enum=["cpu", "cuda"], title="Device"),
        "steps": Param(1, type="integer", minimum=1, maximum=16, title="Post-training steps per run"),
        "build": Param("install", type="string", enum=["install", "verify"], title="Build",
                       description="install: pip install -e the checkout; verify: its existing build"),
        "tests": Param(DEFAULT_TESTS, type="array", minItems=1, title="Tests",
                       items={"type": "string", "pattern": _INSIDE},
                       description="pytest paths or node ids inside the checkout (relative, no ..)"),
        "cells": Param(list(common.ISOLATION_CELLS), type="array", uniqueItems=True, title="Matrix cells",
                       items={"type": "string", "enum": list(common.SELECTABLE_CELLS)}),
        "launcher": Param("local", type="string", enum=["local", "ray"], title="Rank launcher",
                          description="local: ranks are processes of the step's job; ray: Ray actors"),
    }


def gate_repo() -> str:
    """The one repository the gate clones (a setting: see the module docstring)."""
    repo = common.setting("RLK_GATE_REPO", "")
    if not repo or repo.startswith("-") or any(c in repo for c in "\r\n\x00"):
        raise ValueError(f"RLK_GATE_REPO={repo!r}: set it (environment or Airflow Variable "
                         "rlk_gate_repo) to the URL or path of the repository the gate may clone")
    return repo


def inside_checkout(path: str) -> str:
    """``path`` (a pytest path or node id) if it names something inside the checkout."""
    file_part = PurePosixPath(path.split("::", 1)[0])
    if not path or path.startswith("-") or file_part.is_absolute() or ".." in file_part.parts:
        raise ValueError(f"test path {path!r} is outside the checkout; give a path relative to it")
    return path


def params_of_the_form() -> dict[str, Param]:
    """``params()`` under a name a task's own ``params`` argument does not hide."""
    return params()


def gate_root() -> Path:
    """Holds one gate folder per DAG run; shared by the Ray workers."""
    return Path(common.setting("RLK_GATE_ROOT", str(Path.cwd() / "gate-runs"))).expanduser().resolve()


def step_options(conf: dict, gate: Path, matrix_root: Path) -> dict[str, dict]:
    """The options of each `rlk gate STEP` (see rlk_ray.entrypoint for how they are spelled)."""
    model = None if conf["model"] == "tiny" else conf["model"]
    run = {"gate-dir": str(gate), "workload": conf["workload"], "steps": int(conf["steps"]),
           "device": conf["device"], "model-root": model, "prompt-data": conf.get("prompt_data")}
    return {
        "checkout": {"gate-dir": str(gate), "repo": gate_repo(), "commit": conf["commit"],
                     "dest": str(gate / "checkout")},
        "build": {"gate-dir": str(gate), "device": conf["device"],
                  "install": conf["build"] == "install", "no-install": conf["build"] == "verify"},
        "verify-inputs": {"gate-dir": str(gate), "manifest": conf.get("input_manifest"),
                          "model-root": model, "prompt-data": conf.get("prompt_data")},
        "tests": {"gate-dir": str(gate), "select": [inside_checkout(t) for t in conf["tests"]]},
        "strict-run": run,
        "traced-run": run,
        "production-run": {**run, "trace": True},
        "archive": {"gate-dir": str(gate), "matrix-root": str(matrix_root)},
    }


with DAG(
    dag_id="rlk_clean_room_gate",
    dag_display_name="rl-engine clean-room gate",
    description="one pinned commit from a clean checkout: build, inputs, tests, runs, matrix, archive",
    schedule=None,
    start_date=pendulum.datetime(2026, 1, 1, tz="UTC"),
    catchup=False,
    max_active_runs=1,
    params=params(),
    tags=["rl-engine", "gate", "clean-room"],
    doc_md=__doc__,
    default_args=RETRY,
) as dag:

    @task(multiple_outputs=True, **RETRY)
    def prepare(params: dict | None = None, run_id: str | None = None) -> dict:
        """This run's gate folder, every step's options and the matrix DAG run's id and conf.
        Bad params fail here, without retry: the same params give the same answer."""
        from airflow.sdk.exceptions import AirflowFailException

        conf = dict(params or {})
        gate = gate_root() / common.sanitize(run_id)
        matrix_run_id = f"gate__{common.sanitize(run_id)}"
        try:
            common.check_keys(conf, params_of_the_form())
            matrix_root = common.matrix_root(common.matrix_base(), matrix_run_id)
            options = step_options(conf, gate, matrix_root)
            gpus = common.layout_gpus(conf) if conf["device"] == "cuda" else 0
        except Exception as exc:  # noqa: BLE001 - ValueError, or rl_engine's BadInput for a layout
            raise AirflowFailException(f"bad params: {exc}") from None
        log.info("gate folder %s; matrix root %s; repository %s", gate, matrix_root,
                 options["checkout"]["repo"])
        runs = common.job_resources(conf, gpus)
        # On CUDA the build and the tests need a GPU of their own job, whatever the launcher: the
        # build compiles for it and installs into that node's environment.
        tools = {"num_gpus": 1 if gpus else 0, "cluster_needs": {}}
        return {
            **options,
            **{f"{step}_{key}": value for step in GPU_STEPS
               for key, value in (runs if step.endswith("-run") else tools).items()},
            "matrix_run_id": matrix_run_id,
            "matrix_conf": {"cells": list(conf["cells"]), "workload": conf["workload"],
                            "model": conf["model"], "device": conf["device"],
                            "launcher": conf["launcher"], "append_history": False},
            "runtime_env": {"env_vars": {"RLK_LAUNCHER": conf["launcher"], "PYTHONUNBUFFERED": "1"}},
        }

    plan = prepare()
    tasks = []
    for step in GATE_STEPS:
        if step == "matrix":
            tasks.append(TriggerDagRunOperator(
                task_id=step, trigger_dag_id=MATRIX_DAG_ID, trigger_run_id=plan["matrix_run_id"],
                conf=plan["matrix_conf"], wait_for_completion=True, poke_interval=60, deferrable=True,
                # A retry runs the same matrix DAG run again: new attempts under the same root.
                reset_dag_run=True, allowed_states=["success"], failed_states=["failed"],
                execution_timeout=TIMEOUT[step], **RETRY))
            continue
        resources = {}
        if step in GPU_STEPS:
            resources = {"num_gpus": plan[f"{step}_num_gpus"], "cluster_needs": plan[f"{step}_cluster_needs"]}
        tasks.append(RayJobOperator(
            task_id=step, rlk_args=["gate", step], rlk_options=plan[step], **resources,
            runtime_env=plan["runtime_env"], execution_timeout=TIMEOUT[step],
            # The archive records a failed gate too: it runs whatever happened upstream.
            trigger_rule=TriggerRule.ALL_DONE if step == "archive" else TriggerRule.ALL_SUCCESS,
            **RETRY))
    plan >> tasks[0]
    for upstream, downstream in zip(tasks, tasks[1:]):
        upstream >> downstream
