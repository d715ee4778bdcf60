"""The matrix reports as pages of the Airflow API server (a FastAPI app the plugin mounts).

  /            the matrix roots under the matrix base folder that hold a matrix-report.json
  /reports/N   one report: a row per cell, with a link to that cell's task log in the Airflow UI
  /history     the nightly history: a plot of mismatches and duration per cell, and a table

The matrix base folder is ``RLK_MATRIX_ROOT`` (as rl_engine.envs reads it), the folder where the
``rlk_matrix`` DAG makes one root per DAG run, named by the run id sanitised; the history is its
``history`` folder. ``N`` must be one plain folder name directly under the base: anything else
(``..``, a slash, a symlink leading out) is a 404 before the disk is touched beyond that check.

Who may read: the same people as the DAG's runs. A request carries its Airflow JWT as a Bearer
header, as Airflow UI's own session cookie (so the nav entry just works after logging in to
Airflow), or as a ``token`` query parameter for clients that can set neither (a headless browser).
Airflow's access log redacts ``token`` query values; the token is never echoed in a page.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable
from urllib.parse import quote

from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.responses import HTMLResponse

from rl_engine.evidence.layout import MatrixRoot
from rlk_ui import history_plot, render

DAG_ID = "rlk_matrix"
CELL_TASK, CONTROL_TASK = "cell", "control"
REPORT = MatrixRoot(Path(".")).report.name
HISTORY = "history"
TOKEN_COOKIE = "_token"  # Airflow's own session cookie (airflow.api_fastapi.auth.managers)
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,199}")
HEADERS = {
    # The pages are plain HTML with one inline style sheet and inline SVG: nothing else may load.
    "Content-Security-Policy": "default-src 'none'; style-src 'unsafe-inline'; img-src data:; "
                               "frame-ancestors 'self'; base-uri 'none'; form-action 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "same-origin",
    "Cache-Control": "no-store",
}


@dataclass(frozen=True)
class RunRef:
    """The DAG run behind a matrix root and the map index of each mapped cell task."""
    run_id: str
    map_indexes: dict[str, int] = field(default_factory=dict)


def default_matrix_base() -> Path:
    from rl_engine import envs

    return Path(envs.RLK_MATRIX_ROOT).expanduser().resolve()


def sanitize(value: str) -> str:
    from rl_engine.artifacts import ids

    return ids.sanitize(value)


def airflow_run(name: str) -> RunRef | None:
    """Find the ``rlk_matrix`` run whose sanitised id names this matrix root, in the metadata
    database of the API server; ``None`` when there is none (a root made by ``rlk matrix run``)."""
    from sqlalchemy import select

    from airflow.models.dagrun import DagRun
    from airflow.models.taskinstance import TaskInstance
    from airflow.utils.session import create_session

    with create_session() as session:
        run_ids = session.scalars(select(DagRun.run_id).where(DagRun.dag_id == DAG_ID)
                                  .order_by(DagRun.id)).all()
        matches = [r for r in run_ids if sanitize(r) == name]
        if not matches:
            return None
        run_id = matches[-1]  # two run ids that sanitise alike share one root; the newest wins
        rows = session.execute(select(TaskInstance.map_index, TaskInstance.rendered_map_index).where(
            TaskInstance.dag_id == DAG_ID, TaskInstance.run_id == run_id,
            TaskInstance.task_id == CELL_TASK)).all()
    return RunRef(run_id, {label: index for index, label in rows if label and index >= 0})


def log_links(report: dict[str, Any], ref: RunRef, airflow_base: str) -> dict[str, str]:
    """Airflow 3 UI routes: ``/dags/D/runs/R/tasks/T`` and ``.../tasks/T/mapped/N`` (their index
    page is the task log). A mapped cell's index is its rendered label when the database has it,
    else its position: ``prepare`` maps the isolation cells in catalogue order, the report's order."""
    run = f"{airflow_base}/dags/{quote(DAG_ID)}/runs/{quote(ref.run_id, safe='')}/tasks"
    links = {}
    mapped = [c.get("cell") for c in report.get("cells") or [] if c.get("cell") != CONTROL_TASK]
    for cell in report.get("cells") or []:
        name = cell.get("cell")
        if name == CONTROL_TASK:
            links[name] = f"{run}/{CONTROL_TASK}"
        else:
            index = ref.map_indexes.get(name, mapped.index(name))
            links[name] = f"{run}/{CELL_TASK}/mapped/{index}"
    return links


def _token(request: Request) -> str | None:
    auth = request.headers.get("authorization", "")
    if auth.lower().startswith("bearer "):
        return auth[7:].strip() or None
    return request.query_params.get("token") or request.cookies.get(TOKEN_COOKIE) or None


async def require_reader(request: Request) -> None:
    """401 without a token, 403 with an invalid one or for a user who may not read the DAG's runs."""
    token = _token(request)
    if not token:
        raise HTTPException(status_code=401, detail="Not authenticated: log in to Airflow first")
    from airflow.api_fastapi.app import get_auth_manager
    from airflow.api_fastapi.auth.managers.models.resource_details import DagAccessEntity, DagDetails
    from airflow.api_fastapi.core_api.security import resolve_user_from_token

    user = await resolve_user_from_token(token)
    if not get_auth_manager().is_authorized_dag(method="GET", access_entity=DagAccessEntity.RUN,
                                                details=DagDetails(id=DAG_ID), user=user):
        raise HTTPException(status_code=403, detail=f"not allowed to read runs of {DAG_ID}")


