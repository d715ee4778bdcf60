"""Files the output of GPU evidence commands (benchmarks/h200_e2e.sh's $OUT folders) as one folder of
benchmarks/results/, named by the commit they measured, with the provenance.json that says which
code each file measured and how that is known:

    python benchmarks/collect_evidence.py --card h100 small=OUT_SMALL medium=OUT_MEDIUM \\
        [--file det_gemm_plans.json ...] [--gpus gpus.csv] [--command "what ran"]

LABEL=DIR names one command's $OUT: each run it kept (a folder holding manifest.json) lands as
RUN-LABEL/ (its manifest, verdict, steps and readbacks), that run's trace check RUN-trace-gate.json
as RUN-LABEL-trace-gate.json; the results that record their source (hopper_ops.json,
hopper_attention.json...) and cuda_tests.log keep their names; the step tables are joined into
steps.tsv. Every recorded commit must be one and the same, clean: a result of another commit, or of
a tree with uncommitted changes, is refused (exit 2) and nothing is written. The folder
(DEST/CARD/COMMIT7) must not exist yet, and appears whole or not at all. Needs no GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUN_FILES = ("manifest.json", "bitwise-validation.json", "steps.json")


class EvidenceError(Exception):
    """Evidence that cannot be filed as it is; the message names the file and the fix."""


def _json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError is a ValueError
        raise EvidenceError(f"{path} is not JSON ({e}); run the step that writes it again")
    if not isinstance(data, dict):
        raise EvidenceError(f"{path} holds {type(data).__name__}, not a result object")
    return data


def _result_or_none(path: Path) -> dict | None:
    """A top-level JSON of a command's folder, or None where it is not a result object."""
    try:
        return _json(path)
    except EvidenceError:
        return None


def recorded(data: dict) -> tuple[str, bool | None] | None:
    """(commit, dirty) a result records: a benchmark's `source`, a run's source_commit."""
    if isinstance(data.get("source"), dict) and data["source"].get("commit"):
        return data["source"]["commit"], data["source"].get("dirty")
    if data.get("source_commit"):
        return data["source_commit"], data.get("source_dirty")
    return None


class Filing:
    """The files of one evidence folder: where each comes from, and what says which commit it is."""

    def __init__(self):
        self.copies: dict[str, Path] = {}  # name in the folder -> source file
        self.provenance: dict[str, dict] = {}
        self.commit: str | None = None
        self.device: str | None = None
        self.left_out: list[Path] = []  # files of the commands' folders that are not filed

    def check(self, path: Path, data: dict) -> str:
        got = recorded(data)
        if got is None:
            raise EvidenceError(f"{path} records no commit (`source` or source_commit)")
        commit, dirty = got
        if dirty is not False:
            raise EvidenceError(f"{path} measured a tree with uncommitted changes ({commit}, dirty "
                                f"{dirty}); commit them and run it again")
        if self.commit is not None and commit != self.commit:
            raise EvidenceError(f"{path} measured {commit}, the other files {self.commit}: file each "
                                "commit's results in a folder of their own")
        self.commit = commit
        return commit

    def add(self, name: str, source: Path, how_known: str, **extra) -> None:
        if name in self.copies:
            raise EvidenceError(f"{name} comes from both {self.copies[name]} and {source}; give "
                                "each command's results once")
        self.copies[name] = source
        self.provenance[name] = dict(how_known=how_known, **extra)

    def add_result(self, name: str, path: Path, data: dict | None = None) -> None:
        data = _json(path) if data is None else data
        self.check(path, data)
        device = data.get("device")
        if device and self.device and device != self.device:
            raise EvidenceError(f"{path} ran on {device}, the other files on {self.device}: file each "
                                "card's results in a folder of their own")
        self.device = self.device or device
        self.add(name, path, "records it itself")

    def add_run(self, label: str, run: Path, out: Path) -> None:
        name = f"{run.name}-{label}"
        manifest = _json(run / "manifest.json")
        self.check(run / "manifest.json", manifest)
        run_id = manifest.get("run_id")
        if not run_id:
            raise EvidenceError(f"{run / 'manifest.json'} names no run_id: it is not a manifest `rlk run` "
                                "wrote; keep the run folder as h200_e2e.sh does")
        self.add(f"{name}/manifest.json", run / "manifest.json", "records it (source_commit / "
                 "source_dirty)", run_id=run_id)
        for file in RUN_FILES[1:]:
            path = run / file
            if path.exists():
                if _json(path).get("run_id") != run_id:
                    raise EvidenceError(f"{path} is not of run {run_id}, whose manifest is beside it")
                self.add(f"{name}/{file}", path, f"written by run {run_id}", run_id=run_id)
        for path in sorted((run / "readbacks").glob("*.json")):
            data = _json(path)
            self.check(path, data)
            if data.get("run_id") != run_id:
                raise EvidenceError(f"{path} is not of run {run_id}, whose manifest is beside it")
            self.add(f"{name}/readbacks/{path.name}", path, "records it (source_commit / "
                     "source_dirty)", run_id=run_id)
        gate = out / f"{run.name}-trace-gate.json"
        if gate.exists():
            _json(gate)
            self.add(f"{name}-trace-gate.json", gate, f"the trace check of run {run_id}, a later step "
                     "of the same command", run_id=run_id)

    def add_command(self, label: str, out: Path) -> None:
        if not out.is_dir():
            raise EvidenceError(f"{label}={out}: not a folder; give LABEL=DIR, DIR an h200_e2e.sh $OUT")
        before = len(self.copies)
        for run in sorted(p for p in out.iterdir() if (p / "manifest.json").is_file()):
            self.add_run(label, run, out)
        for path in sorted(out.glob("*.json")):
            if path.name.endswith("-trace-gate.json"):
                continue  # filed with its run, or left out below
            data = _result_or_none(path)
            if data is not None and recorded(data) is not None:
                self.add_result(path.name, path, data)
        log = out / "cuda_tests.log"
        if log.exists() and len(self.copies) > before:  # a log names no commit; its folder's results do
            self.add("cuda_tests.log", log, f"the cuda_tests step of the {label} command, whose results "
                     "beside it record the commit")
        filed = set(self.copies.values()) | {out / "steps.tsv"}
        self.left_out += [p for p in sorted(out.rglob("*")) if p.is_file() and p not in filed]


