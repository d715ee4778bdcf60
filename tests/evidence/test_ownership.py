"""`rl_engine.evidence` owns the run directory: no other module spells one of its file names, and
no other module compares log-probs or reads the records it judges."""

from __future__ import annotations

import ast
from pathlib import Path

from rl_engine.evidence import layout

ROOT = Path(__file__).resolve().parents[2]
OWNER = ROOT / "rl_engine" / "evidence"
SCANNED = ("rl_engine", "dags", "plugins")


def file_names() -> set[str]:
    run, matrix = layout.RunDir(Path("r")), layout.MatrixRoot(Path("m"))
    names = {getattr(run, p).name for p in ("manifest", "readbacks", "train_data", "validation", "log",
                                            "exit_code", "steps", "case_env", "console_log")}
    names |= {matrix.matrix_file.name, matrix.report.name,
              *(p.name for p in layout.MatrixRoot.tables_beside(matrix.report))}
    return names


def _docstrings(tree: ast.AST) -> set[int]:
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) \
                and node.body and isinstance(node.body[0], ast.Expr) \
                and isinstance(node.body[0].value, ast.Constant):
            out.add(id(node.body[0].value))
    return out


def sources() -> list[tuple[Path, ast.AST]]:
    out = []
    for top in SCANNED:
        for path in sorted((ROOT / top).rglob("*.py")):
            if OWNER not in path.parents:
                out.append((path, ast.parse(path.read_text(), str(path))))
    return out


# Every verb's last stderr line, `[rlk] exit-code N`, is a console marker the Ray trigger reads,
# not the run directory's exit-code file.
_MARKERS = ("[rlk] exit-code", r"\[rlk\] exit-code")


def name_uses(path: Path, tree: ast.AST, names: set[str]) -> list[str]:
    skip = _docstrings(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skip:
            text = node.value
            for marker in _MARKERS:
                text = text.replace(marker, "")
            for name in names:
                if name in text:
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {name!r} in {node.value!r}")
    return found


# Comparing tensors bit for bit or reading the compared log-probs back is verdict work. (The
# attention parity gate compares its own outputs, not a run directory, in rl_engine.validation.)
_VERDICT_CALLS = {"eq", "equal", "isfinite", "isnan"}
_RECORD_KEYS = {"rollout_logprobs", "trainer_logprobs"}
_ALLOWED_OUTSIDE = {"rl_engine/validation/attention_gate.py"}


def verdict_uses(path: Path, tree: ast.AST) -> list[str]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and node.func.attr in _VERDICT_CALLS and isinstance(node.func.value, ast.Name) \
                and node.func.value.id == "torch":
            found.append(f"{path.relative_to(ROOT)}:{node.lineno}: torch.{node.func.attr}")
        if isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load) \
                and isinstance(node.slice, ast.Constant) and node.slice.value in _RECORD_KEYS:
            found.append(f"{path.relative_to(ROOT)}:{node.lineno}: reads [{node.slice.value!r}]")
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and node.func.attr == "get" and node.args and isinstance(node.args[0], ast.Constant) \
                and node.args[0].value in _RECORD_KEYS:
            found.append(f"{path.relative_to(ROOT)}:{node.lineno}: reads .get({node.args[0].value!r})")
    return found


def test_no_module_outside_evidence_spells_a_run_directory_file_name():
    names = file_names()
    assert {"manifest.json", "readbacks", "exit-code", "matrix-report.json"} <= names
    found = [hit for path, tree in sources() for hit in name_uses(path, tree, names)]
    assert not found, "\n".join(found)


def test_no_module_outside_evidence_judges_log_probs_or_records():
    found = [hit for path, tree in sources() for hit in verdict_uses(path, tree)
             if path.relative_to(ROOT).as_posix() not in _ALLOWED_OUTSIDE]
    assert not found, "\n".join(found)


def test_the_scanners_find_what_they_look_for():
    tree = ast.parse('"""run.log in a docstring is fine."""\n'
                     'p = root / "bitwise-validation.json"\n'
                     'bad = ~torch.eq(a, b)\n'
                     'x = d["trainer_logprobs"]\n')
    path = ROOT / "rl_engine" / "example.py"
    assert [h.split(": ", 1)[1] for h in name_uses(path, tree, file_names())] == [
        "'bitwise-validation.json' in 'root / \"bitwise-validation.json\"'".replace(
            "'root / \"bitwise-validation.json\"'", "'bitwise-validation.json'")]
    assert len(verdict_uses(path, tree)) == 2
