"""The CPU kernels of the kernel table (torch's packed matmuls and the GGUF kinds' layouts), in
preference order, with their `supports` predicates; kernels/registry.py assembles the table.
`select_kernels` measures each against the op reference per M bucket on the build machine."""

from __future__ import annotations

from optc.core.formats import Activations, FormatKind
from optc.core.kv_cache import KV_QUANT_DTYPES
from optc.kernels.spec import KernelQuery, KernelSpec, dtype_ok

CPP_DTYPES = ("bfloat16", "float32")  # what ops.cpp computes in (other dtypes: their launchers run the reference)
# ops.cpp's kernels, one per op: a build that wants every non-matmul node on its reference disables these
CPP_KERNELS = ("cpu.cpp_rms_norm", "cpu.cpp_add_rms_norm", "cpu.cpp_gated_act", "cpu.cpp_rope_kv_store",
               "cpu.cpp_attention")


def _int4pack_cpu_ok(q: KernelQuery) -> bool:
    w = q.weight
    return (dtype_ok(q) and w is not None and w.kind in (FormatKind.INT4_G, FormatKind.INT4_GF) and not w.act_order
            and len(q.weight_shape) == 2 and q.weight_shape[0] % 16 == 0 and q.weight_shape[1] % w.group_size == 0)


def _int8gf_int4x2_ok(q: KernelQuery) -> bool:
    # torch's int4 kernel: groups of 32 or more (not Q6_K's 16), whole tiles of 16 output rows
    w = q.weight
    return (dtype_ok(q) and w is not None and w.kind is FormatKind.INT8_GF and w.group_size >= 32
            and len(q.weight_shape) == 2 and q.weight_shape[0] % 16 == 0 and q.weight_shape[1] % w.group_size == 0)


def _widened_ok(q: KernelQuery) -> bool:
    w = q.weight
    return dtype_ok(q) and w is not None and w.kind in (FormatKind.INT4_GF, FormatKind.INT8_GF)


def _int8pack_cpu_ok(q: KernelQuery) -> bool:
    w = q.weight
    return (dtype_ok(q) and w is not None and w.kind is FormatKind.INT8_WO and w.activations is Activations.NONE
            and len(q.weight_shape) == 2 and q.weight_shape[1] % 16 == 0)


def _int_mm_logits_cpu_ok(q: KernelQuery) -> bool:
    w = q.weight
    return (q.dtype in ("bfloat16", "float16") and w is not None and w.kind is FormatKind.INT8_WO
            and w.activations is Activations.NONE and len(q.weight_shape) == 2)


def _qdot_ok(q: KernelQuery) -> bool:
    # qdot.cpp: groups of 32, 64 or 128 (int8_wo: one group of K), K in blocks of 32; and the shapes of
    # the torch kernel it falls back to where the extension cannot be built (int4pack, int8gf_int4x2: N % 16)
    w = q.weight
    if not dtype_ok(q) or w is None or len(q.weight_shape) != 2:
        return False
    n, k = q.weight_shape
    if w.kind is FormatKind.INT8_WO:
        return w.activations is Activations.NONE and k % 32 == 0
    return (w.kind in (FormatKind.INT4_G, FormatKind.INT4_GF, FormatKind.INT8_GF) and not w.act_order
            and w.group_size in (32, 64, 128) and k % w.group_size == 0 and n % 16 == 0)


def _bf16dot_ok(q: KernelQuery) -> bool:
    # bf16dot.cpp: a dense bfloat16 weight (the cast pass's) with bfloat16 activations, K in chunks of 32
    w = q.weight
    return (q.dtype == "bfloat16" and w is not None and w.kind is FormatKind.DENSE and w.dtype == "bfloat16"
            and len(q.weight_shape) == 2 and q.weight_shape[1] % 32 == 0)


def _moe_packed_cpu_ok(q: KernelQuery) -> bool:
    # experts (E, 2I, H) in one quantized format, as the linear kernels take each expert's gate_up (2I, H) and
    # down (H, I): int8pack K % 16; int4pack with 16-bit x only (float32 int4pack loses to the reference), N % 16
    w = q.weight
    if q.op != "moe" or w is None or len(q.weight_shape) != 3 or not dtype_ok(q):
        return False
    _, two_i, h = q.weight_shape
    i = two_i // 2
    if w.kind is FormatKind.INT8_WO:
        return w.activations is Activations.NONE and h % 16 == 0 and i % 16 == 0
    return (w.kind is FormatKind.INT4_G and not w.act_order and q.dtype != "float32" and two_i % 16 == 0
            and h % 16 == 0 and h % w.group_size == 0 and i % w.group_size == 0)


