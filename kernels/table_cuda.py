"""The CUDA (Triton and torch) kernels of the kernel table, in preference order, with their `supports`
predicates; kernels/registry.py assembles the table."""

from __future__ import annotations

from collections.abc import Callable

from optc.core.formats import INT4_PACKING, INT4_TILES_PACKING, Activations, FormatKind
from optc.core.kv_cache import KV_DTYPES, KV_FLOAT_DTYPES
from optc.kernels.spec import KernelQuery, KernelSpec, dtype_ok

MAX_HIDDEN = 16384  # norm kernels keep one row in registers
MAX_GROUP = 64  # query heads per KV head that the attention tiles hold
GATED_ACTS = ("silu", "gelu_tanh")  # what triton.gated_act computes (optc.kernels.activation.ACTS)


def _norm_ok(q: KernelQuery) -> bool:
    return dtype_ok(q) and 0 < q.hidden_size <= MAX_HIDDEN


def _gated_act_ok(q: KernelQuery) -> bool:
    return dtype_ok(q) and q.act in GATED_ACTS


def _rope_ok(q: KernelQuery) -> bool:
    # partial rotary: an even rotary width within the head (the table's width)
    r = q.rotary_dim
    return (dtype_ok(q) and q.head_dim > 0 and q.head_dim % 2 == 0 and q.head_dim <= 512
            and (r is None or (r > 0 and r % 2 == 0 and r <= q.head_dim)))


