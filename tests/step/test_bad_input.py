"""Every bad input gives one clear line, exit 2 and no half-written JSON; a killed run leaves no
worker behind and no exit-code of 0."""

import json
import shutil
import signal
import subprocess
import sys
import time

import psutil
import pytest


def _no_json_written(folder):
    return not folder.exists() or not list(folder.rglob("*.json"))


@pytest.mark.parametrize("env, args, message", [
    ({"RL_KERNEL_FFN_CASE": "X/R"}, [], "RL_KERNEL_FFN_CASE='X/R' is not allowed; use one of P/P, P/R, R/P, R/R"),
    ({}, ["--run-id", "a/b"], "run id 'a/b' must match"),
    ({}, ["--run-id", ".."], "run id '..' must match"),
    ({"ACTOR_GPUS": "3"}, [], "ACTOR_GPUS=3 is not a multiple of TP_SIZE x CP_SIZE"),
    ({"MODEL_ROOT": "/nonexistent/model"}, [], "MODEL_ROOT /nonexistent/model is not a folder"),
])
def test_bad_settings_exit_2_with_one_line(rlk, tmp_path, env, args, message):
    proc = rlk("run", "--workload", "ci", "--artifact-dir", str(tmp_path / "r"), *args, env=env)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert message in proc.stderr
    assert _no_json_written(tmp_path / "r")


def test_an_artifact_directory_that_holds_a_run_is_refused(rlk, tmp_path):
    run = tmp_path / "r"
    run.mkdir()
    (run / "run.log").write_text("an earlier run\n")
    proc = rlk("run", "--workload", "ci", "--artifact-dir", str(run))
    assert proc.returncode == 2 and "already holds a run" in proc.stderr
    assert sorted(p.name for p in run.iterdir()) == ["run.log"]


def test_a_malformed_prompt_line_is_named(rlk, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "hello"}\n{"prompt": \n')
    proc = rlk("run", "--workload", "ci", "--prompt-data", str(prompts), "--artifact-dir", str(tmp_path / "r"))
    assert proc.returncode == 2 and "p.jsonl:2" in proc.stderr
    assert not (tmp_path / "r" / "manifest.json").exists()


def _copy_model(state_dir, dest):
    shutil.copytree(state_dir / "models" / "tiny", dest)
    return dest


def test_a_checkpoint_that_does_not_match_its_hashes_is_refused(rlk, state_dir, tmp_path):
    model = _copy_model(state_dir, tmp_path / "model")
    with open(model / "model.safetensors", "r+b") as fh:
        fh.seek(-8, 2)
        fh.write(b"\x00" * 8)
    proc = rlk("run", "--workload", "ci", "--model-root", str(model), "--artifact-dir", str(tmp_path / "r"))
    assert proc.returncode == 2 and "model.safetensors" in proc.stderr


def test_a_tokenizer_larger_than_the_vocab_is_refused(rlk, state_dir, tmp_path):
    model = _copy_model(state_dir, tmp_path / "model")
    cfg = json.loads((model / "config.json").read_text())
    cfg["vocab_size"] = 300  # the generated tokenizer has more ids than that
    (model / "config.json").write_text(json.dumps(cfg))
    (model / "manifest.sha256").unlink()
    proc = rlk("run", "--workload", "ci", "--model-root", str(model), "--artifact-dir", str(tmp_path / "r"))
    assert proc.returncode == 2 and "tokenizer" in proc.stderr


def test_verify_inputs_refuses_a_changed_input(rlk, state_dir, tmp_path):
    model = _copy_model(state_dir, tmp_path / "model")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "hello"}\n')
    sums = tmp_path / "inputs.sha256"
    import hashlib
    sums.write_text(f"{hashlib.sha256(b'other').hexdigest()}  p.jsonl\n")
    proc = rlk("run", "--workload", "ci", "--model-root", str(model), "--prompt-data", str(prompts),
               "--verify-inputs", str(sums), "--artifact-dir", str(tmp_path / "r"))
    assert proc.returncode == 2 and "p.jsonl: sha256 differs" in proc.stderr


@pytest.mark.slow
def test_sigkill_mid_step_leaves_no_worker_and_validate_exits_3(rlk, state_dir, tmp_path):
    import os

    run = tmp_path / "killed"
    env = {**os.environ, "RLK_STATE_DIR": str(state_dir), "PYTHONUNBUFFERED": "1"}
    for k in ("RL_KERNEL_ATTENTION_CASE", "RL_KERNEL_FFN_CASE", "RL_KERNEL_LOGP_CASE", "CI_TEST"):
        env.pop(k, None)
    parent = subprocess.Popen([sys.executable, "-m", "rl_engine.cli", "run", "--workload", "ci",
                               "--artifact-dir", str(run)], env=env, cwd=tmp_path,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        workers = []
        while time.monotonic() < deadline and not workers:
            time.sleep(0.5)
            if (run / "manifest.json").exists():
                workers = psutil.Process(parent.pid).children(recursive=True)
        assert workers, "the run never started its workers"
        time.sleep(2)
        parent.send_signal(signal.SIGKILL)
        parent.wait(timeout=30)
        gone, alive = psutil.wait_procs(workers, timeout=30)
        assert not alive, f"workers left behind: {[p.pid for p in alive]}"
    finally:
        if parent.poll() is None:
            parent.kill()
    assert not (run / "exit-code").exists()
    proc = rlk("validate", str(run), "--output", str(tmp_path / "v.json"))
    assert proc.returncode == 3
    assert "no train-data files" in proc.stderr
