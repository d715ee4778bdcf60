"""The vLLM plugin without an engine: its entry point, idempotent registration, what a run refuses
before it starts (exit 2, nothing written), and rl_engine's vocab split of the LM head."""

from __future__ import annotations

import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from rl_engine.runtime.plan import Plan
from rl_engine.runtime.routing import RouteUnavailable


_REGISTER_TWICE = """
from importlib.metadata import entry_points
eps = {ep.name: ep for ep in entry_points(group="vllm.general_plugins")}
assert eps["rl_engine"].value == "rl_engine.adapters.vllm.plugin:register"
register = eps["rl_engine"].load()
from vllm.model_executor.custom_op import op_registry_oot
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import RowParallelLinear
from vllm.v1.attention.backends.registry import AttentionBackendEnum
from rl_engine.adapters.vllm import attention, layers, plugin
register()
before = dict(op_registry_oot)
register()
assert plugin.registered() and dict(op_registry_oot) == before
assert op_registry_oot["RMSNorm"] is layers.RlkRMSNorm
assert op_registry_oot["RowParallelLinear"] is layers.RlkRowParallelLinear
# vLLM's op names stay, so enabled() picks the same forward for the P route.
assert layers.RlkRMSNorm.name == RMSNorm.name == "rms_norm"
assert issubclass(layers.RlkRowParallelLinear, RowParallelLinear)
assert AttentionBackendEnum.CPU_ATTN.get_path() == attention.PATH
print("registered")
"""


def test_the_entry_point_names_the_plugin_and_registering_twice_changes_nothing(tmp_path):
    # In a process of its own: registering swaps vLLM's classes for the whole process.
    proc = subprocess.run([sys.executable, "-c", _REGISTER_TWICE], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "registered" in proc.stdout, proc.stderr[-2000:]


def test_the_lm_head_is_split_as_rl_engine_splits_the_vocab():
    from rl_engine.adapters.vllm.binding import shard_lm_head
    from rl_engine.models.tp import TPGroup
    from rl_engine.ops.logp import shard_range

    full = torch.arange(3000 * 2, dtype=torch.float32).reshape(3000, 2)
    shards = [shard_lm_head(full, TPGroup(rank=r, size=2)) for r in range(2)]
    # 3000 ids: 12 tiles of 256 padded to 16, 8 a rank (vLLM's own split would be 1504 a rank).
    assert [s.shape[0] for s in shards] == [2048, 952]
    assert torch.equal(torch.cat(shards), full)
    assert shard_range(3000, 1, 2)[0] == 2048


def test_cuda_attention_r_is_refused_and_cpu_runs_any_plan():
    from rl_engine.adapters.vllm.rank import VllmRank

    with pytest.raises(RouteUnavailable, match="CPU attention backend only"):
        VllmRank.refuse(Plan(), SimpleNamespace(device="cuda"))
    VllmRank.refuse(Plan(attention="R/P"), SimpleNamespace(device="cuda"))
    for plan in (Plan(), Plan(attention="P/P", ffn="P/P", logp="P/P")):
        VllmRank.refuse(plan, SimpleNamespace(device="cpu"))


def test_a_run_where_vllm_would_not_load_the_plugin_is_refused_before_anything_is_written(tmp_path):
    env = {**os.environ, "VLLM_PLUGINS": "some_other_plugin", "RLK_STATE_DIR": str(tmp_path / "s")}
    run_dir = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "rl_engine.cli", "run", "--workload", "ci",
                           "--rollout-engine", "vllm", "--artifact-dir", str(run_dir)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "VLLM_PLUGINS='some_other_plugin' leaves out the rl_engine plugin" in proc.stderr
    assert not run_dir.exists()
