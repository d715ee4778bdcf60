"""The committed lock file is what CI and the images install; it must agree with pyproject.toml."""

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _lock() -> dict[str, str]:
    pins = {}
    for line in (ROOT / "requirements.lock").read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, version = line.split("==")
            pins[_norm(name)] = version
    return pins


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name.split("[")[0]).lower()


def test_every_pin_of_pyproject_is_in_the_lock_with_the_same_version():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    deps = list(project["dependencies"])
    for extra in project["optional-dependencies"].values():
        deps += extra
    lock = _lock()
    pinned = [d for d in deps if "==" in d]
    assert pinned, "pyproject.toml pins nothing"
    for dep in pinned:
        name, version = dep.split("==")
        assert lock.get(_norm(name)) == version, f"{dep} in pyproject.toml, {lock.get(_norm(name))} in the lock"


def test_the_lock_pins_exact_versions_and_a_torch_that_pyproject_allows():
    lock = _lock()
    assert lock["torch"] == "2.13.0"
    assert all(re.fullmatch(r"[0-9][0-9A-Za-z.+!-]*", v) for v in lock.values())
