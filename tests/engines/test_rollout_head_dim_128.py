"""A head_dim 128 model on the built-in engines: the rollout's paged decode and the trainer's packed
prefill both run KV blocks of 128 keys (kv_block_size), say so in their records, and agree bit for
bit on every sampled token's log-prob across block edges."""

import torch

from rl_engine.engines.rollout import RolloutEngine
from rl_engine.models.config import Qwen3Config
from rl_engine.models.generate import random_weights
from rl_engine.models.qwen3 import Qwen3
from rl_engine.models.tp import TPGroup
from rl_engine.runtime.plan import Plan
from rl_engine.runtime.routing import Router

CONFIG = Qwen3Config(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=1,
                     num_attention_heads=2, num_key_value_heads=1, head_dim=128)
STATE = random_weights(CONFIG, seed=3)
# With 20 new tokens these cross the 128-key block edge during decode (120), at the prefill (130),
# or stay inside the first block (5).
PROMPTS = [[(7 * i) % 250 + 1 for i in range(n)] for n in (5, 120, 130)]
NEW_TOKENS = 20


def build(side: str) -> tuple[Qwen3, Router]:
    router = Router(Plan(), side=side, engine="builtin")
    model = Qwen3(CONFIG, router, TPGroup())
    model.load_full(STATE)
    return model, router


@torch.no_grad()
def recompute(samples) -> tuple[list[torch.Tensor], Router]:
    """Every response token's log-prob from one packed pass over prompt + response."""
    model, router = build("training")
    seqs = [s.prompt + s.tokens for s in samples]
    lengths = [len(x) for x in seqs]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    positions = torch.cat([torch.arange(n) for n in lengths])

    class Packed:
        def attend(self, layer, q, k, v):
            return router.attention("attention", q, k, v, cu, cu, positions, CONFIG.head_dim ** -0.5)

    hidden = model.hidden(torch.tensor([t for x in seqs for t in x]), positions, Packed())
    rows, start = [], 0
    for s, n in zip(samples, lengths):
        rows += range(start + len(s.prompt) - 1, start + n - 1)
        start += n
    targets = torch.tensor([t for s in samples for t in s.tokens])
    logps = model.selected_logp(hidden[rows], targets).split([len(s.tokens) for s in samples])
    return list(logps), router


def test_rollout_and_trainer_agree_with_blocks_of_128():
    model, router = build("rollout")
    samples = RolloutEngine(model, router, max_batch=2).generate(PROMPTS, 1, NEW_TOKENS, 11)
    ref, trainer = recompute(samples)
    for s, r in zip(samples, ref):
        assert torch.equal(s.logprobs, r), s.prompt_index
    for side in (router, trainer):
        assert side.records["attention"].shapes["kv_block"] == {128}
    assert max(router.records["attention"].shapes["decode_batch"]) == 2
