"""The ONNX lowering of `x @ W^T` for each weight format kind: export's own table, so the format schemes
(optc.core.formats) know nothing of ONNX; they only say which export targets cannot hold a format
(`Scheme.export_refusal`), and this module raises that refusal as an `ExportFormatError`.

A new format kind that should export gets its line in `ONNX_MATMULS`; one without a line is refused by
name (tests/test_export.py checks every kind has one).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from onnx import TensorProto

from optc.commands.export.onnx_builder import float32, matmul_operand_dense, matmul_operand_int8
from optc.core.errors import UserError
from optc.core.formats import Format, FormatKind

Parts = dict[str, torch.Tensor]


class ExportFormatError(UserError, ValueError):
    """An artifact whose weight format the asked-for export target cannot hold."""


def onnx_matmul(lowering, x: str, tensor: str, parts: Parts, fmt: Format) -> str:
    """ONNX value x (B, S, K) @ W^T -> (B, S, N) for `tensor` stored in `fmt`, built with `lowering`
    (optc.commands.export.lower.Lowering; its `flavor` picks the refusals and the int4 operator)."""
    refusal = fmt.scheme.export_refusal(fmt, lowering.flavor)
    if refusal is not None:
        raise ExportFormatError(f"tensor {tensor} is {refusal}")
    lower = ONNX_MATMULS.get(fmt.kind)
    if lower is None:
        raise ExportFormatError(f"tensor {tensor} is {fmt.kind.value}, which has no ONNX lowering (kinds that "
                                f"export: {', '.join(k.value for k in ONNX_MATMULS)})")
    return lower(lowering, x, tensor, parts, fmt)


def _dense(lowering, x: str, tensor: str, parts: Parts, fmt: Format) -> str:
    return lowering.b.op1("MatMul", [x, matmul_operand_dense(lowering.b, tensor, parts, fmt)], base=tensor)


def _int8_wo(lowering, x: str, tensor: str, parts: Parts, fmt: Format) -> str:
    return lowering.b.op1("MatMul", [x, matmul_operand_int8(lowering.b, tensor, parts)], base=tensor)


def _int4_g(lowering, x: str, tensor: str, parts: Parts, fmt: Format) -> str:
    return lowering.int4_matmul(x, tensor, parts, fmt)  # MatMulNBits or blocked DequantizeLinear, per flavor


def _fp8_e4m3(lowering, x: str, tensor: str, parts: Parts, fmt: Format) -> str:
    b = lowering.b
    qt = parts["qweight"].T.contiguous()  # (K, N): DequantizeLinear's axis 1 is the output channel
    q = b.packed_initializer(f"{tensor}.qweight", TensorProto.FLOAT8E4M3FN, list(qt.shape),
                             qt.view(torch.uint8).numpy().tobytes())
    scales = float32(parts["scales"])
    s = b.initializer(f"{tensor}.scales", scales.reshape(()) if fmt.per_tensor else scales)
    w = b.op1("DequantizeLinear", [q, s], base=tensor, axis=1)
    return b.op1("MatMul", [x, w], base=tensor)


ONNX_MATMULS: dict[FormatKind, Callable[..., str]] = {
    FormatKind.DENSE: _dense,
    FormatKind.INT8_WO: _int8_wo,
    FormatKind.INT4_G: _int4_g,
    FormatKind.FP8_E4M3: _fp8_e4m3,
}
