"""The Megatron-core trainer's model in-process on CPU ranks: on R/R its log-probs are the built-in
trainer's bits at TP=1 and TP=2; on all-P in fp32 they agree with Hugging Face's Qwen3ForCausalLM
within 1e-4; and its fp32 master weights and AdamW moments persist across three steps of one
resident trainer, equal to a reference AdamW update each step."""

from __future__ import annotations

import pytest
import torch

from rl_engine.adapters.megatron.rank import MegatronTrainer
from rl_engine.engines.launch import launch
from rl_engine.engines.train import Sample, TrainConfig, Trainer
from rl_engine.models import checkpoint
from rl_engine.models.config import Qwen3Config
from rl_engine.runtime.plan import Plan

from engines.test_optimizer_state import TRAIN, check_adamw_over_steps, three_steps
from engines.test_trainer import CONFIG, SAMPLES, STATE

pytestmark = pytest.mark.slow

PP = Plan(attention="P/P", ffn="P/P", logp="P/P")


# -- R/R forward: the built-in trainer's bits -----------------------------------------------------
def both_logprobs(rank: int, world: int) -> dict[str, list[torch.Tensor]]:
    """Each trainer's log-probs of SAMPLES on the same bf16 weights at TP = world."""
    train = TrainConfig(tp=world, max_tokens_per_gpu=4096)
    megatron = MegatronTrainer(CONFIG, STATE, Plan(), train).logprobs(SAMPLES)
    builtin = Trainer(CONFIG, STATE, Plan(), train).logprobs(SAMPLES)
    return {"megatron": megatron, "builtin": builtin}


@pytest.mark.parametrize("tp", [1, 2], ids=["tp1", "tp2"])
def test_rr_logprobs_equal_the_builtin_trainer_bit_for_bit(tp):
    ranks = launch(both_logprobs, tp, timeout=300)
    for out in ranks:
        assert len(out["megatron"]) == len(SAMPLES) == len(out["builtin"])
        for i, (a, b) in enumerate(zip(out["megatron"], out["builtin"])):
            assert a.dtype == b.dtype == torch.float32 and a.shape == b.shape, i
            assert torch.equal(a, b), (i, (a - b).abs().max().item())
    # The log-softmax is reduced over TP, so each TP rank holds every log-prob: the same bits.
    assert all(torch.equal(a, b) for a, b in zip(ranks[0]["megatron"], ranks[-1]["megatron"]))


# -- all-P in fp32 against Hugging Face -----------------------------------------------------------
# (prompt, response) lengths: one sequence longer than a KV block of 64, one shorter.
FP32_LENGTHS = [(5, 150), (3, 34)]
FP32_CONFIG = Qwen3Config(vocab_size=512, hidden_size=128, intermediate_size=256,
                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                          head_dim=32, rope_theta=10_000.0, torch_dtype="float32")


def fp32_samples() -> list[Sample]:
    g = torch.Generator().manual_seed(5)
    vocab = FP32_CONFIG.vocab_size
    ids = lambda n: tuple(torch.randint(0, vocab, (n,), generator=g).tolist())  # noqa: E731
    return [Sample(prompt=ids(p), response=ids(r), rollout_logp=torch.zeros(r))
            for p, r in FP32_LENGTHS]


def write_fp32_folder(out) -> torch.nn.Module:
    """A Qwen3 saved by transformers in fp32; init std 0.1 spreads the logits (std about 1), so
    agreement within 1e-4 is not trivial, and norms away from 1 show a norm applied wrongly."""
    import transformers

    torch.manual_seed(3)
    config = transformers.Qwen3Config(**{**FP32_CONFIG.to_hf(), "initializer_range": 0.1})
    model = transformers.Qwen3ForCausalLM(config).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn_like(p))
    model.save_pretrained(out)
    return model


def megatron_pp_logprobs(rank: int, world: int, folder: str) -> dict:
    config = checkpoint.load_config(folder)
    trainer = MegatronTrainer(config, checkpoint.load_state(folder), PP, TRAIN)
    return {"dtype": config.dtype, "param_dtypes": {p.dtype for p in trainer.params.values()},
            "logps": trainer.logprobs(fp32_samples()),
            "routes": {r["module"]: r["actual"] for r in trainer.router.module_records()}}


def test_all_p_fp32_logprobs_agree_with_transformers(tmp_path):
    hf = write_fp32_folder(tmp_path / "fp32")
    (out,) = launch(megatron_pp_logprobs, 1, args=(str(tmp_path / "fp32"),), timeout=300)
    assert out["dtype"] == torch.float32 and out["param_dtypes"] == {torch.float32}
    assert out["routes"] == dict.fromkeys(("attention", "ffn", "logp"), "P")
    for sample, ours in zip(fp32_samples(), out["logps"]):
        tokens = sample.tokens()
        with torch.no_grad():
            logits = hf(tokens[None]).logits[0].float()
        assert logits.std() > 0.5  # a real spread, so agreement is not trivial
        # Row t predicts token t + 1; the response's log-probs are the last len(response) rows.
        ref = torch.log_softmax(logits[:-1], -1).gather(-1, tokens[1:, None])[:, 0]
        ref = ref[-len(sample.response):]
        diff = (ours - ref).abs().max().item()
        print(f"all-P fp32 Megatron vs transformers, {len(tokens)} tokens: max |logp diff| "
              f"= {diff:.2e}")
        assert ours.shape == ref.shape and diff < 1e-4


# -- optimizer state across the steps of one resident trainer ----------------------------------
def test_master_weights_and_moments_follow_adamw_over_three_megatron_steps():
    (snaps,) = launch(three_steps, 1, args=(MegatronTrainer,), timeout=300)
    check_adamw_over_steps(snaps)
