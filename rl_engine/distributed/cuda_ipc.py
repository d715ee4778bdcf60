"""Fixed-order collectives between the GPUs of one host over CUDA IPC (transport `cuda_ag_rs`).

Each rank of a process group allocates one buffer, exports its IPC handle, and maps every peer's
buffer; the handles travel once over the process group. A collective is then one kernel per rank
(csrc/cuda/ipc_collectives_op.cpp): the payload is stored straight into the peers' buffers,
ordered by flags in those buffers, and summed in rank order 0..N-1 in fp32, the same steps at every
message size. No host synchronisation happens per call, so calls can be captured in CUDA graphs
once the buffers are large enough (a larger message grows them, which is a host-side exchange:
run each message size once before capturing).

A communicator serves one process group on one GPU, and its collectives must be issued on one
stream at a time, in the same order on every rank of the group, like any collective.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from rl_engine.ops import _lib

TRANSPORT = "cuda_ag_rs"
KINDS: dict[str, int] = {"all_gather": 0, "reduce_scatter": 1, "all_reduce": 2}
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# Smallest staging area; it doubles until a message fits.
MIN_STAGE_BYTES = 1 << 20


class IpcUnavailable(RuntimeError):
    """The GPUs of this group cannot run the IPC collectives (a build without the sm_90a kernels,
    too many ranks, or GPUs that are not peers of one host)."""


class Communicator:
    def __init__(self, group) -> None:
        ops = _lib.ops()
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.device = torch.device("cuda", torch.cuda.current_device())
        flag_bytes, _, max_ranks, max_blocks = ops.ipc_layout(0, 0, 1, 2)
        if max_ranks == 0:
            raise IpcUnavailable("the CUDA IPC collectives are not in this build of rl_engine._C; "
                                 "rebuild on a machine with a CUDA toolkit and a CUDA torch")
        if self.world > max_ranks:
            raise IpcUnavailable(f"{self.world} ranks: the CUDA IPC collectives take at most "
                                 f"{max_ranks} GPUs of one host")
        self.flag_bytes = flag_bytes
        self.epochs = torch.zeros(max_blocks, dtype=torch.int64, device=self.device)
        self.sms = torch.cuda.get_device_properties(self.device).multi_processor_count
        # One block per SM at most: the per-block barriers need every block of a grid resident.
        self.max_blocks = min(max_blocks, self.sms)
        self.stage_bytes = 0
        self.buffers: list[torch.Tensor] = []

    def buffers_for(self, kind: str, x: torch.Tensor) -> list[torch.Tensor]:
        numel = x.numel() // self.world if kind == "reduce_scatter" else x.numel()
        need = _stage_bytes(kind, numel, self.world, x.element_size())
        if need > self.stage_bytes:
            self._grow(need)
        return self.buffers

    def _grow(self, need: int) -> None:
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"cuda_ipc: a {need}-byte staging area is needed while a CUDA graph "
                               "is being captured; run this message size once before capturing")
        ops = _lib.ops()
        stage = max(MIN_STAGE_BYTES, self.stage_bytes)
        while stage < need:
            stage *= 2
        # Every rank's kernels on the old buffers end before any rank frees them.
        torch.cuda.synchronize(self.device)
        agreed: list = [None] * self.world
        dist.all_gather_object(agreed, (self.sms, stage), group=self.group)
        if len({a for a in agreed}) != 1:
            raise IpcUnavailable(f"ranks disagree on (SMs, staging bytes): {agreed}; the IPC "
                                 "collectives need the same GPU model and the same calls on every rank")
        self.buffers = []
        own = ops.ipc_buffer(self.epochs, self.flag_bytes + stage)
        self.epochs.zero_()  # the new flags start at zero on every rank
        handles: list = [None] * self.world
        dist.all_gather_object(handles, bytes(ops.ipc_handle(own).numpy().tobytes()),
                               group=self.group)
        self.buffers = [own if p == self.rank else
                        ops.ipc_open(torch.frombuffer(bytearray(h), dtype=torch.uint8), own,
                                     self.flag_bytes + stage)
                        for p, h in enumerate(handles)]
        self.stage_bytes = stage

    def run(self, kind: str, x: torch.Tensor) -> torch.Tensor:
        x = x.detach().contiguous()
        if x.dtype not in DTYPES:
            if kind == "all_gather":
                return self._gather_words(x)
            raise TypeError(f"cuda_ipc {kind}: {x.dtype} tensors are not summed here; the IPC "
                            "collectives sum bf16, fp16 or fp32")
        if x.device != self.device:
            raise ValueError(f"cuda_ipc: tensor on {x.device}, this rank's GPU is {self.device}")
        op = getattr(_lib.ops(), f"ipc_{kind}")
        return op(x, self.buffers_for(kind, x), self.rank, self.epochs, self.max_blocks)

    def _gather_words(self, x: torch.Tensor) -> torch.Tensor:
        """All-gather of a dtype the kernels do not sum (token ids, positions): the kernel only
        loads and stores, so the bytes travel unchanged as 4- or 2-byte words."""
        raw = x.reshape(-1).view(torch.uint8)
        word = torch.float32 if raw.numel() % 4 == 0 else torch.bfloat16
        if raw.numel() % 2:
            raise TypeError(f"cuda_ipc all_gather: {x.dtype} tensor of {raw.numel()} bytes; an "
                            "odd byte count cannot travel as 2-byte words, pad it to an even size")
        out = self.run("all_gather", raw.view(word)).view(torch.uint8).view(x.dtype)
        return out.reshape(self.world * x.shape[0], *x.shape[1:]) if x.dim() else out


@functools.lru_cache(maxsize=1024)
def _stage_bytes(kind: str, numel: int, world: int, element_size: int) -> int:
    """Staging bytes a collective needs (the extension's layout), asked once per message shape:
    the same shapes recur every layer and every decode step."""
    return _lib.ops().ipc_layout(KINDS[kind], numel, world, element_size)[1]


# One communicator per process group (keyed by the group object, which it keeps alive) and GPU.
_COMMUNICATORS: dict[tuple[int, int], Communicator] = {}


def communicator(group) -> Communicator:
    group = group if group is not None else dist.group.WORLD
    key = (id(group), torch.cuda.current_device())
    if key not in _COMMUNICATORS:
        _COMMUNICATORS[key] = Communicator(group)
    return _COMMUNICATORS[key]


def all_gather(x: torch.Tensor, group) -> torch.Tensor:
    """Every rank's x concatenated along dim 0 in rank order."""
    return communicator(group).run("all_gather", x)


def reduce_scatter(x: torch.Tensor, group) -> torch.Tensor:
    """This rank's equal share (dim 0) of the rank-order fp32 sum of x, rounded once."""
    return communicator(group).run("reduce_scatter", x)


def all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    """The rank-order fp32 sum of x over the group, rounded once to x's dtype."""
    return communicator(group).run("all_reduce", x)


def release() -> None:
    """Unmaps every peer buffer and frees this process's buffers, after its kernels ended (call
    on every rank together, e.g. before the process group is destroyed)."""
    if _COMMUNICATORS:
        torch.cuda.synchronize()
    _COMMUNICATORS.clear()
