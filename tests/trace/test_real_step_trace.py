"""`rlk run --trace` on the embedded tiny model (the ci workload: a TP=2 trainer, one rollout engine
of TP=2) under R/R and under P/P, and `rlk trace gate` on what each rank wrote: the R/R traces pass
the control, the P/P traces fail it by production family and module and pass the baseline."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rl_engine.cli import main

pytestmark = pytest.mark.slow

_PLAN_VARS = ("RL_KERNEL_ATTENTION_CASE", "RL_KERNEL_FFN_CASE", "RL_KERNEL_LOGP_CASE",
              "RL_KERNEL_RUN_ID", "RL_KERNEL_ARTIFACT_DIR", "CI_TEST", "VALIDATE_ARTIFACTS")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    from rl_engine.models.generate import init_model

    root = tmp_path_factory.mktemp("traced")
    init_model("tiny", root / "state" / "models" / "tiny", seed=0)
    env = {k: v for k, v in os.environ.items() if k not in _PLAN_VARS}
    env.update(RLK_STATE_DIR=str(root / "state"), RLK_RUNS_ROOT=str(root / "runs"))
    out = {}
    for case in ("R/R", "P/P"):
        run_dir = root / case.replace("/", "")
        cases = {f"RL_KERNEL_{m}_CASE": case for m in ("ATTENTION", "FFN", "LOGP")}
        proc = subprocess.run([sys.executable, "-m", "rl_engine.cli", "run", "--workload", "ci",
                               "--trace", "--artifact-dir", str(run_dir)], cwd=root,
                              env={**env, **cases}, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
        out[case] = run_dir / "trace"
    return out


def gate(trace: Path, plan: str, out: Path) -> tuple[int, dict]:
    code = main(["trace", "gate", "--trace", str(trace), "--plan", plan, "--world-size", "2",
                 "--output", str(out)])
    return code, json.loads(out.read_text())


def test_real_r_trace_passes_with_every_module_ranged_on_both_sides(runs, tmp_path):
    code, report = gate(runs["R/R"], "control", tmp_path / "tg.json")
    assert code == 0 and report["passed"], report["problems"]
    rows = {(r["module"], r["side"]): r for r in report["modules"]}
    assert set(rows) == {(m, s) for m in ("attention", "ffn", "logp")
                         for s in ("training", "rollout")}
    assert all(r["ranges"] > 0 and not r["production"] for r in rows.values())
    # The backward kernels of the attention core are attributed to the attention range.
    assert rows["attention", "training"]["rl_engine"]["attention_bwd"] > 0
    assert rows["attention", "rollout"]["rl_engine"]["attention_decode"] > 0


def test_real_p_trace_fails_the_control_by_family_and_module(runs, tmp_path):
    code, report = gate(runs["P/P"], "control", tmp_path / "tg.json")
    assert code == 1 and report["evidence_complete"]
    forbidden = {(r["module"], r["side"]): r["forbidden"] for r in report["modules"]}
    for side in ("training", "rollout"):
        assert {"aten_gemm", "aten_norm", "aten_sdpa"} <= set(forbidden["attention", side])
        assert {"aten_gemm", "aten_norm"} <= set(forbidden["ffn", side])
    n = forbidden["attention", "training"]["aten_sdpa"]
    assert (f"attention (training): {n} launches of production family aten_sdpa inside "
            "rlk.attention; the plan needs R") in report["problems"]
    code, report = gate(runs["P/P"], "baseline", tmp_path / "tg.json")
    assert code == 0 and report["passed"], report["problems"]
