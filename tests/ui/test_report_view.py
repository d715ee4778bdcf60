"""The matrix report pages (plugins/rlk_ui) on a synthetic matrix root, through FastAPI's TestClient.

The root is written the way `rlk matrix run` leaves one (fake run directories, then the real
analyzer's matrix-report.json and cells.parquet, and the real history writer), so the pages are
checked against the values the analyzer computed, not against values typed into the test.
"""

from __future__ import annotations

import json
import os
import sys
import xml.etree.ElementTree as ET
from datetime import datetime, timedelta, timezone
from html.parser import HTMLParser
from pathlib import Path

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "plugins"))

from fixtures import fake_run  # noqa: E402
from rlk_ui import app as ui  # noqa: E402
from rlk_ui import history_plot  # noqa: E402

from rl_engine.artifacts import files, ids  # noqa: E402
from rl_engine.evidence import records
from rl_engine.evidence.layout import MatrixRoot, RunDir
from rl_engine.matrix import analyze, history, runner, tables  # noqa: E402
from rl_engine.runtime.plan import cell_plan  # noqa: E402
from rl_engine.step.config import StepConfig  # noqa: E402

CONFIG = StepConfig.resolve("ci", tp=2, cp=1, actor_gpus=2, rollout_gpus=2, rollout_gpus_per_engine=2,
                            rollout_batch_size=1, n_samples_per_prompt=2, max_response_len=16,
                            max_tokens_per_gpu=256)
S, L = CONFIG.global_batch_size, CONFIG.max_response_len
RUN_ID = "scheduled__2026-11-30T02:00:00+00:00"
CELLS = ("control", "attention-PP", "logp-PR")
T0 = datetime(2026, 11, 30, 2, 0, tzinfo=timezone.utc)


def add_attempt(root: Path, cell: str, trainer_from: int | None, seconds: int) -> None:
    """A finished attempt whose trainer log-probs differ from the rollout's from a position on."""
    attempt = ids.new_attempt_id(T0)
    folder = root / cell / attempt
    folder.mkdir(parents=True)
    mid = analyze.matrix_id(root)
    case = runner.case_env(mid, cell, attempt, "ci", CONFIG)
    case["STARTED_AT"] = T0.strftime("%Y-%m-%dT%H:%M:%SZ")
    records.write_case_env(RunDir(folder), case)
    rollout = fake_run.logprobs(S, L, seed=len(cell))
    trainer = rollout if trainer_from is None else fake_run.perturbed(rollout, trainer_from)
    fake_run.write_run(folder, run_id=analyze.run_id_of(mid, cell, attempt), plan=cell_plan(cell),
                       rollout=rollout, trainer=trainer, require_bitwise=cell == "control")
    end = (T0 + timedelta(seconds=seconds)).timestamp()
    os.utime(folder / "exit-code", (end, end))


def build(base: Path, run_id: str = RUN_ID, day: int = 30) -> dict:
    root = base / ids.sanitize(run_id)
    created = T0.replace(day=day).strftime("%Y-%m-%dT%H:%M:%SZ")
    files.write_json(MatrixRoot(root).matrix_file, {"matrix_id": root.name, "created_at": created})
    for cell, start, seconds in zip(CELLS, (None, 3, 10), (95, 61, 7)):
        add_attempt(root, cell, start, seconds)
    report = analyze.write_report(root, cells=list(CELLS))
    history.append(report, base / "history")
    return report


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    base = tmp_path_factory.mktemp("matrix-runs")
    build(base)
    build(base, "manual__2026-11-29T08:00:00+00:00", day=29)
    (base / "not-a-report").mkdir()
    outside = tmp_path_factory.mktemp("outside")
    (outside / ui.REPORT).write_text(json.dumps({"matrix_id": "SECRET-OUTSIDE"}))
    (base / "escape").symlink_to(outside)
    return base


def client(base: Path, ref: ui.RunRef | None = None, *, authed: bool = True) -> TestClient:
    app = ui.create_app(matrix_base=lambda: base, find_run=lambda name: ref)
    if authed:
        app.dependency_overrides[ui.require_reader] = lambda: None
    return TestClient(app)


