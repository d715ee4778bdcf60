"""HTML of the matrix report pages, rendered on the server: no script, every value escaped.

Every piece of text that comes from a report, a folder name or the history goes through ``e()``;
the few values built here (numbers, yes/no) are escaped too, so that no path skips it.
"""

from __future__ import annotations

import html
import math
from typing import Any, Iterable

CSS = """
body{font:14px/1.4 system-ui,sans-serif;margin:1.2em 1.6em;color:#1a1a1a}
h1{font-size:1.3em;margin:.2em 0 .6em}h2{font-size:1.1em;margin:1.2em 0 .4em}
nav a{margin-right:1.2em}table{border-collapse:collapse;margin:.4em 0}
th,td{border:1px solid #ccc;padding:.25em .6em;text-align:left;vertical-align:top}
th{background:#f2f2f2}td.num{text-align:right;font-variant-numeric:tabular-nums}
.yes{color:#17692b;font-weight:600}.no{color:#b3261e;font-weight:600}
.muted{color:#666}.pending{color:#8a5a00;font-weight:600}.reasons{font-size:.9em;color:#555;max-width:42em}
"""


def e(value: Any) -> str:
    """Any value as HTML text (quotes included, so it is safe inside an attribute too)."""
    return html.escape("" if value is None else str(value), quote=True)


def yes_no(flag: Any) -> str:
    if flag is None:
        return '<span class="muted">-</span>'
    return f'<span class="{"yes" if flag else "no"}">{"yes" if flag else "no"}</span>'


STATES = ("passed", "failed", "pending")


def cell_state(cell: dict[str, Any]) -> str:
    """passed, failed or pending (no finished attempt yet, the matrix still running). Reports
    written before cells carried ``state`` knew no pending: there it follows ``passed``."""
    state = cell.get("state")
    if state in STATES:
        return state
    return "passed" if cell.get("passed") else "failed"


def matrix_state(cells: list[dict[str, Any]], verdict: dict[str, Any]) -> str:
    """A matrix with a failed cell has failed, even while others run; one with pending cells and
    no failed one is pending; else the verdict says."""
    states = [cell_state(c) for c in cells]
    if "failed" in states:
        return "failed"
    if "pending" in states:
        return "pending"
    return "passed" if verdict.get("passed") else "failed"


def state_mark(state: str) -> str:
    """The verdict in a yes/no column: pending is neither."""
    if state == "pending":
        return '<span class="pending">pending</span>'
    return yes_no(state == "passed")


def number(value: Any, fmt: str = "{}") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    try:
        return e(fmt.format(value))
    except (TypeError, ValueError):
        return e(value)


def duration(seconds: Any) -> str:
    if not isinstance(seconds, (int, float)) or math.isnan(seconds):
        return "-"
    minutes, secs = divmod(int(round(seconds)), 60)
    return e(f"{minutes} min {secs:02d} s" if minutes else f"{secs} s")


def page(title: str, body: str, prefix: str) -> str:
    """A whole page; ``prefix`` is where this app is mounted (already trusted, from the server)."""
    return (f'<!doctype html><html lang="en"><head><meta charset="utf-8">'
            f"<title>{e(title)}</title><style>{CSS}</style></head><body>"
            f'<nav><a href="{e(prefix)}/">matrix reports</a>'
            f'<a href="{e(prefix)}/history">nightly history</a></nav>'
            f"<h1>{e(title)}</h1>{body}</body></html>")


def table(headers: Iterable[str], rows: Iterable[Iterable[str]], *, row_ids: Iterable[str] = ()) -> str:
    """Cells of ``rows`` are HTML already (built with the helpers above)."""
    ids = list(row_ids)
    head = "".join(f"<th>{e(h)}</th>" for h in headers)
    body = []
    for n, row in enumerate(rows):
        attr = f' id="{e(ids[n])}"' if n < len(ids) else ""
        body.append(f"<tr{attr}>" + "".join(row) + "</tr>")
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"


def td(html_text: str, cls: str = "") -> str:
    return f'<td class="{cls}">{html_text}</td>' if cls else f"<td>{html_text}</td>"