def check_inputs(files: list[Path], gpus: Path | None, card: str) -> str | None:
    """Refuses what is wrong before anything is read; returns the CSV of the machine's GPUs."""
    if not card or card in (".", "..") or "/" in card or "\\" in card:
        raise EvidenceError(f"--card {card!r}: name the card's folder under the destination (h100, h200)")
    for path in [*files, *([gpus] if gpus else [])]:
        if not path.is_file():
            raise EvidenceError(f"{path}: no such file; give the path of the result to file")
    if gpus is None:
        return None
    try:
        text = gpus.read_text()
    except UnicodeDecodeError:
        text = ""
    if not text.startswith("name"):
        raise EvidenceError(f"--gpus {gpus} is not nvidia-smi's CSV (its first line starts with `name`): "
                            "write it with nvidia-smi --query-gpu=name,... --format=csv")
    return text


def file_evidence(commands: list[tuple[str, Path]], files: list[Path], gpus: Path | None,
                  card: str, dest: Path, command: str) -> tuple[Path, list[Path]]:
    """The folder written, and the files of the commands' folders left out of it."""
    gpus_csv = check_inputs(files, gpus, card)
    filing = Filing()
    for label, out in commands:
        filing.add_command(label, out)
    for path in files:
        filing.add_result(path.name, path)
    if filing.commit is None:
        raise EvidenceError("nothing here records the commit it measured: give the $OUT folders of "
                            "h200_e2e.sh, whose results and runs record it")
    if filing.device and card.lower() not in filing.device.lower().replace(" ", ""):
        raise EvidenceError(f"the results ran on {filing.device}, not an {card}: give the card they "
                            "ran on as --card")
    steps = [(label, out / "steps.tsv") for label, out in commands if (out / "steps.tsv").exists()]
    final = dest / card / filing.commit[:7]
    if final.exists():
        raise EvidenceError(f"{final} exists: an evidence folder is never written twice; move it away "
                            "first if these results replace it")
    final.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    try:
        for name, source in filing.copies.items():
            (work / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(source, work / name)
        files_of = {name: dict(commit=filing.commit, dirty=False, **p) for name, p in filing.provenance.items()}
        if steps:
            (work / "steps.tsv").write_text("".join(f"# {label}: step, exit code, seconds\n{path.read_text()}"
                                                    for label, path in steps))
            files_of["steps.tsv"] = dict(commit=filing.commit, dirty=False,
                                         how_known="the step tables of the commands above")
        if gpus_csv is not None:
            (work / "gpus.csv").write_text(gpus_csv)
            files_of["gpus.csv"] = dict(commit="", dirty=False, how_known="nvidia-smi on the machine")
        provenance = dict(what="which code each result file here measured", device=filing.device or "unknown",
                          command=command or ", ".join(f"{label}: {out}" for label, out in commands),
                          files=files_of)
        (work / "provenance.json").write_text(json.dumps(provenance, indent=1) + "\n")
        os.chmod(work, 0o755)
        os.rename(work, final)  # the folder appears whole
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return final, filing.left_out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("commands", nargs="+", metavar="LABEL=DIR", help="one h200_e2e.sh command's $OUT")
    ap.add_argument("--card", required=True, help="the card's folder under DEST (h100, h200)")
    ap.add_argument("--dest", type=Path, default=ROOT / "benchmarks" / "results")
    ap.add_argument("--file", type=Path, action="append", default=[], help="another result that "
                    "records its source (det_gemm_plans.json...)")
    ap.add_argument("--gpus", type=Path, help="nvidia-smi's CSV of the machine")
    ap.add_argument("--command", default="", help="what ran, for provenance.json")
    args = ap.parse_args(argv)
    try:
        commands = []
        for item in args.commands:
            label, sep, folder = item.partition("=")
            if not sep or not label or "/" in label:
                raise EvidenceError(f"{item!r}: give LABEL=DIR (small=/path/to/out)")
            commands.append((label, Path(folder)))
        final, left_out = file_evidence(commands, args.file, args.gpus, args.card, args.dest, args.command)
    except (EvidenceError, OSError) as e:
        print(f"collect_evidence: {e}", file=sys.stderr)
        return 2
    if left_out:
        print(f"collect_evidence: not filed (logs, and files that record no commit or belong to no kept "
              f"run): {', '.join(str(p) for p in left_out)}", file=sys.stderr)
    print(final)
    return 0


if __name__ == "__main__":
    sys.exit(main())
