"""Run a graph one decoder block at a time on calibration tokens: what the calibrated quantization
passes (AWQ, GPTQ) share.

A block is the run of consecutive nodes whose `layer` attribute is i (set by the model family's graph
template, kept by the passes); the nodes before the first block (the embedding) are its prefix.
`BlockRunner` keeps only the values that cross a block boundary, so peak memory is about one
block's activations and weights. All computation is fp32, whatever the
stored dtype: quantization statistics must not overflow (SmolLM2's residual channels reach
~25,000). Weights are the ops' torch references over `Param`s, so a block that uses quantized
parts computes exactly what the artifact will.

Not here: choosing what to quantize and how (the passes), or writing the artifact.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from optc.core.errors import InputError
from optc.core.execute import dense_step
from optc.core.formats import DENSE_F32, Format, part_name
from optc.core.ir import Graph, Node, TensorInfo
from optc.core.ops import OPS, Param
from optc.core.store import Entry, TensorStore, transformed
from optc.frontend.quant.awq import fold_into_linear, fold_into_norm

NORMS = ("rms_norm", "add_rms_norm")


@dataclass(frozen=True)
class Block:
    index: int
    nodes: list[Node]
    outputs: list[str]  # values defined in the block and read after it


def split_blocks(graph: Graph) -> tuple[list[Node], list[Block]]:
    """-> (prefix nodes, blocks in order). Nodes after the last block are not returned."""
    prefix: list[Node] = []
    groups: list[tuple[int, list[Node]]] = []
    for node in graph.nodes:
        layer = node.attrs.get("layer")
        if layer is None:
            if groups:
                break
            prefix.append(node)
        elif groups and groups[-1][0] == layer:
            groups[-1][1].append(node)
        else:
            groups.append((layer, [node]))
    blocks = []
    for i, (index, nodes) in enumerate(groups):
        later = {v for _, ns in groups[i + 1:] for n in ns for v in n.inputs}
        later |= {v for n in graph.nodes[graph.nodes.index(nodes[-1]) + 1:] for v in n.inputs} | set(graph.outputs)
        blocks.append(Block(index, nodes, [v for n in nodes for v in n.outputs if v in later]))
    return prefix, blocks


def linear_groups(nodes: Iterable[Node]) -> list[list[Node]]:
    """Linear nodes grouped by their input value, in order of first appearance."""
    groups: dict[str, list[Node]] = {}
    for n in nodes:
        if n.op == "linear":
            groups.setdefault(n.inputs[0], []).append(n)
    return list(groups.values())


def branch(nodes: list[Node], x: str) -> tuple[list[Node], str | None]:
    """The nodes computable from value x (and positions) alone, and the one value of them read by a
    node outside (the residual branch's output: o_proj for q/k/v, down_proj for gate/up); None when
    there is not exactly one."""
    known = {x, "positions"}
    inside = []
    for n in nodes:
        if all(v in known for v in n.inputs):
            inside.append(n)
            known.update(n.outputs)
    produced = {v for n in inside for v in n.outputs}
    read_outside = {v for n in nodes if n not in inside for v in n.inputs if v in produced}
    return inside, (read_outside.pop() if len(read_outside) == 1 else None)


def dense_param(t: torch.Tensor) -> Param:
    return Param({"weight": t.float()}, DENSE_F32)


class BlockRunner:
    """Calibration activations flowing through the graph, one block at a time (fp32), on `device`:
    the activations that cross block boundaries and the weights of the block being loaded live
    there; the store stays on the host (and a block's results are spilled from there), so a GPU holds one block at
    a time."""

    def __init__(self, graph: Graph, store: TensorStore, tokens: torch.Tensor, device: torch.device | str = "cpu"):
        self.graph = graph
        self.store = store
        self.device = torch.device(device)
        self.num_seqs, self.seq_len = tokens.shape
        self.step = dense_step(graph, self.num_seqs, self.seq_len, device=self.device, dtype=torch.float32)
        self.env: dict[str, torch.Tensor] = {"input_ids": tokens.reshape(-1).to(self.device),
                                             "positions": self.step.positions}

    def load(self, nodes: Iterable[Node]) -> dict[str, Param]:
        """Params of the nodes' tensors: dense ones as fp32, quantized ones as stored."""
        params = {}
        for n in nodes:
            for name in n.params.values():
                info = self.graph.tensors[name]
                fmt = info.format
                parts = {r: self.store.get(part_name(name, r, fmt)).to(self.device)
                         for r in fmt.part_shapes(info.shape)}
                params[name] = dense_param(parts["weight"]) if not fmt.is_quantized else Param(parts, fmt)
        return params

    def first(self, num_seqs: int) -> tuple[int, object]:
        """(rows, Step) of the first `num_seqs` calibration windows: a cheaper batch for searches."""
        num_seqs = min(num_seqs, self.num_seqs)
        if num_seqs == self.num_seqs:
            return num_seqs * self.seq_len, self.step
        return num_seqs * self.seq_len, dense_step(self.graph, num_seqs, self.seq_len, device=self.device,
                                                   dtype=torch.float32)

    def run(self, nodes: list[Node], params: dict[str, Param], env: dict[str, torch.Tensor] | None = None,
            until: str | None = None, step=None) -> dict[str, torch.Tensor]:
        """Execute nodes over a copy of `env` (default: the runner's); stop once `until` is computed.
        `step` (default: all windows) must match the rows of `env`."""
        env = dict(self.env if env is None else env)
        step = step or self.step
        for n in nodes:
            if until is not None and until in env:
                break
            if not all(v in env for v in n.inputs):
                continue
            outs = OPS[n.op].ref(n, [env[v] for v in n.inputs], {r: params[t] for r, t in n.params.items()}, step)
            env.update(zip(n.outputs, outs, strict=True))
        return env

    def advance(self, nodes: list[Node], params: dict[str, Param], keep: list[str]) -> None:
        """Run nodes and keep only the values read later (plus the graph inputs)."""
        env = self.run(nodes, params)
        self.env = {v: env[v] for v in ("input_ids", "positions", *keep)}


@dataclass(frozen=True)
class FoldTarget:
    """Where 1/s of a linear group's input folds: a norm's weight (`rows` None; it weighs by `offset` + w,
    so w becomes (offset + w) / s - offset) or `rows` of the linear producing the input."""

    tensor: str
    rows: slice | None = None
    offset: float = 0.0

    def fold(self, weight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        """The target's weight (fp32) with 1/s folded in."""
        if self.rows is None:
            return fold_into_norm(weight, scales, self.offset)
        return fold_into_linear(weight, scales, self.rows)


def fold_target(graph: Graph, nodes: list[Node], x: str) -> FoldTarget | None:
    """Where 1/s of input value x can be folded: its norm, or rows of a linear before it."""
    producers = {o: n for n in graph.nodes for o in n.outputs}
    p = producers.get(x)
    if p is None:
        return None
    if p.op in NORMS and p.outputs[0] == x and not p.attrs.get("head_dim"):
        return FoldTarget(p.params["weight"], offset=p.attrs.get("offset", 0.0))
    if p.op == "gated_act":  # act(g) * (u / s) = (act(g) * u) / s: fold into the up rows
        return _linear_rows(producers, p.inputs[1])
    if p.op == "attention":  # o_proj: fold into v rows only when every head has its own v (no GQA)
        if p.attrs["num_heads"] != p.attrs["num_kv_heads"]:
            return None
        return _linear_rows(producers, p.inputs[2])
    return None


def _linear_rows(producers: dict[str, Node], value: str) -> FoldTarget | None:
    lin = producers.get(value)
    if lin is None or lin.op != "linear" or "bias" in lin.params:
        return None
    split = lin.attrs.get("split") or [lin.attrs["out_features"]]
    j = lin.outputs.index(value)
    return FoldTarget(lin.params["weight"], slice(sum(split[:j]), sum(split[:j + 1])))


def apply(graph: Graph, store: TensorStore, quantized: dict[str, tuple[Format, dict[str, torch.Tensor | Entry]]],
          dense: dict[str, torch.Tensor | Entry]) -> tuple[Graph, TensorStore]:
    """New graph and store with `quantized` tensors in their formats and `dense` tensors replaced (each given as a
    tensor or as a store entry: a spilled one)."""
    graph = graph.copy()
    entries: dict[str, Entry] = {}
    remove = []
    for name, (fmt, parts) in quantized.items():
        old = graph.tensors[name]
        remove += [part_name(name, r, old.format) for r in old.format.part_shapes(old.shape)]
        graph.tensors[name] = TensorInfo(old.shape, fmt)
        entries.update({part_name(name, r, fmt): _entry(t) for r, t in parts.items()})
    for name, t in dense.items():
        info = graph.tensors[name]
        entries[part_name(name, "weight", info.format)] = _entry(t, info.format.torch_dtype)
    return graph, store.with_entries(entries, remove=[k for k in remove if k not in entries])


def _entry(t: torch.Tensor | Entry, dtype: torch.dtype | None = None) -> Entry:
    """A store entry for a tensor or an entry, in `dtype` (default: its own)."""
    if isinstance(t, torch.Tensor):
        return tensor_entry(t if dtype is None else t.to(dtype))
    return t if dtype in (None, t.dtype) else transformed(t, lambda x: x.to(dtype), dtype=dtype)


def tensor_entry(t: torch.Tensor) -> Entry:
    """A store entry holding `t` (moved to the host)."""
    t = t.cpu()  # the same tensor when it is on the CPU already
    return Entry(tuple(t.shape), t.dtype, lambda t=t: t)


def start_calibration(graph: Graph, store: TensorStore, ctx, pass_name: str) -> tuple[BlockRunner, list[Block]]:
    """The calibration tokens run through the nodes before the first block; the blocks to process in order."""
    prefix, blocks = split_blocks(graph)
    runner = BlockRunner(graph, store, calibration_tokens(ctx, pass_name), getattr(ctx, "device", "cpu"))
    runner.advance(prefix, runner.load(prefix), [v for n in prefix for v in n.outputs])
    return runner, blocks


def calibration_tokens(ctx, pass_name: str) -> torch.Tensor:
    """The PassContext's calibration windows (samples, seq_len), or an error that says how to get them."""
    if ctx.calibration_tokens is None:
        raise InputError(f"{pass_name} needs calibration data: set `calibration:` in the recipe "
                         "(source, samples, seq_len, seed)")
    return ctx.calibration_tokens()


def progress(ctx, items, desc: str):
    """tqdm over items when the context shows progress bars, else the items."""
    if not getattr(ctx, "show_progress_bars", False):
        return items
    from tqdm import tqdm

    return tqdm(items, desc=desc, unit="block", leave=False)
