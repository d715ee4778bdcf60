"""Usage errors and bad input exit 2 with one error line, before anything is written: the run
directory of `rlk run`, the report of `rlk matrix analyze`, the verdict of `rlk validate`."""

from __future__ import annotations

import json
import shutil

import pytest


def _error_lines(stderr: str) -> list[str]:
    return [ln for ln in stderr.splitlines() if ln.startswith("error")]


@pytest.mark.parametrize("args, message", [
    (["run", "--steps", "abc"], "Invalid value for '--steps'"),
    (["run", "--no-such-flag"], "No such option: --no-such-flag"),
    (["matrix", "run", "--tp", "two"], "Invalid value for '--tp'"),
    (["frobnicate"], "No such command 'frobnicate'"),
])
def test_usage_errors_exit_2_with_one_line(rlk, tmp_path, args, message):
    proc = rlk(*args, "--artifact-dir" if args[0] == "run" else "--matrix-root", str(tmp_path / "out"))
    assert proc.returncode == 2, proc.stderr[-2000:]
    (line,) = _error_lines(proc.stderr)
    assert message in line and "--help" in line
    assert not (tmp_path / "out").exists()


def _model_with(state_dir, dest, **changes):
    shutil.copytree(state_dir / "models" / "tiny", dest)
    cfg = json.loads((dest / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    (dest / "config.json").write_text(json.dumps(cfg))
    (dest / "manifest.sha256").unlink()
    return dest


@pytest.mark.parametrize("changes, message", [
    # Without model_type the architecture alone must say Qwen3.
    ({"model_type": None, "architectures": ["LlamaForCausalLM"]}, "architectures ['LlamaForCausalLM']"),
    ({"model_type": "llama"}, "model_type 'llama' is not 'qwen3'"),
    ({"model_type": None, "architectures": None}, "names neither architectures nor model_type"),
])
def test_a_config_of_another_model_is_refused_before_the_run_directory(rlk, state_dir, tmp_path,
                                                                      changes, message):
    model = _model_with(state_dir, tmp_path / "model", **changes)
    proc = rlk("run", "--workload", "ci", "--model-root", str(model), "--artifact-dir", str(tmp_path / "r"))
    assert proc.returncode == 2, proc.stderr[-2000:]
    (line,) = _error_lines(proc.stderr)
    assert message in line
    assert proc.stderr.count(message) == 1  # not repeated by the run's log
    assert not (tmp_path / "r").exists()


def test_a_model_folder_without_config_is_refused_before_the_run_directory(rlk, state_dir, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(state_dir / "models" / "tiny", model)
    (model / "config.json").unlink()
    (model / "manifest.sha256").unlink()
    proc = rlk("run", "--workload", "ci", "--model-root", str(model), "--artifact-dir", str(tmp_path / "r"))
    assert proc.returncode == 2 and "config.json is missing" in proc.stderr
    assert len(_error_lines(proc.stderr)) == 1
    assert not (tmp_path / "r").exists()


def test_validate_of_a_missing_folder_exits_2_and_writes_nothing(rlk, tmp_path):
    proc = rlk("validate", str(tmp_path / "missing"), "--output", str(tmp_path / "v.json"))
    assert proc.returncode == 2
    (line,) = _error_lines(proc.stderr)
    assert "does not exist" in line
    assert not (tmp_path / "v.json").exists() and not (tmp_path / "missing").exists()


def test_analyze_of_an_empty_folder_exits_2_and_writes_nothing(rlk, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    proc = rlk("matrix", "analyze", "--matrix-root", str(empty))
    assert proc.returncode == 2
    (line,) = _error_lines(proc.stderr)
    assert "is not a matrix root" in line
    assert list(empty.iterdir()) == []


def test_matrix_run_of_an_unknown_case_exits_2_and_writes_no_root(rlk, tmp_path):
    root = tmp_path / "m"
    proc = rlk("matrix", "run", "--case", "bogus", "--matrix-root", str(root), "--no-history")
    assert proc.returncode == 2
    (line,) = _error_lines(proc.stderr)
    assert "unknown cell 'bogus'" in line
    assert not root.exists()


def test_matrix_run_of_a_model_without_config_exits_2_and_writes_no_root(rlk, state_dir, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(state_dir / "models" / "tiny", model)
    (model / "config.json").unlink()
    (model / "manifest.sha256").unlink()
    root = tmp_path / "m"
    proc = rlk("matrix", "run", "--case", "control", "--workload", "ci", "--model-root", str(model),
               "--matrix-root", str(root), "--no-history")
    assert proc.returncode == 2
    (line,) = _error_lines(proc.stderr)
    assert "config.json is missing" in line
    assert not root.exists()
