"""Run a graph: walk the nodes in order, call each node's bound implementation, free values after
their last use.

Used by the runtime (paged KV caches that persist across steps) and by calibration and evaluation
in the compiler (`run_dense`: equal-length sequences, transient KV caches per layer, in the KV
layout the graph records). Binding is by `Node.kernel`: `torch` (the default) is the op's reference
in optc.core.ops; other names resolve through the `impls` table the caller passes (the runtime passes
the Triton table). With
`use_references`, every node runs its op's reference whatever kernel it is bound to: evaluation and
calibration score the graph's math, which every kernel is tested to match, on any device. This
module imports no runtime machinery: a batch is any object with ForwardBatch's fields.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from optc.core.formats import DTYPES, part_name
from optc.core.ir import REFERENCE_KERNEL, Graph, Node
from optc.core.kv_cache import DEFAULT_BLOCK_SIZE, KVCache, KVCacheSpec
from optc.core.ops import OPS, Impl, Param
from optc.core.store import TensorStore


@dataclass
class Step:
    positions: torch.Tensor  # (T,)
    batch: object  # ForwardBatch fields: block_tables, seq_lens, query_start_loc, slot_mapping
    cos_sin: dict[str, torch.Tensor]  # rotary table name -> (P, rotary_dim) fp32 (optc.core.rope)
    logits_indices: torch.Tensor | None  # rows that get logits; None = all
    kv_caches: list[KVCache] | None = None  # per layer; None = transient (see kv_cache)
    new_transient_cache: Callable[[], KVCache] | None = None  # one layer's empty cache, when transient
    group: object = None  # the tensor-parallel process group the collective ops run over; None: one rank
    # LoRA: each row's adapter slot (T,) int64 (-1: none), on a step with adapter rows; and where the deltas run as
    # torch matmuls (no lora.cpp), (slot, its rows (n,) int64) per slot the rows use (ops/lora.py's slot_groups)
    lora_slots: torch.Tensor | None = None
    lora_groups: list[tuple[int, torch.Tensor]] | None = None
    _transient: dict[int, KVCache] = field(default_factory=dict)

    def kv_cache(self, layer: int) -> KVCache:
        """The layer's cache as the ops take it (data plus optional scales)."""
        if self.kv_caches is not None:
            return self.kv_caches[layer]
        if layer not in self._transient:  # one layer at a time: drop the others' caches
            self._transient.clear()
            self._transient[layer] = self.new_transient_cache()
        return self._transient[layer]


def bind_params(graph: Graph, store: TensorStore, device: torch.device | str = "cpu") -> dict[str, Param]:
    """Load every logical tensor the nodes use, as Params on `device`."""
    params = {}
    for name in graph.used_tensors():
        fmt = graph.tensors[name].format
        parts = {
            role: store.get(part_name(name, role, fmt)).to(device)
            for role in fmt.part_shapes(graph.tensors[name].shape)
        }
        params[name] = Param(parts, fmt)
    return params


class Executor:
    """A graph bound to implementations and loaded params."""

    def __init__(self, graph: Graph, params: dict[str, Param], impls: dict[str, Impl] | None = None,
                 use_references: bool = False):
        self.graph = graph
        self.params = params
        self._impls = [_resolve(n, impls or {}, use_references) for n in graph.nodes]
        self._node_params = [{r: params[t] for r, t in n.params.items()} for n in graph.nodes]
        last_use: dict[str, int] = {}
        for i, n in enumerate(graph.nodes):
            for v in n.inputs:
                last_use[v] = i
        self._dead_after = [
            [v for v in n.inputs if last_use[v] == i and v not in graph.outputs] for i, n in enumerate(graph.nodes)
        ]
        # first node -> (stop, inputs, outputs, fn, inputs dead after the run): runs of nodes as one call (`fuse`)
        self._fused: dict[int, tuple] = {}

    def impl(self, i: int) -> Impl:
        """Node i's bound implementation."""
        return self._impls[i]

    def node_params(self, i: int) -> dict[str, Param]:
        """Node i's params by role, the dict its implementation receives on every call."""
        return self._node_params[i]

    def wrap(self, i: int, wrapper: Callable[[Impl], Impl]) -> None:
        """Node i runs `wrapper(its implementation)` from now on (the runtime's LoRA deltas on a linear)."""
        self._impls[i] = wrapper(self._impls[i])

    def fuse(self, start: int, stop: int, inputs: tuple[str, ...], outputs: tuple[str, ...],
             fn: Callable[[list, Step], list | None]) -> bool:
        """Run nodes [start, stop) as one call where it can: `fn(values of inputs, step)` returns the values of
        `outputs`, or None to decline (the nodes then run one by one). `outputs` must hold every value of the
        range that a later node or the graph's outputs read; False (nothing changed) when they do not, or
        when a node of the range reads a value defined before it that `inputs` does not list."""
        nodes = self.graph.nodes
        inside = {v for n in nodes[start:stop] for v in n.outputs}
        read_later = {v for n in nodes[stop:] for v in n.inputs} | set(self.graph.outputs)
        read_before = {v for n in nodes[start:stop] for v in n.inputs} - inside
        if not (inside & read_later) <= set(outputs) or not set(outputs) <= inside:
            return False
        if not read_before <= set(inputs) | {"positions"}:  # positions: every step carries them (step.positions)
            return False
        dead = [v for v in inputs if v not in read_later]
        self._fused[start] = (stop, inputs, outputs, fn, dead)
        return True

    def fused_fns(self) -> list[Callable[[list, Step], list | None]]:
        """The fns of the runs of nodes `fuse` set up, in node order."""
        return [run[3] for _, run in sorted(self._fused.items())]

    def unfuse(self) -> None:
        """Run every node one by one again (what `fuse` set up is dropped)."""
        self._fused.clear()

    def run(
        self, input_ids: torch.Tensor, step: Step, hook: Callable[[int, Node, list, list], None] | None = None,
        fused: bool = True, stage_inputs: dict[str, torch.Tensor] | None = None,
    ) -> dict[str, torch.Tensor]:
        """Execute every node; `hook(i, node, inputs, outputs)` sees each node's values (and runs every
        node one by one, as `fused=False` does); `stage_inputs`: the graph's other inputs (a pipeline stage's,
        optc/core/ops/stages.py). Returns outputs."""
        env = {"input_ids": input_ids, "positions": step.positions, **(stage_inputs or {})}
        fused = self._fused if hook is None and fused else {}
        nodes, impls, params, dead_after = self.graph.nodes, self._impls, self._node_params, self._dead_after
        i, n = 0, len(nodes)
        while i < n:
            run = fused.get(i)
            if run is not None:
                stop, names, outs, fn, dead = run
                values = fn([env[v] for v in names], step)
                if values is not None:
                    env.update(zip(outs, values, strict=True))
                    for v in dead:
                        del env[v]
                    i = stop
                    continue
            node = nodes[i]
            inputs = [env[v] for v in node.inputs]
            outputs = impls[i](node, inputs, params[i], step)
            if hook is not None:
                hook(i, node, inputs, outputs)
            env.update(zip(node.outputs, outputs, strict=True))
            for v in dead_after[i]:
                del env[v]
            i += 1
        return {v: env[v] for v in self.graph.outputs}


