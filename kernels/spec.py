"""What a kernel table entry is: `KernelQuery` (what a kernel may depend on, read off a node by
select_kernels), `KernelSpec` (one kernel: its op, target, `supports` predicate, launcher, optional
`prepare` and layout) and `PreparedImpl` (a launcher whose node params pass once through `prepare`).
The entries themselves are per target, in kernels/table_cuda.py and kernels/table_cpu.py; the
table and its lookups are kernels/registry.py.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass

from optc.core.formats import DTYPES, Format
from optc.core.ops import OPS, Impl, Param

TARGETS = ("cpu", "cuda")


@dataclass(frozen=True)
class KernelQuery:
    """What a kernel may depend on, as select_kernels reads it off a node."""

    op: str
    dtype: str  # activation dtype name
    weight: Format | None = None  # linear: the weight's format
    weight_shape: tuple[int, ...] = ()  # linear: (N, K); moe: its experts' gate_up (E, 2I, H)
    hidden_size: int = 0  # norms
    num_heads: int = 0  # rope, attention
    num_kv_heads: int = 0
    head_dim: int = 0
    kv_dtype: str | None = None  # attention, rope_kv_store: recorded by kv_layout
    kv_block_size: int | None = None
    norm_offset: float = 0.0  # norms: the weight is offset + w, multiplied in fp32 (Gemma)
    act: str = "silu"  # gated_act
    softcap: float | None = None  # attention: scores soft-capped (Gemma 2)
    window: int | None = None  # attention: a sliding window
    rotary_dim: int | None = None  # rope, rope_kv_store: partial rotary (rotary_dim < head_dim)


@dataclass(frozen=True)
class KernelSpec:
    name: str
    op: str
    supports: Callable[[KernelQuery], bool]
    launcher: str  # "module:function" in optc.kernels, with the op reference's signature
    target: str = "cuda"  # where select_kernels may bind it: one of TARGETS
    prepare: str | None = None  # "module:function" in optc.kernels: node params -> the params the launcher reads
    min_capability: tuple[int, int] | None = None  # cuda: None when the runtime's floor is enough
    by_default: bool = True  # False: select_kernels binds it only when its `enable` option names it
    layout: str | None = None  # the in-memory weight layout `prepare` makes (None: the format's own parts)
    takes_tree_mask: bool = False  # attention: the launcher takes `tree_mask` (draft trees, attention_ref's)
    # a row's result does not depend on the call's row count: where it wins one row, it keeps the speculative
    # steps' rows too (kernels/choose.py), so a decode row and its verification row agree bit for bit
    rows_independent: bool = False
    # "module:function" in optc.kernels that compiles the C++ extension the launcher calls (once per machine, about a
    # minute): a runtime loading a model calls it (registry.compile_extensions), so no request waits on a compile
    extension: str | None = None

    def __post_init__(self) -> None:
        assert self.target in TARGETS, f"{self.name}: target {self.target!r} not in {TARGETS}"

    def compile_extension(self) -> None:
        """Compile (or find cached) the extension the launcher calls; where it cannot be built, the launcher's
        own fallback runs, as it would have at its first call."""
        if self.extension is not None:
            _load(self.extension)()

    def bind(self) -> Impl:
        """Import the launcher and adapt it to the executor's Impl(node, inputs, params, step)."""
        impl = OPS[self.op].bind(_load(self.launcher))
        return impl if self.prepare is None else PreparedImpl(impl, _load(self.prepare))


class PreparedImpl:
    """An Impl whose node params pass through `prepare` on the node's first call; later calls reuse them.

    The executor hands a node the same params dict on every call, so a node is prepared once per
    loaded model (again only if its params dict is replaced).
    """

    def __init__(self, impl: Impl, prepare: Callable[[dict[str, Param]], dict[str, Param]]):
        self.impl = impl
        self.prepare = prepare
        self._prepared: dict[str, tuple[dict[str, Param], dict[str, Param]]] = {}

    def __call__(self, node, inputs, params, step):
        return self.impl(node, inputs, self.params(node, params), step)

    def params(self, node, params: dict[str, Param]) -> dict[str, Param]:
        """The node's prepared params (prepared now if this is the first time): what its launcher reads."""
        hit = self._prepared.get(node.name)
        if hit is None or hit[0] is not params:
            hit = self._prepared[node.name] = (params, self.prepare(params))
        return hit[1]


def _load(path: str) -> Callable:
    module, function = path.split(":")
    return getattr(importlib.import_module(f"optc.kernels.{module}"), function)


def dtype_ok(q: KernelQuery) -> bool:
    """The activation dtype is one the kernels take (optc.core.formats.DTYPES)."""
    return q.dtype in DTYPES
