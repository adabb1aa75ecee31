"""The `portable` flavor: standard ONNX operators only (opset 21, no com.microsoft node), for
TensorRT and any other ONNX consumer.

- attention written out: k/v concatenated after the past (present = concat(past, new) on the
  sequence axis), q grouped as (B, H_kv, H / H_kv, S, D) so each KV head serves its query heads by
  broadcasting, scores + an additive mask, Softmax, a MatMul with v. The mask allows key j for query
  i when attention_mask[b, j] is 1 and j <= P + i (causal by index, so left padding works).
- rotary embedding: cos/sin gathered by position_ids from (P, D / 2) tables, rotate-half by Split
  and Concat.
- RMSNorm as ReduceMean / Sqrt / Reciprocal / Mul (the shared lowering).
- int4 weights: blocked DequantizeLinear + MatMul, the weight-only form TensorRT accepts: symmetric
  int4 in blocks of 64 or 128 along K. Other int4 formats are refused by `check_formats`.
"""

from __future__ import annotations

import numpy as np
import torch
from onnx import TensorProto

from optc.commands.export.lower import PAST_KEY, PAST_VALUE, PRESENT_KEY, PRESENT_VALUE, Lowering
from optc.commands.export.matmuls import ExportFormatError
from optc.commands.export.onnx_builder import matmul_operand_int4_blocked
from optc.core.formats import Format
from optc.core.ir import Graph, Node
from optc.core.rope import GLOBAL

MASK_VALUE = float(np.finfo(np.float32).min)


def check_formats(graph: Graph, flavor: str) -> None:
    """Refuse weight formats `flavor` cannot hold (each scheme's `export_refusal`: int4 TensorRT cannot take
    in the portable flavor, W8A8 in any), naming the recipe options that fit."""
    for name in graph.used_tensors():
        fmt = graph.tensors[name].format
        refusal = fmt.scheme.export_refusal(fmt, flavor)
        if refusal is not None:
            raise ExportFormatError(f"tensor {name} is {refusal}")


