"""benchmarks/sass_diff.sh, the check that tells which kernels a change touches: a stand-in nvcc and
cuobjdump turn each `kernel NAME BODY` line of a unit into one function's SASS, so the comparison,
its verdicts and exit codes run here without the CUDA toolkit."""

from __future__ import annotations

import ast
import re
import shutil
import subprocess
from pathlib import Path

from fixtures.git_repo import git

ROOT = Path(__file__).resolve().parents[2]

# "Compiles" a unit: the cubin is the unit's `kernel NAME BODY [SMEM]` lines; on stderr, ptxas -v's
# lines give each kernel as many registers as its body has characters, twice that in spill stores
# (spill loads 99, which must not be read as stores) and SMEM bytes of static shared memory. It fails
# without the flags that make a cubin with ptxas's report, the kernels' macro and the include paths.
FAKE_NVCC = r"""#!/bin/bash
out=""; src=""; prev=""; args=" $* "
for a in "$@"; do
  [ "$prev" = -o ] && out=$a
  case "$a" in *.cu) src=$a ;; esac
  prev=$a
done
for want in -cubin "-Xptxas -v" -DRL_ENGINE_WITH_SM90 -Iinclude -Icsrc; do
  [[ "$args" == *" $want "* ]] || { echo "nvcc: called without $want" >&2; exit 1; }
done
grep -q BROKEN "$src" && { echo "$src(1): error: expected a ;" >&2; exit 1; }
grep '^kernel ' "$src" > "$out"
while read -r _ name body smem; do
  echo "ptxas info    : Compiling entry function '$name' for 'sm_90a'" >&2
  echo "ptxas info    : Function properties for $name" >&2
  echo "    0 bytes stack frame, $((2 * ${#body})) bytes spill stores, 99 bytes spill loads" >&2
  echo "ptxas info    : Used ${#body} registers, used 1 barriers, ${smem:-0} bytes smem" >&2
done < "$out"
"""

FAKE_CUOBJDUMP = r"""#!/bin/bash
echo "nvdisasm warning : a warning printed on every call" >&2
n=0
while read -r _ name body _smem; do
  printf '\t\tFunction : %s\n        /*%04x*/    %s ;\n\n' "$name" $((n * 16)) "$body"
  n=$((n + 1))
done < "$2"
"""


def make_repo(tmp_path: Path) -> Path:
    repo = tmp_path / "repo"
    (repo / "benchmarks").mkdir(parents=True)
    shutil.copy(ROOT / "benchmarks" / "sass_diff.sh", repo / "benchmarks" / "sass_diff.sh")
    (repo / "include").mkdir()
    (repo / "include" / "k.cuh").write_text("// header\n")
    (repo / "csrc" / "cuda").mkdir(parents=True)
    (repo / "csrc" / "cuda" / "attention.cu").write_text("kernel fwd IADD\nkernel bwd FFMA\n")
    (repo / "csrc" / "cuda" / "ops.cu").write_text("#include <torch/library.h>\nkernel glue MOV\n")
    git(repo, "init", "-q")
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "base")
    for name, text in (("nvcc", FAKE_NVCC), ("cuobjdump", FAKE_CUOBJDUMP)):
        (tmp_path / name).write_text(text)
        (tmp_path / name).chmod(0o755)
    return repo


def sass_diff(repo: Path, *args: str) -> subprocess.CompletedProcess:
    tools = repo.parent
    return subprocess.run(["bash", "benchmarks/sass_diff.sh", *args], cwd=repo, capture_output=True,
                          text=True, timeout=60,
                          env={"PATH": "/usr/bin:/bin", "NVCC": str(tools / "nvcc"),
                               "CUOBJDUMP": str(tools / "cuobjdump")})


def verdicts(out: str) -> dict[str, str]:
    return {m[1]: m[0] for m in re.findall(r"^  (same|CHANGED|only in base|only in new) +(\w+)", out, re.M)}


def test_an_unchanged_tree_is_the_same_everywhere(tmp_path):
    repo = make_repo(tmp_path)
    done = sass_diff(repo, "HEAD")
    assert done.returncode == 0, done.stderr
    # The unit that includes a torch header is left out by default.
    assert verdicts(done.stdout) == {"fwd": "same", "bwd": "same"}
    assert "regs 4 -> 4, spill stores 8 -> 8 bytes" in done.stdout
    assert "every kernel is the same" in done.stdout
    assert "nvdisasm warning" not in done.stderr


