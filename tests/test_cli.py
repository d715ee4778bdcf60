"""The `rlk` command's own cost around a verb: what it imports before the verb needs it, and its
exit. Each check runs a fresh Python, since this test session has torch loaded already."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

FAKE = Path(__file__).resolve().parent / "fixtures" / "fake_run.py"


def python(code: str, *args: str, tmp_path: Path) -> str:
    done = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                          timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip().splitlines()[-1]


def test_every_verb_is_listed_and_a_matrix_cell_starts_before_torch_is_imported(tmp_path):
    """`rlk matrix run --case X` (a DAG job) spends nothing on torch before its cell starts: the
    cell's own `rlk run` imports it, and the runner only for judging the cell afterwards (about
    1.5 s each on a 2-core machine)."""
    code = """
import json, sys
from pathlib import Path
from rl_engine import cli
cli._mount_subcommands()  # every verb, as `rlk --help` lists them
listed = "torch" in sys.modules
from rl_engine.matrix import runner
runner.RLK_COMMAND = (sys.executable, sys.argv[1])
seen = {}
m = runner.MatrixRun(root=Path(sys.argv[2]), cells=["ffn-PR"], workload="ci",
                     on_start=lambda cell, folder, proc: seen.setdefault(cell, "torch" in sys.modules))
code, report = runner.run(m)
print(json.dumps({"listed": listed, "at_cell_start": seen["ffn-PR"], "code": code}))
"""
    out = json.loads(python(code, str(FAKE), str(tmp_path / "m"), tmp_path=tmp_path))
    assert out == {"listed": False, "at_cell_start": False, "code": 0}


def test_the_rlk_command_freezes_the_collector_before_it_exits(tmp_path):
    """A process that imported torch spends about 0.5 s of its exit collecting torch's objects;
    the `rlk` command freezes them first (the exit frees the memory anyway). main() called with
    arguments, as a caller in the same process does, leaves the collector alone."""
    code = """
import gc, sys
from rl_engine.cli import main
assert main(["matrix", "--help"]) == 0 and gc.get_freeze_count() == 0
sys.argv = ["rlk", "matrix", "--help"]
assert main() == 0
print(gc.get_freeze_count() > 0)
"""
    assert python(code, tmp_path=tmp_path) == "True"
