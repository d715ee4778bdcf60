"""benchmarks/collect_evidence.py files h200_e2e.sh outputs as one results folder named by their
commit, with a provenance.json for every file; a result of another commit or of a dirty tree, a
verdict of another run, or an existing folder is refused with exit 2 and nothing written."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("collect_evidence", ROOT / "benchmarks" / "collect_evidence.py")
collect = importlib.util.module_from_spec(spec)
spec.loader.exec_module(collect)

COMMIT = "19fe0469e1221045db73a5068a768793d9221a82"


def write(path: Path, data: dict) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data))
    return path


def command_out(root: Path, run_id: str, benchmarks: bool, commit: str = COMMIT, dirty: bool = False) -> Path:
    """An h200_e2e.sh $OUT: a kept strict run with its trace check, the step table, and (benchmarks)
    the two Hopper results, the CUDA tests' log and a JSON that records no commit."""
    run = root / "rr-tp1"
    write(run / "manifest.json", dict(run_id=run_id, source_commit=commit, source_dirty=dirty))
    write(run / "bitwise-validation.json", dict(run_id=run_id, passed=True))
    write(run / "steps.json", dict(run_id=run_id, mismatch_count=0))
    for side in ("rollout", "training"):
        write(run / "readbacks" / f"builtin-{side}-rank0.json",
              dict(run_id=run_id, source_commit=commit, source_dirty=dirty))
    (run / "run.log").write_text("not filed\n")
    write(root / "rr-tp1-trace-gate.json", dict(cell="control", events=37181))
    (root / "steps.tsv").write_text("rr-tp1\t0\t40\n")
    if benchmarks:
        for name in ("hopper_ops.json", "hopper_attention.json"):
            write(root / name, dict(source=dict(commit=commit, dirty=dirty), device="NVIDIA H100 80GB HBM3"))
        (root / "cuda_tests.log").write_text("117 passed\n")
        write(root / "ipc_collectives.json", dict(rows=[]))
        (root / "rows.json").write_text("[]")
    return root


def test_two_commands_become_one_folder_with_provenance_for_every_file(tmp_path, capsys):
    small = command_out(tmp_path / "small", "run-a", benchmarks=True)
    medium = command_out(tmp_path / "medium", "run-b", benchmarks=False)
    plans = write(tmp_path / "det_gemm_plans.json", dict(source=dict(commit=COMMIT, dirty=False)))
    gpus = tmp_path / "gpus.csv"
    gpus.write_text("name\nNVIDIA H100 80GB HBM3\n")
    dest = tmp_path / "results"
    assert collect.main(["--card", "h100", "--dest", str(dest), f"small={small}", f"medium={medium}",
                         "--file", str(plans), "--gpus", str(gpus), "--command", "two commands"]) == 0
    out = capsys.readouterr()
    folder = dest / "h100" / "19fe046"
    assert out.out.strip() == str(folder)
    # what is not filed is named: a result that records no commit, a run's log, a list
    for name in ("ipc_collectives.json", "small/rr-tp1/run.log", "rows.json"):
        assert name in out.err
    prov = json.loads((folder / "provenance.json").read_text())
    files = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())
    assert files == sorted([*prov["files"], "provenance.json"])
    assert set(prov["files"]) == {
        "hopper_ops.json", "hopper_attention.json", "cuda_tests.log", "det_gemm_plans.json", "gpus.csv",
        "steps.tsv", *(f"rr-tp1-{label}/{f}" for label in ("small", "medium") for f in (
            "manifest.json", "bitwise-validation.json", "steps.json", "readbacks/builtin-rollout-rank0.json",
            "readbacks/builtin-training-rank0.json")),
        "rr-tp1-small-trace-gate.json", "rr-tp1-medium-trace-gate.json"}
    assert prov["device"] == "NVIDIA H100 80GB HBM3" and prov["command"] == "two commands"
    assert all(f["commit"] == COMMIT and f["dirty"] is False for n, f in prov["files"].items() if n != "gpus.csv")
    assert prov["files"]["rr-tp1-medium/steps.json"]["run_id"] == "run-b"
    assert prov["files"]["rr-tp1-small-trace-gate.json"]["run_id"] == "run-a"
    assert (folder / "steps.tsv").read_text() == ("# small: step, exit code, seconds\nrr-tp1\t0\t40\n"
                                                  "# medium: step, exit code, seconds\nrr-tp1\t0\t40\n")
    assert (folder / "rr-tp1-small/manifest.json").read_bytes() == (small / "rr-tp1/manifest.json").read_bytes()
    # a CUDA tests' log beside nothing that records a commit is not filed under one
    logs_only = tmp_path / "logs_only"
    logs_only.mkdir()
    (logs_only / "cuda_tests.log").write_text("3 passed\n")
    assert collect.main(["--card", "h100", "--dest", str(tmp_path / "other"), f"small={small}",
                         f"logs={logs_only}"]) == 0
    assert "logs_only/cuda_tests.log" in capsys.readouterr().err
    # never written twice
    assert collect.main(["--card", "h100", "--dest", str(dest), f"small={small}"]) == 2
    assert "exists: an evidence folder is never written twice" in capsys.readouterr().err


