"""Wall time of `rlk matrix run` on the embedded model, and the share spent outside the steps.

Runs the whole matrix (control, nine cells, baseline) in a new matrix root, then reads each cell's
steps.json (the rollout and training phases of every step, timed by the runner itself, each
including the start of its worker processes). Everything else is "outside the steps": each cell's
`rlk run` start-up, input loading and hashing, the manifest, validation, cleanup between cells and
the analysis. Writes benchmarks/results/matrix_time.json.

    python benchmarks/matrix_time.py [--workload ci|default]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rl_engine.artifacts import files

RESULTS = Path(__file__).parent / "results" / "matrix_time.json"


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workload", default="default", choices=("ci", "default"))
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="rlk-matrix-bench-")) / "matrix"
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "rl_engine.cli", "matrix", "run", "--baseline",
                           "--workload", args.workload, "--matrix-root", str(root), "--no-history"],
                          capture_output=True, text=True)
    wall = time.monotonic() - t0
    if proc.returncode not in (0, 1):
        print(proc.stderr[-3000:], file=sys.stderr)
        return proc.returncode
    cells = {}
    for steps in sorted(root.glob("*/*/steps.json")):
        data = json.loads(steps.read_text())
        cells[steps.parent.parent.name] = round(sum(
            s["seconds"]["rollout"] + s["seconds"]["training"] for s in data["steps"]), 3)
    inside = sum(cells.values())
    result = {
        "benchmark": "matrix_time", "workload": args.workload, "cells": len(cells),
        "matrix_exit_code": proc.returncode, "wall_s": round(wall, 3),
        "inside_steps_s": round(inside, 3), "outside_steps_s": round(wall - inside, 3),
        "outside_share": round((wall - inside) / wall, 4), "per_cell_step_s": cells,
        "machine": {"cpu_count": os.cpu_count(), "load_average": os.getloadavg(),
                    "python": platform.python_version()},
    }
    files.write_json(RESULTS, result)
    print(f"matrix wall {wall:.1f} s over {len(cells)} cells; steps {inside:.1f} s; outside the "
          f"steps {wall - inside:.1f} s ({100 * (wall - inside) / wall:.1f}%)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
