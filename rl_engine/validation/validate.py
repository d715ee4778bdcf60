"""`rlk validate RUN_DIR`: the verdict of a run directory's evidence, from `evidence.judge`."""

from __future__ import annotations

from pathlib import Path

from rl_engine.errors import BadInput
from rl_engine.evidence import judge, layout


def validate(run_dir: Path, *, run_id: str | None = None, require_bitwise: bool = False,
             output: Path | None = None) -> judge.Verdict:
    """Judges the run directory; writes the verdict JSON to output when given."""
    run = layout.RunDir(run_dir)
    if not run.root.is_dir():
        raise BadInput(f"run directory {run.root} does not exist; give the folder `rlk run` wrote "
                       "(RL_KERNEL_ARTIFACT_DIR or runs/<run-id>)")
    if not run.manifest.is_file():
        raise BadInput(f"{run.root} holds no {run.manifest.name}: it is not a run directory")
    verdict = judge.judge(run, expect=judge.Expect(run_id=run_id), require_bitwise=require_bitwise)
    if output is not None:
        verdict.write(output)
    return verdict
