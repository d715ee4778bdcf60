"""Generated preset folders, checkpoint loading (single file, sharded, TP shard) and its errors."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from rl_engine.models import checkpoint, hashing
from rl_engine.models.cli import app
from rl_engine.models.config import PRESETS
from rl_engine.models.generate import init_model
from rl_engine.models.tp import TPGroup
from rl_engine.runtime.plan import Plan
from rl_engine.runtime.routing import Router

FILES = ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return init_model("tiny", tmp_path_factory.mktemp("models") / "tiny")


@pytest.fixture
def tiny_copy(tiny, tmp_path):
    return shutil.copytree(tiny, tmp_path / "copy")


def router() -> Router:
    # Loading needs no kernels; the production plan keeps these tests independent of the build.
    return Router(Plan(attention="P/P", ffn="P/P", logp="P/P"), side="training", engine="builtin")


def test_tiny_is_the_same_bytes_from_the_same_seed(tiny, tmp_path):
    again = init_model("tiny", tmp_path / "again")
    assert hashing.hash_folder(again) == hashing.hash_folder(tiny)
    assert sorted(hashing.verify_manifest(tiny / "manifest.sha256")) == FILES
    other = init_model("tiny", tmp_path / "seed1", seed=1)
    assert hashing.sha256_file(other / "model.safetensors") != hashing.sha256_file(tiny / "model.safetensors")
    assert hashing.sha256_file(other / "tokenizer.json") == hashing.sha256_file(tiny / "tokenizer.json")


def test_tiny_matches_its_preset_and_has_spread_logits(tiny):
    config = checkpoint.load_config(tiny)
    assert config == PRESETS["tiny"]
    state = load_file(str(tiny / "model.safetensors"))
    assert {n: tuple(s) for n, s in checkpoint.expected_tensors(config)} == \
        {n: tuple(t.shape) for n, t in state.items()}
    assert all(t.dtype == torch.bfloat16 for t in state.values())
    norm = state["model.layers.0.input_layernorm.weight"].float()
    assert 0.05 < norm.std() < 0.2 and abs(norm.mean() - 1) < 0.05
    # Logits of unit-RMS hidden states: a standard deviation of about 2, so log-probs spread
    # over several nats.
    h = torch.nn.functional.rms_norm(torch.randn(64, config.hidden_size), (config.hidden_size,))
    logp = torch.log_softmax(h @ state["lm_head.weight"].float().T, -1)
    assert (logp.max(-1).values - logp.min(-1).values).min() > 8.0


def test_build_model_uses_hf_names(tiny):
    model = checkpoint.build_model(tiny, router())
    state = load_file(str(tiny / "model.safetensors"))
    pre = "model.layers.3."
    qkv = torch.cat([state[pre + f"self_attn.{p}_proj.weight"] for p in "qkv"])
    assert torch.equal(model.layers[3].qkv, qkv)
    gate_up = torch.cat([state[pre + "mlp.gate_proj.weight"], state[pre + "mlp.up_proj.weight"]])
    assert torch.equal(model.layers[3].gate_up, gate_up)
    assert torch.equal(model.layers[3].k_norm, state[pre + "self_attn.k_norm.weight"])
    assert torch.equal(model.lm_head, state["lm_head.weight"])
    assert model.embed.dtype == torch.bfloat16
    assert checkpoint.build_model(tiny, router(), dtype="float32").embed.dtype == torch.float32


def test_sharded_index_loads_the_same_weights(tiny, tmp_path):
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    for name in ("config.json", "tokenizer.json"):
        shutil.copy(tiny / name, sharded / name)
    state = load_file(str(tiny / "model.safetensors"))
    names = sorted(state)
    weight_map = {}
    for i, part in enumerate((names[::2], names[1::2])):
        shard = f"model-0000{i + 1}-of-00002.safetensors"
        save_file({n: state[n] for n in part}, str(sharded / shard), metadata={"format": "pt"})
        weight_map.update({n: shard for n in part})
    (sharded / checkpoint.INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    one, two = checkpoint.build_model(tiny, router()), checkpoint.build_model(sharded, router())
    params = dict(two.named_parameters())
    for name, p in one.named_parameters():
        assert torch.equal(p, params[name]), name

    (sharded / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="model-00002-of-00002.safetensors is missing"):
        checkpoint.build_model(sharded, router())


def test_tp_rank_loads_its_slice(tiny):
    state = load_file(str(tiny / "model.safetensors"))
    shard = checkpoint.build_model(tiny, router(), TPGroup(rank=1, size=2))
    o_proj = state["model.layers.0.self_attn.o_proj.weight"]
    assert torch.equal(shard.layers[0].o_proj, o_proj[:, o_proj.shape[1] // 2:])
    assert torch.equal(shard.lm_head, state["lm_head.weight"][2048:])


def test_missing_or_damaged_checkpoint_is_named(tiny_copy, tmp_path):
    with pytest.raises(FileNotFoundError, match="rlk model init"):
        checkpoint.build_model(tmp_path / "nowhere", router())
    weights = tiny_copy / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="model.safetensors cannot be read as safetensors"):
        checkpoint.build_model(tiny_copy, router())
    weights.unlink()
    with pytest.raises(FileNotFoundError, match="neither model.safetensors nor"):
        checkpoint.build_model(tiny_copy, router())


def test_missing_or_foreign_tensors_are_named(tiny_copy):
    weights = tiny_copy / "model.safetensors"
    state = load_file(str(weights))
    down = state.pop("model.layers.2.mlp.down_proj.weight")
    save_file(state, str(weights))
    with pytest.raises(ValueError, match="lacks tensor.*model.layers.2.mlp.down_proj.weight"):
        checkpoint.build_model(tiny_copy, router())
    state["model.layers.2.mlp.down_proj.weight"] = down
    state["model.layers.0.self_attn.q_proj.bias"] = torch.zeros(512)
    save_file(state, str(weights))
    with pytest.raises(ValueError, match="does not use: model.layers.0.self_attn.q_proj.bias"):
        checkpoint.build_model(tiny_copy, router())


def test_tokenizer_larger_than_vocab_is_refused(tiny_copy):
    assert checkpoint.load_tokenizer(tiny_copy).get_vocab_size() <= 4096
    config = json.loads((tiny_copy / "config.json").read_text())
    (tiny_copy / "config.json").write_text(json.dumps({**config, "vocab_size": 300}))
    with pytest.raises(ValueError, match=r"token ids up to \d+ but the model's vocab_size is 300"):
        checkpoint.load_tokenizer(tiny_copy)


def test_manifest_detects_changed_and_missing_files(tiny_copy):
    path = tiny_copy / "tokenizer_config.json"
    path.write_text(path.read_text().replace("<|endoftext|>", "<|im_end|>"))
    (tiny_copy / "tokenizer.json").unlink()
    with pytest.raises(hashing.HashMismatch) as err:
        checkpoint.verify_folder(tiny_copy)
    assert err.value.names == ["tokenizer.json", "tokenizer_config.json"]
    assert "tokenizer.json: missing" in str(err.value)
    assert "tokenizer_config.json: sha256" in str(err.value)


def test_manifest_lines_are_checked():
    good = "a" * 64 + "  config.json\n"
    assert hashing.parse_sha256sum(good + "B" * 64 + " *model.safetensors\n") == {
        "config.json": "a" * 64, "model.safetensors": "b" * 64}
    with pytest.raises(ValueError, match="manifest.sha256:2: expected"):
        hashing.parse_sha256sum(good + "abc  model.safetensors\n")
    with pytest.raises(ValueError, match="relative to the manifest"):
        hashing.parse_sha256sum("a" * 64 + "  ../etc/passwd\n")


def test_init_refuses_a_non_empty_out_dir(tmp_path):
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("x")
    with pytest.raises(FileExistsError, match="not an empty folder"):
        init_model("tiny", tmp_path / "full")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["full"]  # no temp folder left behind
    with pytest.raises(ValueError, match="unknown preset 'huge'"):
        init_model("huge", tmp_path / "new")


def test_cli_init(tmp_path):
    runner = CliRunner()
    (tmp_path / "empty").mkdir()
    ok = runner.invoke(app, ["init", "--preset", "tiny", "--out", str(tmp_path / "empty")])
    assert ok.exit_code == 0, ok.output
    assert sorted(p.name for p in (tmp_path / "empty").iterdir()) == sorted(FILES + ["manifest.sha256"])
    again = runner.invoke(app, ["init", "--preset", "tiny", "--out", str(tmp_path / "empty")])
    assert again.exit_code == 2
    assert again.stderr.count("\n") == 1 and "already exists" in again.stderr
    bad = runner.invoke(app, ["init", "--preset", "huge", "--out", str(tmp_path / "x")])
    assert bad.exit_code == 2 and "unknown preset 'huge'" in bad.stderr
