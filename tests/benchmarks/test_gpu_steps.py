"""benchmarks/gpu_steps.sh reuses a built extension only for the sources it was built from: the key
follows the content of every file under csrc/ and include/ and setup.py (no git needed), a
cached file becomes an editable install without a compiler run, and a tree with no cached build of
its own falls through to building; a bundle names the commit a copied tree is, and a build made
elsewhere is installed only for that commit."""

from __future__ import annotations

import gzip
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import torch

from fixtures.git_repo import git

ROOT = Path(__file__).resolve().parents[2]
SUFFIX = sysconfig.get_config_var("EXT_SUFFIX")


def tree(tmp_path: Path) -> Path:
    """A copy of the tree (no git history: the key reads the files themselves) with the script, the
    packaging files, a kernel and a header (no CUDA here, so a build of it fails)."""
    repo = tmp_path / "repo"
    (repo / "benchmarks").mkdir(parents=True)
    for rel in ("benchmarks/gpu_steps.sh", "setup.py", "pyproject.toml"):
        shutil.copy(ROOT / rel, repo / rel)
    files = {"csrc/op.cu": "a\n", "include/op.cuh": "b\n", "README.md": "c\n", "rl_engine/__init__.py": "",
             "rl_engine/cli.py": "def main():\n    pass\n"}
    for rel, text in files.items():
        (repo / rel).parent.mkdir(parents=True, exist_ok=True)
        (repo / rel).write_text(text)
    return repo


def python_env(tmp_path: Path) -> Path:
    """A venv of its own (site-packages the test may write to) that sees this interpreter's packages."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    site = subprocess.run([str(python), "-c", "import site; print(site.getsitepackages()[0])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    Path(site, "parent-packages.pth").write_text("\n".join(p for p in sys.path if p.endswith("-packages")))
    return python


def steps(repo: Path, python: Path, script: str, **env: str) -> subprocess.CompletedProcess:
    out = repo.parent / "out"
    return subprocess.run(["bash", "-c", f"source benchmarks/gpu_steps.sh; {script}"], cwd=repo,
                          capture_output=True, text=True, timeout=300,
                          env={"PATH": "/usr/bin:/bin", "HOME": str(repo.parent), "OUT": str(out),
                               "PYTHON": str(python), **env})


def key(repo: Path, python: Path) -> str:
    done = steps(repo, python, "ext_key")
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_the_key_follows_the_sources_and_nothing_else(tmp_path):
    repo, python = tree(tmp_path), python_env(tmp_path)
    first = key(repo, python)
    assert len(first) == 16 and key(repo, python) == first
    (repo / "README.md").write_text("docs change\n")
    assert key(repo, python) == first
    (repo / "csrc" / "op.cu").write_text("a changed kernel\n")
    changed = key(repo, python)
    assert changed != first
    (repo / "include" / "new.cuh").write_text("a new header\n")
    added = key(repo, python)
    assert added not in (first, changed)
    (repo / "include" / "new.cuh").unlink()
    assert key(repo, python) == changed


def test_a_cached_build_is_installed_instead_of_built(tmp_path):
    repo, python = tree(tmp_path), python_env(tmp_path)
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / f"rl_engine_C-{key(repo, python)}.so").write_bytes(b"built elsewhere")
    done = steps(repo, python, "prepare", EXT_CACHE=str(cache))
    assert done.returncode == 0, done.stdout + done.stderr
    assert (repo / "rl_engine" / f"_C{SUFFIX}").read_bytes() == b"built elsewhere"
    # An editable install like the build's: the package resolves to the tree and keeps its
    # metadata (the rlk script, the vLLM plugin entry point).
    probe = ("import importlib.metadata as m, rl_engine; print(rl_engine.__file__); "
             "print(sorted(e.name for e in m.distribution('rl-engine').entry_points))")
    where, entry_points = subprocess.run([str(python), "-c", probe], cwd=tmp_path, check=True,
                                         capture_output=True, text=True).stdout.split("\n")[:2]
    assert Path(where) == repo / "rl_engine" / "__init__.py"
    assert entry_points == "['rl_engine', 'rlk']"
    build = (tmp_path / "out" / "steps.tsv").read_text().split("\t")
    assert build[:2] == ["build", "0"]


def test_a_tree_without_its_cached_build_is_built(tmp_path):
    repo, python = tree(tmp_path), python_env(tmp_path)
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "rl_engine_C-0000000000000000.so").write_bytes(b"another tree's build")
    done = steps(repo, python, "prepare", EXT_CACHE=str(cache))
    # The build ran (with no CUDA here setup.py refuses to), so prepare stops there.
    assert done.returncode == 1
    build = (tmp_path / "out" / "steps.tsv").read_text().splitlines()[-1].split("\t")
    assert build[0] == "build" and build[1] != "0"
    if torch.version.cuda is None:  # with a CUDA torch it compiles this tree's stub kernel, and fails there
        assert "RLK_BUILD_CUDA=1 but no CUDA torch" in (tmp_path / "out" / "build.log").read_text()
    assert not (repo / "rl_engine" / f"_C{SUFFIX}").exists()


def device_copy(tmp_path: Path) -> tuple[Path, Path, str]:
    """A checkout whose history stops one commit before the tree it holds (as the GPU machine's
    copy does), and a bundle of that later commit, made in the developer's clone."""
    repo = tree(tmp_path)
    git(repo, "init", "-q")
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "older")
    dev = tmp_path / "dev"
    subprocess.run(["git", "clone", "-q", str(repo), str(dev)], check=True)
    (dev / "csrc" / "op.cu").write_text("the kernel as measured\n")
    (dev / "csrc" / "added.cu").write_text("a kernel the older commit lacks\n")
    git(dev, "add", "-A")
    git(dev, "commit", "-q", "-m", "newer")
    git(dev, "bundle", "create", "-q", str(tmp_path / "source.bundle"), "HEAD")
    for name in ("op.cu", "added.cu"):
        shutil.copy(dev / "csrc" / name, repo / "csrc" / name)
    return repo, tmp_path / "source.bundle", git(dev, "rev-parse", "HEAD")


