"""One function per gate step (the run steps are in rl_engine/gate/runs.py); each returns a Result.

Exit codes follow the contract of every rlk verb: 0 pass; 1 the step's evidence shows a parity or
route failure; 2 bad input (a dirty checkout, an unknown commit, inputs that differ from their
manifest, code that does not build); 3 infrastructure (a process died or timed out, evidence is
missing). Product code (preflight, tests, runs) always runs in a subprocess started in the checkout
under test, with the checkout first on its path.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from rl_engine import errors
from rl_engine.artifacts import files, manifest, provenance
from rl_engine.errors import BadInput, InfrastructureError
from rl_engine.gate.process import product_env, run_logged

_SHA = re.compile(r"[0-9a-fA-F]{7,40}")


@dataclass(slots=True)
class Result:
    passed: bool
    exit_code: int
    reason: str = ""                       # one line, naming what failed
    details: dict[str, Any] = field(default_factory=dict)


def ok(**details: Any) -> Result:
    return Result(True, errors.OK, "", details)


def fail(code: int, reason: str, **details: Any) -> Result:
    return Result(False, code if code in (1, 2, 3) else errors.INFRASTRUCTURE, reason, details)


def code_root(gate_dir: Path, checkout: Path | None = None) -> Path:
    """The code under test: --checkout, else the checkout step's folder, else this rl_engine's."""
    if checkout is not None:
        root = Path(checkout).resolve()
        if not (root / "rl_engine").is_dir():
            raise BadInput(f"--checkout {root} holds no rl_engine package")
        return root
    record = Path(gate_dir) / "checkout.json"
    if record.is_file():
        data = files.read_json(record)
        if not data.get("passed"):
            raise BadInput(f"the checkout step failed ({data.get('reason')}); nothing to run")
        return Path(data["details"]["path"])
    return provenance.SOURCE_ROOT


# ---- checkout ------------------------------------------------------------------------------------

def _git(*args: str, cwd: Path | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "GIT_TERMINAL_PROMPT": "0"}  # a private repo fails, never waits for a password
    try:
        return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, env=env,
                              timeout=timeout)
    except subprocess.TimeoutExpired:
        raise InfrastructureError(f"git {args[0]} did not finish in {timeout:.0f} s") from None


def _resolve(root: Path, commit: str) -> str | None:
    out = _git("rev-parse", "--verify", "--quiet", f"{commit}^{{commit}}", cwd=root)
    return out.stdout.strip() if out.returncode == 0 else None


def _describe(root: Path) -> dict[str, Any]:
    head = _git("log", "-1", "--format=%H%n%cI%n%s", cwd=root)
    status = _git("status", "--porcelain", cwd=root)  # untracked files count; ignored ones do not
    if head.returncode or status.returncode:
        raise InfrastructureError(f"git cannot read {root}: {(head.stderr or status.stderr).strip()}")
    sha, date, subject = (head.stdout.splitlines() + ["", ""])[:3]
    return {"path": str(root), "commit": sha, "committed_at": date, "subject": subject,
            "status": status.stdout.splitlines()[:50]}


def _clone(repo: str, root: Path, commit: str) -> Result | None:
    # "--": a repository that reads as an option (--upload-pack=...) is still a repository.
    clone = _git("clone", "--quiet", "--no-checkout", "--", repo, str(root), timeout=3600)
    if clone.returncode:
        msg = (clone.stderr.strip().splitlines() or ["no output"])[-1]
        missing = re.search(r"does not exist|not found|not a git repository|not appear to be a git",
                            msg, re.IGNORECASE)
        return fail(errors.BAD_INPUT if missing else errors.INFRASTRUCTURE,
                    f"git clone {repo} failed: {msg}", repo=repo)
    sha = _resolve(root, commit)
    if sha is None:  # a commit no branch holds (a pull request's, say) may still be fetched by id
        _git("fetch", "--quiet", "origin", commit, cwd=root, timeout=3600)
        sha = _resolve(root, commit)
    if sha is None:
        return fail(errors.BAD_INPUT, f"commit {commit} is not in {repo}", repo=repo)
    out = _git("checkout", "--quiet", "--detach", sha, cwd=root)
    if out.returncode:
        return fail(errors.INFRASTRUCTURE, f"git checkout {sha} failed: {out.stderr.strip()}")
    return None


def checkout(gate_dir: Path, *, repo: str | None = None, commit: str | None = None,
             dest: Path | None = None, source: Path | None = None) -> Result:
    """A clean checkout of the pinned commit (clone + detached checkout), or --source: an existing
    checkout that must be clean (at --commit when given)."""
    if (repo is None) == (source is None):
        raise BadInput("give --repo with --commit (and --dest), or --source for an existing checkout")
    if commit is not None and not _SHA.fullmatch(commit):
        raise BadInput(f"--commit {commit!r} is not a commit id (7 to 40 hex digits); a branch or "
                       "tag is not pinned")
    if source is not None:
        top = _git("rev-parse", "--show-toplevel", cwd=Path(source))
        if top.returncode:
            raise BadInput(f"--source {source} is not a git checkout")
        root = Path(top.stdout.strip()).resolve()
    else:
        if commit is None:
            raise BadInput("--repo needs --commit: the gate checks out a pinned commit")
        root = Path(dest).resolve() if dest else Path(gate_dir) / "checkout"
        if root.exists() and any(root.iterdir()):
            # A retried step reuses its finished checkout; any other content is refused.
            top = _git("rev-parse", "--show-toplevel", cwd=root).stdout.strip()
            if (not top or Path(top).resolve() != root
                    or not (_resolve(root, "HEAD") or "").startswith(commit.lower())):
                raise BadInput(f"--dest {root} already holds something else; give an empty folder")
        elif (failed := _clone(repo, root, commit)) is not None:
            return failed
    info = {**_describe(root), "repo": repo or str(root)}
    if commit is not None and not info["commit"].startswith(commit.lower()):
        return fail(errors.BAD_INPUT, f"{root} is at {info['commit']}, not the pinned {commit}", **info)
    if info["status"]:
        return fail(errors.BAD_INPUT, f"checkout {root} is not clean: {len(info['status'])} paths "
                                      f"differ, first {info['status'][0].strip()!r}", **info)
    return ok(**info)


# ---- build ---------------------------------------------------------------------------------------

_PROBE = r"""
import json, sys
import rl_engine
from rl_engine.runtime import preflight
from rl_engine.runtime.plan import Plan
out = {"rl_engine": rl_engine.__file__, "checks": []}
for c in preflight.run(Plan(), sys.argv[1]):
    out["checks"].append({"name": c.name, "ok": c.ok, "detail": c.detail, "exit_code": c.exit_code})
