"""The paged KV cache's spec and the per-layer cache object the ops receive.

`KVCacheSpec` (block size, dtype, scale policy) is the one description of the cache: the `kv_layout`
pass writes it, the manifest stores it (`kv_layout` section), and the runtime's sizing and
allocation, the executor's transient caches and the ops read it. `bytes_per_block` is the only
place a block's size in bytes is computed. `KVCache` is one layer's cache as it reaches an op: the
data and, for a scaled cache, its scales; the store goes through `KVCache.encode`, so a quantized
cache changes what is stored in one place. Not here: which blocks a request holds (runtime/
kv_cache_manager.py) or how many blocks fit in memory (runtime/kv_sizing.py).

Layout of `data`, per layer: (num_blocks, 2, block_size, H_kv, D); index 0 of dim 1 is K, 1 is V.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from enum import StrEnum
from typing import Any

import torch

from optc.core.formats import DTYPES
from optc.core.ir import ModelConfig

DEFAULT_BLOCK_SIZE = 16  # tokens per KV block, unless the kv_layout pass chose another
KV_DTYPES = ("float32", "float16", "bfloat16")  # the cache dtypes whose scale policy is `none`


class KVScales(StrEnum):
    """How stored values relate to k and v. An int8 / fp8 cache adds a policy (per block, per head)."""

    NONE = "none"  # a float cache: k and v stored as they are, rounded to the cache dtype


@dataclass(frozen=True)
class KVCacheSpec:
    block_size: int = DEFAULT_BLOCK_SIZE
    dtype: str = "float32"
    scales: KVScales = KVScales.NONE

    def __post_init__(self) -> None:
        object.__setattr__(self, "scales", KVScales(self.scales))
        if not isinstance(self.block_size, int) or self.block_size < 1:
            raise ValueError(f"KV block_size must be an int >= 1, got {self.block_size!r}")
        if self.dtype not in KV_DTYPES:
            raise ValueError(f"KV cache dtype {self.dtype!r} is not allowed; allowed: {', '.join(KV_DTYPES)}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    def block_shape(self, config: ModelConfig) -> tuple[int, ...]:
        """One block of one layer: (2, block_size, H_kv, D)."""
        return (2, self.block_size, config.num_kv_heads, config.head_dim)

    def bytes_per_block(self, config: ModelConfig) -> int:
        """Bytes of one block over every layer (a float cache has no scales to add)."""
        return config.num_layers * math.prod(self.block_shape(config)) * self.torch_dtype.itemsize

    def allocate_layer(self, config: ModelConfig, num_blocks: int, device: torch.device | str) -> KVCache:
        """One layer's zeroed cache of `num_blocks` blocks."""
        data = torch.zeros((num_blocks, *self.block_shape(config)), dtype=self.torch_dtype, device=device)
        return KVCache(data)

    def allocate(self, config: ModelConfig, num_blocks: int, device: torch.device | str) -> list[KVCache]:
        """Every layer's cache."""
        return [self.allocate_layer(config, num_blocks, device) for _ in range(config.num_layers)]

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "scales": self.scales.value}

    @staticmethod
    def from_json(d: dict[str, Any]) -> KVCacheSpec:
        """The manifest's section; one written before the scale policy existed has `none`."""
        return KVCacheSpec(d["block_size"], d["dtype"], KVScales(d.get("scales", KVScales.NONE)))


@dataclass(frozen=True)
class KVCache:
    """One layer's paged cache as the ops receive it."""

    data: torch.Tensor  # (num_blocks, 2, block_size, H_kv, D)
    scales: torch.Tensor | None = None  # None: a float cache (KVScales.NONE)

    @property
    def block_size(self) -> int:
        return self.data.shape[2]

    @property
    def dtype(self) -> torch.dtype:
        return self.data.dtype

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """k or v (T, H_kv, D) in the form the cache stores: rounded to a float cache's dtype. A cache
        with scales (or of an integer dtype) needs its quantizer, which no policy defines yet."""
        if self.scales is not None or not self.data.dtype.is_floating_point:
            raise NotImplementedError(f"storing into a {self.data.dtype} KV cache with scales needs a quantizer")
        return x.to(self.data.dtype)

    def copy_block(self, source: int, destination: int) -> None:
        """Copy one block's K/V (and scales) over another's: copy-on-write of a shared block."""
        self.data[destination].copy_(self.data[source])
        if self.scales is not None:
            self.scales[destination].copy_(self.scales[source])
