"""The Megatron-style trainer: context parallelism, micro-batch packing and data parallelism leave
log-probs, reduced gradients and updated weights bitwise unchanged on the R plan; TP changes them
(row-parallel partial sums); the P plan is close to R but not equal.

Three launches (worlds 4, 2 and 1) run every job once; the tests read their results.
"""

import pytest
import torch

from rl_engine.engines.launch import launch
from rl_engine.engines.train import Sample, TrainConfig, TrainJob, train_worker
from rl_engine.engines.train import loss, packing
from rl_engine.engines.train.layout import check_world
from rl_engine.models.config import Qwen3Config
from rl_engine.runtime.plan import Plan

CONFIG = Qwen3Config(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=32)
RR, PP = Plan(), Plan(attention="P/P", ffn="P/P", logp="P/P")
RESPONSE = 120
# Prompt lengths 72, 100, 8 give sequences of 192, 220 and 128 tokens: 3, 4 and 2 blocks of 64, so
# with CP=2 (4 chunks) some chunks are empty, some hold one block, and one ends in a partial block.
ORDER = [(0, 72), (1, 100), (2, 8), (2, 8), (1, 100), (0, 72)]  # (group, prompt length)


def make_state(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    c, d = CONFIG, CONFIG.head_dim
    w = lambda *s: (torch.randn(*s, generator=g) * 0.05).to(torch.bfloat16)  # noqa: E731
    n = lambda *s: (1 + 0.1 * torch.randn(*s, generator=g)).to(torch.bfloat16)  # noqa: E731
    state = {"model.embed_tokens.weight": w(c.vocab_size, c.hidden_size),
             "model.norm.weight": n(c.hidden_size),
             "lm_head.weight": w(c.vocab_size, c.hidden_size)}
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        state.update({
            p + "self_attn.q_proj.weight": w(c.num_attention_heads * d, c.hidden_size),
            p + "self_attn.k_proj.weight": w(c.num_key_value_heads * d, c.hidden_size),
            p + "self_attn.v_proj.weight": w(c.num_key_value_heads * d, c.hidden_size),
            p + "self_attn.o_proj.weight": w(c.hidden_size, c.num_attention_heads * d),
            p + "self_attn.q_norm.weight": n(d), p + "self_attn.k_norm.weight": n(d),
            p + "input_layernorm.weight": n(c.hidden_size),
            p + "post_attention_layernorm.weight": n(c.hidden_size),
            p + "mlp.gate_proj.weight": w(c.intermediate_size, c.hidden_size),
            p + "mlp.up_proj.weight": w(c.intermediate_size, c.hidden_size),
            p + "mlp.down_proj.weight": w(c.hidden_size, c.intermediate_size)})
    return state


def make_samples(order=ORDER, response=RESPONSE, seed: int = 1) -> list[Sample]:
    g = torch.Generator().manual_seed(seed)
    ids = lambda n: tuple(torch.randint(0, 512, (n,), generator=g).tolist())  # noqa: E731
    prompts = {grp: ids(n) for grp, n in sorted(set(order))}
    return [Sample(prompt=prompts[grp], response=ids(response),
                   rollout_logp=-6.2 + 0.3 * torch.randn(response, generator=g), group=grp)
            for grp, _ in order]


STATE, SAMPLES = make_state(), make_samples()
# Prompt 8 + response 56 = one block: at CP=2 rank 0 holds every row and rank 1 none.
SHORT = make_samples([(0, 8), (0, 8), (1, 8), (1, 8)], response=56, seed=2)
# Micro-batches: M=600 at CP=1 and M=350 at CP=2 (per-rank share) both pack samples 0-2 and 3-5,
# which is also what each DP=2 rank holds; M=4096 packs one micro-batch; M=200 at CP=2 packs four.
JOBS = {
    4: {"cp2_one": dict(tp=2, cp=2, max_tokens_per_gpu=4096),
        "cp2_two": dict(tp=2, cp=2, max_tokens_per_gpu=350),
        "cp2_small": dict(tp=2, cp=2, max_tokens_per_gpu=200),
        "cp2_pp": dict(tp=2, cp=2, max_tokens_per_gpu=4096, plan=PP),
        "cp2_short": dict(tp=2, cp=2, max_tokens_per_gpu=4096, samples=SHORT)},
    2: {"cp1_one": dict(tp=2, max_tokens_per_gpu=4096),
        "cp1_two": dict(tp=2, max_tokens_per_gpu=600),
        "cp1_pp": dict(tp=2, max_tokens_per_gpu=4096, plan=PP),
        "dp2": dict(dp=2, max_tokens_per_gpu=600),
        "cp1_short": dict(tp=2, max_tokens_per_gpu=4096, samples=SHORT)},
    1: {"dp1": dict(max_tokens_per_gpu=600), "dp1_again": dict(max_tokens_per_gpu=600),
        "tp1_one": dict(max_tokens_per_gpu=4096)},
}


def job(plan=RR, samples=SAMPLES, **config) -> TrainJob:
    return TrainJob(model_config=CONFIG, state=STATE, samples=samples, plan=plan,
                    config=TrainConfig(**config), return_state=True)


@pytest.fixture(scope="module")
def runs():
    """name -> every rank's result of that job."""
    out = {}
    for world, jobs in JOBS.items():
        ranks = launch(train_worker, world, args=([job(**kw) for kw in jobs.values()],),
                       timeout=600)
        for i, name in enumerate(jobs):
            out[name] = [r[i] for r in ranks]
    return out


def logps(run):
    return torch.cat(run[0]["logps"])


def worst_relative_diff(a: dict, b: dict) -> float:
    """max over tensors of |a - b| / |b| (Frobenius norms)."""
    return max(((a[k] - b[k]).norm() / b[k].norm()).item() for k in b)


def same_state(a: dict, b: dict) -> list[str]:
    """Names whose tensors differ in any bit."""
    assert a.keys() == b.keys()
    return [k for k in a if not torch.equal(a[k], b[k])]


# -- pure parts ---------------------------------------------------------------------------------
def test_layout_refuses_a_world_that_is_not_tp_cp_dp():
    check_world(2, 2, 1, 4)
    with pytest.raises(ValueError, match=r"TP=2 x CP=2 x DP=1 = 4 .* world has 3"):
        check_world(2, 2, 1, 3)


@pytest.mark.parametrize("length", [1, 63, 64, 128, 192, 220, 300, 1000])
@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_cp_chunks_cover_the_sequence_at_block_boundaries(length, cp):
    chunks = packing.cp_chunks(length, cp, 64)
    assert len(chunks) == 2 * cp and chunks[0][0] == 0 and chunks[-1][1] == length
    assert all(a[1] == b[0] for a, b in zip(chunks, chunks[1:]))
    assert all(s % 64 == 0 for s, _ in chunks)
    mb = packing.MicroBatch([length], cp, 64)
    held = sorted(p for r in range(cp) for p in mb.positions(r).tolist())
    assert held == list(range(length))


def test_packing_counts_the_per_rank_share_and_names_a_sequence_too_long():
    lengths = [192, 220, 128, 128, 220, 192]
    assert packing.pack(lengths, cp=1, max_tokens=600, block=64) == [[0, 1, 2], [3, 4, 5]]
    assert packing.pack(lengths, cp=2, max_tokens=350, block=64) == [[0, 1, 2], [3, 4, 5]]
    assert packing.pack(lengths, cp=2, max_tokens=4096, block=64) == [list(range(6))]
    with pytest.raises(ValueError, match="sequence 1 has 220 tokens, more than "
                                         "MAX_TOKENS_PER_GPU=200"):
        packing.pack(lengths, cp=1, max_tokens=200, block=64)
    with pytest.raises(ValueError, match=r"sequence 0 has 192 tokens \(its largest share over "
                                         r"CP=2 ranks is 128\), more than MAX_TOKENS_PER_GPU=100"):
        packing.pack(lengths, cp=2, max_tokens=100, block=64)


def test_group_advantages_normalise_each_group():
    adv = loss.group_advantages([1.0, 0.0, 0.5, 0.5, 3.0], ["a", "a", "b", "b", "c"])
    assert adv[0] == 0.5 / (0.5 ** 0.5 + 1e-6)  # unbiased std of {1, 0}, epsilon added
    assert adv[0] == -adv[1] and adv[2] == adv[3] == 0.0 and adv[4] == 0.0


# -- launched layouts ---------------------------------------------------------------------------
def test_cp2_logps_equal_cp1_for_every_packing(runs):
    ref = logps(runs["cp1_one"])
    for name in ("cp1_two", "cp2_one", "cp2_two", "cp2_small"):
        assert torch.equal(logps(runs[name]), ref), name
    assert runs["cp2_small"][0]["micro_batches"] == [4]
    assert torch.equal(logps(runs["cp2_short"]), logps(runs["cp1_short"]))
    # Global rank = tp + TP * cp: ranks 0 and 2 are CP ranks 0 and 1 of TP rank 0.
    shapes = [{r["module"]: r for r in runs["cp2_short"][rank]["routes"]}["attention"]["shapes"]
              for rank in (0, 2)]
    assert [s["cp_query_rows"] for s in shapes] == [[4 * 64], [0]]
    attention = {r["module"]: r for r in runs["cp2_one"][0]["routes"]}["attention"]
    assert attention["actual"] == "R" and "rlkernel.attention.cpu.v1" in attention["backend_ids"]
    assert attention["shapes"]["cp_query_rows"]  # each rank's query rows were recorded


def test_cp2_reduced_gradients_and_weights_equal_cp1(runs):
    for cp1, cp2 in (("cp1_one", "cp2_one"), ("cp1_two", "cp2_two"), ("cp1_short", "cp2_short")):
        assert same_state(runs[cp1][0]["grads"], runs[cp2][0]["grads"]) == [], (cp1, cp2)
        assert {r["checksum"] for r in runs[cp1] + runs[cp2]} == {runs[cp1][0]["checksum"]}
    # Other micro-batches add the same token gradients in another order: close, not equal.
    assert same_state(runs["cp1_one"][0]["grads"], runs["cp1_two"][0]["grads"])


def test_tp2_is_close_to_tp1_but_not_bitwise(runs):
    tp1, tp2 = runs["tp1_one"][0], runs["cp2_one"][0]
    diff = (logps(runs["tp1_one"]) - logps(runs["cp2_one"])).abs().max().item()
    print(f"TP=1 CP=1 vs TP=2 CP=2 (R/R): max |logp diff| = {diff:.3e}")
    assert not torch.equal(logps(runs["tp1_one"]), logps(runs["cp2_one"]))
    assert diff < 0.05
    rel = worst_relative_diff(tp2["grads"], tp1["grads"])
    print(f"TP=1 vs TP=2 reduced gradients: worst relative difference {rel:.3e}")
    # Tokens near the PPO clip boundary may fall on either side in the two layouts, so their whole
    # gradient comes or goes; a doubled sum over TP would give 1.0.
    assert rel < 0.2


def test_a_step_changes_the_weights_and_repeats_bitwise(runs):
    a, b = runs["dp1"][0], runs["dp1_again"][0]
    assert a["checksum"] != a["checksum_before"]
    changed = sum(int((a["weights"][k] != STATE[k]).sum()) for k in STATE)
    print(f"one AdamW step (lr 1e-5) changed {changed} bf16 weights")
    assert changed > 0
    assert a["checksum"] == b["checksum"] and a["master_checksum"] == b["master_checksum"]


def test_dp2_equals_dp1_accumulating_the_same_micro_batches(runs):
    dp1, dp2 = runs["dp1"][0], runs["dp2"]
    assert dp1["micro_batches"] == [2] and [r["micro_batches"] for r in dp2] == [[1], [1]]
    assert same_state(dp1["grads"], dp2[0]["grads"]) == []
    assert {r["checksum"] for r in dp2} == {dp1["checksum"]}
    assert {r["master_checksum"] for r in dp2} == {dp1["master_checksum"]}
    assert torch.equal(logps(dp2), logps(runs["dp1"])) and dp2[0]["loss"] == dp1["loss"]


def test_pp_is_close_to_rr_and_reports_the_differences(runs):
    for pp, rr in (("cp1_pp", "cp1_one"), ("cp2_pp", "cp2_one")):
        diff = (logps(runs[pp]) - logps(runs[rr])).abs()
        differing = f"{int((diff > 0).sum())}/{diff.numel()}"
        print(f"P/P vs R/R at {pp}: max |logp diff| = {diff.max().item():.3e}, mean = "
              f"{diff.mean().item():.3e}, differing tokens = {differing}")
        assert diff.max().item() < 0.05
        assert {r["module"]: r["actual"] for r in runs[pp][0]["routes"]} == dict.fromkeys(
            ("attention", "ffn", "logp"), "P")
        rel = worst_relative_diff(runs[pp][0]["grads"], runs[rr][0]["grads"])
        print(f"P/P vs R/R at {pp}: worst relative gradient difference {rel:.3e}")
        assert rel < 0.2
    cp_diff = (logps(runs["cp2_pp"]) - logps(runs["cp1_pp"])).abs().max().item()
    print(f"P/P CP=2 vs CP=1: max |logp diff| = {cp_diff:.3e}")
