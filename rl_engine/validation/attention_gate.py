"""The attention gate: rl_engine's strict attention core, sharded over TP x CP x replicas, must give
the bits of the same computation on one rank.

Every rank builds the same full inputs from a seed and computes the one-rank reference itself
(attention_fwd and one attention_bwd call over whole sequences). Its shard is the trainer's: TP
splits the heads (Hq/T query and Hkv/T kv heads per rank, GQA groups kept whole), CP splits each
sequence into Megatron's load-balanced chunks (packing.MicroBatch), the rank's queries attend to
the causal prefix gathered over CP through the chosen transport, and dK/dV are fp32 partials, one
per query chunk, added in global chunk order after the transport delivered them. The transport only
moves bytes; both end in the same ordered sum (collectives.sum_in_order). Replicas (DP) repeat the
computation independently and must agree, and every repeat must give the same bits again.

On CUDA (one GPU per rank) the inputs are still generated on the CPU from the seed, so both devices
start from the same bits, then moved to the rank's GPU; the reference and the shards run the same
routed ops, which dispatch to the Hopper kernels. `cuda_ag_rs` is the same code as `cpu_ag_rs`: the
fixed-order all-gather takes its CUDA path because the tensors live on the GPU.

The geometry (row ownership, backward calls, where each chunk's partial lands) is the trainer's
ContextParallelAttention; its autograd function is not reused because it returns no LSE and its
exchange is fixed to the all-gather collective.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
from typing import Any

import torch

from rl_engine.distributed import p2p
from rl_engine.engines.train import layout as layouts
from rl_engine.engines.train.context_parallel import ContextParallelAttention, RowExchange
from rl_engine.engines.train.packing import MicroBatch
from rl_engine.errors import BadInput
from rl_engine.ops import attention as attn_ops
from rl_engine.runtime.plan import Plan
from rl_engine.runtime.routing import Router

DEVICES = ("cpu", "cuda")
# The CP transports of each device: point to point, or the fixed-order collectives of that device.
TRANSPORTS = {"cpu": ("p2p_reference", "cpu_ag_rs"), "cuda": ("p2p_reference", "cuda_ag_rs")}
# The runbooks' names for the same transports.
ALIASES = {"p2p_nccl_reference": "p2p_reference"}
TENSORS = ("out", "lse", "dq", "dk", "dv")
CORE_IDS = {"cpu": "rlkernel.attention.cpu.v1", "cuda": "rlkernel.attention.sm90.v1"}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
HEAD_DIM = {"cpu": 32, "cuda": 64}
MODULE = "attention"


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class GateConfig:
    world_size: int
    tp: int = 1
    cp: int = 1
    device: str = "cpu"
    transports: tuple[str, ...] | None = None  # None: both transports of the device
    dtype: str = "bf16"
    seq_lens: tuple[int, ...] = (128, 200)
    heads: int = 8
    kv_heads: int = 4
    head_dim: int | None = None  # None: HEAD_DIM of the device
    repeats: int = 2
    seed: int = 0
    block: int | None = None  # None: kv_block_size of head_dim, as a model of it runs

    def __post_init__(self) -> None:
        if self.device not in DEVICES:
            raise BadInput(f"--device {self.device!r}: use cpu or cuda")
        if self.transports is None:
            object.__setattr__(self, "transports", TRANSPORTS[self.device])
        object.__setattr__(self, "transports", tuple(ALIASES.get(t, t) for t in self.transports))
        if self.head_dim is None:
            object.__setattr__(self, "head_dim", HEAD_DIM[self.device])
        for name in ("world_size", "tp", "cp", "heads", "kv_heads", "head_dim", "repeats"):
            if getattr(self, name) < 1:
                raise BadInput(f"--{name.replace('_', '-')} {getattr(self, name)} must be at least 1")
        if self.world_size % (self.tp * self.cp):
            raise BadInput(f"--world-size {self.world_size} is not TP x CP x replicas: "
                           f"{self.tp} x {self.cp} does not divide it")
        for name, n in (("query heads", self.heads), ("kv heads", self.kv_heads)):
            if n % self.tp:
                raise BadInput(f"{n} {name} cannot be split over TP={self.tp}")
        if self.heads % self.kv_heads:
            raise BadInput(f"{self.heads} query heads are not a multiple of {self.kv_heads} kv heads")
        if self.head_dim % 8:
            raise BadInput(f"head_dim {self.head_dim} must be a multiple of 8")
        if self.block is None:
            object.__setattr__(self, "block", attn_ops.kv_block_size(self.head_dim))
        if not self.seq_lens or min(self.seq_lens) < 1:
            raise BadInput(f"sequence lengths {list(self.seq_lens)} must be positive")
        if self.dtype not in DTYPES:
            raise BadInput(f"dtype {self.dtype!r}: use one of {', '.join(DTYPES)}")
        allowed = TRANSPORTS[self.device]
        bad = [t for t in self.transports if t not in allowed]
        if bad or not self.transports:
            elsewhere = [f"{t} needs --device {d}" for t in bad for d in DEVICES
                         if d != self.device and t in TRANSPORTS[d]]
            hint = f" ({'; '.join(elsewhere)})" if elsewhere else ""
            raise BadInput(f"transport {', '.join(bad) or '(none)'}: with --device {self.device} "
                           f"use {' or '.join(allowed)}{hint}")
        # The Hopper kernels take fewer shapes than the CPU ones (any head_dim a multiple of 8):
        # refused here, before any GPU is taken, rather than by each rank's kernel.
        cuda_only = (("--head-dim", self.head_dim, (64, 128)),
                     ("--dtype", self.dtype, ("bf16", "fp16")),
                     ("kv block size", self.block, (16, 32, 64, 128)))
        for what, value, takes in cuda_only if self.device == "cuda" else ():
            if value not in takes:
                raise BadInput(f"{what} {value}: the CUDA attention kernels take "
                               f"{' or '.join(map(str, takes))}")

    @property
    def replicas(self) -> int:
        return self.world_size // (self.tp * self.cp)

    @property
    def scale(self) -> float:
        return self.head_dim ** -0.5

    @property
    def core(self) -> str:
        return CORE_IDS[self.device]


def bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bit patterns as integers of the same width (so -0 != +0 and NaNs compare)."""
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    return t.contiguous().view(ints[t.element_size()])


