"""The run directory and the matrix root: the one module that knows their file names.

  <run>/run.log  exit-code  manifest.json  steps.json  bitwise-validation.json
  <run>/matrix-case.env  console.log          (written by the matrix runner before the run)
  <run>/readbacks/<engine>-<side>-rank<r>.json
  <run>/train-data/<rollout-id>.rank<r>.pt
  <run>/weights/step-<n>.json
  <run>/trace/
  <matrix-root>/matrix.json  matrix-report.json  cells.parquet  tokens.parquet
  <matrix-root>/<cell>/<attempt-id>/          a run directory
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from rl_engine.artifacts import files
from rl_engine.errors import BadInput

ENGINES: tuple[str, ...] = ("builtin", "megatron", "vllm")

CASE_ENV = "matrix-case.env"
CONSOLE_LOG = "console.log"
# Files the matrix runner writes into an attempt folder before `rlk run` starts in it, so that a
# run killed at once still says what it was; a folder holding only these has never held a run.
MATRIX_FILES: tuple[str, ...] = (CASE_ENV, CONSOLE_LOG)

READBACK_NAME = re.compile(r"(?P<engine>[a-z]+)-(?P<side>training|rollout)-rank(?P<rank>\d+)\.json")
TRAIN_DATA_NAME = re.compile(r"(?P<rollout_id>rollout-(?P<step>\d{4,}))\.rank(?P<rank>\d+)\.pt")
ATTEMPT_ID = re.compile(r"\d{8}T\d{6}Z-[0-9a-f]{6}")


def rollout_id(step: int) -> str:
    return f"rollout-{step:04d}"


def readback_name(engine: str, side: str, rank: int) -> str:
    if engine not in ENGINES:
        raise ValueError(f"engine {engine!r} is not one of {', '.join(ENGINES)}")
    return f"{engine}-{side}-rank{rank}.json"


@dataclass(frozen=True, slots=True)
class RunDir:
    root: Path

    def __post_init__(self) -> None:
        object.__setattr__(self, "root", Path(self.root))

    @property
    def manifest(self) -> Path:
        return self.root / "manifest.json"

    @property
    def readbacks(self) -> Path:
        return self.root / "readbacks"

    @property
    def train_data(self) -> Path:
        return self.root / "train-data"

    @property
    def validation(self) -> Path:
        """The verdict of the run's evidence (`evidence.judge`), as JSON."""
        return self.root / "bitwise-validation.json"

    @property
    def log(self) -> Path:
        return self.root / "run.log"

    @property
    def exit_code(self) -> Path:
        return self.root / "exit-code"

    @property
    def trace(self) -> Path:
        return self.root / "trace"

    @property
    def weights(self) -> Path:
        return self.root / "weights"

    @property
    def steps(self) -> Path:
        return self.root / "steps.json"

    @property
    def case_env(self) -> Path:
        return self.root / CASE_ENV

    @property
    def console_log(self) -> Path:
        return self.root / CONSOLE_LOG

    def readback_file(self, engine: str, side: str, rank: int) -> Path:
        return self.readbacks / readback_name(engine, side, rank)

    def train_data_file(self, rollout: str, rank: int) -> Path:
        return self.train_data / f"{rollout}.rank{rank}.pt"

    def weights_file(self, step: int) -> Path:
        return self.weights / f"step-{step:04d}.json"

    def trace_files(self, side: str) -> list[Path]:
        """The trace files of one side's workers (`<side>-rank<r>-<pid>.json`)."""
        return sorted(p for p in self.trace.glob(f"{side}-*") if p.is_file())

    def write_exit_code(self, code: int) -> None:
        files.write_text(self.exit_code, f"{code}\n")


def create(root: Path, *, allow: tuple[str, ...] = MATRIX_FILES) -> RunDir:
    """Creates an empty run directory; a directory that already holds anything but the files in
    `allow` is refused."""
    root = Path(root)
    if root.exists() and (not root.is_dir() or any(p.name not in allow for p in root.iterdir())):
        raise BadInput(f"artifact directory {root} already holds a run; run directories are never "
                       "reused: give a new RL_KERNEL_ARTIFACT_DIR or RL_KERNEL_RUN_ID")
    run = RunDir(root)
    for sub in (run.readbacks, run.train_data):
        sub.mkdir(parents=True, exist_ok=True)
    return run


@dataclass(frozen=True, slots=True)
class MatrixRoot:
    root: Path

    def __post_init__(self) -> None:
        object.__setattr__(self, "root", Path(self.root))

    @property
    def matrix_file(self) -> Path:
        """The matrix id and when the root was first used."""
        return self.root / "matrix.json"

    @property
    def report(self) -> Path:
        return self.root / "matrix-report.json"

    @staticmethod
    def tables_beside(report: Path) -> tuple[Path, Path]:
        """(cells.parquet, tokens.parquet) in the folder of a report."""
        return Path(report).parent / "cells.parquet", Path(report).parent / "tokens.parquet"

    def cell(self, cell: str) -> Path:
        return self.root / cell

    def attempt(self, cell: str, attempt_id: str) -> RunDir:
        return RunDir(self.root / cell / attempt_id)

    def attempts(self, cell: str) -> list[Path]:
        """The cell's attempt folders, oldest first (attempt ids sort by time)."""
        folder = self.cell(cell)
        if not folder.is_dir():
            return []
        return sorted(p for p in folder.iterdir() if p.is_dir() and ATTEMPT_ID.fullmatch(p.name))


def report_path(path: Path) -> Path:
    """A matrix root or a report file named directly -> the report file."""
    path = Path(path)
    return MatrixRoot(path).report if path.is_dir() else path
