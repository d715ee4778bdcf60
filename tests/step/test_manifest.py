import hashlib
import json

from rl_engine.artifacts import manifest
from rl_engine.cli import main


def _inputs(tmp_path):
    a = tmp_path / "model" / "model.safetensors"
    a.parent.mkdir()
    a.write_bytes(b"weights")
    b = tmp_path / "prompts.jsonl"
    b.write_text('{"prompt": "hi"}\n')
    return a, b


def test_manifest_records_code_environment_and_input_hashes(tmp_path):
    a, b = _inputs(tmp_path)
    man = manifest.build(run_id="r", plan={"attention": "R/R"}, layout={"tp": 2},
                         inputs={"checkpoint": [a], "prompts": [b]})
    assert man["inputs"]["checkpoint"] == {str(a.resolve()): hashlib.sha256(b"weights").hexdigest()}
    assert man["source_commit"] and isinstance(man["source_dirty"], bool)
    assert any(p.startswith("torch==") for p in man["pip_freeze"])
    assert man["extension"]["flags"]["cxx"] and man["extension"]["sm90_compiled"] is False
    assert man["python"] and man["torch"] and man["plan"] == {"attention": "R/R"}


def test_verify_against_a_manifest_and_a_sha256sum_file(tmp_path, capsys):
    a, b = _inputs(tmp_path)
    path = manifest.write(tmp_path / "manifest.json", manifest.build(
        run_id="r", plan={}, layout={}, inputs={"checkpoint": [a], "prompts": [b]}))
    assert main(["manifest", "verify", str(path)]) == 0
    b.write_text('{"prompt": "changed"}\n')
    assert main(["manifest", "verify", str(path)]) == 2
    assert "prompts.jsonl: sha256 differs" in capsys.readouterr().err
    sums = tmp_path / "model" / "SHA256SUMS"
    sums.write_text(f"{hashlib.sha256(b'weights').hexdigest()}  model.safetensors\n")
    assert manifest.verify(sums) == []
    a.write_bytes(b"other")
    assert "model.safetensors: sha256 differs" in manifest.verify(sums)[0]


def test_manifest_json_is_written_atomically_with_a_schema_version(tmp_path):
    path = manifest.write(tmp_path / "m.json", {"run_id": "r", "inputs": {}})
    assert json.loads(path.read_text())["schema_version"] == 1
    assert [p.name for p in tmp_path.iterdir()] == ["m.json"]
