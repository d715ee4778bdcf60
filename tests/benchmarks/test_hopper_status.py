"""benchmarks/hopper_status.py tabulates each evidence folder against the Hopper speed targets: the
README's table is the one its committed folders give, a missed target names its worst row, a folder
mixing two commits or missing a file is refused with exit 2, and --update rewrites only the table."""

from __future__ import annotations

import importlib.util
import json
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
spec = importlib.util.spec_from_file_location("hopper_status", ROOT / "benchmarks" / "hopper_status.py")
hopper_status = importlib.util.module_from_spec(spec)
spec.loader.exec_module(hopper_status)


def test_the_readme_table_is_the_one_its_folders_give(tmp_path):
    readme = tmp_path / "README.md"
    shutil.copy(ROOT / "README.md", readme)
    assert hopper_status.update(readme) is False, (
        "README.md's hopper-status table differs from its folders' JSON: run "
        "`python benchmarks/hopper_status.py --update README.md`")
    assert readme.read_text() == (ROOT / "README.md").read_text()


def write_folder(folder: Path, commit: str, attention_commit: str | None = None, bwd=0.7) -> Path:
    folder.mkdir(parents=True)
    source = dict(commit=commit, dirty=False)
    ops = dict(source=source, device="NVIDIA H200", datasheet_tbs=4.8,
               gemm=[dict(op="det_gemm", shape="square", m=1, ratio=1.1, r_weight_tbs=3.0),
                     dict(op="det_gemm", shape="deep", m=128, ratio=0.8)],
               memory_bound=[dict(op="rmsnorm_backward", r_tbs=3.5)],
               linear_logp=[dict(op="linear_logp", ratio=1.4, ratio_vs_lm_head_gemm=0.95, r_extra_peak_bytes=4e7,
                                 lm_head_gemm_ms=10.0)])
    if commit.startswith("b"):
        ops["linear_logp"].append(dict(op="linear_logp_backward", r_ms=36.0, p_ms=27.0, ratio=0.75))
        ops["gemm"] += [dict(op="det_gemm", shape="4b_kv", m=2, ratio=1.2, r_weight_tbs=1.2, p_weight_tbs=1.0),
                        dict(op="det_gemm", shape="4b_q", m=2, ratio=0.9, r_weight_tbs=2.2, p_weight_tbs=2.5)]
    attention = dict(source=dict(commit=attention_commit or commit, dirty=False),
                     targets=dict(forward_ratio=0.9, backward_ratio=0.75, decode_tbs=3.6),
                     prefill=[dict(tokens=4096, head_dim=128, forward_ratio=0.95, backward_ratio=0.8),
                              dict(tokens=8192, head_dim=128, forward_ratio=0.93, backward_ratio=bwd)],
                     decode=[dict(head_dim=128, r_tbs=3.7)])
    if commit.startswith("b"):
        ops["copy_tbs"] = attention["copy_tbs"] = 4.0
    (folder / "hopper_ops.json").write_text(json.dumps(ops))
    (folder / "hopper_attention.json").write_text(json.dumps(attention))
    return folder


