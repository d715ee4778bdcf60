"""Weight sync from the trainer's ranks to the rollout ranks, around the launching process.

Trainer rank 0 hands over the updated full weights (Hugging Face names) and digests each tensor
where it lives; every rollout rank takes them, digests each tensor it received and compares. On
the CPU the weights go through one safetensors file in shared memory; on CUDA through CUDA IPC
handles of the trainer's own tensors (one host), so the bytes move device to device. Only the
file's path or the handles, and the digests (strings), travel through the launching process; a
tensor whose digest differs stops the run naming it (exit 3).

A digest is an exact integer fingerprint of the tensor's 16-bit words (their sum and two
position-weighted sums, all exact in int64), computed on the tensor's own device: the same on the
CPU and on any GPU, and cheap next to copying the bytes.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from rl_engine.errors import InfrastructureError


class SyncMismatch(InfrastructureError):
    """A rollout rank received a tensor whose bytes differ from the trainer's (exit code 3)."""


_PRIME = 65521  # position weights stay below 2**16, so no sum below can leave int64


def fingerprint(t: torch.Tensor) -> tuple[int, int, int]:
    """(sum of words, sum of words x (i mod p), sum of words x (i div p mod p)) over the tensor's
    bytes read as unsigned 16-bit words w_i: every product is below 2**32, so each sum is exact
    for up to 2**31 words, whatever the order the device adds them in."""
    flat = t.detach().contiguous().reshape(-1)
    if flat.element_size() % 2:
        flat = torch.cat([flat.view(torch.uint8), flat.new_zeros(1, dtype=torch.uint8)])
    words = flat.view(torch.int16).to(torch.int64) & 0xFFFF
    i = torch.arange(words.numel(), device=words.device, dtype=torch.int64)
    sums = torch.stack([words.sum(), (words * (i % _PRIME)).sum(),
                        (words * ((i // _PRIME) % _PRIME)).sum()])
    return tuple(int(v) for v in sums.tolist())


def tensor_digest(name: str, t: torch.Tensor) -> str:
    """The digest of one tensor: its name, dtype, shape and fingerprint."""
    return hashlib.sha256(f"{name}|{t.dtype}|{tuple(t.shape)}|{fingerprint(t)}".encode()).hexdigest()


def digests(state: dict[str, torch.Tensor]) -> dict[str, str]:
    return {name: tensor_digest(name, state[name]) for name in sorted(state)}


def combined(per_tensor: dict[str, str]) -> str:
    """One digest of a whole state from its per-tensor digests (the same on both sides)."""
    return hashlib.sha256("".join(f"{n}={d}\n" for n, d in sorted(per_tensor.items())).encode()).hexdigest()


@dataclass(frozen=True, slots=True)
class Published:
    """What the trainer hands the rollout ranks for one step: where the weights are (a file, or
    CUDA IPC handles of its tensors) and their digests."""
    step: int
    digests: dict[str, str]
    checksum: str
    path: str | None = None
    handles: dict[str, Any] | None = None
    seconds: dict[str, float] = field(default_factory=dict)


def shared_folder(run_id: str) -> Path:
    """A fresh folder in shared memory (/dev/shm where the machine has it) for one run's syncs."""
    base = Path("/dev/shm") if os.access("/dev/shm", os.W_OK) else Path(tempfile.gettempdir())
    return Path(tempfile.mkdtemp(prefix=f"rlk-sync-{run_id}-", dir=base))


def remove_folder(folder: Path) -> None:
    shutil.rmtree(folder, ignore_errors=True)


def publish(state: dict[str, torch.Tensor], folder: Path, step: int) -> Published:
    """Digests the state where it lives, then shares it: CUDA tensors by IPC handle (the caller
    keeps them alive until every rollout rank has loaded them), CPU tensors as a file written
    atomically (a reader never maps half of one)."""
    t0 = time.monotonic()
    per_tensor = digests(state)
    t1 = time.monotonic()
    if all(t.is_cuda for t in state.values()):
        from torch.multiprocessing.reductions import reduce_tensor

        torch.cuda.synchronize()  # the weights are final before another process reads them
        handles = {n: reduce_tensor(t.detach().contiguous()) for n, t in state.items()}
        return Published(step=step, digests=per_tensor, checksum=combined(per_tensor),
                         handles=handles, seconds={"digest": round(t1 - t0, 4),
                                                   "share": round(time.monotonic() - t1, 4)})
    from safetensors.torch import save_file

    path = Path(folder) / f"weights-step-{step:04d}.safetensors"
    tmp = path.with_name(f".{path.name}.tmp")
    save_file({n: t.detach().cpu().contiguous() for n, t in state.items()}, str(tmp))
    os.replace(tmp, path)
    return Published(step=step, digests=per_tensor, checksum=combined(per_tensor), path=str(path),
                     seconds={"digest": round(t1 - t0, 4), "share": round(time.monotonic() - t1, 4)})


def _take(published: Published) -> dict[str, torch.Tensor]:
    if published.handles is not None:
        return {n: rebuild(*args) for n, (rebuild, args) in published.handles.items()}
    from safetensors.torch import load_file

    return load_file(published.path)


def receive(published: Published) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """The published state, each tensor checked against the trainer's digest; (state, seconds)."""
    t0 = time.monotonic()
    state = _take(published)
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
