"""Reads a file that `torch.save` wrote (its zip format) into numpy arrays, without torch.

Judging a finished run reads its train data and nothing else of torch; importing torch for that
costs a matrix cell 1.3 to 1.5 s on a small CPU, more than the judging itself. The unpickler admits
what `torch.load(weights_only=True)` admits for plain containers of CPU tensors: the tensor rebuild
call, the storage types below, and OrderedDict. Anything else (another global, a bfloat16 storage,
a legacy non-zip file, a tensor reaching past its storage) is refused with
`pickle.UnpicklingError`.
"""

from __future__ import annotations

import collections
import io
import pickle
import zipfile
from pathlib import Path
from typing import Any

import numpy as np

# torch's typed storages and the numpy dtype of their elements (the files are little-endian).
_STORAGES = {
    "DoubleStorage": "<f8", "FloatStorage": "<f4", "HalfStorage": "<f2",
    "LongStorage": "<i8", "IntStorage": "<i4", "ShortStorage": "<i2", "CharStorage": "i1",
    "ByteStorage": "u1", "BoolStorage": "?",
}


class _Storage:
    """A storage type named in the pickle; frozen, so that a pickle cannot rewrite its dtype."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        object.__setattr__(self, "name", name)

    def __setattr__(self, key: str, value: Any) -> None:
        raise pickle.UnpicklingError("a storage type cannot be modified")


def _ints(values: Any, what: str) -> tuple[int, ...]:
    if not isinstance(values, tuple) or not all(type(v) is int and v >= 0 for v in values):
        raise pickle.UnpicklingError(f"tensor {what} {values!r} is not a tuple of non-negative ints")
    return values


def _rebuild_tensor(storage: np.ndarray, offset: int, size: tuple, stride: tuple, *_rest) -> np.ndarray:
    """The tensor's own copy (as torch.load gives), after checking that every element it names lies
    inside its storage: as_strided itself reads wherever the strides point."""
    if not isinstance(storage, np.ndarray):
        raise pickle.UnpicklingError("a tensor without a storage")
    (offset,), size, stride = _ints((offset,), "offset"), _ints(size, "size"), _ints(stride, "stride")
    if len(size) != len(stride):
        raise pickle.UnpicklingError(f"tensor size {size} and stride {stride} differ in length")
    if not all(size):
        return np.empty(size, dtype=storage.dtype)
    if offset + sum((n - 1) * s for n, s in zip(size, stride)) >= storage.size:
        raise pickle.UnpicklingError(f"tensor of size {size}, stride {stride} at offset {offset} "
                                     f"reaches past its storage of {storage.size} elements")
    item = storage.itemsize
    view = np.lib.stride_tricks.as_strided(storage[offset:], shape=size,
                                           strides=tuple(s * item for s in stride), writeable=False)
    return np.array(view)  # a 0-d tensor too comes back as an ndarray, not a numpy scalar


class _Unpickler(pickle.Unpickler):
    def __init__(self, data: bytes, archive: zipfile.ZipFile, prefix: str) -> None:
        super().__init__(io.BytesIO(data))
        self._archive, self._prefix, self._loaded = archive, prefix, {}

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return _rebuild_tensor
        if module == "torch" and name in _STORAGES:
            return _Storage(name)
        if (module, name) == ("collections", "OrderedDict"):
            return collections.OrderedDict
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in a tensor file")

    def persistent_load(self, pid: Any) -> np.ndarray:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"
                and isinstance(pid[1], _Storage)):
            raise pickle.UnpicklingError(f"unexpected persistent id {pid!r}")
        _, storage, key, _location, numel = pid
        if key not in self._loaded:
            dtype = np.dtype(_STORAGES[storage.name])
            try:
                raw = self._archive.read(f"{self._prefix}/data/{key}")
            except KeyError:
                raise pickle.UnpicklingError(f"storage {key!r} is missing from the file") from None
            if type(numel) is not int or numel < 0 or numel * dtype.itemsize > len(raw):
                raise pickle.UnpicklingError(f"storage {key!r} holds {len(raw)} bytes, not {numel!r} "
                                             f"elements of {dtype}")
            self._loaded[key] = np.frombuffer(raw, dtype=dtype, count=numel)
        return self._loaded[key]


def load(path: Path | str) -> Any:
    """The object `torch.save` wrote, every CPU tensor in it as a numpy array."""
    try:
        archive = zipfile.ZipFile(path)
    except zipfile.BadZipFile:
        raise pickle.UnpicklingError(f"{Path(path).name} is not a torch zip file") from None
    with archive:
        pickles = [n for n in archive.namelist() if n.endswith("/data.pkl") and n.count("/") == 1]
        if len(pickles) != 1:
            raise pickle.UnpicklingError(f"{Path(path).name} is not a torch zip file (no data.pkl)")
        prefix = pickles[0].split("/", 1)[0]
        order = f"{prefix}/byteorder"
        if order in archive.namelist() and archive.read(order).strip() != b"little":
            raise pickle.UnpicklingError(f"{Path(path).name} is big-endian")
        return _Unpickler(archive.read(pickles[0]), archive, prefix).load()