def _cpp_ok(q: KernelQuery) -> bool:
    return q.dtype in CPP_DTYPES


def _cpp_gated_act_ok(q: KernelQuery) -> bool:
    return q.dtype in CPP_DTYPES and q.act == "silu"


def _cpp_kv_ok(q: KernelQuery) -> bool:
    # a float cache of the activations' dtype, or int8 / fp8 codes with their scales (another float dtype: the
    # launcher would run the reference)
    return q.dtype in CPP_DTYPES and (q.kv_dtype or q.dtype) in (q.dtype, *KV_QUANT_DTYPES)


CPU_KERNELS: tuple[KernelSpec, ...] = (
    # float32 int4pack loses to the reference at M >= 64: select_kernels measures per M bucket
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
    # optc's C++ kernel (kernels/cpu_ext): x rounded to int16 per block of 32, integer dot products on AVX2 or
    # AVX-512 VNNI; torch's packed kernel where the extension cannot be built. After the kernels above, so
    # `measure: false` keeps binding torch's
    KernelSpec("cpu.qdot", "linear", _qdot_ok, "cpu_ext.qdot:qdot_linear", target="cpu", extension="cpu_ext:load",
               prepare="cpu_ext.qdot:prepare_qdot", layout="the format's own parts + float32 scales"),
    KernelSpec("cpu.qdot_logits", "lm_head", _qdot_ok, "cpu_ext.qdot:qdot_logits", target="cpu",
               extension="cpu_ext:load",
               prepare="cpu_ext.qdot:prepare_qdot", layout="the format's own parts + float32 scales"),
    # dense bfloat16: a row's sums independent of the call's rows (a decode row = its verification row), one pass
    # over the weight for every row; torch's GEMM above ROWS rows (prefills)
    KernelSpec("cpu.bf16dot", "linear", _bf16dot_ok, "cpu_ext.bf16dot:bf16dot_linear", target="cpu",
               rows_independent=True, extension="cpu_ext:load"),
    KernelSpec("cpu.bf16dot_logits", "lm_head", _bf16dot_ok, "cpu_ext.bf16dot:bf16dot_logits", target="cpu",
               rows_independent=True, extension="cpu_ext:load"),
    # x rounded to int8 per row, torch._int_mm, then the exact recompute: faster than int8pack, but its logits
    # outside each row's best move (SmolLM2 AWQ: +0.0027 KL, docs/PERF.md), so only where a recipe enables it
    KernelSpec("cpu.int_mm_logits", "lm_head", _int_mm_logits_cpu_ok, "int8_cpu:int_mm_logits", target="cpu",
               by_default=False),
    # quantized experts: the routed tokens of each expert through the packed matmuls above (not measured per M:
    # an expert's M is its share of the step's tokens)
    KernelSpec("cpu.moe_packed", "moe", _moe_packed_cpu_ok, "moe_cpu:moe_packed", target="cpu",
               prepare="moe_cpu:prepare_moe_packed", layout="per-expert int8pack / int4pack_cpu(inner_k_tiles=2)"),
    # a decode step's non-matmul ops as one C++ call each (kernels/cpu_ext/ops.cpp), the references' math; where
    # the extension cannot be built, or for what it does not take (prefill attention), the reference runs
    KernelSpec("cpu.cpp_rms_norm", "rms_norm", _cpp_ok, "cpu_ext.ops:rms_norm", target="cpu",
               extension="cpu_ext:load"),
    KernelSpec("cpu.cpp_add_rms_norm", "add_rms_norm", _cpp_ok, "cpu_ext.ops:add_rms_norm", target="cpu",
               extension="cpu_ext:load"),
    KernelSpec("cpu.cpp_gated_act", "gated_act", _cpp_gated_act_ok, "cpu_ext.ops:gated_act", target="cpu",
               extension="cpu_ext:load"),
    KernelSpec("cpu.cpp_rope_kv_store", "rope_kv_store", _cpp_kv_ok, "cpu_ext.ops:rope_kv_store", target="cpu",
               extension="cpu_ext:load"),
    KernelSpec("cpu.cpp_attention", "attention", _cpp_kv_ok, "cpu_ext.ops:attention", target="cpu",
               takes_tree_mask=True, extension="cpu_ext:load"),
)
