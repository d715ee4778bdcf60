"""The built-in rollout engine: its sampled-token log-probs against a one-pass packed recompute, and
bitwise invariance to decode batch size, page-table layout, runs and the split over engines."""

from __future__ import annotations

import functools
import json

import pytest
import torch

from rl_engine.engines.rollout import RolloutEngine, RolloutJob, run_rollout, state_checksum
from rl_engine.models.config import Qwen3Config
from rl_engine.models.qwen3 import Qwen3
from rl_engine.models.tp import TPGroup
from rl_engine.ops import counters
from rl_engine.runtime.plan import Plan
from rl_engine.runtime.routing import Router

CONFIG = Qwen3Config(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=32)
RR = Plan()
PP = Plan(attention="P/P", ffn="P/P", logp="P/P")
# Lengths straddle page (16) and KV-block (64) boundaries once the response is added.
PROMPTS = [[7, 3, 9, 1, 4], list(range(20, 37)), [(11 * i) % 500 + 1 for i in range(50)]]
N_SAMPLES, NEW_TOKENS, SEED = 2, 24, 1234


def random_state(config: Qwen3Config = CONFIG, seed: int = 0) -> dict[str, torch.Tensor]:
    """A random Qwen3 checkpoint under Hugging Face names (untied LM head)."""
    g = torch.Generator().manual_seed(seed)
    c, d, dt = config, config.head_dim, config.dtype

    def w(rows, cols, scale=None):
        return (torch.randn(rows, cols, generator=g) * (scale or cols ** -0.5)).to(dt)

    def norm(n):
        return (1 + 0.1 * torch.randn(n, generator=g)).to(dt)

    h, i = c.hidden_size, c.intermediate_size
    state = {"model.embed_tokens.weight": w(c.vocab_size, h, 1.0), "model.norm.weight": norm(h),
             "lm_head.weight": w(c.vocab_size, h, 2 * h ** -0.5)}
    for n in range(c.num_hidden_layers):
        pre = f"model.layers.{n}."
        state.update({
            pre + "self_attn.q_proj.weight": w(c.num_attention_heads * d, h),
            pre + "self_attn.k_proj.weight": w(c.num_key_value_heads * d, h),
            pre + "self_attn.v_proj.weight": w(c.num_key_value_heads * d, h),
            pre + "self_attn.o_proj.weight": w(h, c.num_attention_heads * d),
            pre + "self_attn.q_norm.weight": norm(d), pre + "self_attn.k_norm.weight": norm(d),
            pre + "input_layernorm.weight": norm(h),
            pre + "post_attention_layernorm.weight": norm(h),
            pre + "mlp.gate_proj.weight": w(i, h), pre + "mlp.up_proj.weight": w(i, h),
            pre + "mlp.down_proj.weight": w(h, i),
        })
    return state


STATE = random_state()


def build(plan: Plan, side: str) -> tuple[Qwen3, Router]:
    router = Router(plan, side=side, engine="builtin")
    model = Qwen3(CONFIG, router, TPGroup())
    model.load_full(STATE)
    return model, router


@functools.lru_cache(maxsize=None)
def rollout(plan: Plan, max_batch: int, policy: str = "fragmented",
            num_prompts: int = len(PROMPTS)):
    """(samples, router, extension launches by kernel) of one in-process engine doing every
    sample, single-threaded as the launched ranks are."""
    model, router = build(plan, "rollout")
    engine = RolloutEngine(model, router, max_batch=max_batch, page_policy=policy)
    threads, before = torch.get_num_threads(), counters.read()
    torch.set_num_threads(1)
    try:
        samples = engine.generate(PROMPTS[:num_prompts], N_SAMPLES, NEW_TOKENS, SEED)
    finally:
        torch.set_num_threads(threads)
    launches = {k: n for (k, _), n in counters.delta(before, counters.read()).items()}
    return samples, router, launches


class PackedPrefill:
    """The trainer's view: whole sequences in one packed varlen call, no cache."""

    def __init__(self, router: Router, lengths: list[int]):
        self.router, self.scale = router, CONFIG.head_dim ** -0.5
        self.cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
        self.positions = torch.cat([torch.arange(n) for n in lengths])

    def attend(self, layer, q, k, v):
        return self.router.attention("attention", q, k, v, self.cu, self.cu, self.positions,
                                     self.scale)


@torch.no_grad()
def recompute(trainer: tuple[Qwen3, Router], samples) -> list[torch.Tensor]:
    """Log-probs of every response token from one training-side pass over prompt + response."""
    model, router = trainer
    seqs = [s.prompt + s.tokens for s in samples]
    backend = PackedPrefill(router, [len(s) for s in seqs])
    hidden = model.hidden(torch.tensor([t for s in seqs for t in s]), backend.positions, backend)
    rows, start = [], 0
    for s, full in zip(samples, seqs):
        rows += range(start + len(s.prompt) - 1, start + len(full) - 1)
        start += len(full)
    targets = torch.tensor([t for s in samples for t in s.tokens])
    return list(model.selected_logp(hidden[rows], targets).split([len(s.tokens) for s in samples]))


