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


def test_the_rlk_command_finishes_threads_handlers_and_output_then_skips_the_teardown(tmp_path):
    """A process that imported torch spends about 0.15 s tearing its modules down (and 0.5 s more
    collecting their objects) only to free memory its exit frees anyway. The `rlk` command ends
    without that teardown, after what an exit must still do: join its threads, run its exit
    handlers (the Ray launcher's disconnect among them), flush its output. main() called with arguments, as a
    caller in the same process does, returns."""
    code = """
import atexit, sys, threading, time
from rl_engine.cli import main

class Teardown:
    def __del__(self):
        print("torn down", flush=True)

kept = Teardown()
assert main(["matrix", "--help"]) == 0
print("returned")
atexit.register(print, "exit handler")
threading.Thread(target=lambda: (time.sleep(0.3), print("thread finished"))).start()
print("buffered")  # a pipe: block-buffered, not yet written
sys.argv = ["rlk", "matrix", "run", "--no-such-flag"]
main()
print("after main")
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, cwd=tmp_path)
    assert done.returncode == 2, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert "returned" in lines and lines[-3:] == ["buffered", "thread finished", "exit handler"]
    assert "torn down" not in done.stdout and "after main" not in done.stdout
    assert done.stderr.rstrip().endswith("[rlk] exit-code 2")

