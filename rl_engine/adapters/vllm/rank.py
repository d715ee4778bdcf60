"""One vLLM rollout engine behind rl_engine's engine interface (engine id `vllm`).

The launcher starts one process per engine (`one_process_per_engine`); it holds a resident vLLM
`LLM` for the whole run, which starts the engine's TP workers itself (in this process at TP=1,
vLLM's worker processes above). Every worker is bound to the run's plan through the plugin
(worker.RlkWorker.rlk_attach), writes its own readback as rollout rank engine x TP + TP rank, and
loads each step's weights itself. vLLM's sampler picks every token: temperature 1, exactly
max_new_tokens tokens (EOS ignored), each sample seeded by (seed, prompt index, sample index) as the
built-in engine seeds it; the log-prob reported is rl_engine's under logp R, vLLM's raw one under P.
"""

from __future__ import annotations

import multiprocessing
import os
import time
from pathlib import Path
from typing import Any

from rl_engine.engines import sync
from rl_engine.engines.rollout import sampling
from rl_engine.engines.rollout.worker import RolloutJob, engine_requests
from rl_engine.errors import BadInput, InfrastructureError
from rl_engine.runtime.plan import Plan
from rl_engine.runtime.routing import RouteUnavailable

WORKER = "rl_engine.adapters.vllm.worker.RlkWorker"
# vLLM's CPU settings this engine runs with unless the environment sets them (see docs/engines/vllm.md).
CPU_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


def plugin_missing() -> str | None:
    """Why vLLM would build its model without this plugin, or None. Cheap: reads the installed
    entry points and VLLM_PLUGINS, imports nothing."""
    from importlib.metadata import entry_points

    names = {ep.name: ep.value for ep in entry_points(group="vllm.general_plugins")}
    if names.get("rl_engine") != "rl_engine.adapters.vllm.plugin:register":
        return ("the rl_engine vLLM plugin is not installed (entry point vllm.general_plugins:"
                "rl_engine); reinstall rl_engine with `make install`")
    allowed = os.environ.get("VLLM_PLUGINS")
    if allowed is not None and "rl_engine" not in allowed.split(","):
        return f"VLLM_PLUGINS={allowed!r} leaves out the rl_engine plugin; add rl_engine to it"
    return None


