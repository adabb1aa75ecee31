"""The paged KV cache's spec and the per-layer cache object the ops receive.

`KVCacheSpec` (block size, dtype, scale policy) is the one description of the cache: the `kv_layout`
pass writes it, the manifest stores it (`kv_layout` section), the graph's KV-touching nodes carry it
as attrs (`node_attrs`), and the runtime's sizing and allocation, the executor's transient caches
and the ops read it. `bytes_per_block` is the only place a block's size in bytes is computed.
`KVCache` is one layer's cache as it reaches an op: the data and, for a scaled cache, its scales;
the store goes through `KVCache.encode` and the references read through `dequantize`, so a
quantized cache changes what is stored and read in one place each. Not here: which blocks a request
holds (runtime/kv_cache_manager.py) or how many blocks fit in memory (runtime/kv_sizing.py).

Layout of `data`, per layer: (num_blocks, 2, block_size, H_kv, D); index 0 of dim 1 is K, 1 is V. An MLA
model's (`ModelConfig.is_mla`: DeepSeek-V2) is the latent layout (num_blocks, 1, block_size, 1, R + Dr): one
latent (kv_lora_rank R) and rope key (Dr) per token, shared by every head (optc/core/ops/mla.py); the pool,
the block tables and prefix caching see blocks either way, and `bytes_per_block` counts this shape.

KV-cache groups (`kv_cache_groups`). Layers are grouped by attention kind (full; sliding with its
window), and each kind's layers are cut into groups of `slots` layers, `slots` being the layer count
of the smallest kind (a kind whose count is not a multiple of it has a last group with fewer layers).
The layers of a group share one block table: a request holds, per group, a list of blocks, and a
sliding group lets go of the blocks wholly before its window (runtime/kv_cache_manager.py). Every
group takes its blocks from one pool, so a block is the memory of `slots` layers whatever group
holds it: `allocate` makes `slots` cache tensors and layer `group.layers[i]` of every group reads and
writes tensor i. A model without sliding layers has one group of every layer: the layout (one tensor
per layer) and the bytes per block are those of a single block table.

Quantized caches (`int8`, `fp8_e4m3`) hold one fp32 scale per (token, KV head), for K and for V,
in `scales`: (num_blocks, 2, block_size, H_kv), indexed by the same block id as the data, so a
block carries its own scales (prefix caching, copy-on-write, preemption and speculative rollback
move block ids and nothing else). The scale is symmetric absmax, computed when the token is
written: s = max_d |x_d| / QMAX, stored value = x / s (int8: rounded half up, clamped to +-127;
fp8: rounded to nearest e4m3), read back as value * s. A row of zeros has s = 0 and reads as zeros.
"""

from __future__ import annotations

import math
from collections.abc import Collection
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import torch

from optc.core.formats import DTYPES
from optc.core.ir import ModelConfig

