"""Which module breaks parity: the one whose P/P cell reintroduces a mismatch.

In a P/P cell both sides run the module's production twin and everything else on R, so the two
sides compute the same function and any mismatch comes from that twin not being invariant between
the training shapes (packed micro-batches) and the rollout shapes (prefill, then decode batches).
The P/R and R/P cells mix implementations, so their mismatches measure how far the twin is from
rl_engine's kernel; they are reported as magnitudes, not as attribution. The attribution is
conclusive only when the control is bitwise and every P/P cell's evidence is complete.
"""

from __future__ import annotations

from typing import Any

from rl_engine.runtime.plan import MODULES


def _figures(cell: dict[str, Any] | None) -> dict[str, Any] | None:
    if cell is None:
        return None
    row = cell["latest"]
    first = None
    if row.get("first_position") is not None:
        first = {"step": row["first_step"], "sample": row["first_sample"],
                 "position": row["first_position"]}
    # Figures of incomplete evidence, or of a plan a fallback changed, are no measurement of the
    # cell: they are left out, not shown as zero.
    known = cell["evidence_complete"] and not row.get("fallbacks")
    return {"cell": cell["cell"], "attempt_id": row.get("attempt_id"),
            "evidence_complete": known, "numel": row.get("numel") if known else None,
            "mismatch_count": row.get("mismatch_count") if known else None,
            "max_abs_diff": row.get("max_abs_diff") if known else None,
            "first_divergent": first if known else None}


def attribute(cells: dict[str, dict[str, Any]]) -> dict[str, Any]:
    modules: dict[str, Any] = {}
    notes: list[str] = []
    for module in MODULES:
        pp = _figures(cells.get(f"{module}-PP"))
        reintroduces = None
        if pp is not None and pp["evidence_complete"]:
            reintroduces = pp["mismatch_count"] > 0
        elif pp is not None:
            notes.append(f"{module}: the P/P cell's evidence is incomplete or a route fell back")
        modules[module] = {
            "pp_reintroduces_mismatch": reintroduces,
            "pp": pp, "pr": _figures(cells.get(f"{module}-PR")), "rp": _figures(cells.get(f"{module}-RP")),
            "first_divergent": pp["first_divergent"] if pp else None,
        }
    control = cells.get("control")
    if control is None:
        notes.append("no control cell: a mismatch cannot be told from a broken R/R baseline")
    elif not control["evidence_complete"]:
        notes.append("the control's evidence is incomplete")
    elif not control["bitwise"]:
        notes.append("the control (R/R) is not bitwise: mismatches of other cells are not "
                     "attributable to a module")
    conclusive = (control is not None and control["bitwise"]
                  and all(m["pp_reintroduces_mismatch"] is not None for m in modules.values()))
    return {"conclusive": conclusive,
            "attributed_modules": [m for m, v in modules.items() if v["pp_reintroduces_mismatch"]],
            "modules": modules, "notes": notes}
