"""benchmarks/provenance.py names the code a GPU result measured: the checkout's commit, whether
tracked files differ from it and which; --commit / --dirty stand in for a copy without history;
outside a checkout it says it cannot tell instead of guessing."""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

from fixtures.git_repo import git

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("provenance", ROOT / "benchmarks" / "provenance.py")
provenance = importlib.util.module_from_spec(spec)
spec.loader.exec_module(provenance)


def parse(*argv: str) -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    provenance.add_source_args(ap)
    return ap.parse_args(list(argv))


def test_a_checkout_is_named_by_its_commit_and_its_changed_files(tmp_path):
    git(tmp_path, "init", "-q")
    (tmp_path / "kernel.cu").write_text("a\n")
    (tmp_path / "bench.py").write_text("b\n")
    git(tmp_path, "add", ".")
    git(tmp_path, "commit", "-qm", "one")
    head = git(tmp_path, "rev-parse", "HEAD")
    assert provenance.source_state(tmp_path) == dict(commit=head, dirty=False, changed_files=[])
    (tmp_path / "kernel.cu").write_text("changed\n")
    (tmp_path / "untracked.txt").write_text("not part of the code\n")
    assert provenance.source_of(parse(), tmp_path) == dict(commit=head, dirty=True,
                                                           changed_files=["kernel.cu"])


def test_a_copy_without_history_is_named_by_the_flags(tmp_path):
    assert provenance.source_of(parse("--commit", "abc123", "--dirty", "0"), tmp_path) == dict(
        commit="abc123", dirty=False, changed_files=None)
    assert provenance.source_of(parse("--commit", "abc123"), tmp_path)["dirty"] is None


def test_outside_a_checkout_nothing_is_guessed(tmp_path):
    assert provenance.source_state(tmp_path / "missing") == dict(commit=None, dirty=None,
                                                                 changed_files=None)
