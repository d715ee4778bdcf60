"""benchmarks/kernel_ab.sh split in two: KERNEL_AB_OUT builds both sides where there is nvcc but no
GPU, KERNEL_AB_PREBUILT runs such builds without a compiler, and only for the base commit, case set
and working-tree sources they were built for. A stand-in nvcc links scripts that print kernel_ab's
lines, so the whole flow, the comparison and its exit codes run here."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

from fixtures.git_repo import git

ROOT = Path(__file__).resolve().parents[2]

# Links "binaries" that print one forward case as kernel_ab.cu does, time and hash from the
# environment (KAB_MS_BASE, KAB_OUT_NEW, ...), so each test says what each side measured.
FAKE_NVCC = r"""#!/bin/bash
out=""; compile=0; prev=""
for a in "$@"; do
  [ "$prev" = -o ] && out=$a
  [ "$a" = -c ] && compile=1
  prev=$a
done
if [ $compile = 1 ]; then echo obj > "$out"; exit 0; fi
side=$(basename "$out"); side=${side#kernel_ab-}; side=${side^^}
cat > "$out" <<EOF
#!/bin/bash
[ "\$1" = attn ] || { echo "unknown case set \$1" >&2; exit 2; }
echo "fwd t=4096 d=128 block=64 ms=\${KAB_MS_$side} out=\${KAB_OUT_$side} lse=0011"
EOF
chmod +x "$out"
"""


def make_repo(tmp_path: Path) -> Path:
    """A repository with the script and a kernel source, one commit."""
    repo = tmp_path / "repo"
    (repo / "benchmarks").mkdir(parents=True)
    shutil.copy(ROOT / "benchmarks" / "kernel_ab.sh", repo / "benchmarks" / "kernel_ab.sh")
    (repo / "benchmarks" / "kernel_ab.cu").write_text("// cases\n")
    for rel in ("include/k.cuh", "csrc/cuda/attention.cu", "csrc/cuda/attention_bwd.cu",
                "csrc/cuda/attention_decode.cu"):
        (repo / rel).parent.mkdir(parents=True, exist_ok=True)
        (repo / rel).write_text(f"// {rel}\n")
    git(repo, "init", "-q")
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "base")
    nvcc = tmp_path / "nvcc"
    nvcc.write_text(FAKE_NVCC)
    nvcc.chmod(0o755)
    return repo


def kernel_ab(repo: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "benchmarks/kernel_ab.sh", *args], cwd=repo, capture_output=True,
                          text=True, timeout=120,
                          env={"PATH": "/usr/bin:/bin", "NVCC": str(repo.parent / "nvcc"), **env})


def build(repo: Path, what: str = "attn") -> Path:
    out = repo.parent / "builds"
    done = kernel_ab(repo, "HEAD", what, KERNEL_AB_OUT=str(out))
    assert done.returncode == 0, done.stderr
    return out


def test_a_build_made_elsewhere_runs_and_compares(tmp_path):
    repo = make_repo(tmp_path)
    out = build(repo)
    base, holds, _sources, head, dirty = (out / "built-for").read_text().split()
    assert (base, holds, head, dirty) == (git(repo, "rev-parse", "HEAD"), "attn-decode", base, "clean")

    same = kernel_ab(repo, "HEAD", "attn", KERNEL_AB_PREBUILT=str(out), KAB_MS_BASE="0.5",
                     KAB_MS_NEW="0.4", KAB_OUT_BASE="ab", KAB_OUT_NEW="ab")
    assert same.returncode == 0, same.stderr
    assert "speed-up 1.250 bits same" in same.stdout
    assert "bits the same in every case" in same.stdout

    differ = kernel_ab(repo, "HEAD", "attn", KERNEL_AB_PREBUILT=str(out), KAB_MS_BASE="0.5",
                       KAB_MS_NEW="0.4", KAB_OUT_BASE="ab", KAB_OUT_NEW="cd")
    assert differ.returncode == 3
    assert "bits DIFFER" in differ.stdout and "1 with different bits" in differ.stdout


def test_a_build_for_other_sources_base_or_cases_is_refused(tmp_path):
    repo = make_repo(tmp_path)
    out = build(repo)
    run = {"KERNEL_AB_PREBUILT": str(out), "KAB_MS_BASE": "1", "KAB_MS_NEW": "1",
           "KAB_OUT_BASE": "ab", "KAB_OUT_NEW": "ab"}

    no_gemm = kernel_ab(repo, "HEAD", "gemm", **run)
    assert no_gemm.returncode == 2 and "rebuild it" in no_gemm.stderr

    (repo / "include" / "k.cuh").write_text("// changed after the build\n")
    stale = kernel_ab(repo, "HEAD", "attn", **run)
    assert stale.returncode == 2 and "from this tree's" in stale.stderr

    # The sources as built again, but a newer commit asked for as the base: only the base differs.
    (repo / "include" / "k.cuh").write_text("// include/k.cuh\n")
    assert kernel_ab(repo, "HEAD", "attn", **run).returncode == 0
    (repo / "README").write_text("not a kernel source\n")
    git(repo, "add", "README")
    git(repo, "commit", "-q", "-m", "newer base")
    other_base = kernel_ab(repo, "HEAD", "attn", **run)
    assert other_base.returncode == 2
    assert f"not {git(repo, 'rev-parse', 'HEAD')}" in other_base.stderr


def test_a_build_runs_where_the_history_lacks_its_base_named_in_full(tmp_path):
    repo = make_repo(tmp_path)
    out = build(repo)
    base = git(repo, "rev-parse", "HEAD")
    # The same files in a checkout of another history (a GPU machine's copy of the tree).
    shutil.rmtree(repo / ".git")
    git(repo, "init", "-q")
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "copy")
    run = {"KERNEL_AB_PREBUILT": str(out), "KAB_MS_BASE": "0.5", "KAB_MS_NEW": "0.5",
           "KAB_OUT_BASE": "ab", "KAB_OUT_NEW": "ab"}
    done = kernel_ab(repo, base, "attn", **run)
    assert done.returncode == 0, done.stderr
    assert "bits the same in every case" in done.stdout
    short = kernel_ab(repo, base[:12], "attn", **run)
    assert short.returncode == 2 and "full 40-digit hash" in short.stderr
    # A full hash is still checked against the one the build was made for.
    other = kernel_ab(repo, "f" * 40, "attn", **run)
    assert other.returncode == 2 and "rebuild it" in other.stderr


def test_wrong_arguments_say_what_is_wrong(tmp_path):
    repo = make_repo(tmp_path)
    bad_rev = kernel_ab(repo, "no-such-rev", "attn")
    assert bad_rev.returncode == 2 and "not a commit" in bad_rev.stderr
    bad_set = kernel_ab(repo, "HEAD", "fwd")
    assert bad_set.returncode == 2 and "unknown case set 'fwd'" in bad_set.stderr
    missing = kernel_ab(repo, "HEAD", "attn", KERNEL_AB_PREBUILT=str(tmp_path / "none"))
    assert missing.returncode == 2 and "built-for is missing" in missing.stderr