def test_a_source_bundle_names_the_commit_the_tree_is(tmp_path):
    repo, bundle, newer = device_copy(tmp_path)
    done = steps(repo, python_env(tmp_path), "source_commit", SOURCE_BUNDLE=str(bundle))
    assert done.returncode == 0, done.stderr
    assert git(repo, "rev-parse", "HEAD") == newer
    assert git(repo, "status", "--porcelain", "--untracked-files=no") == ""


@pytest.mark.parametrize("change", ["edited", "missing"])
def test_a_source_bundle_of_another_tree_is_refused(tmp_path, change):
    repo, bundle, _ = device_copy(tmp_path)
    if change == "edited":
        (repo / "csrc" / "op.cu").write_text("not what was committed\n")
    else:  # a file the newer commit added, which the older index does not know
        (repo / "csrc" / "added.cu").unlink()
    older = git(repo, "rev-parse", "HEAD")
    done = steps(repo, python_env(tmp_path), "source_commit", SOURCE_BUNDLE=str(bundle))
    assert done.returncode == 1
    assert "the tree differs from its commit" in done.stderr
    assert ("op.cu" if change == "edited" else "added.cu") in done.stderr
    assert git(repo, "rev-parse", "HEAD") == older


def test_a_prebuilt_extension_of_head_is_installed_and_another_is_refused(tmp_path):
    repo, bundle, newer = device_copy(tmp_path)
    python = python_env(tmp_path)
    stale = tmp_path / "rl_engine_C-000000000000.so.gz"
    stale.write_bytes(gzip.compress(b"an older build"))
    done = steps(repo, python, "source_commit && prebuilt", SOURCE_BUNDLE=str(bundle), EXT_PREBUILT=str(stale))
    assert done.returncode == 1
    assert f"is not a build of HEAD {newer[:12]}" in done.stderr
    assert not (repo / "rl_engine" / f"_C{SUFFIX}").exists()
    fresh = tmp_path / f"rl_engine_C-{newer[:12]}.so.gz"
    fresh.write_bytes(gzip.compress(b"built elsewhere for this commit"))
    done = steps(repo, python, "prebuilt", EXT_PREBUILT=str(fresh))
    assert done.returncode == 0, done.stdout + done.stderr
    assert (repo / "rl_engine" / f"_C{SUFFIX}").read_bytes() == b"built elsewhere for this commit"


def test_an_archive_inside_the_folder_it_packs_is_refused(tmp_path):
    repo, python = tree(tmp_path), python_env(tmp_path)
    out = repo.parent / "out"
    inside = steps(repo, python, "echo sourced", ARCHIVE=str(out / "results.tgz"))
    assert inside.returncode == 2 and "is inside OUT" in inside.stderr
    assert "sourced" not in inside.stdout
    beside = steps(repo, python, "echo sourced; pack", ARCHIVE=str(repo.parent / "results.tgz"))
    assert beside.returncode == 0 and "sourced" in beside.stdout, beside.stderr
    assert (repo.parent / "results.tgz").is_file()
