"""Tensor-parallel sharding: the graph one rank runs and the weight slices it holds, derived at load
from the artifact's graph. The artifact stays one artifact; nothing here touches a process group.

How each op's parameters and values partition is declared once per op in `PARTITIONS` (every op of
optc.core.ops has an entry; a test holds that):
- REPLICATED (norms): params whole, inputs and outputs whole;
- PER_HEAD (a norm with a `head_dim` attr: Qwen3's and Gemma 3's q/k norms): its (head_dim,) weight
  whole, its value in whichever head partition its consumer takes (the rope after it), output alike;
- ELEMENTWISE (add): every input laid out alike, the output too;
- GATED (gated_act): gate and up split evenly along features, the output alike;
- HEADS (rope, attention, rope_kv_store): query heads split evenly; KV heads split evenly or, when
  the ranks outnumber them, each rank holds the one KV head its query heads read (replicated, as vLLM
  does). The node's head counts become the rank's;
- LINEAR: column-parallel (weight rows) when its input is whole and its consumers take a split value,
  each split output (fused QKV, gate-up) in its consumer's partition; row-parallel (weight columns)
  when its input is split: the output is a partial sum that an inserted `all_reduce` sums, and the
  bias is added on rank 0 only; whole when nothing downstream takes a split value;
- EXPERTS (moe): input whole, router whole (every rank routes every token alike), each expert split
  along its intermediate dimension (gate and up rows, down columns: each rank holds a slice of every
  expert); the output is a partial sum that an inserted `all_reduce` sums. Expert parallelism (whole
  experts per rank) is not done;
- LATENT (mla_attention): query heads split evenly (q's rows per head, kv_b's rows per head, the output's
  v_head_dim columns per head, so o_proj is row-parallel); kv_a, kv_norm and the latent cache replicated
  (every rank stores the same latent: the cache has no head axis to split);
- VOCAB_LOOKUP (embedding): rows split over the vocabulary (ceil(V / N) per rank); ids outside the
  shard give 0 and an inserted `all_reduce` sums;
- VOCAB_LOGITS (lm_head): rows split over the vocabulary; an inserted `all_gather` concatenates the
  logits, so every rank ends with the whole (T, V);
- COLLECTIVE: all_reduce / all_gather, which only a rank's graph holds.

Quantized weights are sliced along their own axes by their format's scheme (`Scheme.part_slices`):
an int4 group or packed word is never cut. A model that cannot be split N ways is a ShardError at
load naming the tensor, its shape and the tensor-parallel sizes that work. A rank's model config has
its own head counts (its KV pool is sized from them); every other field stays global (the vocabulary
too: the logits are gathered).
"""

from __future__ import annotations

import copy
import enum
from dataclasses import dataclass, replace

import torch

from optc.core.errors import InputError
from optc.core.formats import part_name
from optc.core.formats.scheme import Ranges
from optc.core.ir import Graph, Node, TensorInfo
from optc.core.store import Entry, TensorStore


class Partition(enum.Enum):
    REPLICATED = "replicated"
    PER_HEAD = "per_head"
    ELEMENTWISE = "elementwise"
    GATED = "gated"
    HEADS = "heads"
    LINEAR = "linear"
    EXPERTS = "experts"
    LATENT = "latent"
    VOCAB_LOOKUP = "vocab_lookup"
    VOCAB_LOGITS = "vocab_logits"
    COLLECTIVE = "collective"


PARTITIONS: dict[str, Partition] = {
    "embedding": Partition.VOCAB_LOOKUP,
    "rms_norm": Partition.REPLICATED,
    "add_rms_norm": Partition.REPLICATED,
    "add": Partition.ELEMENTWISE,
    "linear": Partition.LINEAR,
    "rope": Partition.HEADS,
    "rope_kv_store": Partition.HEADS,
    "attention": Partition.HEADS,
    "gated_act": Partition.GATED,
    "lm_head": Partition.VOCAB_LOGITS,
    "moe": Partition.EXPERTS,
    "mla_attention": Partition.LATENT,
    "all_reduce": Partition.COLLECTIVE,
    "all_gather": Partition.COLLECTIVE,
}