class Rows(HTMLParser):
    """Table rows by id: {row id: [(cell text, first link href), ...]}."""

    def __init__(self):
        super().__init__()
        self.rows: dict[str, list[tuple[str, str | None]]] = {}
        self._row: str | None = None
        self._cell: list[str] | None = None
        self._href: str | None = None

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "tr" and attrs.get("id"):
            self._row = attrs["id"]
            self.rows[self._row] = []
        elif tag == "td" and self._row:
            self._cell, self._href = [], None
        elif tag == "a" and self._cell is not None and self._href is None:
            self._href = attrs.get("href")

    def handle_endtag(self, tag):
        if tag == "td" and self._cell is not None:
            self.rows[self._row].append(("".join(self._cell).strip(), self._href))
            self._cell = None
        elif tag == "tr":
            self._row = None

    def handle_data(self, data):
        if self._cell is not None:
            self._cell.append(data)


def table_rows(html: str) -> dict[str, list[tuple[str, str | None]]]:
    parser = Rows()
    parser.feed(html)
    return parser.rows


def test_index_lists_each_report_newest_first(base):
    page = client(base).get("/")
    assert page.status_code == 200
    first, second = ids.sanitize(RUN_ID), ids.sanitize("manual__2026-11-29T08:00:00+00:00")
    assert f'href="/reports/{first}"' in page.text and f'href="/reports/{second}"' in page.text
    assert page.text.index(second) < page.text.index(first)  # built last, so newest
    assert "not-a-report" not in page.text and 'href="/reports/escape"' not in page.text
    assert page.headers["content-security-policy"].startswith("default-src 'none'")


def test_report_table_shows_each_cells_values_and_its_task_log(base):
    name = ids.sanitize(RUN_ID)
    ref = ui.RunRef(RUN_ID, {"attention-PP": 0, "logp-PR": 1})
    page = client(base, ref).get(f"/reports/{name}")
    assert page.status_code == 200
    rows = table_rows(page.text)
    parquet = {r["cell"]: r for r in tables.read(MatrixRoot.tables_beside(MatrixRoot(base / name).report)[0]) if r["latest"]}
    assert set(parquet) == set(CELLS)
    run = "/dags/rlk_matrix/runs/scheduled__2026-11-30T02%3A00%3A00%2B00%3A00/tasks"
    expected = {"control": (95, "1 min 35 s", f"{run}/control"),
                "attention-PP": (61, "1 min 01 s", f"{run}/cell/mapped/0"),
                "logp-PR": (7, "7 s", f"{run}/cell/mapped/1")}
    for cell, (seconds, shown, link) in expected.items():
        row = parquet[cell]
        values = [text for text, _ in rows[f"cell-{cell}"]]
        assert values[0] == cell
        assert values[1] == f"{row['plan_attention']} {row['plan_ffn']} {row['plan_logp']}"
        assert values[2:5] == ["yes" if row[k] else "no" for k in ("passed", "bitwise", "evidence_complete")]
        assert values[5] == str(row["mismatch_count"])
        assert values[6] == f"{row['max_abs_diff']:.3g}"
        assert row["duration_s"] == seconds and values[7] == shown
        assert values[8] == row["attempt_id"]
        assert rows[f"cell-{cell}"][10] == ("task log", link)
    # the control is bitwise; the broken cells differ from positions 3 and 10 of 16, both samples
    assert [parquet[c]["mismatch_count"] for c in CELLS] == [0, 2 * 13, 2 * 6]
    assert [r[0] for r in rows["cell-attention-PP"][2:4]] == ["yes", "no"]  # passes: not required


def test_without_labels_a_mapped_cell_links_by_its_position(base):
    page = client(base, ui.RunRef("nightly-7")).get(f"/reports/{ids.sanitize(RUN_ID)}")
    rows = table_rows(page.text)
    assert rows["cell-logp-PR"][10][1] == "/dags/rlk_matrix/runs/nightly-7/tasks/cell/mapped/1"
    no_run = client(base, None).get(f"/reports/{ids.sanitize(RUN_ID)}")
    assert table_rows(no_run.text)["cell-control"][10] == ("-", None)


