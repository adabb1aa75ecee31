"""Model: an artifact's graph bound to kernels on a device; one forward step over a ForwardBatch.

It owns the weights, the rope table and the KV spec (from the manifest), not the KV cache: the
caller allocates the per-layer caches (`allocate_kv_caches`, a `KVCache` per layer) and passes them
to every `forward`. A tensor-parallel rank's model holds the rank's graph (its heads, its weight
slices, the collectives) and the process group its collectives run over.

KV-cache groups (optc/core/kv_cache.py): a model with sliding-window layers has several, each with its
own block table; its KV-touching nodes get their group as a `kv_group` attr here (once, at load), and
its batches carry a block table and slot mapping per group (`BatchBuilder(device, num_groups)`).

LoRA (runtime/lora.py): `enable_lora` allocates the adapter slots, wraps every targetable linear so that it adds
its rows' deltas, and hands the fused CPU step's runs the same slot tables (kernels/cpu_ext/step.py `attach_lora`),
so that a step with adapter rows stays fused and gives the node-by-node step's bits.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from optc.core.execute import Executor, Impl, Step, bind_params
from optc.core.formats import DTYPES
from optc.core.ir import GRAPH_INPUTS, REFERENCE_KERNEL, Graph, Node
from optc.core.kv_cache import KVCache, KVCacheGroup, KVCacheSpec, kv_cache_groups
from optc.core.ops import OPS
from optc.core.ops.lora import slot_groups
from optc.core.rope import cos_sin_tables
from optc.core.store import TensorStore
from optc.runtime.batch import ForwardBatch
from optc.runtime.lora import LoraSlots


class Model:
    def __init__(
        self,
        graph: Graph,
        store: TensorStore,
        device: str | torch.device = "cpu",
        kv_spec: KVCacheSpec | None = None,  # None: the model's dtype, the default block size
        impls: dict[str, Impl] | None = None,
        group: object = None,  # the tensor-parallel process group of a rank's graph (optc/core/ops/sharding.py)
        use_references: bool = False,  # every node runs its op's reference, whatever kernel it is bound to
    ):
        c = graph.config
        self.kv_groups = kv_cache_groups(c)
        self.kv_windows = tuple(g.window for g in self.kv_groups)  # what the KV manager needs of them
        self._num_group_tables = len(self.kv_groups) if len(self.kv_groups) > 1 else 0
        if self._num_group_tables:
            graph = _with_kv_groups(graph, self.kv_groups)
        self.graph = graph
        # the lm_head's input, the target feature an EAGLE head drafts from: a graph output too, so that the
        # executor keeps it (it dies at the lm_head, the last node, anyway: no memory is held longer)
        self.feature_name = next((n.inputs[0] for n in graph.nodes if n.op == "lm_head"), None)
        run_graph = graph
        if self.feature_name is not None and self.feature_name not in graph.outputs:
            run_graph = replace(graph, outputs=(*graph.outputs, self.feature_name))
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:  # as tensors report it: no re-move per step
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.executor = Executor(run_graph, bind_params(graph, store, self.device), impls, use_references)
        # on the CPU, each run of nodes the artifact's plan records (passes/plan_cpu_step.py) as one C++ call
        # (kernels/cpu_ext/step.py); how many runs were fused (0: node by node)
        self.fused_runs = (_fuse_planned(run_graph, self.executor)
                           if self.device.type == "cpu" and not use_references and group is None else 0)
        self.group = group
        self.num_layers, self.num_kv_heads, self.head_dim = c.num_layers, c.num_kv_heads, c.head_dim
        self.vocab_size = c.vocab_size
        self.max_position_embeddings = c.max_position_embeddings
        self.eos_token_ids = list(c.eos_token_ids)
        self.dtype = DTYPES[c.dtype]
        self.kv_spec = kv_spec or KVCacheSpec(dtype=c.dtype)
        # a pipeline stage's graph (optc/core/ops/stages.py) holds some layers: its KV caches are theirs only
        layers = {n.attrs["layer"] for n in graph.nodes if OPS[n.op].touches_kv_cache}
        self.kv_layers = None if len(layers) == c.num_layers else tuple(sorted(layers))
        self.receives = tuple(v for v in graph.inputs if v not in GRAPH_INPUTS)  # a later stage's: its inputs
        self.cos_sin = {name: t.to(self.device) for name, t in cos_sin_tables(c, c.max_position_embeddings).items()}
        # a batch may carry draft trees (ForwardBatch.tree_mask) when every KV-touching node is an attention whose
        # implementation takes the mask, over full attention in one KV-cache group, on one rank
        self.takes_tree_mask = group is None and len(self.kv_groups) == 1 and self.kv_groups[0].window is None and all(
            n.op == "attention" and not n.attrs.get("window") and (use_references or _takes_tree_mask(n.kernel))
            for n in graph.nodes if OPS[n.op].touches_kv_cache and n.op != "rope_kv_store")
        self.lora: LoraSlots | None = None

    def enable_lora(self, max_loras: int, max_rank: int) -> LoraSlots:
        """Allocate `max_loras` adapter slots of rank <= max_rank and add their deltas to the targetable linears."""
        if self.lora is None:
            self.lora = LoraSlots(self.graph, max_loras, max_rank, self.device)
            for i, node in enumerate(self.executor.graph.nodes):
                if node.name in self.lora.tables:
                    self.executor.wrap(i, lambda impl, name=node.name: _with_lora(impl, name, self.lora))
            if self.fused_runs:
                from optc.kernels.cpu_ext.step import attach_lora

                attach_lora(self.executor, self.lora)
        return self.lora

    def kv_bytes_per_block(self, block_size: int) -> int:
        return replace(self.kv_spec, block_size=block_size).bytes_per_block(self.graph.config, self.kv_layers)

    def allocate_kv_caches(self, num_blocks: int, block_size: int) -> list[KVCache | None]:
        """Every layer's cache (None for a layer another pipeline stage holds)."""
        return replace(self.kv_spec, block_size=block_size).allocate(self.graph.config, num_blocks, self.device,
                                                                     self.kv_layers)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, kv_caches: list[KVCache],
                with_features: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """float32 logits (len(batch.logits_indices), vocab) for the batch's selected rows; `with_features`:
        also the lm_head's input (T, H) at every token of the batch (what an EAGLE head drafts from)."""
        if batch.input_ids.device != self.device:
            batch = batch.to(self.device)
        if len(batch.group_tables) != self._num_group_tables:
            raise ValueError(f"the batch has {len(batch.group_tables) or 1} KV-cache group(s), this model "
                             f"{len(self.kv_groups)}: build it with num_groups={len(self.kv_groups)}")
        step = Step(batch.positions, batch, self.cos_sin, batch.logits_indices, kv_caches, group=self.group)
        if batch.lora_slots is not None and self.lora is not None:
            step.lora_slots = batch.lora_slots
            step.lora_groups = slot_groups(batch.lora_slots) if self.lora.kernel is None else None
        out = self.executor.run(batch.input_ids, step)
        return (out["logits"], out[self.feature_name]) if with_features else out["logits"]

    @torch.inference_mode()
    def run_stage(self, batch: ForwardBatch, kv_caches: list,
                  received: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A pipeline stage's step (runtime/pipeline.py): the values it sends on (the last stage: its logits)
        for the batch, from the values `received` from the stage before (none for stage 0)."""
        if batch.input_ids.device != self.device:
            batch = batch.to(self.device)
        step = Step(batch.positions, batch, self.cos_sin, batch.logits_indices, kv_caches, group=self.group)
        return self.executor.run(batch.input_ids, step, stage_inputs=received)


def _with_lora(impl: Impl, name: str, lora: LoraSlots) -> Impl:
    """A linear's implementation followed by its LoRA deltas on steps with adapter rows."""
    def run(node, inputs, params, step):
        outputs = impl(node, inputs, params, step)
        if step is None or step.lora_slots is None:
            return outputs
        return lora.apply(name, inputs[0], outputs, step.lora_slots, step.lora_groups)
    return run


def _fuse_planned(graph: Graph, executor: Executor) -> int:
    if not any("step_run" in n.attrs for n in graph.nodes):
        return 0
    from optc.kernels.cpu_ext.step import fuse_planned

    return fuse_planned(graph, executor)


def _takes_tree_mask(kernel: str) -> bool:
    if kernel == REFERENCE_KERNEL:
        return True
    from optc.kernels.registry import KERNELS

    return kernel in KERNELS and KERNELS[kernel].takes_tree_mask


def kv_windows(model: Any) -> tuple[int | None, ...]:
    """The window of each of a model's KV-cache groups (None: full attention); one full-attention group
    for a model object that does not say (the tests' and benchmarks' stand-ins)."""
    return getattr(model, "kv_windows", (None,))


def _with_kv_groups(graph: Graph, groups: tuple[KVCacheGroup, ...]) -> Graph:
    """The graph with each KV-touching node's group index as its `kv_group` attr."""
    group_of = {layer: g for g, group in enumerate(groups) for layer in group.layers}
    return replace(graph, nodes=[
        Node(n.name, n.op, n.inputs, n.outputs, {**n.attrs, "kv_group": group_of[n.attrs["layer"]]}, n.params)
        if OPS[n.op].touches_kv_cache else n for n in graph.nodes])
