"""Weight sync around the launching process: the published state arrives whole, each tensor is
checked against the trainer's digest where it lands, and a changed tensor is named."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from rl_engine.engines import sync


def state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"model.embed_tokens.weight": torch.randn(300, 16, generator=g).to(torch.bfloat16),
            "model.norm.weight": torch.randn(16, generator=g).to(torch.bfloat16),
            "lm_head.weight": torch.randn(300, 16, generator=g)}


def test_the_fingerprint_is_the_exact_sums_of_the_16_bit_words():
    t = torch.tensor([1.0, -2.0, 0.5], dtype=torch.bfloat16)
    words = [w & 0xFFFF for w in t.view(torch.int16).tolist()]
    want = (sum(words), sum(w * i for i, w in enumerate(words)), 0)
    assert sync.fingerprint(t) == want
    flipped = t.clone()
    flipped[2] = -0.5  # one sign bit
    assert sync.fingerprint(flipped) != want
    swapped = t[[1, 0, 2]]  # same words, other places
    assert sync.fingerprint(swapped)[0] == want[0] and sync.fingerprint(swapped) != want


def test_published_weights_arrive_bit_for_bit_with_their_digests(tmp_path):
    sent = state()
    published = sync.publish(sent, tmp_path, step=3)
    assert published.checksum == sync.combined(sync.digests(sent)) and published.handles is None
    received, seconds = sync.receive(published)
    assert set(received) == set(sent) and all(torch.equal(received[n], sent[n]) for n in sent)
    assert {"read", "digest"} <= set(seconds)


def test_a_tensor_changed_on_the_way_is_named(tmp_path):
    published = sync.publish(state(), tmp_path, step=1)
    on_disk = load_file(published.path)
    on_disk["model.norm.weight"][5] += 1
    save_file(on_disk, published.path)
    with pytest.raises(sync.SyncMismatch, match="weight sync of step 1: tensor model.norm.weight "
                                                "arrived with digest"):
        sync.receive(published)
