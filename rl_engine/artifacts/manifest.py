"""manifest.json, written before a step starts: code, environment and the hash of every input.

`verify` checks inputs against a recorded manifest or a `sha256sum`-format file.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import platform
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from rl_engine.artifacts import files, provenance
from rl_engine.errors import BadInput

_CHUNK = 1 << 20


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def hash_inputs(paths: list[Path]) -> dict[str, str]:
    """{absolute path: sha256}; an unreadable input is a BadInput naming it."""
    out = {}
    for p in paths:
        try:
            out[str(Path(p).resolve())] = sha256(Path(p))
        except OSError as exc:
            raise BadInput(f"cannot read input {p}: {exc.strerror or exc}") from None
    return out


def _pip_freeze() -> list[str]:
    return sorted(f"{d.metadata['Name']}=={d.version}" for d in importlib.metadata.distributions()
                  if d.metadata["Name"])


def _nvidia_smi() -> str | None:
    if not shutil.which("nvidia-smi"):
        return None
    try:
        return subprocess.run(["nvidia-smi", "-q"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        return f"nvidia-smi failed: {exc}"


def _build_info() -> Any:
    from rl_engine.ops import _lib

    if not _lib.available():
        return None
    ops = _lib.ops()
    return {"flags": json.loads(ops.build_info()), "sm90_compiled": bool(ops.det_gemm_sm90_compiled())}


def build(*, run_id: str, plan: dict, layout: dict, inputs: dict[str, list[Path]]) -> dict[str, Any]:
    import torch

    src = provenance.source()
    return {
        "run_id": run_id,
        "source_commit": src["commit"],
        "source_dirty": src["dirty"],
        "plan": plan,
        "layout": layout,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "gpu": _nvidia_smi() if torch.cuda.is_available() else None,
        "extension": _build_info(),
        "pip_freeze": _pip_freeze(),
        "inputs": {kind: hash_inputs(paths) for kind, paths in inputs.items()},
    }


def write(path: Path, manifest: dict[str, Any]) -> Path:
    return files.write_json(path, manifest)


def expected_hashes(path: Path) -> dict[str, str]:
    """{file: sha256} from a manifest.json or a sha256sum-format file."""
    text = Path(path).read_text()
    if Path(path).suffix == ".json":
        data = json.loads(text)
        return {f: h for group in data.get("inputs", {}).values() for f, h in group.items()}
    out = {}
    base = Path(path).resolve().parent
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        parts = line.split(maxsplit=1)
        if len(parts) != 2 or len(parts[0]) != 64:
            raise BadInput(f"{path}:{n}: not a sha256sum line ('<64 hex>  <file>')")
        name = parts[1].lstrip("*").strip()
        out[str((base / name).resolve())] = parts[0]
    return out


def verify(path: Path) -> list[str]:
    """Problems found (empty when every file matches)."""
    problems = []
    for name, want in expected_hashes(path).items():
        p = Path(name)
        if not p.exists():
            problems.append(f"{name}: missing")
        elif sha256(p) != want:
            problems.append(f"{name}: sha256 differs from the recorded {want[:12]}...")
    return problems