class VllmRank:
    engine_id = "vllm"
    one_process_per_engine = True

    @staticmethod
    def refuse(plan: Plan, config, model=None) -> None:
        """Before any rank starts (exit 2): a run where vLLM would not load the plugin, or a plan
        the plugin cannot route on the run's device."""
        if (why := plugin_missing()) is not None:
            raise BadInput(f"--rollout-engine vllm: {why}")
        if config.device != "cpu" and plan.impl("attention", "rollout") == "R":
            raise RouteUnavailable("--rollout-engine vllm: the rollout's attention R route stands in "
                                   "for vLLM's CPU attention backend only; on CUDA run attention "
                                   "with a P rollout side")

    def __init__(self, rank: int, world: int, job: RolloutJob):
        if world != job.engines:
            raise ValueError(f"launched {world} processes for {job.engines} vLLM engines")
        if job.model_root is None:
            raise BadInput("the vllm rollout engine loads its weights from a model folder; give "
                           "model_root, not a state dict")
        if (why := plugin_missing()) is not None:
            raise BadInput(why)
        self.rank, self.job, self.engine_index = rank, job, rank
        self.llm = _start_llm(job)
        spec = {"plan": job.plan.as_dict(), "run_dir": None if job.run_dir is None else str(job.run_dir),
                "run_id": job.run_id, "engine_index": rank, "world": job.world,
                "model_root": str(job.model_root), "extra": dict(job.extra)}
        self.workers = self.llm.collective_rpc("rlk_attach", args=(spec,))
        if not all(w["plugin"] for w in self.workers):
            raise BadInput("the rl_engine vLLM plugin did not load in every vLLM worker")

    def generate(self, prompts: list[list[int]], n_samples: int, max_new_tokens: int, seed: int,
                 step: int) -> dict[str, Any]:
        from vllm import SamplingParams

        requests = engine_requests(len(prompts), n_samples, self.engine_index, self.job.engines)
        params = [SamplingParams(n=1, temperature=1.0, top_p=1.0, top_k=0, max_tokens=max_new_tokens,
                                 ignore_eos=True, logprobs=0, detokenize=False,
                                 seed=sampling.sequence_seed(seed, p, s)) for p, s in requests]
        outputs = self.llm.generate([{"prompt_token_ids": list(prompts[p])} for p, _ in requests],
                                    sampling_params=params, use_tqdm=False)
        samples = []
        for (p, s), out in zip(requests, outputs):
            done = out.outputs[0]
            tokens = list(done.token_ids)
            if len(tokens) != max_new_tokens or done.logprobs is None:
                raise InfrastructureError(f"vLLM returned {len(tokens)} tokens for sample {(p, s)}, "
                                          f"not {max_new_tokens} with their log-probs")
            samples.append({"prompt_index": p, "sample_index": s, "prompt": list(prompts[p]),
                            "tokens": tokens,
                            "logprobs": [lp[t].logprob for t, lp in zip(tokens, done.logprobs)]})
        self.readback(step, samples=len(samples))
        return {"rank": self.rank, "engine": self.engine_index, "tp_rank": 0, "samples": samples,
                "records": self.llm.collective_rpc("rlk_records")[0]}

    def load_weights(self, published: sync.Published) -> dict[str, Any]:
        """Every worker of the engine reads and checks the published weights; only the file's
        path and the digests go through vLLM's RPC."""
        message = {"step": published.step, "digests": published.digests,
                   "checksum": published.checksum, "path": published.path}
        if published.path is None:
            raise InfrastructureError("the vllm engine takes weights from a shared-memory file; "
                                      "the trainer published CUDA IPC handles")
        loaded = self.llm.collective_rpc("rlk_load", args=(message,))
        held = {w["checksum"] for w in loaded}
        if held != {published.checksum}:
            raise InfrastructureError(f"vLLM workers of engine {self.engine_index} hold {sorted(held)} "
                                      f"after the sync, the trainer published {published.checksum}")
        seconds = {k: max(w["seconds"][k] for w in loaded) for k in loaded[0]["seconds"]}
        return {"rank": self.rank, "checksum": published.checksum, "seconds": seconds}

    def weights_checksum(self) -> str:
        held = set(self.llm.collective_rpc("rlk_checksum"))
        if len(held) != 1:
            raise InfrastructureError(f"vLLM workers of engine {self.engine_index} hold different "
                                      f"weights: {sorted(held)}")
        return held.pop()

    def close(self) -> None:
        """Stops the engine (and its TP workers) while this process's groups still exist."""
        llm, self.llm = getattr(self, "llm", None), None
        if llm is not None:
            llm.llm_engine.engine_core.shutdown()

    def readback(self, step: int, **extra: Any) -> Path | None:
        paths = self.llm.collective_rpc("rlk_readback", args=(step, extra))
        return None if paths[0] is None else Path(paths[0])


def _start_llm(job: RolloutJob):
    """A resident vLLM engine of the job's model and TP size, on the CPU settings above."""
    for key, value in CPU_ENV.items():
        os.environ.setdefault(key, value)
    if job.tp > 1:
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(str(i % (os.cpu_count() or 1))
                                                                     for i in range(job.tp)))
    else:
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    import torch.distributed as dist

    if dist.is_initialized():
        # The launcher's group of engine processes: vLLM forms its own groups, and at TP=1 in
        # this process it would otherwise take this one for its world.
        dist.destroy_process_group()
    # vLLM starts its TP workers as children of this process; the launcher's ranks are daemonic,
    # which multiprocessing forbids to have children. vLLM's workers watch their parent and exit
    # with it.
    multiprocessing.current_process()._config["daemon"] = False
    from vllm import LLM

    longest = max(len(p) for p in job.prompts) + job.max_new_tokens
    t0 = time.monotonic()
    llm = LLM(model=str(job.model_root), dtype="bfloat16",
              tensor_parallel_size=job.tp, enforce_eager=True, enable_prefix_caching=False,
              max_model_len=max(256, longest), seed=0, worker_extension_cls=WORKER)
    llm.rlk_start_seconds = round(time.monotonic() - t0, 3)
    return llm