def refused(tmp_path, capsys, *arguments: str) -> str:
    dest = tmp_path / "results"
    card = [] if "--card" in arguments else ["--card", "h100"]
    assert collect.main([*card, "--dest", str(dest), *arguments]) == 2
    assert not dest.exists()  # nothing written, not even the card's folder
    return capsys.readouterr().err


def test_another_commit_a_dirty_tree_or_another_run_is_refused_and_nothing_written(tmp_path, capsys):
    small = command_out(tmp_path / "small", "run-a", benchmarks=True)
    other = command_out(tmp_path / "other", "run-b", benchmarks=False, commit="f" * 40)
    err = refused(tmp_path, capsys, f"small={small}", f"other={other}")
    assert "measured ffffffff" in err and "folder of their own" in err
    dirty = command_out(tmp_path / "dirty", "run-c", benchmarks=True, dirty=True)
    assert "uncommitted changes" in refused(tmp_path, capsys, f"dirty={dirty}")
    write(small / "rr-tp1" / "steps.json", dict(run_id="run-z"))
    assert "is not of run run-a" in refused(tmp_path, capsys, f"small={small}")


def test_a_card_other_than_the_results_or_a_run_without_its_id_is_refused(tmp_path, capsys):
    small = command_out(tmp_path / "small", "run-a", benchmarks=True)
    assert "ran on NVIDIA H100 80GB HBM3, not an h200" in refused(tmp_path, capsys, "--card", "h200",
                                                                 f"small={small}")
    other = command_out(tmp_path / "other", "run-b", benchmarks=False)
    write(other / "det_gemm_plans.json", dict(source=dict(commit=COMMIT, dirty=False), device="NVIDIA H200"))
    assert "file each card's results in a folder of their own" in refused(
        tmp_path, capsys, f"small={small}", f"other={other}")
    write(small / "rr-tp1" / "manifest.json", dict(source_commit=COMMIT, source_dirty=False))
    assert "names no run_id" in refused(tmp_path, capsys, f"small={small}")


def test_bad_arguments_name_the_fix(tmp_path, capsys):
    assert "give LABEL=DIR" in refused(tmp_path, capsys, str(tmp_path))
    assert "not a folder" in refused(tmp_path, capsys, f"small={tmp_path / 'missing'}")
    empty = tmp_path / "empty"
    empty.mkdir()
    assert "nothing here records the commit" in refused(tmp_path, capsys, f"empty={empty}")
    small = command_out(tmp_path / "small", "run-a", benchmarks=True)
    assert "--card '../x': name the card's folder" in refused(tmp_path, capsys, "--card", "../x", f"small={small}")
    assert "no such file" in refused(tmp_path, capsys, f"small={small}", "--file", str(tmp_path / "no.json"))
    script = tmp_path / "gpus.py"
    script.write_text("print('not a csv')\n")
    assert "is not nvidia-smi's CSV" in refused(tmp_path, capsys, f"small={small}", "--gpus", str(script))
    garbled = tmp_path / "garbled.json"
    garbled.write_bytes(b"\xff\xfe")
    assert "garbled.json is not JSON" in refused(tmp_path, capsys, f"small={small}", "--file", str(garbled))
