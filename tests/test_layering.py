"""The design's package table, rl_engine bottom up: a package imports only packages listed above it,
never one below it. Every import of every module counts, the ones inside functions too, since a
lazy import is still a dependency."""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "rl_engine"

# The table's rows, top first; names in one row may import each other. `_C` is the compiled
# extension (csrc/, above every Python row); `rl_engine` is the package root (__init__.py), which
# holds only the version: any module may import it, and it may import nothing of the project, since
# whatever it imported would load with every module.
ROWS: tuple[tuple[str, ...], ...] = (
    ("_C", "rl_engine"),
    ("envs",),
    ("errors", "console"),
    ("ops",),
    ("distributed",),
    ("artifacts",),
    ("runtime",),
    ("evidence",),
    ("models",),
    ("engines",),
    ("adapters",),
    ("step",),
    ("validation", "matrix", "trace", "gate"),
    ("stack",),
    ("cli",),
)
RANK = {name: i for i, row in enumerate(ROWS) for name in row}


def package_of(module: str) -> str:
    """The table's name for a dotted module: rl_engine.runtime.plan -> runtime, rl_engine -> rl_engine."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def _module_of(path: Path, root: Path) -> str:
    rel = path.relative_to(root.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imported(node: ast.AST, module: str, is_package: bool, root: Path) -> list[str]:
    """The rl_engine modules an import statement names (relative imports resolved)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name.split(".")[0] == "rl_engine"]
    if not isinstance(node, ast.ImportFrom):
        return []
    base = node.module or ""
    if node.level:
        here = module.split(".") if is_package else module.split(".")[:-1]
        here = here[:len(here) - (node.level - 1)]
        base = ".".join([*here, base] if base else here)
    if base.split(".")[0] != "rl_engine":
        return []
    if base != "rl_engine":
        return [base]
    # `from rl_engine import errors` names a module; `from rl_engine import __version__` the root.
    names = []
    for a in node.names:
        sub = root / a.name
        names.append(f"rl_engine.{a.name}" if sub.is_dir() or sub.with_suffix(".py").exists()
                     or a.name == "_C" else "rl_engine")
    return names


def violations(source: str, path: Path, root: Path = PACKAGE) -> list[str]:
    """One line per import of a package listed below the importing one (or not listed at all)."""
    module = _module_of(path, root)
    importer = package_of(module)
    found = []
    if importer not in RANK:
        return [f"{path}: package {importer!r} is not in the design's table; add it to ROWS"]
    for node in ast.walk(ast.parse(source, filename=str(path))):
        for target in _imported(node, module, path.name == "__init__.py", root):
            imported = package_of(target)
            if imported not in RANK:
                found.append(f"{path}:{node.lineno}: imports {target}, whose package "
                             f"{imported!r} is not in the design's table")
            elif RANK[imported] > RANK[importer]:
                found.append(f"{path}:{node.lineno}: {importer} imports {imported} ({target}), "
                             "which the design's table lists below it")
    return found


def test_no_package_imports_one_listed_below_it():
    files = sorted(PACKAGE.rglob("*.py"))
    assert len(files) > 50  # the walk found the package, not an empty folder
    found = [v for f in files for v in violations(f.read_text(), f)]
    assert not found, "\n".join(found)


@pytest.mark.parametrize("path, source, expected", [
    # A module-level import from a lower row.
    ("errors.py", "from rl_engine.runtime.plan import PlanError\n", "errors.py:1: errors imports runtime"),
    # A lazy import inside a function counts as much as one at the top.
    ("runtime/plan.py", "def f():\n    import rl_engine.models.qwen3\n", "runtime/plan.py:2: runtime imports models"),
    # `from rl_engine import x` names the module x.
    ("ops/linear.py", "from rl_engine import distributed\n", "ops/linear.py:1: ops imports distributed"),
    # A relative import is resolved against the importing module's package.
    ("models/tp.py", "from ..engines import launch\n", "models/tp.py:1: models imports engines"),
    # The package root imports nothing of the project.
    ("__init__.py", "from rl_engine import envs\n", "__init__.py:1: rl_engine imports envs"),
    # A package the table does not list.
    ("newpkg/thing.py", "x = 1\n", "not in the design's table"),
])
def test_the_checker_catches_an_upward_import(path, source, expected):
    found = violations(source, PACKAGE / path)
    assert len(found) == 1 and expected in found[0], found


@pytest.mark.parametrize("path, source", [
    ("runtime/routing.py", "from rl_engine.errors import BadInput\nfrom rl_engine.ops import linear\n"),
    ("gate/steps.py", "from rl_engine.matrix import cells\nimport rl_engine\n"),  # one row
    ("ops/_lib.py", "def load():\n    from rl_engine import _C\n"),
    ("cli.py", "from rl_engine.stack import services\nfrom . import envs\n"),
])
def test_the_checker_allows_imports_from_above_and_the_same_row(path, source):
    assert violations(source, PACKAGE / path) == []
