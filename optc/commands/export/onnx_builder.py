"""What both ONNX flavors share: a small graph builder over `onnx.helper`, and the conversion of
optc's stored weight formats into ONNX initializers.

Layouts written here:
- dense (N, K) -> a float32 initializer W^T (K, N), the right operand of MatMul.
- int8_wo -> q^T (K, N) int8 and scales (N,) float32 for DequantizeLinear(axis=1), per output channel.
- int4_g, blocked DequantizeLinear (opset 21): q (K, N) as INT4 (q - 8, symmetric formats only) with
  scales (K / G, N), axis=0, block_size=G: the pattern ONNX Runtime fuses into MatMulNBits and
  TensorRT reads as weight-only int4.
- int4_g, MatMulNBits (com.microsoft): B (N, K / G, G / 2) uint8 where byte k // 2 of row n holds
  value k in its low nibble when k is even; optc's k8_lsb int32 words, read as little-endian bytes,
  are exactly that, so B is the stored words reinterpreted. Zero points are packed two per byte the
  same way, (N, ceil(K / G / 2)) uint8; scales are (N, K / G).
"""

from __future__ import annotations

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper, numpy_helper

from optc.core.formats import Format, dequantize

OPSET = 21
MS_DOMAIN = "com.microsoft"


class GraphBuilder:
    """Collects nodes, initializers and value names; every name it hands out is unique."""

    def __init__(self) -> None:
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []
        self._used: set[str] = set()
        self._consts: dict[tuple, str] = {}
        self.uses_ms_domain = False

    def name(self, base: str) -> str:
        name, i = base, 1
        while name in self._used:
            name, i = f"{base}_{i}", i + 1
        self._used.add(name)
        return name

    def reserve(self, name: str) -> str:
        """Claim an exact name (graph inputs and outputs)."""
        assert name not in self._used, f"value name {name!r} is taken"
        self._used.add(name)
        return name

    def op(self, op_type: str, inputs: list[str], outputs: int | list[str] = 1, domain: str = "",
           base: str | None = None, **attrs) -> list[str]:
        """Add one node; `outputs` is a count (fresh names from `base`) or explicit names ("" = omitted)."""
        base = base or op_type.lower()
        outs = [self.name(f"{base}/out{i}") for i in range(outputs)] if isinstance(outputs, int) else outputs
        self.nodes.append(helper.make_node(op_type, inputs, outs, name=self.name(f"{base}/{op_type}"),
                                           domain=domain, **attrs))
        if domain == MS_DOMAIN:
            self.uses_ms_domain = True
        return outs

    def op1(self, op_type: str, inputs: list[str], domain: str = "", base: str | None = None, **attrs) -> str:
        return self.op(op_type, inputs, 1, domain, base, **attrs)[0]

    def initializer(self, base: str, array: np.ndarray) -> str:
        name = self.name(base)
        self.initializers.append(numpy_helper.from_array(np.ascontiguousarray(array), name))
        return name

    def packed_initializer(self, base: str, data_type: int, dims: list[int], raw: bytes) -> str:
        """An INT4/UINT4 initializer from bytes already packed two values per byte, low nibble first."""
        name = self.name(base)
        self.initializers.append(helper.make_tensor(name, data_type, dims, raw, raw=True))
        return name

    def const(self, array: np.ndarray | list, dtype=np.int64) -> str:
        """A small constant, shared between uses (axes, shapes, scalars)."""
        a = np.asarray(array, dtype=dtype)
        key = (a.dtype.str, a.shape, a.tobytes())
        if key not in self._consts:
            self._consts[key] = self.initializer("const", a)
        return self._consts[key]


def float32(t: torch.Tensor) -> np.ndarray:
    return t.detach().to(torch.float32).contiguous().numpy()


def dense_weight(parts: dict[str, torch.Tensor], fmt: Format) -> np.ndarray:
    """Any stored format -> the dense (N, K) float32 weight (optc's reference dequantization)."""
    return float32(dequantize(parts, fmt, torch.float32))


def matmul_operand_dense(b: GraphBuilder, name: str, parts: dict[str, torch.Tensor], fmt: Format) -> str:
    return b.initializer(name, dense_weight(parts, fmt).T)


def matmul_operand_int8(b: GraphBuilder, name: str, parts: dict[str, torch.Tensor]) -> str:
    """DequantizeLinear(q^T (K, N) int8, scales (N,), axis=1): the (K, N) float32 weight."""
    q = b.initializer(f"{name}.qweight", parts["qweight"].T.contiguous().numpy())
    s = b.initializer(f"{name}.scales", float32(parts["scales"]))
    return b.op1("DequantizeLinear", [q, s], base=name, axis=1)


def matmul_operand_int4_blocked(b: GraphBuilder, name: str, parts: dict[str, torch.Tensor], fmt: Format) -> str:
    """DequantizeLinear(q (K, N) int4, scales (K / G, N), axis=0, block_size=G): symmetric int4 only."""
    assert not fmt.zero_point, "blocked int4 DequantizeLinear is written for symmetric formats"
    words = parts["qweight"].contiguous().numpy().view(np.uint8)  # (N, K / 2): k even in the low nibble
    n, k = words.shape[0], words.shape[1] * 2
    q = np.empty((n, k), np.uint8)
    q[:, 0::2], q[:, 1::2] = words & 0xF, words >> 4
    signed = np.ascontiguousarray(q.T) ^ 8  # (K, N); q - 8 as a two's-complement nibble
    qname = b.packed_initializer(f"{name}.qweight", TensorProto.INT4, [k, n], _pack_nibbles(signed.reshape(-1)))
    s = b.initializer(f"{name}.scales", float32(parts["scales"]).T)
    return b.op1("DequantizeLinear", [qname, s], base=name, axis=0, block_size=fmt.group_size)


def matmulnbits_inputs(b: GraphBuilder, name: str, parts: dict[str, torch.Tensor], fmt: Format) -> list[str]:
    """[B, scales, zero_points?] for com.microsoft MatMulNBits (bits=4, block_size=G)."""
    qweight = parts["qweight"].contiguous()
    n, k = qweight.shape[0], qweight.shape[1] * 8
    g = fmt.group_size
    blob = qweight.view(torch.uint8).reshape(n, k // g, g // 2)  # k8_lsb words are MatMulNBits bytes
    names = [b.initializer(f"{name}.qweight", blob.numpy()), b.initializer(f"{name}.scales", float32(parts["scales"]))]
    if fmt.zero_point:
        zeros = parts["zeros"].to(torch.uint8)
        if zeros.shape[1] % 2:
            zeros = torch.cat([zeros, torch.full((n, 1), 8, dtype=torch.uint8)], dim=1)
        packed = zeros[:, 0::2] | (zeros[:, 1::2] << 4)
        names.append(b.initializer(f"{name}.zeros", packed.contiguous().numpy()))
    return names


def embedding_table(parts: dict[str, torch.Tensor], fmt: Format) -> np.ndarray:
    """The (V, H) float32 table Gather reads; a quantized embedding is dequantized (exact in float32)."""
    return dense_weight(parts, fmt)


def _pack_nibbles(values: np.ndarray) -> bytes:
    """Flat uint8 nibbles -> bytes, element 2i in the low nibble of byte i (ONNX INT4/UINT4 raw_data)."""
    if values.size % 2:
        values = np.concatenate([values, np.zeros(1, np.uint8)])
    return (values[0::2] | (values[1::2] << 4)).tobytes()
