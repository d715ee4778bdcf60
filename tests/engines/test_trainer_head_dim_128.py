"""A head_dim 128 model trains with KV blocks of 128 keys (kv_block_size), and its context-parallel
chunks are cut at that size: CP=2 gives the log-probs and reduced gradients of CP=1 bit for bit."""

import pytest
import torch

from rl_engine.engines.launch import launch
from rl_engine.engines.train import Sample, TrainConfig, TrainJob, train_worker
from rl_engine.models.config import Qwen3Config
from rl_engine.models.generate import random_weights

CONFIG = Qwen3Config(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=1,
                     num_attention_heads=2, num_key_value_heads=1, head_dim=128)


def samples() -> list[Sample]:
    # 8 + 120 = 128 tokens: one block of 128, which CP=2 leaves whole on rank 0 (with blocks of 64
    # the two ranks would hold 64 rows each); 40 + 160 = 200 tokens: a whole block and a partial one.
    g = torch.Generator().manual_seed(4)
    ids = lambda n: tuple(torch.randint(0, CONFIG.vocab_size, (n,), generator=g).tolist())  # noqa: E731
    return [Sample(prompt=ids(p), response=ids(r), rollout_logp=-5.5 + 0.3 * torch.randn(r, generator=g),
                   group=i) for i, (p, r) in enumerate([(8, 120), (40, 160)])]


def job(sample_list, **config) -> TrainJob:
    return TrainJob(model_config=CONFIG, state=random_weights(CONFIG, seed=2), samples=sample_list,
                    config=TrainConfig(max_tokens_per_gpu=4096, **config), return_state=True)


@pytest.fixture(scope="module")
def runs():
    one, both = samples()[:1], samples()
    cp2 = launch(train_worker, 2, args=([job(one, cp=2), job(both, cp=2)],), timeout=600)
    cp1 = launch(train_worker, 1, args=([job(one), job(both)],), timeout=600)
    return {"cp2_one": [r[0] for r in cp2], "cp2_both": [r[1] for r in cp2],
            "cp1_one": [r[0] for r in cp1], "cp1_both": [r[1] for r in cp1]}


def test_cp_chunks_are_blocks_of_128(runs):
    rows = [{r["module"]: r for r in rank["routes"]}["attention"]["shapes"]["cp_query_rows"]
            for rank in runs["cp2_one"]]
    assert rows == [[128], [0]]


@pytest.mark.parametrize("name", ["one", "both"])
def test_cp2_equals_cp1_bit_for_bit(runs, name):
    cp1, cp2 = runs[f"cp1_{name}"][0], runs[f"cp2_{name}"][0]
    assert torch.equal(torch.cat(cp2["logps"]), torch.cat(cp1["logps"]))
    assert cp1["grads"].keys() == cp2["grads"].keys()
    assert [k for k in cp1["grads"] if not torch.equal(cp1["grads"][k], cp2["grads"][k])] == []