def compare(got: torch.Tensor, want: torch.Tensor) -> tuple[float, bool]:
    """(max |got - want| over elements whose bits differ, bitwise equal)."""
    if got.shape != want.shape or got.dtype != want.dtype:
        return float("inf"), False
    same = bits(got) == bits(want)
    if bool(same.all()):
        return 0.0, True
    return float((got.float() - want.float()).abs()[~same].max()), False


def digest(tensors: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for name in sorted(tensors):
        h.update(name.encode())
        h.update(bits(tensors[name]).cpu().numpy().tobytes())
    return h.hexdigest()


def _inputs(cfg: GateConfig) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(cfg.seed)
    total, dtype = sum(cfg.seq_lens), DTYPES[cfg.dtype]
    shapes = {"q": cfg.heads, "k": cfg.kv_heads, "v": cfg.kv_heads, "grad_out": cfg.heads}
    return {name: torch.randn(total, h, cfg.head_dim, generator=g).to(dtype)
            for name, h in shapes.items()}


def reference(cfg: GateConfig, x: dict[str, torch.Tensor], router: Router) -> dict[str, torch.Tensor]:
    """The one-rank computation: whole sequences, every head, one backward call, on x's device.
    router: a strict one of its own, so the shards' call counts do not include the reference's."""
    dev = x["q"].device
    cu = torch.tensor([0, *torch.tensor(cfg.seq_lens).cumsum(0).tolist()], dtype=torch.int32,
                      device=dev)
    pos = torch.cat([torch.arange(n) for n in cfg.seq_lens]).to(dev)
    out, lse = router.attention_lse(MODULE, x["q"], x["k"], x["v"], cu, cu, pos, cfg.scale,
                                    cfg.block)
    dq, dk, dv = router.attention_backward(MODULE, x["grad_out"], x["q"], x["k"], x["v"], out, lse,
                                           cu, cu, pos, cfg.scale, cfg.block)
    return {"out": out, "lse": lse, "dq": dq, "dk": dk, "dv": dv}


def _gather_rows(x, cpa: ContextParallelAttention, transport: str, router: Router, group):
    """All K (or V) rows of the micro-batch in one-rank row order, from each CP rank's rows."""
    ex = cpa.exchange
    if transport != p2p.TRANSPORT:  # cpu_ag_rs or cuda_ag_rs: the device comes from x
        return ex.gather(x, router, MODULE)
    padded = torch.cat([x, x.new_zeros((ex.width - x.shape[0], *x.shape[1:]))])
    return router.point_to_point(MODULE, "all_gather", padded, group)[ex.index]


def _partials_in_chunk_order(parts, cpa: ContextParallelAttention, owned: list[torch.Tensor],
                             transport: str, router: Router, group) -> torch.Tensor:
    """[chunks, own key rows, 2, Hkv, D]: every chunk's dK/dV partial of this rank's key rows, in
    global chunk order (zero rows for chunks past a sequence's end), whichever rank computed it.
    owned: each CP rank's key rows, on parts' device."""
    if transport != p2p.TRANSPORT:  # the trainer's: every partial to every rank, then pick
        gathered = router.collective(MODULE, "all_gather", parts, group)
        flat = torch.cat([gathered.flatten(0, 1), gathered.new_zeros((1, *gathered.shape[2:]))])
        return flat[cpa.dkv_index]
    # p2p: each peer gets only the partials of the key rows it owns: [CP, calls, own rows, ...].
    rank, cp, calls = cpa.exchange.rank, len(owned), cpa.calls_max
    n_own, total = owned[rank].numel(), parts.shape[1]
    recv = router.point_to_point(MODULE, "all_to_all", [parts[:, o].contiguous() for o in owned],
                                 group, recv_shape=(calls, n_own, *parts.shape[2:]))
    flat = torch.cat([recv.flatten(0, 2), recv.new_zeros((1, *recv.shape[3:]))])
    # Re-address the trainer's index: slot s of global key row g becomes slot s of own row i.
    idx = cpa.dkv_index
    zero = idx == cp * calls * total
    local = torch.arange(n_own, device=idx.device)[None, :]
    assert bool(((idx % total) == owned[rank][None, :]).logical_or(zero).all())
    return flat[torch.where(zero, cp * calls * n_own, (idx // total) * n_own + local)]


def sharded(cfg: GateConfig, x: dict[str, torch.Tensor], cpa: ContextParallelAttention,
            owned: list[torch.Tensor], transport: str, router: Router, group) -> dict[str, torch.Tensor]:
    """This rank's Out, LSE, dQ (its query rows) and fp32 dK, dV (its key rows), for its heads."""
    q, g_out = x["q"], x["grad_out"]
    k_all = _gather_rows(x["k"], cpa, transport, router, group)
    v_all = _gather_rows(x["v"], cpa, transport, router, group)
    out, lse = router.attention_lse(MODULE, q, k_all, v_all, cpa.cu_q, cpa.cu_k, cpa.q_pos,
                                    cfg.scale, cfg.block)
    dq = torch.empty_like(q)
    parts = torch.zeros((cpa.calls_max, k_all.shape[0], 2, *k_all.shape[1:]),
                        device=k_all.device)
    for j, (rows, cu_q, pos) in enumerate(cpa.calls):
        dq[rows], parts[j, :, 0], parts[j, :, 1] = router.attention_backward(
            MODULE, g_out[rows], q[rows], k_all, v_all, out[rows], lse[rows], cu_q, cpa.cu_k, pos,
            cfg.scale, cfg.block)
    ordered = _partials_in_chunk_order(parts, cpa, owned, transport, router, group)
    if ordered.shape[0] > 1:
        dkv = router.sum_in_order(MODULE, list(ordered))
    else:
        dkv = ordered[0]
    return {"out": out, "lse": lse, "dq": dq, "dk": dkv[:, 0], "dv": dkv[:, 1]}


def _strict_router(device) -> Router:
    return Router(Plan(mode="strict"), side="training", engine="builtin", device=device)


def gate_worker(rank: int, world: int, cfg: GateConfig) -> dict[str, Any]:
    """One rank: its shard for every transport and repeat, compared with its own reference."""
    import torch.distributed as dist

    from rl_engine.engines.launch import rank_device

    dev = rank_device(cfg.device)
    lay = layouts.build(cfg.tp, cfg.cp, cfg.replicas)
    full = _inputs(cfg)  # on the CPU: the same bits on every device
    ref = reference(cfg, {name: t.to(dev) for name, t in full.items()}, _strict_router(dev))
    mb = MicroBatch(list(cfg.seq_lens), cfg.cp, cfg.block)
    owned = [mb.rows(r) for r in range(cfg.cp)]
    owned_dev = [o.to(dev) for o in owned]
    rows = owned[lay.cp_rank]
    hq = slice(lay.tp_rank * cfg.heads // cfg.tp, (lay.tp_rank + 1) * cfg.heads // cfg.tp)
    hkv = slice(lay.tp_rank * cfg.kv_heads // cfg.tp, (lay.tp_rank + 1) * cfg.kv_heads // cfg.tp)
    heads = {"q": hq, "grad_out": hq, "k": hkv, "v": hkv}
    x = {name: t[rows][:, heads[name]].contiguous().to(dev) for name, t in full.items()}
    want = {name: ref[name][owned_dev[lay.cp_rank]][:, hkv if name in ("dk", "dv") else hq]
            for name in TENSORS}
    out: dict[str, Any] = {"rank": rank, "tp_rank": lay.tp_rank, "cp_rank": lay.cp_rank,
                           "replica": lay.dp_rank, "query_rows": int(rows.numel()),
                           "device": str(dev),
                           "process_group_backend": str(dist.get_backend(lay.cp_group)),
                           "reference_digest": digest(ref), "transports": {}}
    for transport in cfg.transports:
        router = _strict_router(dev)
        ex = RowExchange(owned, torch.arange(mb.total), lay.cp_rank, lay.cp_group, device=dev)
        cpa = ContextParallelAttention(router, mb, ex, cfg.scale)
        runs = [sharded(cfg, x, cpa, owned_dev, transport, router, lay.cp_group)
                for _ in range(cfg.repeats)]
        tensors = {}
        for name in TENSORS:
            diffs = [compare(r[name], want[name]) for r in runs]
            tensors[name] = {"max_abs_diff": max(d for d, _ in diffs),
                             "bitwise": all(b for _, b in diffs),
                             "run_to_run_bitwise": all(compare(r[name], runs[0][name])[1]
                                                       for r in runs)}
        record = router.records[MODULE]
        out["transports"][transport] = {
            "tensors": tensors, "digest": digest(runs[0]), "fallback": record.fallback,
            "call_counts": dict(record.call_counts)}
    return out


def _topology_report(cfg: GateConfig, results: list[dict[str, Any]], transport: str) -> dict[str, Any]:
    from rl_engine.artifacts import provenance

    per_rank = [r["transports"][transport] for r in results]
    tensors = {name: {"max_abs_diff": max(p["tensors"][name]["max_abs_diff"] for p in per_rank),
                      "bitwise": all(p["tensors"][name]["bitwise"] for p in per_rank),
                      "run_to_run_bitwise": all(p["tensors"][name]["run_to_run_bitwise"]
                                                for p in per_rank)}
               for name in TENSORS}
    shards = collections.defaultdict(set)
    for r, p in zip(results, per_rank):
        shards[(r["tp_rank"], r["cp_rank"])].add(p["digest"])
    replicas_agree = all(len(d) == 1 for d in shards.values())
    reference_agrees = len({r["reference_digest"] for r in results}) == 1
    fallback = any(p["fallback"] for p in per_rank)
    calls: collections.Counter[str] = collections.Counter()
    for p in per_rank:
        calls.update(p["call_counts"])
    src = provenance.source()
    # The device's own kernels must have run: bits from any other core prove nothing about it.
    passed = (all(t["bitwise"] and t["run_to_run_bitwise"] for t in tensors.values())
              and replicas_agree and reference_agrees and not fallback and calls[cfg.core] > 0)
    backends = sorted({r["process_group_backend"] for r in results})
    return {
        "kind": "attention-gate", "commit": src["commit"], "dirty": src["dirty"],
        "device": cfg.device, "world_size": cfg.world_size,
        "topology": {"tp": cfg.tp, "cp": cfg.cp, "replicas": cfg.replicas,
                     "rank_order": "tp fastest, then cp, then replica"},
        "ranks": [{k: r[k] for k in ("rank", "tp_rank", "cp_rank", "replica", "query_rows",
                                     "device")} for r in results],
        "dtype": cfg.dtype,
        "shape": {"seq_lens": list(cfg.seq_lens), "heads": cfg.heads, "kv_heads": cfg.kv_heads,
                  "head_dim": cfg.head_dim, "heads_per_rank": cfg.heads // cfg.tp,
                  "kv_heads_per_rank": cfg.kv_heads // cfg.tp, "seed": cfg.seed},
        "kv_blocks": {"block_size": cfg.block, "anchor": 0, "query_chunk_size": cfg.block,
                      "blocks_per_sequence": [-(-n // cfg.block) for n in cfg.seq_lens]},
        "core": cfg.core, "split_kv": False,
        "merge_order": {"forward": "global block order", "dk_dv": "global query-chunk order"},
        "transport": transport, "communication_backend": transport,
        "process_group_backend": backends[0] if len(backends) == 1 else backends,
        "fallback_allowed": False, "fallback": fallback,
        "repeats": cfg.repeats,
        "compared": "each rank's shard against the same rows and heads of the one-rank reference; "
                    "dk/dv in fp32, before the cast to the activation dtype",
        "tensors": tensors, "replicas_agree": replicas_agree,
        "reference_agrees_across_ranks": reference_agrees,
        "call_counts": dict(sorted(calls.items())),
        "passed": passed,
    }


def check_routes(device: str = "cpu") -> None:
    """Strict mode: fails (exit 2) before any work when the attention kernels cannot run on device
    (no GPU visible, a GPU that is not Hopper, kernels not built)."""
    if device == "cuda" and not torch.cuda.is_available():
        raise BadInput("--device cuda: no CUDA device is visible; use --device cpu")
    _strict_router(device)


def check_device(cfg: GateConfig) -> None:
    """Before any rank starts: the strict routes can run, and on CUDA each rank gets a GPU of its
    own. Under the Ray launcher CUDA ranks run on the cluster's machines, not this one, so their own
    routers check (strictly, before any work) and Ray's placement finds their GPUs."""
    from rl_engine import envs
    from rl_engine.engines.launch import check_devices

    if envs.RLK_LAUNCHER == "ray" and cfg.device == "cuda":
        return
    check_routes(cfg.device)
    try:
        check_devices(cfg.world_size, cfg.device)
    except ValueError as exc:
        raise BadInput(f"--world-size {cfg.world_size}: {exc}") from None


def run(cfg: GateConfig, *, timeout: float | None = None) -> list[dict[str, Any]]:
    """Runs the gate on cfg.world_size ranks of cfg.device; one report per transport."""
    from rl_engine.engines.launch import launch

    check_device(cfg)
    results = launch(gate_worker, cfg.world_size, args=(cfg,), timeout=timeout, device=cfg.device)
    return [_topology_report(cfg, results, t) for t in cfg.transports]


def file_name(report: dict[str, Any]) -> str:
    """CPU reports keep their original name; CUDA ones say the device."""
    t = report["topology"]
    device = "" if report["device"] == "cpu" else f"{report['device']}-"
    return (f"attention-gate-{device}w{report['world_size']}-tp{t['tp']}-cp{t['cp']}-"
            f"{report['transport']}-{report['dtype']}.json")
