"""Which code a benchmark result measured: the commit of the checkout it ran from, whether tracked
files differed from it (dirty) and which ones, recorded in every result JSON. A copy of the tree
without its own history (a device machine's) names its commit with --commit / --dirty."""

from __future__ import annotations

import argparse
import subprocess
from pathlib import Path


def add_source_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--commit", help="the commit this tree is, where the checkout's own git history is "
                    "not the tree's (a copy of it): recorded in place of git's answer")
    ap.add_argument("--dirty", choices=("0", "1"), help="with --commit: whether tracked files differ from it")


def source_state(where: Path) -> dict:
    """{"commit", "dirty", "changed_files"} of the checkout holding `where` (None where git cannot
    tell)."""
    def git(*args):
        try:
            return subprocess.run(["git", "-C", str(where), *args], capture_output=True, text=True,
                                  timeout=30, check=True).stdout
        except (OSError, subprocess.SubprocessError):
            return None

    commit, status = git("rev-parse", "HEAD"), git("status", "--porcelain", "--untracked-files=no")
    changed = None if status is None else [line[3:] for line in status.splitlines()]
    return dict(commit=None if commit is None else commit.strip(),
                dirty=None if changed is None else bool(changed), changed_files=changed)


def source_of(args: argparse.Namespace, where: Path) -> dict:
    """The source record of a run: --commit / --dirty where given, else git's answer for `where`."""
    if args.commit is not None:
        return dict(commit=args.commit, dirty=None if args.dirty is None else args.dirty == "1",
                    changed_files=None)
    return source_state(where)
