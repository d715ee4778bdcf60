"""The torch-free reader of `torch.save` files: it gives back what `torch.load` gives, bit for bit,
as numpy arrays, refuses what a weights-only load refuses, and judging a run needs no torch."""

from __future__ import annotations

import collections
import pickle
import subprocess
import sys
import zipfile

import numpy as np
import pytest
import torch

from rl_engine.artifacts import torchfile
from rl_engine.runtime.plan import Plan
from fixtures import fake_run


def _same(array: np.ndarray, tensor: torch.Tensor) -> bool:
    return array.dtype == tensor.numpy().dtype and array.shape == tuple(tensor.shape) \
        and array.tobytes() == tensor.contiguous().numpy().tobytes()


def test_every_tensor_comes_back_with_its_bits_dtype_and_shape(tmp_path):
    g = torch.Generator().manual_seed(0)
    base = torch.randn(6, 7, generator=g)
    special = torch.tensor([0.0, -0.0, float("nan"), float("inf"), -float("inf"), 1e-45])
    obj = {
        "run_id": "r-1", "step": 3, "nested": [{"x": torch.arange(5)}, (1.5, None)],
        "float32": base, "special": special, "float64": base.double(), "float16": base.half(),
        "int64": torch.arange(-5, 7).view(3, 4), "int32": torch.arange(4, dtype=torch.int32),
        "int16": torch.arange(4, dtype=torch.int16), "int8": torch.arange(-2, 2, dtype=torch.int8),
        "uint8": torch.arange(250, 254, dtype=torch.uint8), "bool": torch.tensor([True, False]),
        "scalar": torch.tensor(2.5), "empty": torch.zeros(0, 4),
        "strided": base[1:5:2, 2:], "transposed": base.t(), "shares_storage": base[2],
        "ordered": collections.OrderedDict(a=torch.ones(2)),
    }
    torch.save(obj, tmp_path / "t.pt")
    got = torchfile.load(tmp_path / "t.pt")
    want = torch.load(tmp_path / "t.pt", weights_only=True)
    assert got.keys() == want.keys()
    assert (got["run_id"], got["step"], got["nested"][1]) == ("r-1", 3, (1.5, None))
    assert _same(got["nested"][0]["x"], want["nested"][0]["x"])
    assert isinstance(got["ordered"], collections.OrderedDict) and _same(got["ordered"]["a"], want["ordered"]["a"])
    for key in ("float32", "special", "float64", "float16", "int64", "int32", "int16", "int8", "uint8",
                "bool", "scalar", "empty", "strided", "transposed", "shares_storage"):
        assert isinstance(got[key], np.ndarray) and _same(got[key], want[key]), key
    got["strided"][0, 0] = 7.0  # each array is its own copy, writable, as a loaded tensor is
    assert got["float32"][1, 2] == base[1, 2]


def test_what_a_weights_only_load_refuses_is_refused(tmp_path):
    torch.save({"x": torch.ones(2, dtype=torch.bfloat16)}, tmp_path / "bf16.pt")
    with pytest.raises(pickle.UnpicklingError, match="BFloat16Storage is not allowed"):
        torchfile.load(tmp_path / "bf16.pt")
    torch.save({"f": fake_run.logprobs}, tmp_path / "code.pt")
    with pytest.raises(pickle.UnpicklingError, match="is not allowed in a tensor file"):
        torchfile.load(tmp_path / "code.pt")
    (tmp_path / "legacy.pt").write_bytes(pickle.dumps({"x": 1}))
    with pytest.raises(pickle.UnpicklingError, match="not a torch zip file"):
        torchfile.load(tmp_path / "legacy.pt")


def _text(s: str) -> bytes:
    return b"X" + len(s).to_bytes(4, "little") + s.encode()


def _ints(values) -> bytes:
    return b"(" + b"".join(b"J" + v.to_bytes(4, "little", signed=True) for v in values) + b"t"


def _tensor_file(path, *, numel: int, offset: int, size, stride, data: bytes | None = None):
    """A file as torch.save lays out one float32 tensor, with the rebuild arguments given."""
    pkl = (b"\x80\x02ctorch._utils\n_rebuild_tensor_v2\n((" + _text("storage")
           + b"ctorch\nFloatStorage\n" + _text("0") + _text("cpu") + _ints([numel])[1:-1] + b"tQ"
           + _ints([offset])[1:-1] + _ints(size) + _ints(stride)
           + b"\x89ccollections\nOrderedDict\n)RtR.")
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("t/data.pkl", pkl)
        z.writestr("t/byteorder", "little")
        z.writestr("t/data/0", np.arange(4, dtype="<f4").tobytes() if data is None else data)


@pytest.mark.parametrize("numel, offset, size, stride, data, problem", [
    (4, 0, (5,), (1,), None, "reaches past its storage"),
    (4, 2, (2, 2), (1, 1), None, "reaches past its storage"),
    (4, 0, (2,), (-1,), None, "not a tuple of non-negative ints"),
    (4, -1, (1,), (1,), None, "not a tuple of non-negative ints"),
    (4, 0, (2, 2), (2,), None, "differ in length"),
    (8, 0, (8,), (1,), None, "holds 16 bytes, not 8 elements"),
])
def test_a_tensor_that_reaches_past_its_storage_is_refused(tmp_path, numel, offset, size, stride, data,
                                                           problem):
    _tensor_file(tmp_path / "ok.pt", numel=4, offset=1, size=(1, 2), stride=(2, 1))
    assert torchfile.load(tmp_path / "ok.pt").tolist() == [[1.0, 2.0]]
    _tensor_file(tmp_path / "bad.pt", numel=numel, offset=offset, size=size, stride=stride, data=data)
    with pytest.raises(pickle.UnpicklingError, match=problem):
        torchfile.load(tmp_path / "bad.pt")


def test_judging_a_run_loads_no_torch(tmp_path):
    ro = fake_run.logprobs(4, 6)
    tr = fake_run.perturbed(ro, 3)
    code = fake_run.write_run(tmp_path / "run", run_id="r", plan=Plan(), rollout=ro, trainer=tr)
    assert code == 1
    script = ("import sys\n"
              "from rl_engine.evidence import judge, layout\n"
              "from rl_engine.matrix import analyze, runner, tables\n"
              f"v = judge.judge(layout.RunDir({str(tmp_path / 'run')!r}))\n"
              "print(v.mismatch_count, v.numel, 'torch' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["12", "24", "False"]


def test_the_comparison_counts_bits_on_tensors_and_arrays_alike():
    from rl_engine.evidence.compare import compare

    ro = torch.tensor([[0.0, -1.5, float("nan"), 2.0]])
    tr = torch.tensor([[-0.0, -1.5, float("nan"), 2.5]])
    for a, b in ((ro, tr), (ro.numpy(), tr.numpy()), (ro.clone().requires_grad_(), tr)):
        c = compare(a, b)
        assert (c.numel, c.mismatch_count, c.nonfinite_count, c.max_abs_diff) == (4, 2, 1, 0.5)
        assert c.differs.tolist() == [[True, False, False, True]]
    with pytest.raises(ValueError, match="must be float32"):
        compare(ro.bfloat16(), tr)
    with pytest.raises(ValueError, match="differ in shape"):
        compare(ro, tr[:, :2])
