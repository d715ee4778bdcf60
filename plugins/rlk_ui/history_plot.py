"""The nightly history as one inline SVG: mismatches and duration of every cell, matrix by matrix.

Two panels share the x axis (one position per matrix, oldest left). Mismatch counts span zero to
hundreds of thousands, so their axis is log10(1 + n): a clean night sits on the baseline and one
mismatch is already visible. Every point carries a <title> (the browser's tooltip). Every text
is escaped; nothing here runs a script.
"""

from __future__ import annotations

import math
from typing import Any

from rlk_ui.render import e

# Cell order and colours are fixed, so a cell keeps its colour from one night to the next.
CELLS = ("control", "attention-PR", "attention-RP", "attention-PP", "ffn-PR", "ffn-RP", "ffn-PP",
         "logp-PR", "logp-RP", "logp-PP", "baseline")
COLOURS = ("#000000", "#1f77b4", "#6baed6", "#08306b", "#2ca02c", "#74c476", "#00441b",
           "#d62728", "#fc9272", "#67000d", "#9467bd")
WIDTH, PANEL_H, LEFT, RIGHT, TOP, GAP, LEGEND_W = 1100, 190, 70, 20, 24, 56, 130


def _colour(cell: str) -> str:
    return COLOURS[CELLS.index(cell)] if cell in CELLS else "#7f7f7f"


def _marks(highest: float, log: bool) -> list[float]:
    """Axis marks from 0 to a round value at or above ``highest``: decades on the log axis,
    steps of 1, 2 or 5 times a power of ten (at most about five marks) on the linear one."""
    if log:
        return [0.0] + [10.0 ** k for k in range(math.ceil(math.log10(max(highest, 1.0))) + 1)]
    step = 10 ** math.floor(math.log10(highest / 4))
    step *= next(m for m in (1, 2, 5, 10) if highest / (step * m) <= 4)
    return [i * step for i in range(math.ceil(highest / step) + 1)]


def _fmt(value: float) -> str:
    if value >= 1000:
        return f"{value / 1000:g}k"
    return f"{value:g}"


def svg(rows: list[dict[str, Any]]) -> str:
    """rows: the history dataset (rl_engine.matrix.history.read), oldest first."""
    matrices: list[str] = []
    dates: dict[str, str] = {}
    for r in rows:
        # Two matrices may share an id (a folder name); the history's key tells them apart.
        key = r.get("matrix_key") or r["matrix_id"]
        if key not in dates:
            matrices.append(key)
            dates[key] = str(r.get("date") or "")
    if not matrices:
        return '<p class="muted">No history to plot yet.</p>'
    cells = sorted({r["cell"] for r in rows}, key=lambda c: (CELLS.index(c) if c in CELLS else 99, c))
    plot_w = WIDTH - LEFT - RIGHT - LEGEND_W
    x_of = {m: LEFT + (plot_w / 2 if len(matrices) == 1 else plot_w * i / (len(matrices) - 1))
            for i, m in enumerate(matrices)}
    height = TOP + 2 * PANEL_H + GAP + 40
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" '
           f'viewBox="0 0 {WIDTH} {height}" role="img" font-family="sans-serif" font-size="11">'
           "<title>mismatches and duration per cell, per matrix</title>"]
    # (title, column, scale, top of the panel); both axes reach at least 10
    panels = (("mismatches (log scale, 0 at the baseline)", "mismatch_count",
               lambda v: math.log10(1 + v), TOP),
              ("duration (s)", "duration_s", lambda v: v, TOP + PANEL_H + GAP))
    for title, key, scale, y0 in panels:
        values = [float(r[key]) for r in rows if isinstance(r.get(key), (int, float))]
        marks = _marks(max([*values, 10.0]), log=key == "mismatch_count")
        top = scale(marks[-1])
        y_of = lambda v, top=top, y0=y0, scale=scale: y0 + PANEL_H * (1 - scale(v) / top)  # noqa: E731
        out.append(f'<text x="{LEFT}" y="{y0 - 8}" font-weight="bold">{e(title)}</text>')
        out.append(f'<line x1="{LEFT}" y1="{y0 + PANEL_H}" x2="{LEFT + plot_w}" y2="{y0 + PANEL_H}" '
                   'stroke="#888"/>')
        for mark in marks:
            y = y_of(mark)
            out.append(f'<line x1="{LEFT}" y1="{y:.1f}" x2="{LEFT + plot_w}" y2="{y:.1f}" '
                       'stroke="#eee"/>')
            out.append(f'<text x="{LEFT - 6}" y="{y + 4:.1f}" text-anchor="end">{e(_fmt(mark))}</text>')
        for cell in cells:
            points = [(x_of[r.get("matrix_key") or r["matrix_id"]], y_of(float(r[key])), r) for r in rows
                      if r["cell"] == cell and isinstance(r.get(key), (int, float))]
            colour = _colour(cell)
            if len(points) > 1:
                path = " ".join(f"{x:.1f},{y:.1f}" for x, y, _ in points)
                out.append(f'<polyline points="{path}" fill="none" stroke="{colour}" '
                           'stroke-width="1.5" opacity="0.8"/>')
            for x, y, r in points:
                ring = "#b3261e" if not r.get("passed") else colour
                tip = (f"{cell} | {r['matrix_id']} | {r.get('date')} | "
                       f"{key.replace('_', ' ')} {_fmt(float(r[key]))} | "
                       f"{'passed' if r.get('passed') else 'did not pass'}")
                out.append(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="3.5" fill="{colour}" '
                           f'stroke="{ring}" stroke-width="1.5"><title>{e(tip)}</title></circle>')
    # x labels: at most ~12, always the first and the last matrix.
    step = max(1, math.ceil(len(matrices) / 12))
    label_y = TOP + 2 * PANEL_H + GAP + 16
    for i, m in enumerate(matrices):
        if i % step == 0 or i == len(matrices) - 1:
            out.append(f'<text x="{x_of[m]:.1f}" y="{label_y}" text-anchor="middle">'
                       f"{e(dates[m])}<title>{e(m)}</title></text>")
    legend_x = WIDTH - LEGEND_W + 10
    for i, cell in enumerate(cells):
        y = TOP + 14 * i
        out.append(f'<rect x="{legend_x}" y="{y}" width="10" height="10" fill="{_colour(cell)}"/>'
                   f'<text x="{legend_x + 16}" y="{y + 9}">{e(cell)}</text>')
    out.append(f'<text x="{legend_x}" y="{TOP + 14 * len(cells) + 14}" fill="#b3261e">'
               "red ring: did not pass</text>")
    out.append("</svg>")
    return "".join(out)