def partition(node: Node) -> Partition:
    """The node's partition rule: its op's, or PER_HEAD for a per-head norm."""
    if node.op == "rms_norm" and node.attrs.get("head_dim"):
        return Partition.PER_HEAD
    return PARTITIONS[node.op]


WHOLE = "whole"
PARTIAL = "partial"
Layout = str | Ranges  # WHOLE, PARTIAL (summed over ranks) or the feature ranges this rank holds


class ShardError(InputError):
    """A model that cannot be split over the asked number of ranks; the message names the tensor,
    its shape and the tensor-parallel sizes that work."""


@dataclass(frozen=True)
class ShardPlan:
    graph: Graph  # the rank's graph: local shapes and head counts, collectives inserted
    slices: dict[str, tuple[int, Ranges]]  # tensor -> (axis, ranges of the artifact's tensor) it holds


def shard(graph: Graph, store: TensorStore, rank: int, size: int) -> tuple[Graph, TensorStore]:
    """Rank `rank` of `size`'s graph and a store whose entries load only that rank's slices (a group of
    one: the graph with its collectives, the store as it is)."""
    plan = plan_shards(graph, rank, size)
    if size == 1:
        return plan.graph, store
    entries = {}
    for name, (axis, ranges) in plan.slices.items():
        info = graph.tensors[name]
        fmt = info.format
        for role, (part_axis, part_ranges) in fmt.part_slices(info.shape, axis, ranges).items():
            key = part_name(name, role, fmt)
            source = store.entry(key)
            shape = list(source.shape)
            shape[part_axis] = sum(b - a for a, b in part_ranges)
            entries[key] = Entry(tuple(shape), source.dtype, lambda s=source, p=part_axis, r=part_ranges: _take(
                s.load(), p, r))
    return plan.graph, store.with_entries(entries)


def plan_shards(graph: Graph, rank: int, size: int) -> ShardPlan:
    """The rank's graph and slices; ShardError when the model cannot be split `size` ways."""
    if not 0 <= rank < size:
        raise ValueError(f"rank {rank} is outside a tensor-parallel group of {size}")
    try:
        return _Planner(graph, rank, size).run()
    except _Unsplittable as e:
        allowed = allowed_sizes(graph)
        raise ShardError(f"cannot split {e.what} {size} ways: {e.reason}; tensor-parallel sizes that work for "
                         f"this model: {', '.join(map(str, allowed))}") from None


def allowed_sizes(graph: Graph) -> list[int]:
    """Every tensor-parallel size (up to the query-head count) every rank of which can be planned."""
    out = []
    for size in range(1, graph.config.num_heads + 1):
        try:
            for rank in range(size):
                _Planner(graph, rank, size).run()
        except _Unsplittable:
            continue
        out.append(size)
    return out


def rank_weight_bytes(graph: Graph) -> int:
    """Bytes of the stored parts of every tensor a (rank's) graph uses."""
    total = 0
    for name in graph.used_tensors():
        info = graph.tensors[name]
        for shape, dtype in info.format.part_shapes(info.shape).values():
            total += torch.Size(shape).numel() * dtype.itemsize
    return total


# -- helpers ----------------------------------------------------------------------------------------


class _Unsplittable(Exception):
    def __init__(self, what: str, reason: str) -> None:
        super().__init__(f"{what}: {reason}")
        self.what, self.reason = what, reason


