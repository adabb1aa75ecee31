"""Lower an optc graph to an ONNX decoder model with the Optimum / onnxruntime-genai interface.

    inputs   input_ids (B, S) int64, attention_mask (B, T) int64, position_ids (B, S) int64,
             past_key_values.{i}.key / .value (B, H_kv, P, D) float32          with T = P + S
    outputs  logits (B, S, V) float32, present.{i}.key / .value (B, H_kv, T, D) float32

Values between ONNX nodes are (B, S, features) where optc's are (T, features). The walk over the IR
and the ops both flavors write the same way (embedding, add, linear with its weight formats, gated_act,
lm_head, rms_norm as standard ops, which ONNX Runtime fuses itself) live in `Lowering`; the flavors
(optc.commands.export.ort, optc.commands.export.portable) supply attention, rotary embedding, the residual-add norm and
int4 matmuls. The families' attributes lower as the references compute them: an offset norm's weight is
`offset + w`, a per-head norm (`head_dim`) reshapes to heads, an embedding `scale` and a soft-cap (scores,
logits) are a Mul and a Tanh, a sliding `window` narrows the mask (portable) or sets GroupQueryAttention's
`local_window_size` (ort), `rope_table` picks the rotary caches and `rotary_dim` rotates part of each head.
Activations are float32 whatever the artifact's dtype (bf16 and fp16 weights widen
exactly); the KV cache is plain past/present tensors, not optc's paged blocks.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper
from tqdm import tqdm

from optc.commands.export.matmuls import onnx_matmul
from optc.commands.export.onnx_builder import (
    MS_DOMAIN,
    OPSET,
    GraphBuilder,
    embedding_table,
    float32,
)
from optc.core.errors import UserError
from optc.core.formats import Format, part_name
from optc.core.ir import Graph, Node
from optc.core.rope import GLOBAL, cos_sin_tables
from optc.core.store import TensorStore

# every op of optc.core.ops has a lowering or is refused by name (tests/test_export.py checks the lists agree)
LOWERED_OPS = ("embedding", "rms_norm", "add_rms_norm", "add", "linear", "rope", "rope_kv_store", "attention",
               "gated_act", "lm_head")
# a graph holding one is refused by check_lowerable, naming the node (refused ops before any attribute)
REFUSED_WHY = {"moe": "a Mixture-of-Experts block", "mla_attention": "Multi-head Latent Attention over a latent cache"}
REFUSED_OPS = tuple(REFUSED_WHY)
PAST_KEY = "past_key_values.{}.key"
PAST_VALUE = "past_key_values.{}.value"
PRESENT_KEY = "present.{}.key"
PRESENT_VALUE = "present.{}.value"


def check_lowerable(graph: Graph) -> None:
    """Raise a UserError naming the first node whose op the ONNX export cannot lower."""
    for node in graph.nodes:
        if node.op in REFUSED_OPS:
            raise UserError(f"node {node.name} ({node.op}) of a {graph.config.architecture} graph has no ONNX "
                            f"lowering ({REFUSED_WHY[node.op]}); export it with --format hf instead")


class Lowering:
    """One export: walks the graph once and returns the ModelProto. Subclasses are the flavors."""

    flavor = ""

    def __init__(self, graph: Graph, store: TensorStore, show_progress: bool = False):
        self.graph, self.store, self.show_progress = graph, store, show_progress
        self.cfg = graph.config
        self.b = GraphBuilder()
        self._tables: dict[str, str] = {}  # logical tensor -> Gather table initializer
        self._pending_kv: dict[int, tuple[str, str]] = {}  # layer -> roped k, v (rope_kv_store)
        self._cache: dict[str, str] = {}  # per-graph values a flavor builds once (masks, rotary tables)

    # --- the flavor's part ------------------------------------------------------------------------
    def rope(self, x: str, num_heads: int, node: Node, base: str) -> str:
        """x (B, S, H * D) rotated at position_ids: the first `rotary_dim` dims of each head (node attr,
        default D) through the table the node's `rope_table` names."""
        raise NotImplementedError

    def attention(self, q: str, k: str, v: str, node: Node) -> str:
        """Returns the (B, S, H * D) output; writes present.{layer}.key/value."""
        raise NotImplementedError

    def add_rms_norm(self, x: str, residual: str, weight: str, eps: float, base: str) -> tuple[str, str]:
        summed = self.b.op1("Add", [x, residual], base=base)
        return self.rms_norm(summed, weight, eps, base), summed

    def int4_matmul(self, x: str, tensor: str, parts: dict[str, torch.Tensor], fmt: Format) -> str:
        raise NotImplementedError

    # --- the walk ---------------------------------------------------------------------------------
    def build(self) -> onnx.ModelProto:
        check_lowerable(self.graph)
        b, cfg = self.b, self.cfg
        kv_shape = ["batch_size", cfg.num_kv_heads, "past_sequence_length", cfg.head_dim]
        present_shape = ["batch_size", cfg.num_kv_heads, "total_sequence_length", cfg.head_dim]
        inputs = [
            helper.make_tensor_value_info(b.reserve("input_ids"), TensorProto.INT64, ["batch_size", "sequence_length"]),
            helper.make_tensor_value_info(
                b.reserve("attention_mask"), TensorProto.INT64, ["batch_size", "total_sequence_length"]
            ),
            helper.make_tensor_value_info(
                b.reserve("position_ids"), TensorProto.INT64, ["batch_size", "sequence_length"]
            ),
        ]
        outputs = [
            helper.make_tensor_value_info(b.reserve("logits"), TensorProto.FLOAT,
                                          ["batch_size", "sequence_length", cfg.vocab_size])
        ]
        for i in range(cfg.num_layers):
            for past, present in ((PAST_KEY, PRESENT_KEY), (PAST_VALUE, PRESENT_VALUE)):
                inputs.append(helper.make_tensor_value_info(b.reserve(past.format(i)), TensorProto.FLOAT, kv_shape))
                outputs.append(
                    helper.make_tensor_value_info(b.reserve(present.format(i)), TensorProto.FLOAT, present_shape)
                )
        env = {"input_ids": "input_ids", "positions": "position_ids"}
        nodes = tqdm(self.graph.nodes, desc=f"lowering ({self.flavor})", unit="node", disable=not self.show_progress)
        for node in nodes:
            outs = self._lower(node, [env[v] for v in node.inputs])
            env.update(zip(node.outputs, outs, strict=True))
        (logits,) = [env[v] for v in self.graph.outputs]
        b.nodes.append(helper.make_node("Identity", [logits], ["logits"], name=b.name("logits/Identity")))
        g = helper.make_graph(b.nodes, f"optc-{self.flavor}", inputs, outputs, b.initializers)
        opsets = [helper.make_opsetid("", OPSET)] + ([helper.make_opsetid(MS_DOMAIN, 1)] if b.uses_ms_domain else [])
        return helper.make_model(g, opset_imports=opsets, ir_version=10, producer_name="optc")

    def _lower(self, node: Node, ins: list[str]) -> list[str]:
        b, a, base = self.b, node.attrs, node.name
        if node.op == "embedding":
            hidden = b.op1("Gather", [self._table(node.params["weight"]), ins[0]], base=base)
            return [b.op1("Mul", [hidden, b.const(a["scale"], np.float32)], base=base) if a.get("scale") else hidden]
        if node.op == "rms_norm" and a.get("head_dim"):  # per head (Qwen3's q/k norms)
            heads = b.op1("Reshape", [ins[0], b.const([0, 0, -1, a["head_dim"]])], base=base)
            normed = self.rms_norm(heads, self._norm_weight(node), a["eps"], base)
            return [b.op1("Reshape", [normed, b.const([0, 0, -1])], base=base)]
        if node.op == "rms_norm":
            return [self.rms_norm(ins[0], self._norm_weight(node), a["eps"], base)]
        if node.op == "add_rms_norm":
            return list(self.add_rms_norm(ins[0], ins[1], self._norm_weight(node), a["eps"], base))
        if node.op == "add":
            return [b.op1("Add", ins, base=base)]
        if node.op == "linear":
            y = self.matmul(ins[0], node.params["weight"])
            if "bias" in node.params:
                y = b.op1("Add", [y, b.initializer(node.params["bias"], self._dense(node.params["bias"]))], base=base)
            split = a.get("split")
            return b.op("Split", [y, b.const(split)], len(split), base=base, axis=-1) if split else [y]
        if node.op == "rope":
            return [self.rope(ins[0], a["num_heads"], node, f"{base}/q"),
                    self.rope(ins[1], a["num_kv_heads"], node, f"{base}/k")]
        if node.op == "rope_kv_store":
            self._pending_kv[a["layer"]] = (self.rope(ins[1], a["num_kv_heads"], node, f"{base}/k"), ins[2])
            return [self.rope(ins[0], a["num_heads"], node, f"{base}/q")]
        if node.op == "attention":
            k, v = self._pending_kv.pop(a["layer"]) if a.get("kv_stored") else (ins[1], ins[2])
            return [self.attention(ins[0], k, v, node)]
        if node.op == "gated_act":
            gate, up = ins
            if a["act"] == "gelu_tanh":
                act = b.op1("Gelu", [gate], base=base, approximate="tanh")
            else:
                act = b.op1("Mul", [gate, b.op1("Sigmoid", [gate], base=base)], base=base)
            return [b.op1("Mul", [act, up], base=base)]
        if node.op == "lm_head":
            tensor = node.params["weight"]
            if tensor in self._tables:  # tied embeddings: one table, transposed once at load
                logits = b.op1("MatMul", [ins[0], b.op1("Transpose", [self._tables[tensor]], base=base)], base=base)
            else:
                logits = self.matmul(ins[0], tensor)
            return [self.soft_cap(logits, a["softcap"], base) if a.get("softcap") else logits]
        raise ValueError(f"node {node.name!r}: op {node.op!r} has no ONNX lowering")

    # --- shared pieces ----------------------------------------------------------------------------
    def matmul(self, x: str, tensor: str) -> str:
        """x (B, S, K) @ W^T for a weight in any optc format -> (B, S, N)."""
        b, fmt = self.b, self.graph.tensors[tensor].format
        parts = self._parts(tensor)
        if fmt.act_order:  # stored column j is input channel perm[j]
            perm = b.initializer(f"{tensor}.perm", parts["perm"].to(torch.int64).numpy())
            x = b.op1("Gather", [x, perm], base=tensor, axis=-1)
        return onnx_matmul(self, x, tensor, parts, fmt)

    def rms_norm(self, x: str, weight: str, eps: float, base: str) -> str:
        # x * 1 / sqrt(mean(x^2) + eps) * w, in float32 like rms_norm_ref
        b = self.b
        ms = b.op1("ReduceMean", [b.op1("Mul", [x, x], base=base), b.const([-1])], base=base, keepdims=1)
        inv = b.op1("Reciprocal", [b.op1("Sqrt", [b.op1("Add", [ms, b.const(eps, np.float32)], base=base)], base=base)],
                    base=base)
        return b.op1("Mul", [b.op1("Mul", [x, inv], base=base), weight], base=base)

    def soft_cap(self, x: str, cap: float, base: str) -> str:
        """cap * tanh(x / cap): Gemma 2's soft-capping of scores and logits."""
        b = self.b
        return b.op1("Mul", [b.op1("Tanh", [b.op1("Div", [x, b.const(cap, np.float32)], base=base)], base=base),
                             b.const(cap, np.float32)], base=base)

    def cos_sin(self, table: str = GLOBAL) -> tuple[np.ndarray, np.ndarray]:
        """(P, R / 2) cos and sin of rotary table `table` over the model's max positions (rope scaling
        included; R the rotary width)."""
        rows = cos_sin_tables(self.cfg, self.cfg.max_position_embeddings)[table].numpy()
        half = rows.shape[1] // 2
        return rows[:, :half], rows[:, half:]

    def rotary_caches(self, table: str = GLOBAL) -> tuple[str, str]:
        """The cos and sin initializers of rotary table `table`, (P, R / 2) each, written once per model."""
        suffix = "" if table == GLOBAL else f"_{table}"
        if f"cos_cache{suffix}" not in self._cache:
            cos, sin = self.cos_sin(table)
            self._cache[f"cos_cache{suffix}"] = self.b.initializer(f"cos_cache{suffix}", cos)
            self._cache[f"sin_cache{suffix}"] = self.b.initializer(f"sin_cache{suffix}", sin)
        return self._cache[f"cos_cache{suffix}"], self._cache[f"sin_cache{suffix}"]

    def once(self, key: str, make: Callable[[], str]) -> str:
        if key not in self._cache:
            self._cache[key] = make()
        return self._cache[key]

    def _parts(self, tensor: str) -> dict[str, torch.Tensor]:
        info = self.graph.tensors[tensor]
        roles = info.format.part_shapes(info.shape)
        return {role: self.store.get(part_name(tensor, role, info.format)) for role in roles}

    def _dense(self, tensor: str) -> np.ndarray:
        return float32(self._parts(tensor)["weight"])

    def _norm_weight(self, node: Node) -> str:
        """The norm's weight as a float32 initializer; an offset norm's (Gemma's) is `offset + w`, the factor
        rms_norm_ref multiplies by in float32."""
        tensor, offset = node.params["weight"], node.attrs.get("offset", 0.0)
        return self.once(f"norm:{tensor}", lambda: self.b.initializer(tensor, self._dense(tensor) + np.float32(offset)))

    def _table(self, tensor: str) -> str:
        if tensor not in self._tables:
            fmt = self.graph.tensors[tensor].format
            self._tables[tensor] = self.b.initializer(tensor, embedding_table(self._parts(tensor), fmt))
        return self._tables[tensor]
