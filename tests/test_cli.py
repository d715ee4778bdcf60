"""The `rlk` command's own cost around a verb: what it imports before the verb needs it, and its
exit. Each check runs a fresh Python, since this test session has torch loaded already."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def python(code: str, *args: str, tmp_path: Path) -> str:
    done = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                          timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip().splitlines()[-1]


def test_every_verb_is_listed_without_importing_torch(tmp_path):
    """`rlk --help` and the start of every verb (a Ray job's `rlk matrix run`, say) do not pay
    for torch (about 1.5 s on a 2-core machine); a verb imports it when it needs it."""
    code = """
import sys
from rl_engine import cli
cli._mount_subcommands()  # every verb, as `rlk --help` lists them
print("torch" in sys.modules)
"""
    assert python(code, tmp_path=tmp_path) == "False"


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