def _attention_ok(q: KernelQuery) -> bool:
    # head dims 16..256 in multiples of 8 (16-byte rows in bf16; a dim that is not a power of two pads its
    # tile with masked columns); soft cap and window: any positive value
    d = q.head_dim
    return (dtype_ok(q) and (q.kv_dtype or q.dtype) in KV_DTYPES and 16 <= d <= 256 and d % 8 == 0
            and (q.softcap is None or q.softcap > 0) and (q.window is None or q.window > 0)
            and q.num_kv_heads > 0 and q.num_heads % q.num_kv_heads == 0
            and q.num_heads // q.num_kv_heads <= MAX_GROUP)


def _mla_decode_ok(q: KernelQuery) -> bool:
    # the absorbed decode over a float latent cache (a quantized one, and prefill, run the reference in the launcher)
    return dtype_ok(q) and (q.kv_dtype or q.dtype) in KV_FLOAT_DTYPES


def _rope_kv_store_ok(q: KernelQuery) -> bool:
    return _rope_ok(q) and (q.kv_dtype or q.dtype) in KV_DTYPES


def _w4a16_ok(q: KernelQuery) -> bool:
    w = q.weight
    # act_order weights (imported GPTQ desc_act) carry a `perm` part the kernel does not apply
    return (dtype_ok(q) and w is not None and w.kind is FormatKind.INT4_G and not w.act_order
            and w.packing == INT4_PACKING
            and len(q.weight_shape) == 2 and q.weight_shape[1] % w.group_size == 0 and q.weight_shape[1] % 8 == 0)


def _w4a16_tiles_ok(q: KernelQuery) -> bool:
    # n8_tiles weights (select_kernels: {int4_packing: n8_tiles}); x in the scales' dtype, which it dequantizes in
    w = q.weight
    return (dtype_ok(q) and w is not None and w.kind is FormatKind.INT4_G and w.packing == INT4_TILES_PACKING
            and q.dtype == w.dtype and len(q.weight_shape) == 2)


def _int4pack_cuda_ok(q: KernelQuery) -> bool:
    # either packing: its prepare reads the k8_lsb words (an n8_tiles weight's through untile_int4)
    w = q.weight
    return (q.dtype == "bfloat16" and w is not None and w.kind is FormatKind.INT4_G and not w.act_order
            and w.group_size in (32, 64, 128, 256) and len(q.weight_shape) == 2 and q.weight_shape[0] % 8 == 0
            and q.weight_shape[1] % 32 == 0 and q.weight_shape[1] % w.group_size == 0)


def _w8a16_ok(q: KernelQuery) -> bool:
    w = q.weight
    return (dtype_ok(q) and w is not None and w.kind is FormatKind.INT8_WO and w.activations is Activations.NONE
            and len(q.weight_shape) == 2)


def _fp8_w8a16_ok(q: KernelQuery) -> bool:
    w = q.weight
    return (dtype_ok(q) and w is not None and w.kind is FormatKind.FP8_E4M3 and w.activations is Activations.NONE
            and len(q.weight_shape) == 2)


def _w8a8_ok(kind: FormatKind, multiple: int) -> Callable[[KernelQuery], bool]:
    """W8A8 of `kind` whose N and K are multiples of `multiple` (the 8-bit matmuls' alignment on CUDA)."""
    def ok(q: KernelQuery) -> bool:
        w = q.weight
        return (dtype_ok(q) and w is not None and w.kind is kind and w.activations is Activations.DYNAMIC
                and len(q.weight_shape) == 2 and not q.weight_shape[0] % multiple and not q.weight_shape[1] % multiple)
    return ok


def _fused_moe_ok(q: KernelQuery) -> bool:
    # experts (E, 2I, H) dense, int8_wo or int4_g (k8_lsb, no act_order; the format keeps H and I whole groups)
    w = q.weight
    if q.op != "moe" or w is None or len(q.weight_shape) != 3 or not dtype_ok(q) or q.act not in GATED_ACTS:
        return False
    if w.kind is FormatKind.DENSE:
        return True
    return w.activations is Activations.NONE and (
        (w.kind is FormatKind.INT8_WO and w.group_size is None)
        or (w.kind is FormatKind.INT4_G and not w.act_order and w.packing == INT4_PACKING))


CUDA_KERNELS: tuple[KernelSpec, ...] = (
    KernelSpec("triton.rms_norm", "rms_norm", _norm_ok, "norm:rms_norm"),
    KernelSpec("triton.add_rms_norm", "add_rms_norm", _norm_ok, "norm:add_rms_norm"),
    KernelSpec("triton.gated_act", "gated_act", _gated_act_ok, "activation:gated_act"),
    KernelSpec("triton.rope", "rope", _rope_ok, "rope:rope"),
    # the moe block in two grouped GEMMs over all experts: checked under the interpreter and compiled for sm_90,
    # not yet run on a GPU
    KernelSpec("triton.fused_moe", "moe", _fused_moe_ok, "moe_fused:fused_moe", by_default=False),
    KernelSpec("triton.rope_kv_store", "rope_kv_store", _rope_kv_store_ok, "rope:rope_kv_store"),
    KernelSpec("triton.paged_attention", "attention", _attention_ok, "attention:paged_attention", takes_tree_mask=True),
    # MLA's absorbed decode: checked under the interpreter and compiled for sm_90, not yet run on a GPU
    KernelSpec("triton.mla_decode", "mla_attention", _mla_decode_ok, "mla_decode:mla_decode", by_default=False),
    # torch's tinygemm int4 matmul, ahead of w4a16 but off unless enabled: a candidate GPU sessions measure
    KernelSpec("torch.int4pack", "linear", _int4pack_cuda_ok, "int4_cuda:int4pack_cuda_linear",
               prepare="int4_cuda:prepare_int4pack_cuda", by_default=False,
               layout="int4pack_cuda(inner_k_tiles=8|4|2)"),
    KernelSpec("triton.w4a16", "linear", _w4a16_ok, "w4a16:w4a16_linear"),
    # n8_tiles int4 linears: the decode GEMV (whole columns over all of K, no split) and the prefill GEMM; the
    # default per-M table splits at 16 rows and the first load on a GPU refines it (optc.kernels.choose_cuda).
    # Checked under the interpreter and compiled for sm_90, not yet run on a GPU (docs/PERF.md)
    KernelSpec("triton.w4a16_decode", "linear", _w4a16_tiles_ok, "w4a16_tiles:w4a16_decode_linear"),
    KernelSpec("triton.w4a16_prefill", "linear", _w4a16_tiles_ok, "w4a16_tiles:w4a16_prefill_linear"),
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
)