from rl_engine.ops import _lib
if _lib.available():
    from rl_engine import _C
    from rl_engine.evidence.records import kernel_totals
    ops = _lib.ops()
    out["extension"] = {"file": _C.__file__, "flags": json.loads(ops.build_info()),
                        "sm90_compiled": bool(ops.det_gemm_sm90_compiled())}
    out["kernel_totals"] = kernel_totals()
print("RLK-GATE-PROBE " + json.dumps(out), flush=True)
"""


def _stale_sources(root: Path, library: Path, cuda: bool) -> list[str]:
    """Sources of this build newer than its library (CUDA sources only count in a CUDA build)."""
    built = library.stat().st_mtime
    paths = [root / "setup.py", *(root / "csrc").rglob("*"), *(root / "include").rglob("*")]
    newer = []
    for p in paths:
        if not p.is_file() or (not cuda and ("cuda" in p.relative_to(root).parts
                                             or p.suffix in (".cu", ".cuh"))):
            continue
        if p.stat().st_mtime > built:
            newer.append(str(p.relative_to(root)))
    return sorted(newer)


def _probe(root: Path, device: str, log: Path) -> dict[str, Any] | str:
    """The probe's findings, or why there are none."""
    start = log.stat().st_size if log.exists() else 0
    code = run_logged([sys.executable, "-c", _PROBE, device], cwd=root, log=log, env=product_env(root),
                      timeout=1800)
    with open(log, errors="replace") as fh:
        fh.seek(start)
        lines = fh.read().splitlines()
    found = [ln for ln in lines if ln.startswith("RLK-GATE-PROBE ")]
    if code == 0 and found:
        return json.loads(found[-1].split(" ", 1)[1])
    last = next((ln.strip() for ln in reversed(lines) if ln.strip()), "no output")
    return f"the preflight probe {'hung' if code is None else f'exited {code}'}: {last}"


