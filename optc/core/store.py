"""TensorStore: named tensors, loaded lazily.

Each entry knows its shape and dtype without loading, and a `load()` that produces the tensor on
demand (from a safetensors file, from another entry through a transform, or from a seeded
generator). Stores are immutable: `with_entries` returns a new store, so a pass never edits its
input, and nothing is materialized until somebody (usually the artifact writer, one shard at a
time) asks for it. That is how an 8B build avoids holding two copies of the weights.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

_ST_DTYPES = {
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn,  # fp8_e4m3 weights
}


@dataclass(frozen=True)
class Entry:
    shape: tuple[int, ...]
    dtype: torch.dtype
    load: Callable[[], torch.Tensor]


class TensorStore:
    def __init__(self, entries: Mapping[str, Entry] | None = None):
        self._entries: dict[str, Entry] = dict(entries or {})

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def names(self) -> list[str]:
        return list(self._entries)

    def entry(self, name: str) -> Entry:
        try:
            return self._entries[name]
        except KeyError:
            raise KeyError(f"tensor {name!r} is not in the store") from None

    def get(self, name: str) -> torch.Tensor:
        e = self.entry(name)
        t = e.load()
        if tuple(t.shape) != e.shape or t.dtype != e.dtype:
            raise ValueError(f"tensor {name!r} loaded as {t.dtype}{list(t.shape)}, declared {e.dtype}{list(e.shape)}")
        return t

    def with_entries(self, entries: Mapping[str, Entry] | None = None, remove: Iterable[str] = ()) -> TensorStore:
        new = dict(self._entries)
        for name in remove:
            new.pop(name, None)
        new.update(entries or {})
        return TensorStore(new)

    def keep(self, names: Iterable[str]) -> TensorStore:
        return TensorStore({n: self._entries[n] for n in names})

    @staticmethod
    def of(tensors: Mapping[str, torch.Tensor]) -> TensorStore:
        """A store over tensors already in memory."""
        return TensorStore({n: Entry(tuple(t.shape), t.dtype, (lambda t=t: t)) for n, t in tensors.items()})

    @staticmethod
    def from_safetensors(files: Iterable[Path], rename: Callable[[str], str | None] = lambda k: k) -> TensorStore:
        """Lazy entries for every tensor of `files`; `rename` maps a key to a store name (None drops it)."""
        entries = {}
        for path in files:
            with safe_open(str(path), framework="pt") as f:
                for key in f.keys():
                    name = rename(key)
                    if name is None:
                        continue
                    sl = f.get_slice(key)
                    entries[name] = Entry(
                        tuple(sl.get_shape()), _ST_DTYPES[sl.get_dtype()], (lambda p=str(path), k=key: _read(p, k))
                    )
        return TensorStore(entries)


class Spill:
    """Tensors written to a temporary folder as they are produced and read back lazily, so a pass whose results
    grow with the model (a calibrated quantization's, block after block) holds entries, not tensors. Each
    entry's `load` holds the Spill, so the folder lives as long as an entry that reads from it; it is removed
    with the last one (or at exit)."""

    def __init__(self, prefix: str = "optc-spill-"):
        self._dir = tempfile.TemporaryDirectory(prefix=prefix)
        self._files = 0

    def write(self, tensors: Mapping[str, torch.Tensor]) -> dict[str, Entry]:
        """Write `tensors` (on any device) to one new file -> an entry for each that reads it back."""
        path = str(Path(self._dir.name) / f"{self._files:06d}.safetensors")
        self._files += 1
        # own contiguous host copies: safetensors refuses views and tensors sharing memory
        host = {k: t.detach().to("cpu", copy=True, memory_format=torch.contiguous_format) for k, t in tensors.items()}
        save_file(host, path)
        return {k: Entry(tuple(t.shape), t.dtype, partial(self._read, path, k)) for k, t in host.items()}

    def _read(self, path: str, key: str) -> torch.Tensor:
        return _read(path, key)


def transformed(src: Entry, fn: Callable[[torch.Tensor], torch.Tensor], shape=None, dtype=None) -> Entry:
    """An entry computed lazily from another: `fn(src.load())`."""
    return Entry(tuple(shape or src.shape), dtype or src.dtype, lambda: fn(src.load()))


def _read(path: str, key: str) -> torch.Tensor:
    with safe_open(path, framework="pt") as f:
        return f.get_tensor(key)