def _resolve(node: Node, impls: dict[str, Impl], use_references: bool) -> Impl:
    """The implementation a node runs: its op's reference, or the kernel it is bound to from `impls`."""
    if use_references or node.kernel == REFERENCE_KERNEL:
        return OPS[node.op].ref
    if node.kernel not in impls:
        raise ValueError(
            f"node {node.name!r} is bound to kernel {node.kernel!r}, which this runtime lacks "
            f"(available: {REFERENCE_KERNEL}, {', '.join(sorted(impls)) or 'nothing else'})"
        )
    return impls[node.kernel]


@dataclass
class _ContiguousBatch:
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    slot_mapping: torch.Tensor


def dense_step(
    graph: Graph,
    num_seqs: int,
    seq_len: int,
    device="cpu",
    dtype=torch.float32,
    block_size: int = DEFAULT_BLOCK_SIZE,
    all_logits: bool = True,
    kv_spec: KVCacheSpec | None = None,
) -> Step:
    """A Step for `num_seqs` sequences of `seq_len` tokens each, from position 0, with transient caches
    of `kv_spec` (None: a float cache of `block_size`, `dtype`)."""
    from functools import partial

    from optc.core.rope import cos_sin_tables

    cfg = graph.config
    spec = kv_spec or KVCacheSpec(block_size, str(dtype).removeprefix("torch."))
    block_size = spec.block_size
    per_seq = -(-seq_len // block_size)
    blocks = torch.arange(1, 1 + num_seqs * per_seq, dtype=torch.int32).view(num_seqs, per_seq)
    pos = torch.arange(seq_len).repeat(num_seqs)
    slots = (blocks.long()[:, :, None] * block_size + torch.arange(block_size)).flatten(1)[:, :seq_len].flatten()
    batch = _ContiguousBatch(
        block_tables=blocks.to(device),
        seq_lens=torch.full((num_seqs,), seq_len, dtype=torch.int32, device=device),
        query_start_loc=(torch.arange(num_seqs + 1, dtype=torch.int32) * seq_len).to(device),
        slot_mapping=slots.to(device),
    )
    last = None if all_logits else (torch.arange(1, num_seqs + 1) * seq_len - 1).to(device)
    return Step(
        pos.to(device),
        batch,
        {name: t.to(device) for name, t in cos_sin_tables(cfg, max(seq_len, 1)).items()},
        last,
        new_transient_cache=partial(spec.allocate_layer, cfg, 1 + num_seqs * per_seq, device),
    )


def graph_kv_spec(graph: Graph) -> KVCacheSpec | None:
    """The KV layout kv_layout recorded on the graph's KV-touching nodes; None when it has not run."""
    node = next((n for n in graph.nodes if OPS[n.op].touches_kv_cache), None)
    return None if node is None else KVCacheSpec.from_node_attrs(node.attrs)


def run_dense(executor: Executor, input_ids: torch.Tensor, hook=None, all_logits: bool = True) -> torch.Tensor:
    """Logits for a (num_seqs, seq_len) batch of token ids: (num_seqs, seq_len | 1, vocab) float32. The
    transient KV caches have the layout the graph records (an int8 KV graph is scored with int8 KV),
    else the graph's dtype."""
    n, s = input_ids.shape
    some = next(iter(executor.params.values())).parts
    dev = next(iter(some.values())).device
    step = dense_step(executor.graph, n, s, dev, DTYPES[executor.graph.config.dtype], all_logits=all_logits,
                      kv_spec=graph_kv_spec(executor.graph))
    logits = executor.run(input_ids.reshape(-1).to(dev), step, hook)["logits"]
    return logits.view(n, s if all_logits else 1, -1)