def same(a, b) -> bool:
    return len(a) == len(b) and all(
        (x.prompt_index, x.sample_index, x.tokens) == (y.prompt_index, y.sample_index, y.tokens)
        and torch.equal(x.logprobs, y.logprobs) for x, y in zip(a, b))



# -- in-process engine (TP=1) ---------------------------------------------------------------------
def test_rr_rollout_logprobs_equal_packed_recompute():
    samples, router, launches = rollout(RR, 4)
    assert len(samples) == len(PROMPTS) * N_SAMPLES
    assert all(len(s.tokens) == NEW_TOKENS and s.logprobs.dtype == torch.float32 for s in samples)
    for s, ref in zip(samples, recompute(build(RR, "training"), samples)):
        assert torch.equal(s.logprobs, ref), (s.prompt_index, s.sample_index)
    # Two samples of one prompt are different draws, not one draw reported twice.
    assert samples[0].tokens != samples[1].tokens
    shapes = router.records["attention"].shapes
    assert max(shapes["decode_batch"]) == 4 and max(shapes["prefill_batch"]) == 4
    assert max(shapes["fragmented_page_tables"]) > 0
    # Each layer of each decode step ran the paged decode kernel: six sequences, at most four live,
    # make two waves of NEW_TOKENS - 1 decode steps.
    assert launches["attention_decode"] == 2 * (NEW_TOKENS - 1) * CONFIG.num_hidden_layers


def test_rr_decode_batch_of_one_and_four_identical():
    one, router, _ = rollout(RR, 1)
    assert router.records["attention"].shapes["decode_batch"] == {1}
    assert same(one, rollout(RR, 4)[0])


def test_rr_fragmented_and_contiguous_page_tables_identical():
    contiguous, router, _ = rollout(RR, 4, "contiguous")
    assert router.records["attention"].shapes["fragmented_page_tables"] == {0}
    assert same(contiguous, rollout(RR, 4, "fragmented")[0])


def test_r_logp_samples_a_sequence_alike_alone_and_in_a_batch():
    """Under R logits the token drawn for a sequence does not depend on the sequences beside it."""
    model, router = build(RR, "rollout")
    engine = RolloutEngine(model, router, max_batch=1)
    alone = engine.generate(PROMPTS, N_SAMPLES, NEW_TOKENS, SEED, requests=[(2, 1)])[0]
    assert router.records["attention"].shapes["decode_batch"] == {1}
    batched, batch_router, _ = rollout(RR, 4)
    assert max(batch_router.records["attention"].shapes["decode_batch"]) == 4
    in_batch = batched[2 * N_SAMPLES + 1]
    assert (in_batch.prompt_index, in_batch.sample_index) == (2, 1)
    assert torch.equal(torch.tensor(alone.tokens), torch.tensor(in_batch.tokens))
    assert torch.equal(alone.logprobs, in_batch.logprobs)


@pytest.mark.parametrize("plan, backend", [(RR, "rlkernel.det_gemm.cpu.v1"),
                                           (PP, "production.torch.linear")])
def test_sampling_logits_are_counted_in_the_logp_record(plan, backend):
    samples, router, launches = rollout(plan, 4)
    # Six sequences, at most four live: two waves of one prefill and NEW_TOKENS - 1 decode steps,
    # each drawing its tokens from one logits call over the live rows.
    draws = 2 * NEW_TOKENS
    logp_counts = router.records["logp"].call_counts
    assert logp_counts[backend] == draws
    if plan is RR:
        gemms = sum(router.records[m].call_counts[backend] for m in ("attention", "ffn", "logp"))
        assert launches["det_gemm"] == gemms  # every det_gemm launch is some module's
    else:
        assert "det_gemm" not in launches


def test_pp_decode_differs_from_packed_prefill():
    samples, router, launches = rollout(PP, 4)
    assert "production.split_kv_decode" in router.records["attention"].call_counts
    assert "attention_decode" not in launches
    refs = recompute(build(PP, "training"), samples)
    diff = torch.cat([s.logprobs - ref for s, ref in zip(samples, refs)])
    mismatches = int((diff != 0).sum())
    print(f"P/P rollout vs packed recompute: {mismatches} of {diff.numel()} log-probs differ, "
          f"max |diff| = {diff.abs().max().item():.3g}")
    assert mismatches > 0


# -- pieces ---------------------------------------------------------------------------------------
def test_block_manager_fragments_and_reuses_pages():
    from rl_engine.engines.rollout.kv_cache import BlockManager, is_fragmented

    frag = BlockManager(8, "fragmented")
    a, b = frag.allocate(3), frag.allocate(2)
    assert is_fragmented(a) and is_fragmented(b) and not set(a) & set(b)
    frag.free(a)
    assert frag.allocate(3) == a[::-1]  # freed pages are granted again first
    cont = BlockManager(8, "contiguous")
    x, y = cont.allocate(4), cont.allocate(4)
    assert (x, y) == ([0, 1, 2, 3], [4, 5, 6, 7])
    with pytest.raises(RuntimeError, match="exhausted"):
        cont.allocate(1)


