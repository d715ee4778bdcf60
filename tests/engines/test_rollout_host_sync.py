"""The rollout's decode loop never reads a device tensor back to the host: on a GPU each such read
(`.item()`, `int(t)`, `.tolist()`, `.cpu()`, ...) makes the host wait for the GPU once per token.

On the CPU those calls cost nothing, but the same code runs on CUDA, so the test forbids them in
the loop (prefill and decode steps) and allows them only in the one copy-out after it."""

from __future__ import annotations

import contextlib

import pytest
import torch

from rl_engine.engines.rollout import RolloutEngine
from rl_engine.ops import counters
from test_rollout import N_SAMPLES, NEW_TOKENS, PROMPTS, RR, SEED, build, rollout, same

# Every Tensor method that hands a tensor's values to the host.
READBACKS = ("item", "tolist", "cpu", "numpy", "__int__", "__index__", "__float__", "__bool__")


class ReadbackGuard:
    """Makes the READBACKS raise while `forbidden()` is active."""

    def __init__(self, monkeypatch):
        self.active = False
        for name in READBACKS:
            monkeypatch.setattr(torch.Tensor, name, self._guarded(name, getattr(torch.Tensor, name)))

    def _guarded(self, name, original):
        def call(tensor, *args, **kwargs):
            if self.active:
                raise AssertionError(f"Tensor.{name} in the decode loop")
            return original(tensor, *args, **kwargs)
        return call

    @contextlib.contextmanager
    def forbidden(self, on: bool = True):
        before, self.active = self.active, on
        try:
            yield
        finally:
            self.active = before


def test_decode_loop_reads_nothing_back(monkeypatch):
    guard = ReadbackGuard(monkeypatch)
    with guard.forbidden(), pytest.raises(AssertionError, match="__int__"):
        int(torch.tensor(3))  # the guard itself works

    steps = {"prefill": 0, "decode": 0}

    def inside_loop(name, method):
        def call(*args, **kwargs):
            steps[name] += 1
            with guard.forbidden():
                return method(*args, **kwargs)
        return call

    monkeypatch.setattr(RolloutEngine, "_prefill", inside_loop("prefill", RolloutEngine._prefill))
    monkeypatch.setattr(RolloutEngine, "_decode", inside_loop("decode", RolloutEngine._decode))
    # The launch counters are host-side integers kept by the extension's launchers, not device
    # memory: reading them is no wait.
    read = counters.read

    def read_host_counters():
        with guard.forbidden(False):
            return read()

    monkeypatch.setattr(counters, "read", read_host_counters)
    model, router = build(RR, "rollout")
    samples = RolloutEngine(model, router, max_batch=4).generate(PROMPTS, N_SAMPLES, NEW_TOKENS,
                                                                 SEED)
    assert steps == {"prefill": 2, "decode": 2 * (NEW_TOKENS - 1)}
    monkeypatch.undo()
    assert same(samples, rollout(RR, 4)[0])  # the same bits as an unguarded run