class PortableLowering(Lowering):
    flavor = "portable"

    def rope(self, x: str, num_heads: int, node: Node, base: str) -> str:
        # out = [x1 * cos - x2 * sin, x2 * cos + x1 * sin | x_pass] per head, x = [x1 | x2 | x_pass]
        b, d = self.b, self.cfg.head_dim
        table = node.attrs.get("rope_table", GLOBAL)
        cos, sin = (self.once(f"rope_{which}:{table}", lambda w=which: self._gathered(table, w)) for which in (0, 1))
        r = node.attrs.get("rotary_dim") or d
        heads = b.op1("Reshape", [x, b.const([0, 0, num_heads, d])], base=base)  # (B, S, H, D)
        x1, x2, *rest = b.op("Split", [heads, b.const([r // 2, r // 2] + ([d - r] if r < d else []))],
                             3 if r < d else 2, base=base, axis=-1)
        first = b.op1("Sub", [b.op1("Mul", [x1, cos], base=base), b.op1("Mul", [x2, sin], base=base)], base=base)
        second = b.op1("Add", [b.op1("Mul", [x2, cos], base=base), b.op1("Mul", [x1, sin], base=base)], base=base)
        rotated = b.op1("Concat", [first, second, *rest], base=base, axis=-1)
        return b.op1("Reshape", [rotated, b.const([0, 0, num_heads * d])], base=base)

    def attention(self, q: str, k: str, v: str, node: Node) -> str:
        a, b, layer, base = node.attrs, self.b, node.attrs["layer"], node.name
        h, h_kv, d = a["num_heads"], a["num_kv_heads"], a["head_dim"]
        # q: (B, S, H * D) -> (B, H_kv, G, S, D), k/v: (B, S, H_kv * D) -> (B, H_kv, S, D)
        qg = b.op1("Transpose", [b.op1("Reshape", [q, b.const([0, 0, h_kv, h // h_kv, d])], base=base)],
                   base=base, perm=[0, 2, 3, 1, 4])
        present = []
        for x, past, name in ((k, PAST_KEY, PRESENT_KEY), (v, PAST_VALUE, PRESENT_VALUE)):
            heads = b.op1("Transpose", [b.op1("Reshape", [x, b.const([0, 0, h_kv, d])], base=base)], base=base,
                          perm=[0, 2, 1, 3])
            out = name.format(layer)
            b.op("Concat", [past.format(layer), heads], [out], base=base, axis=2)  # (B, H_kv, T, D)
            present.append(b.op1("Unsqueeze", [out, b.const([2])], base=base))  # (B, H_kv, 1, T, D)
        k_t = b.op1("Transpose", [present[0]], base=base, perm=[0, 1, 2, 4, 3])  # (B, H_kv, 1, D, T)
        scores = b.op1("Mul", [b.op1("MatMul", [qg, k_t], base=base), b.const(a["scale"], np.float32)], base=base)
        if a.get("softcap"):
            scores = self.soft_cap(scores, a["softcap"], base)
        window = a.get("window")
        mask = self.once(f"mask:{window}", lambda: self._mask(window))
        probs = b.op1("Softmax", [b.op1("Add", [scores, mask], base=base)], base=base, axis=-1)
        out = b.op1("MatMul", [probs, present[1]], base=base)  # (B, H_kv, G, S, D)
        out = b.op1("Transpose", [out], base=base, perm=[0, 3, 1, 2, 4])  # (B, S, H_kv, G, D)
        return b.op1("Reshape", [out, b.const([0, 0, h * d])], base=base)

    def int4_matmul(self, x: str, tensor: str, parts: dict[str, torch.Tensor], fmt: Format) -> str:
        return self.b.op1("MatMul", [x, matmul_operand_int4_blocked(self.b, tensor, parts, fmt)], base=tensor)

    def _gathered(self, table: str, which: int) -> str:
        """cos (which=0) or sin (1) of rotary table `table` at position_ids: (B, S, 1, R / 2), broadcast
        over heads."""
        cache = self.rotary_caches(table)[which]
        g = self.b.op1("Gather", [cache, "position_ids"], base="rope", axis=0)
        return self.b.op1("Unsqueeze", [g, self.b.const([2])], base="rope")

    def _mask(self, window: int | None) -> str:
        """(B, 1, 1, S, T) additive mask: 0 where key j is visible to query i, float32 min elsewhere; with a
        sliding `window`, only keys j > P + i - window are (attention_ref's rule)."""
        b = self.b
        total = b.op1("Shape", ["attention_mask"], base="mask", start=1, end=2)  # [T]
        seq = b.op1("Shape", ["input_ids"], base="mask", start=1, end=2)  # [S]
        t, s = (b.op1("Squeeze", [v, b.const([0])], base="mask") for v in (total, seq))
        rows = b.op1("Range", [b.op1("Sub", [t, s], base="mask"), t, b.const(1)], base="mask")  # P .. T - 1
        cols = b.op1("Range", [b.const(0), t, b.const(1)], base="mask")
        cols, rows = b.op1("Unsqueeze", [cols, b.const([0])], base="mask"), b.op1("Unsqueeze", [rows, b.const([1])],
                                                                                  base="mask")
        causal = b.op1("LessOrEqual", [cols, rows], base="mask")  # (S, T)
        if window is not None:
            recent = b.op1("Greater", [cols, b.op1("Sub", [rows, b.const(window)], base="mask")], base="mask")
            causal = b.op1("And", [causal, recent], base="mask")
        keys = b.op1("Unsqueeze", [b.op1("Cast", ["attention_mask"], base="mask", to=TensorProto.BOOL),
                                   b.const([1])], base="mask")  # (B, 1, T)
        allowed = b.op1("And", [causal, keys], base="mask")  # (B, S, T)
        bias = b.op1("Where", [allowed, b.const(0.0, np.float32), b.const(MASK_VALUE, np.float32)], base="mask")
        return b.op1("Unsqueeze", [bias, b.const([1, 2])], base="mask")