def report_list(entries: list[dict[str, Any]], prefix: str, base: str) -> str:
    """The index: one row per matrix root that holds a report."""
    if not entries:
        return (f"<p>No matrix report under <code>{e(base)}</code> yet. "
                "Trigger the <code>rlk_matrix</code> DAG, or run <code>rlk matrix run</code>.</p>")
    rows = []
    for entry in entries:
        report = entry.get("report") or {}
        verdict = report.get("verdict") or {}
        cells = report.get("cells") or []
        link = f'<a href="{e(prefix)}/reports/{e(entry["name"])}">{e(entry["name"])}</a>'
        if entry.get("error"):
            rows.append([td(link), td(f'<span class="no">unreadable</span>: {e(entry["error"])}'),
                         td("-"), td("-"), td("-")])
            continue
        states = [cell_state(c) for c in cells]
        pending = states.count("pending")
        counted = f"{states.count('passed')}/{len(cells)}" + (f", {pending} pending" if pending else "")
        failed = [c.get("cell") for c, state in zip(cells, states) if state == "failed"]
        rows.append([td(link), td(state_mark(matrix_state(cells, verdict))),
                     td(e(counted), "num"), td(e(report.get("generated_at"))),
                     td(e(", ".join(str(f) for f in failed)) or "-")])
    return (f'<p class="muted">Matrix roots under <code>{e(base)}</code>, newest first.</p>'
            + table(("matrix", "passed", "cells passed", "generated", "failed cells"), rows))


def report_page(report: dict[str, Any], links: dict[str, str | None], run_id: str | None) -> str:
    """One report: the verdict, one row per cell (its latest attempt), the attribution."""
    v = report.get("verdict") or {}
    cells = report.get("cells") or []
    parts = [
        "<p>"
        f"matrix <code>{e(report.get('matrix_id'))}</code>; passed {state_mark(matrix_state(cells, v))}, "
        f"evidence complete {yes_no(v.get('evidence_complete'))}, "
        f"control bitwise {yes_no(v.get('bitwise'))}; generated {e(report.get('generated_at'))}; "
        f"DAG run {('<code>' + e(run_id) + '</code>') if run_id else '<span class=muted>unknown</span>'}"
        "</p>"]
    rows, ids = [], []
    for cell in cells:
        latest = cell.get("latest") or {}
        state = cell_state(cell)
        name = cell.get("cell")
        plan = " ".join(str(latest.get(f"plan_{m}") or "?") for m in ("attention", "ffn", "logp"))
        link = links.get(name)
        log = f'<a href="{e(link)}" target="_top">task log</a>' if link else '<span class="muted">-</span>'
        reasons = cell.get("reasons") or []
        shown = "; ".join(str(r) for r in reasons[:3]) + (" ..." if len(reasons) > 3 else "")
        ids.append(f"cell-{name}")
        # A pending cell has no verdict and no figures yet: not "no" or 0, just not known.
        done = state != "pending"
        rows.append([
            td(e(name)), td(e(plan)), td(state_mark(state)),
            td(yes_no(cell.get("bitwise") if done else None)),
            td(yes_no(cell.get("evidence_complete") if done else None)),
            td(number(latest.get("mismatch_count") if done else None), "num"),
            td(number(latest.get("max_abs_diff") if done else None, "{:.3g}"), "num"),
            td(duration(latest.get("duration_s")), "num"), td(e(latest.get("attempt_id") or "-")),
            td(str(len(cell.get("attempts") or [])), "num"), td(log), td(e(shown), "reasons")])
    parts.append(table(("cell", "plan (attention ffn logp)", "passed", "bitwise", "evidence",
                        "mismatches", "max |diff|", "duration", "attempt", "older", "log",
                        "reasons"), rows, row_ids=ids))
    a = report.get("attribution") or {}
    if a:
        modules = ", ".join(a.get("attributed_modules") or []) or "no module"
        notes = "".join(f"<li>{e(n)}</li>" for n in a.get("notes") or [])
        parts.append(f"<h2>Attribution</h2><p>{e(modules)} (conclusive {yes_no(a.get('conclusive'))})</p>"
                     + (f"<ul>{notes}</ul>" if notes else ""))
    return "".join(parts)


def history_page(summary: list[dict[str, Any]], svg: str, prefix: str, known: set[str]) -> str:
    """The plot (``svg`` is built by history_plot, which escapes its own text) and one line per
    matrix, newest first; a matrix whose root still holds its report links to it."""
    if not summary:
        return "<p>No nightly history yet: the matrix DAG appends to it after each run.</p>"
    rows = []
    for s in reversed(summary):
        mid = s.get("matrix_id")
        name = f'<a href="{e(prefix)}/reports/{e(mid)}">{e(mid)}</a>' if mid in known else e(mid)
        rows.append([td(e(s.get("date"))), td(name), td(yes_no(s.get("passed"))),
                     td(f"{e(s.get('cells_passed'))}/{e(s.get('cells'))}", "num"),
                     td(number(s.get("control_mismatch_count")), "num"),
                     td(e(", ".join(s.get("failed") or [])) or "-"),
                     td(e(", ".join(s.get("attributed_modules") or [])) or "-")])
    return svg + table(("date", "matrix", "passed", "cells passed", "control mismatches",
                        "failed cells", "attributed"), rows)