def test_gumbel_max_samples_the_softmax():
    from rl_engine.engines.rollout import sampling

    logits = torch.tensor([2.0, 1.0, 0.0, -1.0])
    draws = sampling.gumbel_max(logits.expand(4000, 4), [sampling.step_seed(7, i)
                                                         for i in range(4000)])
    freq = torch.bincount(draws, minlength=4).float() / draws.numel()
    assert torch.allclose(freq, torch.softmax(logits, 0), atol=0.03)  # ~4 standard errors


def test_weight_sync_replaces_weights_and_checksum_tracks_them():
    model, router = build(RR, "rollout")
    engine = RolloutEngine(model, router, max_batch=4)
    assert engine.weights_checksum() == state_checksum(STATE)
    other = random_state(seed=1)
    engine.load_weights(other)
    assert engine.weights_checksum() == state_checksum(other) != state_checksum(STATE)
    changed = engine.generate(PROMPTS[:1], 1, 8, SEED)[0]
    engine.load_weights(STATE)
    back = engine.generate(PROMPTS[:1], 1, 8, SEED)[0]
    ref = rollout(RR, 4)[0][0]  # the same sample, 24 tokens long: its first 8 must match
    assert back.tokens == ref.tokens[:8] and torch.equal(back.logprobs, ref.logprobs[:8])
    assert changed.tokens != back.tokens


# -- launched ranks: TP inside an engine, several engines -----------------------------------------
def job(**kw) -> RolloutJob:
    base = dict(config=CONFIG, state=STATE, plan=RR, prompts=PROMPTS, n_samples=N_SAMPLES,
                max_new_tokens=NEW_TOKENS, seed=SEED, max_batch=4)
    return RolloutJob(**{**base, **kw})


def tp_worker(rank: int, world: int, rollout_job: RolloutJob) -> dict:
    """A rollout rank, then the same rank as a TP=2 trainer recomputing its samples."""
    from rl_engine.engines.rollout import RolloutRank, Sample

    engine = RolloutRank(rank, world, rollout_job)
    j = rollout_job
    out = engine.generate(j.prompts, j.n_samples, j.max_new_tokens, j.seed, j.step)
    out["weights_checksum"] = engine.engine.weights_checksum()  # gathered over the TP ranks
    samples = [Sample.from_plain(s) for s in out["samples"]]
    router = Router(rollout_job.plan, side="training", engine="builtin")
    model = Qwen3(CONFIG, router, TPGroup(rank=rank, size=world, group=None))
    model.load_full(rollout_job.state)
    out["recompute"] = [r.tolist() for r in recompute((model, router), samples)]
    return out


def test_rr_tp2_engine_repeats_bitwise_and_matches_tp2_recompute():
    from rl_engine.engines.launch import launch
    from rl_engine.engines.rollout import Sample

    runs = [launch(tp_worker, 2, args=(job(tp=2),), timeout=120) for _ in range(2)]
    for ranks in runs:
        assert ranks[0]["samples"] == ranks[1]["samples"]  # both TP ranks hold every bit
        assert {r["weights_checksum"] for r in ranks} == {state_checksum(STATE)}
        for s, ref in zip(ranks[0]["samples"], ranks[0]["recompute"]):
            assert s["logprobs"] == ref
    assert runs[0][0]["samples"] == runs[1][0]["samples"]
    # TP=2 is not TP=1: each rank rounds its row-parallel partial to bf16 before the rank-order
    # sum, where TP=1 rounds the whole dot product once. Parity holds per layout, not across them.
    tp2 = [Sample.from_plain(s) for s in runs[0][0]["samples"]]
    assert not same(tp2, rollout(RR, 4)[0])


def test_two_engines_split_samples_like_one_engine(tmp_path):
    four = job(engines=2, prompts=PROMPTS[:2], run_dir=tmp_path, run_id="split-test")  # 4 samples
    split, ranks = run_rollout(four, timeout=120)
    assert [len(r["samples"]) for r in ranks] == [2, 2]
    records = [json.loads(p.read_text()) for p in sorted((tmp_path / "readbacks").iterdir())]
    assert len(records) == 2 and {r["run_id"] for r in records} == {"split-test"}
    for record in records:
        modules = {m["module"]: m for m in record["modules"]}
        assert modules["attention"]["shapes"]["decode_batch"] == [2]
        assert modules["attention"]["shapes"]["fragmented_page_tables"][0] > 0
        # The engine's two samples run as one wave: NEW_TOKENS logits calls on the logp route.
        assert modules["logp"]["call_counts"]["rlkernel.det_gemm.cpu.v1"] == NEW_TOKENS
    one, router, _ = rollout(RR, 4, num_prompts=2)
    assert router.records["attention"].shapes["decode_batch"] == {4}
    assert same(split, one)