def build(gate_dir: Path, *, checkout: Path | None, install: bool, device: str) -> Result:
    """Builds the checkout into this environment (or, with install off, requires its existing build
    to be newer than its sources), then runs preflight on the control plan in the checkout."""
    if device not in ("cpu", "cuda"):
        raise BadInput(f"--device {device!r}: use cpu or cuda")
    root = code_root(gate_dir, checkout)
    log = Path(gate_dir) / "build.log"
    details: dict[str, Any] = {"checkout": str(root), "install": install, "device": device}
    if install:
        cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-build-isolation", "--no-deps",
               "-e", str(root)]
        env = product_env(root, RLK_BUILD_CUDA="1" if device == "cuda" else None)
        code = run_logged(cmd, cwd=root, log=log, env=env, timeout=7200)
        if code != 0:
            return fail(errors.BAD_INPUT if code else errors.INFRASTRUCTURE,
                        f"pip install of {root} {'timed out' if code is None else f'exited {code}'}; "
                        f"see {log}", **details)
    libraries = sorted((root / "rl_engine").glob("_C*.so"))
    if not libraries:
        return fail(errors.BAD_INPUT, f"{root} has no built extension; run the build with --install",
                    **details)
    probe = _probe(root, device, log)
    if isinstance(probe, str):
        return fail(errors.INFRASTRUCTURE, f"{probe} (see {log})", **details)
    details.update(rl_engine=probe["rl_engine"], preflight=probe["checks"],
                   extension=probe.get("extension"), kernel_totals=probe.get("kernel_totals"))
    if not Path(probe["rl_engine"]).resolve().is_relative_to(root):
        return fail(errors.BAD_INPUT, f"the probe imported rl_engine from {probe['rl_engine']}, "
                                      f"not from the checkout {root}", **details)
    bad = next((c for c in probe["checks"] if not c["ok"]), None)
    if bad is not None:
        return fail(bad["exit_code"], f"preflight: {bad['name']}: {bad['detail']}", **details)
    ext = probe.get("extension") or {}
    if not install:
        stale = _stale_sources(root, libraries[-1], bool(ext.get("flags", {}).get("cuda")))
        details["stale_sources"] = stale
        if stale:
            return fail(errors.BAD_INPUT, f"the build is older than {len(stale)} of its sources "
                                          f"(first {stale[0]}); run the build with --install", **details)
    if device == "cuda":
        sm90 = {k: n for k, n in (probe.get("kernel_totals") or {}).items() if ".sm90." in k}
        if not ext.get("sm90_compiled") or not sm90:
            return fail(errors.BAD_INPUT, "the Hopper (sm90) kernels are not compiled or no probe "
                                          "launched them; build with RLK_BUILD_CUDA=1 on a CUDA host",
                        **details)
    return ok(**details)


# ---- inputs and tests ----------------------------------------------------------------------------