def test_links_follow_the_mount_point_and_the_airflow_root_path(base):
    parent = FastAPI()
    sub = ui.create_app(matrix_base=lambda: base, find_run=lambda name: ui.RunRef("r1"))
    sub.dependency_overrides[ui.require_reader] = lambda: None
    parent.mount("/rlk", sub)
    name = ids.sanitize(RUN_ID)
    for root, airflow in (("", ""), ("/airflow", "/airflow")):
        page = TestClient(parent, root_path=root).get(f"{root}/rlk/reports/{name}")
        assert page.status_code == 200, page.text
        assert f'href="{airflow}/rlk/history"' in page.text
        link = table_rows(page.text)["cell-control"][10][1]
        assert link == f"{airflow}/dags/rlk_matrix/runs/r1/tasks/control"
    index = TestClient(parent).get("/rlk/")
    assert f'href="/rlk/reports/{name}"' in index.text


# Dot segments are sent percent-encoded: an HTTP client (a browser too) resolves literal ones itself.
@pytest.mark.parametrize("name", ["%2e%2e", "%2e", "...", ".hidden", "a..b", "history", "no-such-run",
                                  "not-a-report", "escape", "%2E%2E", "..%2F..%2Fetc%2Fpasswd",
                                  "%2Fetc%2Fpasswd", "x" * 300, "a%00b"])
def test_bad_names_are_404(base, name):
    page = client(base).get(f"/reports/{name}")
    assert page.status_code == 404
    assert "SECRET-OUTSIDE" not in page.text


def test_values_are_html_escaped(base, tmp_path):
    name = "hostile"
    report = json.loads((base / ids.sanitize(RUN_ID) / ui.REPORT).read_text())
    report["matrix_id"] = "<script>alert('m')</script>"
    report["cells"][1]["reasons"] = ['<img src=x onerror="alert(1)">', "a & b"]
    report["cells"][1]["latest"]["attempt_id"] = '"><b>bold</b>'
    files.write_text(tmp_path / name / ui.REPORT, json.dumps(report))
    page = client(tmp_path, ui.RunRef('run"<x>')).get(f"/reports/{name}")
    assert page.status_code == 200
    for raw in ("<script>", "<img", "<b>bold", '"><b>', 'run"<x>'):
        assert raw not in page.text
    assert "&lt;script&gt;alert(&#x27;m&#x27;)&lt;/script&gt;" in page.text
    assert "&lt;img src=x onerror=&quot;alert(1)&quot;&gt;; a &amp; b" in page.text
    assert "run%22%3Cx%3E" in page.text  # the run id inside the link is URL-quoted
    assert "<script" not in client(tmp_path).get("/").text


def test_history_plots_every_cell_of_every_matrix(base):
    page = client(base).get("/history")
    assert page.status_code == 200
    start, end = page.text.index("<svg"), page.text.index("</svg>") + len("</svg>")
    svg = ET.fromstring(page.text[start:end])  # well-formed XML
    ns = "{http://www.w3.org/2000/svg}"
    points = [c.find(f"{ns}title").text for c in svg.iter(f"{ns}circle")]
    assert len(points) == 2 * len(CELLS) * 2  # two matrices, three cells, two panels
    assert len(list(svg.iter(f"{ns}polyline"))) == len(CELLS) * 2
    assert any(p.startswith("attention-PP | ") and "mismatch count 26" in p for p in points)
    assert any(p.startswith("control | ") and "duration s 95" in p for p in points)
    rows = page.text[end:]
    assert rows.index("2026-11-30") < rows.index("2026-11-29")  # newest first
    assert f'href="/reports/{ids.sanitize(RUN_ID)}"' in rows


def test_history_plot_escapes_its_text_and_handles_one_matrix():
    rows = [{"matrix_id": "<m>&", "date": "2026-11-30", "cell": "<c>", "mismatch_count": 0,
             "duration_s": None, "passed": True}]
    svg = history_plot.svg(rows)
    ET.fromstring(svg)
    assert "<m>" not in svg and "<c>" not in svg and "&lt;c&gt;" in svg
    assert svg.count("<circle") == 1  # no duration: one point only
    assert "No history" in history_plot.svg([])


def test_requests_without_credentials_are_refused(base):
    page = client(base, authed=False).get(f"/reports/{ids.sanitize(RUN_ID)}")
    assert page.status_code == 401
    assert "cell-control" not in page.text and "Log in to Airflow" in page.text
    assert client(base, authed=False).get("/history").status_code == 401