def test_each_target_says_met_or_missed_with_its_worst_row(tmp_path):
    a = write_folder(tmp_path / "a", "a" * 40)
    b = write_folder(tmp_path / "b", "b" * 40, bwd=0.76)
    cells = [line[2:-2].split(" | ") for line in hopper_status.table([a, b]).splitlines()[2:]]
    rows = {c[0]: c[1:] for c in cells}
    assert hopper_status.table([a, b]).splitlines()[0] == "| target | NVIDIA H200, aaaaaaa | NVIDIA H200, bbbbbbb |"
    decode = rows["det_gemm at M <= 128, of cuBLAS (>= 1.0)"][0]
    assert decode == "**missed**: 1 / 2 rows; worst deep m=128: 0.8"
    backward = rows["attention backward, of cuDNN (>= 0.75)"]
    assert backward[0] == "**missed**: 1 / 2 rows; worst 8192 tokens, head_dim 128: 0.7"
    assert backward[1] == "met: 2 / 2 rows; worst 8192 tokens, head_dim 128: 0.76"
    assert rows["paged decode, TB/s (>= 3.6)"][0] == "met: 3.7"
    # where the run recorded its copy bandwidth, a TB/s figure comes with its share of it
    assert rows["paged decode, TB/s (>= 3.6)"][1] == "met: 3.7 (0.93 of a copy's 4.00)"
    assert rows["RMSNorm backward, TB/s (>= 3.4)"][1] == "met: 3.5 (0.88 of a copy's 4.00)"
    assert rows["linear_logp forward, of the LM-head GEMM (>= 1.0)"][0] == "**missed**: 0.95"
    assert rows["linear_logp backward, of the plain path (>= 1.0)"][0] == "not run"
    # of the two rows under half of 4.8 TB/s, cuBLAS streams one (2.5 TB/s) and misses the other
    assert rows["det_gemm's weight stream at M <= 16, of HBM (>= 0.5)"][1] == (
        "**missed**: 1 / 3 rows; worst 4b_kv m=2: 0.25 (cuBLAS also under 0.5 on 1 of the 2 rows missed)")
    # beside the backward, the ratio it would reach recomputing the logits at cuBLAS's rate: 27 / 30
    assert rows["linear_logp backward, of the plain path (>= 1.0)"][1] == (
        "**missed**: 0.75 (0.90 if it took three LM-head GEMMs' time)")


def test_a_folder_of_two_commits_or_without_a_file_is_refused(tmp_path, capsys):
    mixed = write_folder(tmp_path / "mixed", "a" * 40, attention_commit="c" * 40)
    assert hopper_status.main([str(mixed)]) == 2
    assert "keep each commit's results in a folder of their own" in capsys.readouterr().err
    empty = tmp_path / "empty"
    empty.mkdir()
    assert hopper_status.main([str(empty)]) == 2
    err = capsys.readouterr().err
    assert "hopper_ops.json is missing" in err and "benchmarks/hopper_ops.py" in err
    assert hopper_status.main([str(mixed / "hopper_ops.json")]) == 2
    assert "is not a folder: give evidence folders" in capsys.readouterr().err
    listed = write_folder(tmp_path / "listed", "a" * 40)
    (listed / "hopper_attention.json").write_text("[]")
    assert hopper_status.main([str(listed)]) == 2
    assert "holds list, not a benchmark result" in capsys.readouterr().err
    unnamed = write_folder(tmp_path / "unnamed", "a" * 40)
    (unnamed / "hopper_ops.json").write_text(json.dumps(dict(device="NVIDIA H200")))
    assert hopper_status.main([str(unnamed)]) == 2
    assert "must record the commit it measured" in capsys.readouterr().err
    cards = write_folder(tmp_path / "cards", "a" * 40)
    attention = json.loads((cards / "hopper_attention.json").read_text())
    (cards / "hopper_attention.json").write_text(json.dumps({**attention, "device": "NVIDIA H100"}))
    assert hopper_status.main([str(cards)]) == 2
    assert "one card's, but its files ran on" in capsys.readouterr().err


def test_update_rewrites_only_the_table_and_needs_its_markers(tmp_path, monkeypatch):
    folder = write_folder(tmp_path / "f", "d" * 40)
    monkeypatch.setattr(hopper_status, "ROOT", tmp_path)
    readme = tmp_path / "README.md"
    readme.write_text("intro\n<!-- hopper-status: f -->\nstale row\n<!-- /hopper-status -->\noutro\n")
    assert hopper_status.update(readme) is True
    text = readme.read_text()
    assert text == ("intro\n<!-- hopper-status: f -->\n" + hopper_status.table([folder]) +
                    "<!-- /hopper-status -->\noutro\n")
    assert hopper_status.update(readme) is False
    readme.write_text("intro\n<!-- /hopper-status -->\n")
    with pytest.raises(hopper_status.StatusError, match="needs one `<!-- hopper-status"):
        hopper_status.update(readme)
    assert readme.read_text() == "intro\n<!-- /hopper-status -->\n"
    readme.write_text("<!-- /hopper-status -->\n<!-- hopper-status: f -->\n")
    with pytest.raises(hopper_status.StatusError, match=r"\(line 1\) comes before"):
        hopper_status.update(readme)
    assert hopper_status.main(["--update", str(tmp_path / "missing.md")]) == 2