def verify_inputs(gate_dir: Path, *, manifest_file: Path | None, model_root: Path | None,
                  prompt_data: Path | None) -> Result:
    """The inputs match their recorded hashes: --manifest (a run's manifest.json or a sha256sum
    file) as recorded; a model folder against its manifest.sha256; with both, every file of the
    model and the prompts must be recorded in --manifest too. Nothing given: the embedded model."""
    from rl_engine.models import checkpoint
    from rl_engine.step import inputs as step_inputs

    problems: list[str] = []
    checked: dict[str, str] = {}
    if manifest_file is not None:
        if not Path(manifest_file).is_file():
            raise BadInput(f"--manifest {manifest_file} does not exist")
        problems += manifest.verify(manifest_file)
        checked.update(manifest.expected_hashes(manifest_file))
    if model_root is None and prompt_data is None and manifest_file is None:
        model_root = step_inputs.embedded_model()
    if prompt_data is not None and manifest_file is None:
        raise BadInput("--prompt-data has no recorded hash to compare with; give --manifest")
    wanted: list[Path] = [Path(prompt_data)] if prompt_data is not None else []
    if model_root is not None:
        root = Path(model_root)
        if not root.is_dir():
            raise BadInput(f"--model-root {root} is not a folder")
        own = root / "manifest.sha256"
        if own.is_file():
            problems += manifest.verify(own)
            checked.update(manifest.expected_hashes(own))
        elif manifest_file is None:
            raise BadInput(f"{root} has no manifest.sha256; give --manifest with its recorded hashes")
        wanted += [root / "config.json", *checkpoint.weight_files(root)]
        wanted += [p for p in (root / "tokenizer.json", root / "tokenizer_config.json") if p.exists()]
    if manifest_file is not None:
        recorded = manifest.expected_hashes(manifest_file)
        for name, digest in manifest.hash_inputs(wanted).items():
            if name not in recorded:
                problems.append(f"{name}: not recorded in {manifest_file}")
            elif recorded[name] != digest:
                problems.append(f"{name}: sha256 differs from the recorded {recorded[name][:12]}...")
    details = {"manifest": str(manifest_file) if manifest_file else None,
               "model_root": str(model_root) if model_root else None,
               "prompt_data": str(prompt_data) if prompt_data else None,
               "files": checked, "problems": problems}
    if problems:
        return fail(errors.BAD_INPUT, f"{len(problems)} inputs differ: {problems[0]}", **details)
    return ok(**details)


def _junit(path: Path) -> dict[str, int]:
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return {}
    suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
    return {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}


def tests(gate_dir: Path, *, select: Sequence[str], keyword: str | None, checkout: Path | None,
          timeout: float | None = None) -> Result:
    """pytest on the selected paths (and -k keyword) in the checkout; tests.log and JUnit XML."""
    if not select and not keyword:
        raise BadInput("give --select PATH (repeatable) and/or --keyword EXPR: the tests to run")
    root = code_root(gate_dir, checkout)
    gate_dir = Path(gate_dir)
    junit, log = gate_dir / "tests-junit.xml", gate_dir / "tests.log"
    junit.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}",
           *select, *(["-k", keyword] if keyword else [])]
    code = run_logged(cmd, cwd=root, log=log, env=product_env(root), timeout=timeout)
    counts = _junit(junit)
    details = {"checkout": str(root), "select": list(select), "keyword": keyword, "pytest_exit_code": code,
               "log": str(log), "junit": str(junit) if junit.exists() else None, **counts}
    if code == 0:
        return ok(**details)
    if code == 1:
        bad = counts.get("failures", 0) + counts.get("errors", 0)
        return fail(errors.PARITY_FAILURE, f"{bad} of {counts.get('tests', '?')} tests failed; see {log}",
                    **details)
    if code in (4, 5):
        what = "no test matched the selection" if code == 5 else "pytest refused its arguments"
        return fail(errors.BAD_INPUT, f"{what}; see {log}", **details)
    return fail(errors.INFRASTRUCTURE, f"pytest {'timed out' if code is None else f'exited {code}'}; "
                                       f"see {log}", **details)
