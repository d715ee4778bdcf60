"""Methods vLLM adds to each of its workers (`worker_extension_cls`), called through
`LLM.collective_rpc`: only control messages travel that way (the plan, paths, digests, a step
number); the weights themselves are read by each worker from the trainer's shared-memory file and
checked against the trainer's digests here, inside the worker.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from rl_engine.adapters.vllm import binding, layers, plugin
from rl_engine.engines import sync
from rl_engine.evidence import layout, records
from rl_engine.models import checkpoint
from rl_engine.models.tp import TPGroup
from rl_engine.runtime.plan import Plan
from rl_engine.runtime.routing import Router


def _head(state: dict[str, torch.Tensor]) -> torch.Tensor:
    return state.get("lm_head.weight", state["model.embed_tokens.weight"])


class RlkWorker:
    """Mixed into vLLM's worker class; `self` is the worker."""

    def rlk_attach(self, spec: dict[str, Any]) -> dict[str, Any]:
        """Binds this worker to the run: its router (engine vllm, rollout side) and TP group."""
        from vllm.distributed import get_tp_group

        model = self.model_runner.get_model()
        device = next(model.parameters()).device
        group = get_tp_group()
        tp = TPGroup() if group.world_size == 1 else \
            TPGroup(rank=group.rank_in_group, size=group.world_size, group=group.cpu_group)
        router = Router(Plan(**spec["plan"]), side="rollout", engine="vllm", device=device)
        state = checkpoint.load_state(Path(spec["model_root"]))
        config = model.config
        self.rlk = {"spec": spec, "tp": tp, "digests": sync.digests(state), "model": model}
        self.rlk["binding"] = binding.attach(
            model, router=router, tp=tp, layers=config.num_hidden_layers, vocab=config.vocab_size,
            lm_head=_head(state), sampler=self.model_runner.sampler)
        return {"tp_rank": tp.rank, "tp_size": tp.size, "plugin": plugin.registered(),
                "checksum": sync.combined(self.rlk["digests"])}

    @torch.no_grad()
    def rlk_load(self, published: dict[str, Any]) -> dict[str, Any]:
        """Reads the published weights, checks each tensor's digest, loads them into vLLM's model
        (vLLM's own loader shards and fuses them) and rebuilds what derives from them."""
        state, seconds = sync.receive(sync.Published(**published))
        t0 = time.monotonic()
        model = self.rlk["model"]
        model.load_weights(state.items())
        layers.repack(model)
        b = self.rlk["binding"]
        if b.lm_head is not None:
            b.lm_head = binding.shard_lm_head(_head(state), self.rlk["tp"])
        self.rlk["digests"] = dict(published["digests"])
        return {"checksum": sync.combined(self.rlk["digests"]),
                "seconds": {**seconds, "load": round(time.monotonic() - t0, 4)}}

    def rlk_checksum(self) -> str:
        return sync.combined(self.rlk["digests"])

    def rlk_readback(self, step: int, extra: dict[str, Any]) -> str | None:
        """Writes this worker's readback as rollout rank engine x TP + TP rank."""
        spec, tp = self.rlk["spec"], self.rlk["tp"]
        if spec.get("run_dir") is None:
            return None
        rank = spec["engine_index"] * tp.size + tp.rank
        path = records.write_readback(
            layout.RunDir(Path(spec["run_dir"])), self.rlk["binding"].router,
            run_id=spec["run_id"], rank=rank, world_size=spec["world"], step=step,
            extra={"engine_index": spec["engine_index"], "tp_rank": tp.rank, "tp_size": tp.size,
                   **extra, **spec.get("extra", {})})
        return str(path)

    def rlk_records(self) -> list[dict[str, Any]]:
        return self.rlk["binding"].router.module_records()