def test_airflow_loads_exactly_one_plugin_with_a_valid_app_and_view():
    from airflow._shared.plugins_manager.plugins_manager import _load_plugins_from_plugin_directory
    from airflow.api_fastapi.app import RESERVED_URL_PREFIXES
    from airflow.api_fastapi.core_api.datamodels.plugins import ExternalViewResponse

    plugins, errors = _load_plugins_from_plugin_directory(str(ROOT / "plugins"))
    assert not errors
    ours = [p for p in plugins if p.name == "rlk_ui"]
    assert len(ours) == 1
    (app,) = ours[0].fastapi_apps
    assert app["url_prefix"] == "/rlk" and not app["url_prefix"].startswith(tuple(RESERVED_URL_PREFIXES))
    (view,) = ours[0].external_views
    assert ExternalViewResponse(**view).href == "rlk/"


def _running(base: Path, tmp_path: Path, name: str = "running") -> Path:
    """The report of a matrix still running: the analyzer marks cells with no finished attempt
    pending (here the last one), their figures unknown."""
    report = json.loads((base / ids.sanitize(RUN_ID) / ui.REPORT).read_text())
    for cell in report["cells"]:
        cell["state"] = "passed" if cell["passed"] else "failed"
    pending = report["cells"][-1]
    pending.update(state="pending", passed=False, evidence_complete=False, bitwise=False)
    pending["latest"].update(attempt_id=None, mismatch_count=0, max_abs_diff=0.0, duration_s=None)
    report["verdict"].update(passed=False, failed_cells=[pending["cell"]])
    files.write_text(tmp_path / name / ui.REPORT, json.dumps(report))
    return tmp_path


def test_a_running_matrix_shows_its_pending_cells_as_pending_not_failed(base, tmp_path):
    running = _running(base, tmp_path)
    page = client(running).get("/reports/running")
    rows = table_rows(page.text)
    assert [text for text, _ in rows["cell-logp-PR"][2:7]] == ["pending", "-", "-", "-", "-"]
    assert [text for text, _ in rows["cell-control"][2:5]] == ["yes", "yes", "yes"]
    assert 'passed <span class="pending">pending</span>' in page.text
    index = client(running).get("/").text
    cells = [c for c in index.split("<tr>") if "/reports/running" in c][0]
    assert "pending" in cells and "2/3, 1 pending" in cells and ">no<" not in cells
    assert "logp-PR" not in cells  # not listed among the failed cells


def test_a_failed_cell_fails_the_matrix_while_others_are_pending(base, tmp_path):
    running = _running(base, tmp_path)
    report = json.loads((running / "running" / ui.REPORT).read_text())
    report["cells"][1].update(state="failed", passed=False)
    files.write_text(running / "running" / ui.REPORT, json.dumps(report))
    index = client(running).get("/").text
    row = [c for c in index.split("<tr>") if "/reports/running" in c][0]
    assert ">no<" in row and "1/3, 1 pending" in row and "attention-PP" in row


def test_an_older_report_without_state_reads_its_verdict_from_passed(base):
    report = json.loads((base / ids.sanitize(RUN_ID) / ui.REPORT).read_text())
    for cell in report["cells"]:
        cell.pop("state", None)
    report["cells"][1]["passed"] = False
    folder = base.parent / "older-report"
    files.write_text(folder / "older" / ui.REPORT, json.dumps(report))
    rows = table_rows(client(folder).get("/reports/older").text)
    assert [rows[f"cell-{c}"][2][0] for c in CELLS] == ["yes", "no", "yes"]


def test_two_matrix_roots_of_one_folder_name_stay_two_matrices_in_the_history(tmp_path):
    # /a/nightly and /b/nightly: one name, two matrices; appending one again replaces only it.
    history_root = tmp_path / "history"
    for parent in ("a", "b"):
        report = build(tmp_path / parent)
        history.append(report, history_root)
    history.append(report, history_root)
    rows = history.read(history_root)
    summary = history.summarize(rows)
    assert len(summary) == 2 and len(rows) == 2 * len(CELLS)
    assert len({s["matrix_key"] for s in summary}) == 2
    assert {s["matrix_id"] for s in summary} == {ids.sanitize(RUN_ID)}
    svg = history_plot.svg(rows)
    assert svg.count("<polyline") == len(CELLS) * 2 and svg.count("<circle") == 2 * len(CELLS) * 2
