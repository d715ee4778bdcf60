"""A serving-style rollout engine: continuous batching over a paged KV cache.

Up to `max_batch` sequences are live at once. Newly admitted prompts are prefilled together in one
packed varlen call; then every live sequence advances one token per decode step. Finished
sequences give their pages back and waiting ones take them. Every sample generates exactly
`max_new_tokens` tokens (parity workloads are fixed length; EOS is not special).

The loop never reads the device back: what the host needs to schedule (positions, page tables,
how many tokens each sequence has) follows from host-side counts, since the lengths are fixed.
Sampled tokens stay on the device, feed the next decode step there, and come back to the host in
one copy when every sequence is done.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Sequence

import torch

from rl_engine.engines.rollout import sampling
from rl_engine.engines.rollout.kv_cache import (DecodeBackend, PagedKVCache, PrefillBackend,
                                                SeqSlot, is_fragmented, pages_for, to_device)
from rl_engine.models.qwen3 import Qwen3
from rl_engine.models.unshard import full_state, state_checksum
from rl_engine.models.tp import TPGroup
from rl_engine.runtime.routing import Router


@dataclass(kw_only=True, slots=True)
class Sample:
    prompt_index: int
    sample_index: int
    prompt: list[int]
    tokens: list[int]          # the response's token ids
    logprobs: torch.Tensor     # fp32 [len(tokens)], log p(tokens[i] | prompt, tokens[:i])

    def plain(self) -> dict:
        """Tensor-free form, safe to send between processes."""
        return {"prompt_index": self.prompt_index, "sample_index": self.sample_index,
                "prompt": list(self.prompt), "tokens": list(self.tokens),
                "logprobs": self.logprobs.tolist()}

    @classmethod
    def from_plain(cls, d: dict) -> Sample:
        return cls(**{**d, "logprobs": torch.tensor(d["logprobs"], dtype=torch.float32)})


@dataclass(slots=True)
class _Seq:
    sample: Sample
    seed: int
    slot: SeqSlot
    generated: int = 0                                            # host-side count of tokens
    tokens: list[torch.Tensor] = field(default_factory=list)     # device, [1] per step
    logprobs: list[torch.Tensor] = field(default_factory=list)   # device, [1] per step

    @property
    def length(self) -> int:
        return len(self.sample.prompt) + self.generated


def all_requests(num_prompts: int, n_samples: int) -> list[tuple[int, int]]:
    return [(p, s) for p in range(num_prompts) for s in range(n_samples)]


class RolloutEngine:
    def __init__(self, model: Qwen3, router: Router, tp: TPGroup = TPGroup(), *, max_batch: int = 8,
                 page_policy: str = "fragmented"):
        if max_batch < 1:
            raise ValueError(f"max_batch={max_batch} must be at least 1")
        self.model, self.router, self.tp = model, router, tp
        self.max_batch, self.page_policy = max_batch, page_policy
        self.scale = model.config.head_dim ** -0.5

    # -- generation ---------------------------------------------------------------------------
    @torch.no_grad()
    def generate(self, prompts: list[list[int]], n_samples: int, max_new_tokens: int,
                 seeds: int | Sequence[int], *,
                 requests: Sequence[tuple[int, int]] | None = None) -> list[Sample]:
        """Samples of the requested (prompt index, sample index) pairs (default: every sample of
        every prompt), in request order. `seeds` is one base seed, or one per prompt."""
        if max_new_tokens < 1 or n_samples < 1:
            raise ValueError(f"max_new_tokens={max_new_tokens} and n_samples={n_samples} "
                             "must be at least 1")
        if any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        base = [seeds] * len(prompts) if isinstance(seeds, int) else list(seeds)
        if len(base) != len(prompts):
            raise ValueError(f"{len(base)} seeds for {len(prompts)} prompts")
        requests = list(all_requests(len(prompts), n_samples) if requests is None else requests)
        if len(set(requests)) != len(requests) or any(
                not (0 <= p < len(prompts) and 0 <= s < n_samples) for p, s in requests):
            raise ValueError("requests must be distinct (prompt index, sample index) pairs "
                             "within the prompts and n_samples")
        longest = max(len(prompts[p]) for p, _ in requests) + max_new_tokens if requests else 1
        c = self.model.config
        # max_batch live sequences of at most `longest` tokens each never run out of pages.
        cache = PagedKVCache(layers=c.num_hidden_layers,
                             num_pages=self.max_batch * pages_for(longest),
                             kv_heads=self.model.hkv, head_dim=c.head_dim, dtype=c.dtype,
                             policy=self.page_policy, device=self.router.device)
        pending = collections.deque(
            _Seq(Sample(prompt_index=p, sample_index=s, prompt=list(prompts[p]), tokens=[],
                        logprobs=torch.empty(0)),
                 sampling.sequence_seed(base[p], p, s), SeqSlot())
            for p, s in requests)
        live: list[_Seq] = []
        done: list[_Seq] = []
        fragmented = 0
        while pending or live:
            admitted = []
            while pending and len(live) + len(admitted) < self.max_batch:
                admitted.append(pending.popleft())
            if admitted:
                self._prefill(cache, admitted, longest - 1)
                live += admitted
            if any(s.generated < max_new_tokens for s in live):
                self._decode(cache, [s for s in live if s.generated < max_new_tokens])
            for s in [s for s in live if s.generated == max_new_tokens]:
                fragmented += is_fragmented(s.slot.pages)
                cache.release(s.slot)
                live.remove(s)
                done.append(s)
        self.router.note("attention", "fragmented_page_tables", fragmented)
        self._copy_out(done)
        by_key = {(s.sample.prompt_index, s.sample.sample_index): s.sample for s in done}
        return [by_key[r] for r in requests]

    def _prefill(self, cache: PagedKVCache, seqs: list[_Seq], run_tokens: int) -> None:
        lengths = [len(s.sample.prompt) for s in seqs]
        for s, n in zip(seqs, lengths):
            # The contiguous policy reserves one equal run per sequence now (equal runs never
            # leave a hole too small for the next one); fragmented grows page by page.
            cache.reserve(s.slot, run_tokens if self.page_policy == "contiguous" else n)
        backend = PrefillBackend(cache, self.router, [s.slot for s in seqs], lengths, self.scale)
        tokens = to_device([t for s in seqs for t in s.sample.prompt], torch.long,
                           self.router.device)
        self.router.note("attention", "prefill_batch", len(seqs))
        hidden = self.model.hidden(tokens, backend.positions, backend)
        last = (backend.cu[1:] - 1).long()
        self._sample(seqs, hidden[last])

    def _decode(self, cache: PagedKVCache, seqs: list[_Seq]) -> None:
        """One token per sequence: the input is each one's last sampled token, still on the
        device; positions and page tables come from the host-side lengths."""
        positions = [s.length - 1 for s in seqs]
        for s, p in zip(seqs, positions):
            cache.reserve(s.slot, p + 1)
        backend = DecodeBackend(cache, self.router, [s.slot for s in seqs], positions, self.scale)
        tokens = torch.cat([s.tokens[-1] for s in seqs])
        hidden = self.model.hidden(tokens, backend.positions, backend)
        self._sample(seqs, hidden)

    def _sample(self, seqs: list[_Seq], hidden_last: torch.Tensor) -> None:
        """Draws each sequence's next token, then its log-prob through the plan's logp route;
        both stay on the device."""
        logits = sampling.full_logits(hidden_last, self.model.lm_head,
                                      vocab=self.model.config.vocab_size, tp=self.tp,
                                      router=self.router)
        chosen = sampling.gumbel_max(logits, [sampling.step_seed(s.seed, s.generated)
                                              for s in seqs])
        logp = self.model.selected_logp(hidden_last, chosen)
        for b, s in enumerate(seqs):
            s.tokens.append(chosen[b:b + 1])
            s.logprobs.append(logp[b:b + 1])
            s.generated += 1

    @staticmethod
    def _copy_out(done: list[_Seq]) -> None:
        """Every finished sequence's tokens and log-probs to the host: one copy of each kind for
        the whole call, after the loop, rather than a wait per token."""
        if not done:
            return
        tokens = torch.cat([t for s in done for t in s.tokens]).cpu()
        logprobs = torch.cat([lp for s in done for lp in s.logprobs]).float().cpu()
        sizes = [s.generated for s in done]
        for s, t, lp in zip(done, tokens.split(sizes), logprobs.split(sizes)):
            # A clone, so that saving one sample's log-probs does not save every sample's.
            s.sample.tokens, s.sample.logprobs = t.tolist(), lp.clone()

    # -- weight sync --------------------------------------------------------------------------
    @torch.no_grad()
    def load_weights(self, state: dict[str, torch.Tensor]) -> None:
        """Replaces the weights from a full Hugging Face-named state dict (this rank's shard)."""
        self.model.load_full(state)

    def weights_checksum(self) -> str:
        """sha256 of the full (unsharded) weights under their Hugging Face names; equal on every
        TP rank and equal to state_checksum() of the state dict that was loaded."""
        return state_checksum(full_state(self.model))
