"""`rlk run --rollout-engine vllm` at TP=2 (vLLM's TP=2 against the built-in trainer's TP=2) on a
Qwen3 folder written by transformers, with sizes unlike the presets (3 layers, hidden 192, 6 query
/ 2 KV heads of 32, vocab 3000: not a multiple of the log-prob tile, so vLLM's vocab split and
rl_engine's differ): every log-prob bitwise over 2 steps with a weight sync between them, no route
falling back, and one readback per rollout rank written from inside vLLM's two workers."""

import json
import os
import subprocess
import sys

import pytest
import transformers
from tokenizers import Tokenizer, models, pre_tokenizers

pytestmark = pytest.mark.slow
_RUN_VARS = ("RL_KERNEL_", "TP_SIZE", "CP_SIZE", "ACTOR_GPUS", "ROLLOUT_", "GLOBAL_BATCH_SIZE",
             "MAX_RESPONSE_LEN", "MODEL_ROOT", "PROMPT_DATA", "N_SAMPLES_PER_PROMPT", "RLK_")


def rlk(tmp_path, *args, env=None, timeout=900):
    """The CLI in a fresh process, without the caller's run settings."""
    base = {k: v for k, v in os.environ.items() if not k.startswith(_RUN_VARS)}
    base.update(RLK_STATE_DIR=str(tmp_path / "state"), RLK_RUNS_ROOT=str(tmp_path / "runs"),
                PYTHONUNBUFFERED="1", **(env or {}))
    return subprocess.run([sys.executable, "-m", "rl_engine.cli", *args], cwd=tmp_path, env=base,
                          capture_output=True, text=True, timeout=timeout)


def hf_folder(path):
    config = transformers.Qwen3Config(vocab_size=3000, hidden_size=192, intermediate_size=320,
                                      num_hidden_layers=3, num_attention_heads=6,
                                      num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
                                      tie_word_embeddings=False, rope_theta=10000.0,
                                      dtype="bfloat16")
    transformers.set_seed(5)
    model = transformers.Qwen3ForCausalLM(config).to(dtype=config.dtype)
    model.save_pretrained(path)
    words = {f"w{i}": i for i in range(1000)}
    tok = Tokenizer(models.WordLevel(words, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "w0"}))
    return path


def test_vllm_tp2_on_a_transformers_folder_is_bitwise_over_two_steps(tmp_path):
    folder = hf_folder(tmp_path / "qwen3")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt_token_ids": ids}) + "\n"
                               for ids in ([5, 2999, 17, 400, 1234], [7, 8, 9])))
    run_dir = tmp_path / "tp2"
    proc = rlk(tmp_path, "run", "--workload", "ci", "--rollout-engine", "vllm", "--steps", "2",
               "--rollout-batch-size", "2", "--max-response-len", "12", "--model-root", str(folder),
               "--prompt-data", str(prompts), "--artifact-dir", str(run_dir), "--run-id", "vllm-tp2",
               env={"VALIDATE_ARTIFACTS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((run_dir / "bitwise-validation.json").read_text())
    assert report["passed"] and report["bitwise"] and report["evidence_complete"], report["problems"]
    assert report["numel"] == 2 * 2 * 2 * 12 and report["max_abs_diff"] == 0.0
    assert report["fallbacks"] == [] and report["mismatch_count"] == 0
    readbacks = {p.name: json.loads(p.read_text()) for p in (run_dir / "readbacks").glob("vllm-*")}
    assert sorted(readbacks) == ["vllm-rollout-rank0.json", "vllm-rollout-rank1.json"]
    assert len({r["pid"] for r in readbacks.values()}) == 2  # vLLM's two TP workers
    for r in readbacks.values():
        assert r["tp_size"] == 2 and r["world_size"] == 2
        counts = {m["module"]: m["call_counts"] for m in r["modules"]}
        # The row reductions of attention and ffn are rl_engine's fixed-order all-reduce.
        assert counts["attention"]["rlkernel.collective.all_reduce.cpu.v1"] > 0
        assert counts["ffn"]["rlkernel.collective.all_reduce.cpu.v1"] > 0
        assert counts["logp"]["rlkernel.linear_logp.cpu.v1"] > 0
        assert not any(k.startswith("production.") for c in counts.values() for k in c)
    w0, w1 = (json.loads((run_dir / "weights" / f"step-000{s}.json").read_text()) for s in (0, 1))
    assert w0["checksum"] != w1["checksum"]