DEFAULT_BLOCK_SIZE = 16  # tokens per KV block, unless the kv_layout pass chose another
KV_FLOAT_DTYPES = ("float32", "float16", "bfloat16")  # stored as they are: scale policy `none`
KV_QUANT_DTYPES = ("int8", "fp8_e4m3")  # stored with a scale per (token, KV head)
KV_DTYPES = KV_FLOAT_DTYPES + KV_QUANT_DTYPES
STORAGE_DTYPES = {**DTYPES, "int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn}
QMAX = {"int8": 127.0, "fp8_e4m3": 448.0}  # the largest stored magnitude: int8's symmetric range, e4m3fn's max
SCALE_DTYPE = torch.float32
SCALES_AT = "block"  # where a scaled cache's scales live: beside the block's data, under its block id


class KVScales(StrEnum):
    """How stored values relate to k and v."""

    NONE = "none"  # a float cache: k and v stored as they are, rounded to the cache dtype
    PER_TOKEN_HEAD = "per_token_head"  # one absmax scale per (token, KV head), K and V each, written with the token


@dataclass(frozen=True)
class KVCacheGroup:
    """Layers whose caches share one block table (one per request): one attention kind."""

    window: int | None  # None: full attention; else the sliding window of every layer of the group
    layers: tuple[int, ...]  # layer layers[i] lives in the pool's cache tensor i (its slot)

    def to_json(self) -> dict[str, Any]:
        return {"window": self.window, "layers": list(self.layers)}


def kv_cache_groups(config: ModelConfig) -> tuple[KVCacheGroup, ...]:
    """The model's KV-cache groups: full-attention layers first, then sliding layers by window, each
    kind cut into groups of `num_kv_slots(config)` layers in layer order."""
    kinds: dict[int | None, list[int]] = {}
    for layer in range(config.num_layers):
        kinds.setdefault(config.window(layer), []).append(layer)
    slots = min(len(layers) for layers in kinds.values())
    order = sorted(kinds, key=lambda w: -1 if w is None else w)
    return tuple(KVCacheGroup(w, tuple(kinds[w][i: i + slots])) for w in order
                 for i in range(0, len(kinds[w]), slots))


def num_kv_slots(config: ModelConfig) -> int:
    """Layers one pool block holds the memory of (the largest group's layer count)."""
    return max(len(g.layers) for g in kv_cache_groups(config))


def _slots(config: ModelConfig, layers: Collection[int] | None) -> dict[int, int]:
    """Layer -> its cache tensor: the i-th kept layer of each group on tensor i (every layer kept: None)."""
    keep = range(config.num_layers) if layers is None else layers
    return {layer: slot for group in kv_cache_groups(config)
            for slot, layer in enumerate(x for x in group.layers if x in keep)}


@dataclass(frozen=True)
class KVCacheSpec:
    block_size: int = DEFAULT_BLOCK_SIZE
    dtype: str = "float32"
    scales: KVScales | None = None  # None: the dtype's policy (`none` for floats, per (token, head) otherwise)

    def __post_init__(self) -> None:
        if not isinstance(self.block_size, int) or self.block_size < 1:
            raise ValueError(f"KV block_size must be an int >= 1, got {self.block_size!r}")
        if self.dtype not in KV_DTYPES:
            raise ValueError(f"KV cache dtype {self.dtype!r} is not allowed; allowed: {', '.join(KV_DTYPES)}")
        wanted = KVScales.PER_TOKEN_HEAD if self.dtype in KV_QUANT_DTYPES else KVScales.NONE
        scales = wanted if self.scales is None else KVScales(self.scales)
        if scales is not wanted:
            raise ValueError(f"KV cache dtype {self.dtype} takes scales {wanted.value!r}, not {scales.value!r}")
        object.__setattr__(self, "scales", scales)

    @property
    def torch_dtype(self) -> torch.dtype:
        """The dtype of the stored values."""
        return STORAGE_DTYPES[self.dtype]

    @property
    def is_quantized(self) -> bool:
        return self.scales is not KVScales.NONE

    def block_shape(self, config: ModelConfig) -> tuple[int, ...]:
        """One block of one layer: (2, block_size, H_kv, D); an MLA model's (1, block_size, 1, R + Dr)."""
        if config.is_mla:
            return (1, self.block_size, 1, config.latent_dim)
        return (2, self.block_size, config.num_kv_heads, config.head_dim)

    def scale_shape(self, config: ModelConfig) -> tuple[int, ...]:
        """One block's scales in one layer: (2, block_size, H_kv) (an MLA model's: (1, block_size, 1)); () for a
        float cache."""
        if config.is_mla:  # one scale per token over its latent row (latent and rope key together)
            return (1, self.block_size, 1) if self.is_quantized else ()
        return (2, self.block_size, config.num_kv_heads) if self.is_quantized else ()

    def bytes_per_block(self, config: ModelConfig, layers: Collection[int] | None = None) -> int:
        """Bytes of one pool block, its scales included: one layer's block in each of the
        `num_kv_slots` cache tensors (every layer, for a model without sliding layers); of `layers`'
        slots only, when given (a pipeline stage's: optc/core/ops/stages.py)."""
        return len(set(_slots(config, layers).values())) * self._layer_block_bytes(config)

    def bytes_per_token(self, config: ModelConfig) -> float:
        """KV bytes one token costs over every layer (scales included), when every layer holds it."""
        return config.num_layers * self._layer_block_bytes(config) / self.block_size

    def _layer_block_bytes(self, config: ModelConfig) -> int:
        data = math.prod(self.block_shape(config)) * self.torch_dtype.itemsize
        scales = math.prod(self.scale_shape(config)) * SCALE_DTYPE.itemsize if self.is_quantized else 0
        return data + scales

    def allocate_layer(self, config: ModelConfig, num_blocks: int, device: torch.device | str) -> KVCache:
        """One layer's zeroed cache of `num_blocks` blocks."""
        data = torch.zeros((num_blocks, *self.block_shape(config)), dtype=self.torch_dtype, device=device)
        scales = None
        if self.is_quantized:
            scales = torch.zeros((num_blocks, *self.scale_shape(config)), dtype=SCALE_DTYPE, device=device)
        return KVCache(data, scales, QMAX.get(self.dtype, 0.0))

    def allocate(self, config: ModelConfig, num_blocks: int, device: torch.device | str,
                 layers: Collection[int] | None = None) -> list[KVCache | None]:
        """Every layer's cache: `num_kv_slots` tensors, layer i of each group on tensor i (layers of
        different groups share a tensor; a model without sliding layers has one per layer). With
        `layers` (a pipeline stage's), only theirs: the other layers' entries are None."""
        slot_of = _slots(config, layers)
        slots = [self.allocate_layer(config, num_blocks, device) for _ in set(slot_of.values())]
        return [slots[slot_of[layer]] if layer in slot_of else None for layer in range(config.num_layers)]

    def node_attrs(self) -> dict[str, Any]:
        """What kv_layout records on every node that touches the cache."""
        attrs = {"kv_block_size": self.block_size, "kv_dtype": self.dtype, "kv_scales": self.scales.value}
        return attrs | ({"kv_scales_at": SCALES_AT} if self.is_quantized else {})

    @staticmethod
    def from_node_attrs(attrs: dict[str, Any]) -> KVCacheSpec | None:
        """The spec a node's attrs record; None when kv_layout has not run."""
        if "kv_block_size" not in attrs:
            return None
        return KVCacheSpec(attrs["kv_block_size"], attrs["kv_dtype"], attrs.get("kv_scales"))

    def to_json(self) -> dict[str, Any]:
        d = {"block_size": self.block_size, "dtype": self.dtype, "scales": self.scales.value}
        if self.is_quantized:
            d |= {"scale_dtype": str(SCALE_DTYPE).removeprefix("torch."), "scales_at": SCALES_AT}
        return d

    @staticmethod
    def from_json(d: dict[str, Any]) -> KVCacheSpec:
        """The manifest's section; one written before the scale policy existed has `none`. The scale
        dtype and location are fixed by the policy, so they are written for readers, not read back."""
        return KVCacheSpec(d["block_size"], d["dtype"], KVScales(d.get("scales", KVScales.NONE)))


@dataclass(frozen=True)
class KVCache:
    """One layer's paged cache as the ops receive it."""

    data: torch.Tensor  # (num_blocks, 2, block_size, H_kv, D)
    scales: torch.Tensor | None = None  # (num_blocks, 2, block_size, H_kv) fp32; None: a float cache
    qmax: float = 0.0  # the largest stored magnitude of a scaled cache (QMAX of its dtype)

    def __post_init__(self) -> None:
        if self.scales is not None and self.qmax <= 0:
            raise ValueError("a KV cache with scales needs its dtype's qmax")
        if self.scales is None and (not self.data.dtype.is_floating_point or self.data.dtype.itemsize < 2):
            raise ValueError(f"a {self.data.dtype} KV cache needs its scales: never a blind cast into it")

    @property
    def block_size(self) -> int:
        return self.data.shape[2]

    @property
    def dtype(self) -> torch.dtype:
        return self.data.dtype

    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """k or v (T, H_kv, D) in the form the cache stores, and its scales (T, H_kv) (None for a float
        cache, whose values are only rounded to its dtype)."""
        if self.scales is None:
            return x.to(self.data.dtype), None
        return quantize(x, self.data.dtype, self.qmax)

    def copy_block(self, source: int, destination: int) -> None:
        """Copy one block's K/V (and scales) over another's: copy-on-write of a shared block."""
        self.data[destination].copy_(self.data[source])
        if self.scales is not None:
            self.scales[destination].copy_(self.scales[source])

    def copy_slots(self, sources: torch.Tensor, destinations: torch.Tensor) -> None:
        """Copy the K/V (and scales) of token slots over others (sources, destinations: (n,) int64 slots), all
        read before any is written: a verified draft tree's path moving to consecutive positions."""
        bs = self.block_size
        self.data[destinations // bs, :, destinations % bs] = self.data[sources // bs, :, sources % bs]
        if self.scales is not None:
            self.scales[destinations // bs, :, destinations % bs] = self.scales[sources // bs, :, sources % bs]


def quantize(x: torch.Tensor, dtype: torch.dtype, qmax: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x (..., D) -> values of `dtype` and fp32 scales (...,): absmax symmetric over the last dim. The
    kernels (optc.kernels.rope) compute the same expressions in the same order."""
    xf = x.float()
    amax = xf.abs().amax(-1)
    # products with IEEE reciprocals, the same bits on every device: torch divides a tensor by a scalar as
    # a quotient on the CPU and as a product with the scalar's reciprocal on CUDA
    scale = amax * (1.0 / qmax)
    inv = torch.where(amax > 0, amax.reciprocal() * qmax, 0.0)
    y = (xf * inv[..., None]).clamp(-qmax, qmax)
    if not dtype.is_floating_point:
        y = torch.floor(y + 0.5)  # round half up: the kernels' rounding, not torch.round's half to even
    return y.to(dtype), scale


def dequantize(data: torch.Tensor, scales: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """Cache values (..., D) and their scales (...,) as `dtype` (a float cache: only cast)."""
    if scales is None:
        return data.to(dtype)
    return (data.float() * scales[..., None]).to(dtype)