class _Planner:
    def __init__(self, graph: Graph, rank: int, size: int) -> None:
        self.graph, self.rank, self.size = graph, rank, size
        self.consumers = graph.consumers()
        self.layouts: dict[str, Layout] = dict.fromkeys(graph.inputs, WHOLE)
        self.nodes: list[Node] = []
        self.tensors = dict(graph.tensors)
        self.slices: dict[str, tuple[int, Ranges] | None] = {}  # None: used whole

    def run(self) -> ShardPlan:
        c = self.graph.config
        q_heads, kv_heads = self._head_ranges()
        self.q = ((q_heads[0] * c.head_dim, q_heads[1] * c.head_dim),)
        self.kv = ((kv_heads[0] * c.head_dim, kv_heads[1] * c.head_dim),)
        self.num_q_heads, self.num_kv_heads = q_heads[1] - q_heads[0], kv_heads[1] - kv_heads[0]
        self.q_heads = q_heads
        for node in self.graph.nodes:
            if node.op not in PARTITIONS:
                raise _Unsplittable(f"node {node.name}", f"op {node.op} declares no partition")
            rule = partition(node)
            getattr(self, f"_{rule.value}")(copy.deepcopy(node), [self.layouts[v] for v in node.inputs])
        for v in self.graph.outputs:
            if self.layouts[v] != WHOLE:
                raise _Unsplittable(f"graph output {v}", "it would end split over the ranks")
        config = replace(c, num_heads=self.num_q_heads, num_kv_heads=self.num_kv_heads)
        graph = replace(self.graph, config=config, nodes=self.nodes, tensors=self.tensors)
        return ShardPlan(graph, {t: s for t, s in self.slices.items() if s is not None})

    # -- partitions -----------------------------------------------------------------------------

    def _head_ranges(self) -> tuple[tuple[int, int], tuple[int, int]]:
        c, n, r = self.graph.config, self.size, self.rank
        what = f"attention ({c.num_heads} query heads over {c.num_kv_heads} KV heads)"
        if c.num_heads % n:
            raise _Unsplittable(what, f"{c.num_heads} query heads do not split evenly")
        per_rank = c.num_heads // n
        if n <= c.num_kv_heads:
            if c.num_kv_heads % n:
                raise _Unsplittable(what, f"{c.num_kv_heads} KV heads do not split evenly")
            kv = c.num_kv_heads // n
            return (r * per_rank, (r + 1) * per_rank), (r * kv, (r + 1) * kv)
        if n % c.num_kv_heads:
            raise _Unsplittable(what, f"{c.num_kv_heads} KV heads neither split nor replicate evenly")
        head = r // (n // c.num_kv_heads)  # the KV head this rank's query heads read
        return (r * per_rank, (r + 1) * per_rank), (head, head + 1)

    def _even(self, width: int, what: str) -> Ranges:
        if width % self.size:
            raise _Unsplittable(what, f"{width} features do not split evenly")
        w = width // self.size
        return ((self.rank * w, (self.rank + 1) * w),)

    def _vocab(self) -> Ranges:
        v = self.graph.config.vocab_size
        per_rank = -(-v // self.size)
        return ((min(v, self.rank * per_rank), min(v, (self.rank + 1) * per_rank)),)

    def _demand(self, value: str, width: int, what: str) -> Layout:
        """The layout `value`'s consumers take it in: a head or even partition, or WHOLE."""
        wanted = set()
        for consumer in self.consumers[value]:
            rule, i = partition(consumer), consumer.inputs.index(value)
            if rule is Partition.PER_HEAD:  # passes its value through: what its own consumers take
                wanted.add(self._demand(consumer.outputs[0], width, what))
            elif rule is Partition.HEADS:
                wanted.add(self.q if i == 0 else self.kv)
            elif rule is Partition.GATED:
                wanted.add(self._even(width, what))
            elif rule is Partition.LATENT:
                wanted.add(self._latent_heads(consumer, "qk") if i == 0 else WHOLE)
            else:
                wanted.add(WHOLE)
        if len(wanted) > 1:
            raise _Unsplittable(what, f"its output {value} is consumed in different partitions")
        return wanted.pop() if wanted else WHOLE

    # -- rules ----------------------------------------------------------------------------------

    def _replicated(self, node: Node, ins: list[Layout]) -> None:
        self._need(node, ins, all(x == WHOLE for x in ins), "needs its inputs whole")
        self._emit(node, [WHOLE] * len(node.outputs))

    def _per_head(self, node: Node, ins: list[Layout]) -> None:
        self._need(node, ins, ins[0] != PARTIAL, "needs its heads whole (not a partial sum)")
        self._use_whole(node)
        self._emit(node, [ins[0]])

    def _elementwise(self, node: Node, ins: list[Layout]) -> None:
        self._need(node, ins, len(set(ins)) == 1 and ins[0] != PARTIAL, "needs its inputs laid out alike")
        self._emit(node, [ins[0]] * len(node.outputs))

    def _gated(self, node: Node, ins: list[Layout]) -> None:
        self._need(node, ins, len(set(ins)) == 1 and ins[0] not in (WHOLE, PARTIAL), "needs gate and up split alike")
        self._emit(node, [ins[0]])

    def _heads(self, node: Node, ins: list[Layout]) -> None:
        # q first, then k and v; the positions are a graph input, whole
        expected = [WHOLE if v in self.graph.inputs else self.q if i == 0 else self.kv
                    for i, v in enumerate(node.inputs)]
        self._need(node, ins, ins == expected, "needs its query and KV heads in the rank's partition")
        node.attrs.update(num_heads=self.num_q_heads, num_kv_heads=self.num_kv_heads)
        self._emit(node, [self.q, self.kv][: len(node.outputs)])

    def _linear(self, node: Node, ins: list[Layout]) -> None:
        weight = node.params["weight"]
        what = self._describe(weight)
        if ins[0] == WHOLE:
            widths = node.attrs.get("split") or [node.attrs["out_features"]]
            outs = [self._demand(v, w, what) for v, w in zip(node.outputs, widths, strict=True)]
            if all(o == WHOLE for o in outs):
                self._use_whole(node)
                return self._emit(node, outs)
            if WHOLE in outs:
                raise _Unsplittable(what, "some of its split outputs are used whole")
            offsets = [sum(widths[:i]) for i in range(len(widths))]
            rows = tuple((o + a, o + b) for o, ranges in zip(offsets, outs, strict=True) for a, b in ranges)
            for tensor in node.params.values():
                self._slice(tensor, 0, rows)
            local = [sum(b - a for a, b in ranges) for ranges in outs]
            node.attrs["out_features"] = sum(local)
            if "split" in node.attrs:
                node.attrs["split"] = local
            return self._emit(node, outs)
        self._need(node, ins, ins[0] != PARTIAL and "split" not in node.attrs, "takes a split input")
        self._slice(weight, 1, ins[0])
        node.attrs["in_features"] = sum(b - a for a, b in ins[0])
        if "bias" in node.params:
            self._use_whole_tensor(node.params["bias"])
            if self.rank != 0:  # the bias joins the partial sums once
                del node.params["bias"]
        self._emit_reduced(node)

    def _experts(self, node: Node, ins: list[Layout]) -> None:
        self._need(node, ins, ins[0] == WHOLE, "needs its input whole")
        size = node.attrs["intermediate_size"]
        (cols,) = self._even(size, self._describe(node.params["down"]))
        self._use_whole_tensor(node.params["router"])
        self._slice(node.params["gate_up"], 1, (cols, (size + cols[0], size + cols[1])))  # gate rows, then up rows
        self._slice(node.params["down"], 2, (cols,))
        node.attrs["intermediate_size"] = cols[1] - cols[0]
        self._emit_reduced(node)

    def _latent(self, node: Node, ins: list[Layout]) -> None:
        self._need(node, ins, ins == [self._latent_heads(node, "qk"), WHOLE, WHOLE],
                   "needs its query heads in the rank's partition and its latent whole")
        self._use_whole_tensor(node.params["kv_norm"])
        self._slice(node.params["kv_b"], 0, self._latent_heads(node, "kv_b"))
        node.attrs.update(num_heads=self.num_q_heads, num_kv_heads=self.num_kv_heads)
        self._emit(node, [self._latent_heads(node, "v")])

    def _latent_heads(self, node: Node, what: str) -> Ranges:
        """The rank's heads of an mla_attention node in features of q (`qk`), of kv_b's rows or of its output."""
        a = node.attrs
        width = {"qk": a["qk_nope_head_dim"] + a["head_dim"], "kv_b": a["qk_nope_head_dim"] + a["v_head_dim"],
                 "v": a["v_head_dim"]}[what]
        return ((self.q_heads[0] * width, self.q_heads[1] * width),)

    def _vocab_lookup(self, node: Node, ins: list[Layout]) -> None:
        self._need(node, ins, ins[0] == WHOLE, "needs its input ids whole")
        rows = self._vocab()
        self._slice(node.params["weight"], 0, rows)
        node.attrs["vocab_start"] = rows[0][0]
        self._emit_reduced(node)

    def _vocab_logits(self, node: Node, ins: list[Layout]) -> None:
        self._need(node, ins, ins[0] == WHOLE, "needs its input whole")
        self._slice(node.params["weight"], 0, self._vocab())
        out = node.outputs[0]
        node.outputs = [f"{out}.shard"]
        self._emit(node, [self._vocab()])
        gather = Node(f"{node.name}.all_gather", "all_gather", [f"{out}.shard"], [out],
                      {"num_features": self.graph.config.vocab_size})
        self._emit(gather, [WHOLE])

    def _collective(self, node: Node, ins: list[Layout]) -> None:
        raise _Unsplittable(f"node {node.name}", "the graph is already a rank's (it holds collectives)")

    # -- bookkeeping ----------------------------------------------------------------------------

    def _emit(self, node: Node, outs: list[Layout]) -> None:
        self.nodes.append(node)
        self.layouts.update(zip(node.outputs, outs, strict=True))

    def _emit_reduced(self, node: Node) -> None:
        """The node's one output is a partial sum: rename it and sum it with an all_reduce."""
        out = node.outputs[0]
        node.outputs = [f"{out}.partial"]
        self._emit(node, [PARTIAL])
        attrs = {"layer": node.attrs["layer"]} if "layer" in node.attrs else {}
        self._emit(Node(f"{node.name}.all_reduce", "all_reduce", [f"{out}.partial"], [out], attrs), [WHOLE])

    def _need(self, node: Node, ins: list[Layout], ok: bool, reason: str) -> None:
        if not ok:
            raise _Unsplittable(f"node {node.name} ({node.op})", f"it {reason}")

    def _describe(self, tensor: str) -> str:
        info = self.graph.tensors[tensor]
        return f"{tensor} ({info.format.kind.value} {list(info.shape)})"

    def _use_whole(self, node: Node) -> None:
        for tensor in node.params.values():
            self._use_whole_tensor(tensor)

    def _use_whole_tensor(self, tensor: str) -> None:
        if self.slices.get(tensor, None) is not None:
            raise _Unsplittable(self._describe(tensor), "it is used both whole and split")
        self.slices[tensor] = None

    def _slice(self, tensor: str, axis: int, ranges: Ranges) -> None:
        info = self.graph.tensors[tensor]
        if axis >= len(info.shape):  # a bias (N,) of a row-parallel linear is handled by the caller
            raise _Unsplittable(self._describe(tensor), f"it has no axis {axis}")
        if tensor in self.slices and self.slices[tensor] != (axis, ranges):
            raise _Unsplittable(self._describe(tensor), "its users take different slices of it")
        try:
            info.format.part_slices(info.shape, axis, ranges)
        except ValueError as e:
            raise _Unsplittable(self._describe(tensor), str(e)) from None
        self.slices[tensor] = (axis, ranges)
        shape = list(info.shape)
        shape[axis] = sum(b - a for a, b in ranges)
        self.tensors[tensor] = TensorInfo(tuple(shape), info.format)


def _take(t: torch.Tensor, axis: int, ranges: Ranges) -> torch.Tensor:
    """The slices `ranges` of `t` along `axis`, concatenated, as a tensor of its own."""
    return torch.cat([t.narrow(axis, a, b - a) for a, b in ranges], axis).contiguous()
