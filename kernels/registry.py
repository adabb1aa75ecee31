"""The kernel table: per kernel name, the IR op it implements, the target it runs on (`cpu`, `cuda`),
a `supports` predicate over the node's shapes, formats and dtypes, its launcher, an optional
`prepare` that repacks the node's weights once into the layout the launcher reads (named by
`layout`, which `optc inspect` shows), and the CUDA capability it needs beyond the runtime's floor.

A launcher has its op's torch reference signature (optc.core.ops), so the op's own node -> arguments
adapter binds it: `impls(names)` returns `OPS[op].bind(launcher)` per name, wrapped so that a kernel
with `prepare` gets its node's params through it, prepared on the node's first call and kept. A
prepared layout lives only in the loaded model; the artifact stores the format's own parts, so the
reference (any device) still reads it. `select_kernels` (compiler) asks `select(query, target)` which
kernel serves a node (or `candidates(...)`, every one that could, when it measures them); the runtime
loader asks `impls(names)` for the names recorded in the graph. The table is plain data: importing
this module imports no Triton; a kernel module is imported when its kernel is bound.

Per-M choice: a node may carry `kernel_by_m`, a list of [max_rows, kernel] pairs in increasing
max_rows (the last max_rows None: no bound), written by `select_kernels` from measurements on the build
machine. The node's `kernel` is then one of the kernels in that list (what the loader binds), and every
implementation `impls` returns routes a call of M rows (the op's `rows`: an lm_head's selected rows) to
the first pair with M <= max_rows; `torch` in the list is the op's reference. A node without it runs
its `kernel` for every M.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass

from optc.core.formats import DTYPES, INT4_PACKING, Activations, Format, FormatKind
from optc.core.ir import REFERENCE_KERNEL
from optc.core.kv_cache import KV_DTYPES, KV_FLOAT_DTYPES
from optc.core.ops import OPS, Impl, Param

TARGETS = ("cpu", "cuda")
MAX_HIDDEN = 16384  # norm kernels keep one row in registers
MAX_GROUP = 64  # query heads per KV head that the attention tiles hold
GATED_ACTS = ("silu", "gelu_tanh")  # what triton.gated_act computes (optc.kernels.activation.ACTS)


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

    def __post_init__(self) -> None:
        assert self.target in TARGETS, f"{self.name}: target {self.target!r} not in {TARGETS}"

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
        hit = self._prepared.get(node.name)
        if hit is None or hit[0] is not params:
            hit = self._prepared[node.name] = (params, self.prepare(params))
        return self.impl(node, inputs, hit[1], step)


class ByM:
    """The executor's Impl for one kernel name: a node with `kernel_by_m` runs, per call, the
    implementation its table names for the call's rows (M: the op's `rows`); any other node
    runs the kernel. Implementations are shared through `bound`, so a prepared layout is made once."""

    def __init__(self, name: str, bound: _Bound):
        self.name = name
        self.bound = bound
        self._routes: dict[str, tuple[list[int | None], list[Impl]]] = {}  # node name -> (bounds, impls)

    def __call__(self, node, inputs, params, step):
        table = node.attrs.get("kernel_by_m")
        if not table:
            return self.bound.get(self.name)(node, inputs, params, step)
        route = self._routes.get(node.name)
        if route is None:
            route = self._routes[node.name] = ([b for b, _ in table], [self.bound.get(k, node.op) for _, k in table])
        m = OPS[node.op].rows(inputs, step)
        bounds, fns = route
        for bound, fn in zip(bounds, fns, strict=True):
            if bound is None or m <= bound:
                return fn(node, inputs, params, step)
        return fns[-1](node, inputs, params, step)


class _Bound:
    """Kernel name -> its bound Impl, each bound once (the op reference for `torch`)."""

    def __init__(self):
        self._impls: dict[str, Impl] = {}

    def get(self, name: str, op: str | None = None) -> Impl:
        if name == REFERENCE_KERNEL:
            return OPS[op].ref
        if name not in self._impls:
            self._impls[name] = KERNELS[name].bind()
        return self._impls[name]


def candidates(query: KernelQuery, target: str, enabled: tuple[str, ...] = ()) -> list[KernelSpec]:
    """Every kernel for `target` and the query's op that supports it, in table order; a kernel that is
    not on by default counts only when `enabled` names it."""
    return [k for k in KERNELS.values() if k.target == target and k.op == query.op
            and (k.by_default or k.name in enabled) and k.supports(query)]


def select(query: KernelQuery, target: str, enabled: tuple[str, ...] = ()) -> KernelSpec | None:
    """The first of `candidates`, else None (the torch reference)."""
    return next(iter(candidates(query, target, enabled)), None)


def impls(names: set[str] | list[str]) -> dict[str, Impl]:
    """Kernel name -> bound implementation (routing per M where a node says so), for the executor's
    `impls` table."""
    unknown = sorted(set(names) - set(KERNELS))
    if unknown:
        raise ValueError(f"unknown kernel(s) {unknown}; known: {', '.join(sorted(KERNELS))}")
    bound = _Bound()
    return {name: ByM(name, bound) for name in sorted(names)}


def _load(path: str) -> Callable:
    module, function = path.split(":")
    return getattr(importlib.import_module(f"optc.kernels.{module}"), function)


# --- supports predicates ------------------------------------------------------------------------

def _dtype_ok(q: KernelQuery) -> bool:
    return q.dtype in DTYPES


def _norm_ok(q: KernelQuery) -> bool:
    return _dtype_ok(q) and 0 < q.hidden_size <= MAX_HIDDEN


def _gated_act_ok(q: KernelQuery) -> bool:
    return _dtype_ok(q) and q.act in GATED_ACTS


def _rope_ok(q: KernelQuery) -> bool:
    # partial rotary: an even rotary width within the head (the table's width)
    r = q.rotary_dim
    return (_dtype_ok(q) and q.head_dim > 0 and q.head_dim % 2 == 0 and q.head_dim <= 512
            and (r is None or (r > 0 and r % 2 == 0 and r <= q.head_dim)))


def _attention_ok(q: KernelQuery) -> bool:
    # head dims 16..256 in multiples of 8 (16-byte rows in bf16; a dim that is not a power of two pads its
    # tile with masked columns); soft cap and window: any positive value
    d = q.head_dim
    return (_dtype_ok(q) and (q.kv_dtype or q.dtype) in KV_DTYPES and 16 <= d <= 256 and d % 8 == 0
            and (q.softcap is None or q.softcap > 0) and (q.window is None or q.window > 0)
            and q.num_kv_heads > 0 and q.num_heads % q.num_kv_heads == 0
            and q.num_heads // q.num_kv_heads <= MAX_GROUP)


def _mla_decode_ok(q: KernelQuery) -> bool:
    # the absorbed decode over a float latent cache (a quantized one, and prefill, run the reference in the launcher)
    return _dtype_ok(q) and (q.kv_dtype or q.dtype) in KV_FLOAT_DTYPES


def _rope_kv_store_ok(q: KernelQuery) -> bool:
    return _rope_ok(q) and (q.kv_dtype or q.dtype) in KV_DTYPES


def _w4a16_ok(q: KernelQuery) -> bool:
    w = q.weight
    # act_order weights (imported GPTQ desc_act) carry a `perm` part the kernel does not apply
    return (_dtype_ok(q) and w is not None and w.kind is FormatKind.INT4_G and not w.act_order
            and len(q.weight_shape) == 2 and q.weight_shape[1] % w.group_size == 0 and q.weight_shape[1] % 8 == 0)


def _int4pack_cpu_ok(q: KernelQuery) -> bool:
    w = q.weight
    return (_dtype_ok(q) and w is not None and w.kind in (FormatKind.INT4_G, FormatKind.INT4_GF) and not w.act_order
            and len(q.weight_shape) == 2 and q.weight_shape[0] % 16 == 0 and q.weight_shape[1] % w.group_size == 0)


def _int8gf_int4x2_ok(q: KernelQuery) -> bool:
    # torch's int4 kernel: groups of 32 or more (not Q6_K's 16), whole tiles of 16 output rows
    w = q.weight
    return (_dtype_ok(q) and w is not None and w.kind is FormatKind.INT8_GF and w.group_size >= 32
            and len(q.weight_shape) == 2 and q.weight_shape[0] % 16 == 0 and q.weight_shape[1] % w.group_size == 0)


def _widened_ok(q: KernelQuery) -> bool:
    w = q.weight
    return _dtype_ok(q) and w is not None and w.kind in (FormatKind.INT4_GF, FormatKind.INT8_GF)


def _int4pack_cuda_ok(q: KernelQuery) -> bool:
    w = q.weight
    return (q.dtype == "bfloat16" and w is not None and w.kind is FormatKind.INT4_G and not w.act_order
            and w.group_size in (32, 64, 128, 256) and len(q.weight_shape) == 2 and q.weight_shape[0] % 8 == 0
            and q.weight_shape[1] % 32 == 0 and q.weight_shape[1] % w.group_size == 0)


def _int8pack_cpu_ok(q: KernelQuery) -> bool:
    w = q.weight
    return (_dtype_ok(q) and w is not None and w.kind is FormatKind.INT8_WO and w.activations is Activations.NONE
            and len(q.weight_shape) == 2 and q.weight_shape[1] % 16 == 0)


def _int_mm_logits_cpu_ok(q: KernelQuery) -> bool:
    w = q.weight
    return (q.dtype in ("bfloat16", "float16") and w is not None and w.kind is FormatKind.INT8_WO
            and w.activations is Activations.NONE and len(q.weight_shape) == 2)


def _w8a16_ok(q: KernelQuery) -> bool:
    w = q.weight
    return (_dtype_ok(q) and w is not None and w.kind is FormatKind.INT8_WO and w.activations is Activations.NONE
            and len(q.weight_shape) == 2)


def _fp8_w8a16_ok(q: KernelQuery) -> bool:
    w = q.weight
    return (_dtype_ok(q) and w is not None and w.kind is FormatKind.FP8_E4M3 and w.activations is Activations.NONE
            and len(q.weight_shape) == 2)


def _w8a8_ok(kind: FormatKind, multiple: int) -> Callable[[KernelQuery], bool]:
    """W8A8 of `kind` whose N and K are multiples of `multiple` (the 8-bit matmuls' alignment on CUDA)."""
    def ok(q: KernelQuery) -> bool:
        w = q.weight
        return (_dtype_ok(q) and w is not None and w.kind is kind and w.activations is Activations.DYNAMIC
                and len(q.weight_shape) == 2 and not q.weight_shape[0] % multiple and not q.weight_shape[1] % multiple)
    return ok


def _moe_packed_cpu_ok(q: KernelQuery) -> bool:
    # experts (E, 2I, H) in one quantized format, as the linear kernels take each expert's gate_up (2I, H) and
    # down (H, I): int8pack K % 16; int4pack with 16-bit x only (float32 int4pack loses to the reference), N % 16
    w = q.weight
    if q.op != "moe" or w is None or len(q.weight_shape) != 3 or not _dtype_ok(q):
        return False
    _, two_i, h = q.weight_shape
    i = two_i // 2
    if w.kind is FormatKind.INT8_WO:
        return w.activations is Activations.NONE and h % 16 == 0 and i % 16 == 0
    return (w.kind is FormatKind.INT4_G and not w.act_order and q.dtype != "float32" and two_i % 16 == 0
            and h % 16 == 0 and h % w.group_size == 0 and i % w.group_size == 0)


def _fused_moe_ok(q: KernelQuery) -> bool:
    # experts (E, 2I, H) dense, int8_wo or int4_g (k8_lsb, no act_order; the format keeps H and I whole groups)
    w = q.weight
    if q.op != "moe" or w is None or len(q.weight_shape) != 3 or not _dtype_ok(q) or q.act not in GATED_ACTS:
        return False
    if w.kind is FormatKind.DENSE:
        return True
    return w.activations is Activations.NONE and (
        (w.kind is FormatKind.INT8_WO and w.group_size is None)
        or (w.kind is FormatKind.INT4_G and not w.act_order and w.packing == INT4_PACKING))


KERNELS: dict[str, KernelSpec] = {s.name: s for s in (
    KernelSpec("triton.rms_norm", "rms_norm", _norm_ok, "norm:rms_norm"),
    KernelSpec("triton.add_rms_norm", "add_rms_norm", _norm_ok, "norm:add_rms_norm"),
    KernelSpec("triton.gated_act", "gated_act", _gated_act_ok, "activation:gated_act"),
    KernelSpec("triton.rope", "rope", _rope_ok, "rope:rope"),
    # the moe block in two grouped GEMMs over all experts: checked under the interpreter and compiled for sm_90,
    # not yet run on a GPU
    KernelSpec("triton.fused_moe", "moe", _fused_moe_ok, "moe_fused:fused_moe", by_default=False),
    KernelSpec("triton.rope_kv_store", "rope_kv_store", _rope_kv_store_ok, "rope:rope_kv_store"),
    KernelSpec("triton.paged_attention", "attention", _attention_ok, "attention:paged_attention"),
    # MLA's absorbed decode: checked under the interpreter and compiled for sm_90, not yet run on a GPU
    KernelSpec("triton.mla_decode", "mla_attention", _mla_decode_ok, "mla_decode:mla_decode", by_default=False),
    # torch's tinygemm int4 matmul, ahead of w4a16 but off unless enabled: a candidate GPU sessions measure
    KernelSpec("torch.int4pack", "linear", _int4pack_cuda_ok, "int4_cuda:int4pack_cuda_linear",
               prepare="int4_cuda:prepare_int4pack_cuda", by_default=False,
               layout="int4pack_cuda(inner_k_tiles=8|4|2)"),
    KernelSpec("triton.w4a16", "linear", _w4a16_ok, "w4a16:w4a16_linear"),
    KernelSpec("triton.w8a16", "linear", _w8a16_ok, "w8a16:w8a16_linear"),
    KernelSpec("triton.w4a16_logits", "lm_head", _w4a16_ok, "w4a16:w4a16_logits"),
    KernelSpec("triton.w8a16_logits", "lm_head", _w8a16_ok, "w8a16:w8a16_logits"),
    KernelSpec("triton.fp8_w8a16", "linear", _fp8_w8a16_ok, "fp8_w8a16:fp8_w8a16_linear",
               prepare="fp8_w8a16:prepare_fp8_w8a16", min_capability=(8, 9)),
    # W8A8 through torch's 8-bit matmuls; not yet measured on a GPU (docs/PERF.md)
    KernelSpec("torch.scaled_mm", "linear", _w8a8_ok(FormatKind.FP8_E4M3, 16), "w8a8:scaled_mm_linear",
               prepare="w8a8:prepare_w8a8", min_capability=(8, 9)),
    KernelSpec("torch.int_mm", "linear", _w8a8_ok(FormatKind.INT8_WO, 8), "w8a8:int_mm_linear",
               prepare="w8a8:prepare_w8a8"),
    # cpu: select_kernels measures them against the reference per M bucket (float32 int4pack loses at M >= 64)
    KernelSpec("cpu.int4pack", "linear", _int4pack_cpu_ok, "int4_cpu:int4pack_linear", target="cpu",
               prepare="int4_cpu:prepare_int4pack", layout="int4pack_cpu(inner_k_tiles=2)"),
    KernelSpec("cpu.int8pack", "linear", _int8pack_cpu_ok, "int8_cpu:int8pack_linear", target="cpu",
               prepare="int8_cpu:prepare_int8pack"),
    # a quantized lm_head (quantize_lm_head): the same matmuls, then logits_ref's fp32 recompute of the best rows
    KernelSpec("cpu.int4pack_logits", "lm_head", _int4pack_cpu_ok, "int4_cpu:int4pack_logits", target="cpu",
               prepare="int4_cpu:prepare_int4pack_logits", layout="int4pack_cpu(inner_k_tiles=2) + stored parts"),
    KernelSpec("cpu.int8pack_logits", "lm_head", _int8pack_cpu_ok, "int8_cpu:int8pack_logits", target="cpu",
               prepare="int8_cpu:prepare_int8pack"),
    # the GGUF kinds (source_quantization: keep): int8_gf as two int4 packs, or either kind dequantized once
    KernelSpec("cpu.int8gf_int4x2", "linear", _int8gf_int4x2_ok, "gf_cpu:int8gf_int4x2_linear", target="cpu",
               prepare="gf_cpu:prepare_int8gf_int4x2", layout="int4pack_cpu x2 (high, low nibbles of q + 128)"),
    KernelSpec("cpu.int8gf_int4x2_logits", "lm_head", _int8gf_int4x2_ok, "gf_cpu:int8gf_int4x2_logits",
               target="cpu", prepare="gf_cpu:prepare_int8gf_int4x2",
               layout="int4pack_cpu x2 (high, low nibbles of q + 128) + stored parts"),
    KernelSpec("cpu.widened", "linear", _widened_ok, "gf_cpu:widened_linear", target="cpu",
               prepare="gf_cpu:prepare_widened", layout="dense in the activation dtype + stored parts"),
    KernelSpec("cpu.widened_logits", "lm_head", _widened_ok, "gf_cpu:widened_logits", target="cpu",
               prepare="gf_cpu:prepare_widened", layout="dense in the activation dtype + stored parts"),
    # x rounded to int8 per row, torch._int_mm, then the exact recompute: faster than int8pack, but its logits
    # outside each row's best move (SmolLM2 AWQ: +0.0027 KL, docs/PERF.md), so only where a recipe enables it
    KernelSpec("cpu.int_mm_logits", "lm_head", _int_mm_logits_cpu_ok, "int8_cpu:int_mm_logits", target="cpu",
               by_default=False),
    # quantized experts: the routed tokens of each expert through the packed matmuls above (not measured per M:
    # an expert's M is its share of the step's tokens)
    KernelSpec("cpu.moe_packed", "moe", _moe_packed_cpu_ok, "moe_cpu:moe_packed", target="cpu",
               prepare="moe_cpu:prepare_moe_packed", layout="per-expert int8pack / int4pack_cpu(inner_k_tiles=2)"),
)}
