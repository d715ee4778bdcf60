"""Our Qwen3 against Hugging Face's Qwen3ForCausalLM, both loading the same generated folder.

HF runs eager attention, one sequence at a time; ours runs the two sequences packed. The
sequences are longer than one KV block, so the block-ordered attention merges several blocks.
"""

from __future__ import annotations

import functools
import json

import pytest
import torch
import transformers

from rl_engine.models.checkpoint import build_model, load_config
from rl_engine.models.config import Qwen3Config
from rl_engine.models.generate import init_model
from rl_engine.ops.attention import kv_block_size
from rl_engine.runtime.plan import Plan
from rl_engine.runtime.routing import Router

# vocab 500 is not a multiple of the logp tile, so the padded last tile is exercised too.
CONFIG = dict(vocab_size=500, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16)
LENGTHS = (2 * kv_block_size(CONFIG["head_dim"]) - 28, 37)
PRODUCTION = Plan(attention="P/P", ffn="P/P", logp="P/P")
CONTROL = Plan()


class PackedAttention:
    """The attention core over packed causal sequences that start at position 0."""

    def __init__(self, router: Router, lengths: tuple[int, ...], head_dim: int):
        self.router, self.scale = router, head_dim ** -0.5
        self.positions = torch.cat([torch.arange(n) for n in lengths])
        self.cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)

    def attend(self, layer, q, k, v):
        return self.router.attention("attention", q, k, v, self.cu, self.cu, self.positions, self.scale)


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def folder(request, tmp_path_factory):
    config = Qwen3Config(**CONFIG, tie_word_embeddings=request.param)
    return init_model(config, tmp_path_factory.mktemp("parity") / "model", seed=3)


@pytest.fixture(scope="module")
def sequences():
    gen = torch.Generator().manual_seed(11)
    return [torch.randint(0, CONFIG["vocab_size"], (n,), generator=gen) for n in LENGTHS]


@functools.cache
def _hf_logits(folder, dtype, sequences) -> torch.Tensor:
    model = transformers.Qwen3ForCausalLM.from_pretrained(folder, dtype=dtype, attn_implementation="eager")
    with torch.no_grad():
        return torch.cat([model(torch.tensor(s)[None]).logits[0] for s in sequences]).float()


def hf_logits(folder, dtype, sequences) -> torch.Tensor:
    return _hf_logits(folder, dtype, tuple(tuple(s.tolist()) for s in sequences))


def ours(folder, plan, dtype, sequences):
    """(fp32 full logits, selected log-probs of the next tokens, router) of our model."""
    router = Router(plan, side="training", engine="builtin")
    model = build_model(folder, router, dtype=dtype)
    attn = PackedAttention(router, LENGTHS, CONFIG["head_dim"])
    with torch.no_grad():
        hidden = model.hidden(torch.cat(sequences), attn.positions, attn)
        logp = model.selected_logp(hidden, targets(sequences))
    return hidden.float() @ model.lm_head.float().T, logp, router


def targets(sequences) -> torch.Tensor:
    # The next token of each position (the last one wraps to the sequence start; any id will do).
    return torch.cat([s.roll(-1) for s in sequences])


def gather_logp(logits, sequences) -> torch.Tensor:
    return torch.log_softmax(logits, -1).gather(-1, targets(sequences)[:, None])[:, 0]


@pytest.mark.parametrize("plan", [PRODUCTION, CONTROL], ids=["P/P", "R/R"])
def test_fp32_logits_and_logp_match_hf(folder, sequences, plan):
    ref = hf_logits(folder, torch.float32, sequences)
    logits, logp, router = ours(folder, plan, "float32", sequences)
    assert ref.std() > 1.0  # a real spread, so agreement is not trivial
    torch.testing.assert_close(logits, ref, rtol=0, atol=1e-4)
    torch.testing.assert_close(logp, gather_logp(ref, sequences), rtol=0, atol=1e-4)
    if plan is CONTROL:
        counts = {k for r in router.module_records() for k in r["call_counts"]}
        assert {"rlkernel.attention.cpu.v1", "rlkernel.det_gemm.cpu.v1", "rlkernel.rope.cpu.v1",
                "rlkernel.rmsnorm.cpu.v1", "rlkernel.swiglu.cpu.v1", "rlkernel.linear_logp.cpu.v1"} <= counts


def test_bf16_rl_engine_kernels_match_hf_within_bf16_rounding(folder, sequences):
    """bf16 differs by rounding only: our kernels compute in fp32 and round once per op, HF rounds
    after most steps (its RMSNorm casts to bf16 before the weight multiply; its logits are bf16).
    Two layers of that give logit differences of a few hundredths against a spread of about 2, so
    the bounds are 0.2 (max) and 0.03 (mean) on logits, 0.15 on log-probs; and our bf16 must be at
    least as close to the fp32 model as HF's bf16 is (within 50%)."""
    exact = hf_logits(folder, torch.float32, sequences)
    ref = hf_logits(folder, torch.bfloat16, sequences)
    logits, logp, _ = ours(folder, CONTROL, "bfloat16", sequences)
    diff = (logits - ref).abs()
    assert diff.max() < 0.2 and diff.mean() < 0.03, (diff.max(), diff.mean())
    assert (logp - gather_logp(ref, sequences)).abs().max() < 0.15
    ours_err, hf_err = (logits - exact).abs().mean(), (ref - exact).abs().mean()
    assert ours_err < 1.5 * hf_err, (ours_err, hf_err)


def test_config_saved_by_transformers_reads_back(tmp_path):
    """transformers 5 writes RoPE settings as rope_parameters; theta must come from there."""
    ours = Qwen3Config(**CONFIG, rope_theta=10_000.0)
    transformers.Qwen3Config(**ours.to_hf()).save_pretrained(tmp_path)
    assert "rope_theta" not in json.loads((tmp_path / "config.json").read_text())
    assert load_config(tmp_path) == ours
    scaled = {**ours.to_hf(), "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0}}
    (tmp_path / "config.json").write_text(json.dumps(scaled))
    with pytest.raises(ValueError, match="RoPE scaling .*yarn.* is not supported"):
        load_config(tmp_path)