def _inside(base: Path, folder: Path) -> bool:
    """Whether ``folder`` is a folder directly under ``base`` once links are followed."""
    try:
        return folder.resolve(strict=True).parent == base and folder.is_dir()
    except OSError:
        return False


def _html(text: str, status: int = 200) -> HTMLResponse:
    return HTMLResponse(text, status_code=status, headers=HEADERS)


def _read(path: Path) -> dict[str, Any]:
    report = json.loads(path.read_text())
    if not isinstance(report, dict):
        raise ValueError("not a JSON object")
    return report


def create_app(*, matrix_base: Callable[[], Path] = default_matrix_base,
               find_run: Callable[[str], RunRef | None] = airflow_run) -> FastAPI:
    """The app; ``matrix_base`` and ``find_run`` are read per request (tests give their own)."""
    app = FastAPI(title="rl-engine matrix reports", docs_url=None, redoc_url=None, openapi_url=None,
                  dependencies=[Depends(require_reader)])

    @app.exception_handler(HTTPException)
    async def _error(request: Request, exc: HTTPException) -> HTMLResponse:
        airflow = _airflow_base(request) or ""
        body = f"<p>{render.e(exc.detail)}</p>"
        if exc.status_code == 401:
            body += f'<p><a href="{render.e(airflow)}/" target="_top">Log in to Airflow</a></p>'
        return _html(render.page(f"{exc.status_code}", body, _prefix(request)), exc.status_code)

    def root_of(name: str) -> Path:
        """The matrix root ``name`` directly under the base, or 404."""
        base = matrix_base().resolve()
        if not _NAME.fullmatch(name) or ".." in name or name == HISTORY:
            raise HTTPException(status_code=404, detail="no such matrix report")
        folder = base / name
        if not _inside(base, folder) or not (folder / REPORT).is_file():
            raise HTTPException(status_code=404, detail="no such matrix report")
        return folder

    @app.get("/", response_class=HTMLResponse)
    def index(request: Request) -> HTMLResponse:
        base = matrix_base().resolve()
        entries = []
        folders = sorted(base.iterdir()) if base.is_dir() else []
        for folder in folders:
            if folder.name == HISTORY or not _NAME.fullmatch(folder.name) or not _inside(base, folder):
                continue
            path = folder / REPORT
            if not path.is_file():
                continue
            entry: dict[str, Any] = {"name": folder.name, "mtime": path.stat().st_mtime}
            try:
                entry["report"] = _read(path)
            except (OSError, ValueError) as exc:
                entry["error"] = f"{type(exc).__name__}: {exc}"
            entries.append(entry)
        entries.sort(key=lambda x: x["mtime"], reverse=True)
        prefix = _prefix(request)
        return _html(render.page("rl-engine parity matrix reports",
                                 render.report_list(entries, prefix, str(base)), prefix))

    @app.get("/reports/{name}", response_class=HTMLResponse)
    def report(name: str, request: Request) -> HTMLResponse:
        path = root_of(name) / REPORT
        try:
            data = _read(path)
        except (OSError, ValueError) as exc:
            raise HTTPException(status_code=500, detail=f"{REPORT} is unreadable: {exc}") from None
        try:
            ref = find_run(name)
        except Exception:  # noqa: BLE001 - no metadata database: the page still shows the report
            ref = None
        links = log_links(data, ref, _airflow_base(request)) if ref else {}
        prefix = _prefix(request)
        return _html(render.page(f"matrix report {name}",
                                 render.report_page(data, links, ref.run_id if ref else None), prefix))

    @app.get("/history", response_class=HTMLResponse)
    def history(request: Request) -> HTMLResponse:
        from rl_engine.matrix import history as hist

        base = matrix_base().resolve()
        prefix = _prefix(request)
        try:
            rows = hist.read(base / HISTORY)
        except Exception as exc:  # noqa: BLE001 - a damaged dataset is shown as such, not as a 500
            body = f"<p>The history under {render.e(base / HISTORY)} is unreadable: {render.e(exc)}</p>"
            return _html(render.page("rl-engine parity matrix: nightly history", body, prefix))
        known = {p.name for p in base.iterdir() if _inside(base, p) and (p / REPORT).is_file()} \
            if base.is_dir() else set()
        body = render.history_page(hist.summarize(rows), history_plot.svg(rows), prefix, known)
        return _html(render.page("rl-engine parity matrix: nightly history", body, prefix))

    return app


def _prefix(request: Request) -> str:
    """Where this app is mounted (``/rlk`` under Airflow), from the server's own routing."""
    return request.scope.get("root_path", "").rstrip("/")


def _airflow_base(request: Request) -> str:
    """The Airflow UI's path prefix: the root path of the app this one is mounted in."""
    return str(request.scope.get("app_root_path", "")).rstrip("/")

