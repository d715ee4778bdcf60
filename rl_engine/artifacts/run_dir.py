"""The run directory: one per run or cell attempt, never reused.

  run.log  exit-code  matrix-case.env  manifest.json
  readbacks/{<engine>-<side>-<pid>}.json
  train-data/<rollout-id>.rank<rank>.pt
  steps.json  weights/step-<n>.json
  bitwise-validation.json
  trace/
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from rl_engine.artifacts import files
from rl_engine.errors import BadInput


@dataclass(frozen=True, slots=True)
class RunDir:
    root: Path

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

    def train_data_file(self, rollout_id: str, rank: int) -> Path:
        return self.train_data / f"{rollout_id}.rank{rank}.pt"

    def write_exit_code(self, code: int) -> None:
        files.write_text(self.exit_code, f"{code}\n")


# Files the matrix runner writes into an attempt folder before `rlk run` starts in it, so that a
# run killed at once still says what it was; a folder holding only these has never held a run.
MATRIX_FILES: tuple[str, ...] = ("matrix-case.env", "console.log")


def create(root: Path, *, allow: tuple[str, ...] = MATRIX_FILES) -> RunDir:
    """Creates an empty run directory; a directory that already holds anything but the files in
    `allow` is refused."""
    root = Path(root)
    if root.exists() and (not root.is_dir() or any(p.name not in allow for p in root.iterdir())):
        raise BadInput(f"artifact directory {root} already holds a run; run directories are never "
                       "reused: give a new RL_KERNEL_ARTIFACT_DIR or RL_KERNEL_RUN_ID")
    for sub in ("readbacks", "train-data"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    return RunDir(root)
