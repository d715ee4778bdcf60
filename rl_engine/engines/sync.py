"""Weight sync from the trainer's ranks to the rollout ranks, around the launching process.

Trainer rank 0 writes the updated full weights (Hugging Face names) as one safetensors file in
shared memory and digests each tensor where it lives; every rollout rank maps that file, digests
each tensor it received and compares. Only the file's path and the digests (strings) travel
through the launching process; a tensor whose digest differs stops the run naming it (exit 3).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from rl_engine.errors import InfrastructureError


class SyncMismatch(InfrastructureError):
    """A rollout rank received a tensor whose bytes differ from the trainer's (exit code 3)."""


def tensor_digest(name: str, t: torch.Tensor) -> str:
    """sha256 over the name, dtype, shape and bytes of one tensor."""
    h = hashlib.sha256(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
    flat = t.detach().cpu().contiguous().reshape(-1)
    h.update(flat.view(torch.uint8).numpy())
    return h.hexdigest()


def digests(state: dict[str, torch.Tensor]) -> dict[str, str]:
    return {name: tensor_digest(name, state[name]) for name in sorted(state)}


def combined(per_tensor: dict[str, str]) -> str:
    """One digest of a whole state from its per-tensor digests (the same on both sides)."""
    return hashlib.sha256("".join(f"{n}={d}\n" for n, d in sorted(per_tensor.items())).encode()).hexdigest()


@dataclass(frozen=True, slots=True)
class Published:
    """What the trainer hands the rollout ranks for one step: a path and the digests."""
    path: str
    step: int
    digests: dict[str, str]
    checksum: str
    seconds: dict[str, float] = field(default_factory=dict)


def shared_folder(run_id: str) -> Path:
    """A fresh folder in shared memory (/dev/shm where the machine has it) for one run's syncs."""
    base = Path("/dev/shm") if os.access("/dev/shm", os.W_OK) else Path(tempfile.gettempdir())
    return Path(tempfile.mkdtemp(prefix=f"rlk-sync-{run_id}-", dir=base))


def remove_folder(folder: Path) -> None:
    shutil.rmtree(folder, ignore_errors=True)


def publish(state: dict[str, torch.Tensor], folder: Path, step: int) -> Published:
    """Writes the state (atomically: a reader never maps half a file) and digests it."""
    from safetensors.torch import save_file

    t0 = time.monotonic()
    cpu = {n: t.detach().cpu().contiguous() for n, t in state.items()}
    t1 = time.monotonic()
    per_tensor = digests(cpu)
    t2 = time.monotonic()
    path = Path(folder) / f"weights-step-{step:04d}.safetensors"
    tmp = path.with_name(f".{path.name}.tmp")
    save_file(cpu, str(tmp))
    os.replace(tmp, path)
    return Published(path=str(path), step=step, digests=per_tensor, checksum=combined(per_tensor),
                     seconds={"copy": round(t1 - t0, 4), "digest": round(t2 - t1, 4),
                              "write": round(time.monotonic() - t2, 4)})


def receive(published: Published) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """The published state, each tensor checked against the trainer's digest; (state, seconds)."""
    from safetensors.torch import load_file

    t0 = time.monotonic()
    state = load_file(published.path)
    t1 = time.monotonic()
    mine = digests(state)
    missing = sorted(set(published.digests) - set(mine))
    extra = sorted(set(mine) - set(published.digests))
    if missing or extra:
        raise SyncMismatch(f"weight sync of step {published.step}: tensors missing {missing[:3]}, "
                           f"unexpected {extra[:3]}")
    for name, digest in published.digests.items():
        if mine[name] != digest:
            raise SyncMismatch(f"weight sync of step {published.step}: tensor {name} arrived with "
                               f"digest {mine[name][:12]}, the trainer sent {digest[:12]}")
    return state, {"read": round(t1 - t0, 4), "digest": round(time.monotonic() - t1, 4)}