def test_a_changed_kernel_is_named_and_only_it(tmp_path):
    repo = make_repo(tmp_path)
    # bwd's instruction moves to another address, which alone is no change.
    (repo / "csrc" / "cuda" / "attention.cu").write_text("kernel dq HMMA\nkernel fwd IADD.X\nkernel bwd FFMA\n")
    done = sass_diff(repo, "HEAD", "attention.cu")
    assert done.returncode == 3, done.stderr
    assert verdicts(done.stdout) == {"fwd": "CHANGED", "bwd": "same", "dq": "only in new"}
    assert "fwd  regs 4 -> 6, spill stores 8 -> 12 bytes" in done.stdout
    assert "dq  regs - -> 4, spill stores - -> 8 bytes" in done.stdout
    assert "2 kernel(s) differ" in done.stdout


def test_the_same_instructions_with_other_resources_are_a_change(tmp_path):
    repo = make_repo(tmp_path)
    (repo / "csrc" / "cuda" / "attention.cu").write_text("kernel fwd IADD 1024\nkernel bwd FFMA\n")
    done = sass_diff(repo, "HEAD", "attention.cu")
    assert done.returncode == 3, done.stderr
    assert verdicts(done.stdout) == {"fwd": "CHANGED", "bwd": "same"}


def test_units_added_or_removed_are_compared_by_default(tmp_path):
    repo = make_repo(tmp_path)
    (repo / "csrc" / "cuda" / "attention.cu").unlink()
    (repo / "csrc" / "cuda" / "decode.cu").write_text("kernel split FMUL\n")
    done = sass_diff(repo, "HEAD")
    assert done.returncode == 3, done.stderr
    assert verdicts(done.stdout) == {"fwd": "only in base", "bwd": "only in base", "split": "only in new"}
    assert "bwd  regs 4 -> -, spill stores 8 -> - bytes" in done.stdout


def test_wrong_arguments_and_a_broken_build_exit_non_zero(tmp_path):
    repo = make_repo(tmp_path)
    bad_rev = sass_diff(repo, "no-such-rev")
    assert bad_rev.returncode == 2 and "not a commit of this repository" in bad_rev.stderr
    path = sass_diff(repo, "HEAD", "csrc/cuda/attention.cu")
    assert path.returncode == 2 and "given by its name alone" in path.stderr
    missing = sass_diff(repo, "HEAD", "nothing.cu")
    assert missing.returncode == 2 and "in neither the working tree nor HEAD" in missing.stderr
    torch_unit = sass_diff(repo, "HEAD", "ops.cu")
    assert torch_unit.returncode == 2 and "includes torch headers" in torch_unit.stderr

    no_rev = sass_diff(repo)
    assert no_rev.returncode == 2 and "no BASE_REV" in no_rev.stderr

    (repo / "csrc" / "cuda" / "attention.cu").write_text("BROKEN\n")
    broken = sass_diff(repo, "HEAD", "attention.cu")
    assert broken.returncode == 1
    assert "does not build on the new side" in broken.stderr and "expected a ;" in broken.stderr
    git(repo, "commit", "-qam", "a broken base")
    (repo / "csrc" / "cuda" / "attention.cu").write_text("kernel fwd IADD\n")
    broken_base = sass_diff(repo, "HEAD", "attention.cu")
    assert broken_base.returncode == 1 and "does not build on the base side" in broken_base.stderr


def test_a_tree_whose_units_all_include_torch_has_nothing_to_compare(tmp_path):
    repo = make_repo(tmp_path)
    (repo / "csrc" / "cuda" / "attention.cu").unlink()
    git(repo, "commit", "-qam", "torch units alone")
    done = sass_diff(repo, "HEAD")
    assert done.returncode == 2 and "no unit under csrc/cuda without torch headers" in done.stderr


def test_the_flags_are_setup_pys_nvcc_list():
    tree = ast.parse((ROOT / "setup.py").read_text())
    lists = [node.value for node in ast.walk(tree)
             if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "nvcc" for t in node.targets)]
    assert len(lists) == 1
    setup_flags = ast.literal_eval(lists[0])
    script = (ROOT / "benchmarks" / "sass_diff.sh").read_text()
    line = re.search(r"^flags=\((.*)\)$", script, re.M)
    assert line is not None
    assert line[1].split() == setup_flags
