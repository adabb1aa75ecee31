"""LoRA adapters at run time: `max_loras` slots of adapter factors beside a model's linears, and the names that
hold them.

`LoraSlots` holds, per linear an adapter may target (q/k/v/o/gate/up/down: optc/core/lora.py's TARGETS), the
factors of every slot stacked: a (S, R, K) and bt (S, R, N) (B transposed: what lora.cpp walks; `b` is its
(S, N, R) view), R = max_rank per projection the linear holds
(a fused qkv linear: 3 * max_rank), allocated at once when the model enables LoRA, so that a KV budget computed
from free memory afterwards counts them. The factors are float32, or bfloat16 on a model whose activations are
bfloat16 (as vLLM holds them in the model's dtype): a decode step's deltas cost the bytes of the factors its
adapters read, and halving them is what keeps a batch over several adapters near the base's speed (docs/PERF.md);
products and sums stay float32 either way. An adapter written for the separate q, k and v projections loads into a
fused qkv linear's slot as one factor pair: its projections' a rows one after the other, each projection's b in
its rows of the fused output and its own rank columns (zero elsewhere), so each delta lands in its slice; `parts`
(S, P, 2) int64 records per slot and projection its first column and rank, so that a kernel reads only those.
`apply` is the linear's post-step: the deltas of the step's rows (`Step.lora_slots`) added to the linear's outputs,
which stay the base kernel's (quantized or not): on the CPU by kernels/cpu_ext/lora.cpp's lora_add, the function
the fused CPU step calls for the linears of its runs (kernels/cpu_ext/step.py `attach_lora`), so both paths agree
bit for bit; on CUDA by kernels/lora_bgmv.py's Triton kernel; where neither runs (lora.cpp not built), by
optc/core/ops/lora.py's grouped matmuls over the step's `Step.lora_groups`.

`LoraNames` is the engine's side: adapter name -> slot, with the requests using each, so that an unloaded adapter
frees its slot only after its requests finish. Not here: reading and checking an adapter (optc/core/lora.py).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from optc.core.errors import InputError
from optc.core.ir import Graph
from optc.core.lora import TARGETS, AdapterError, LoraAdapter, linear_targets, load_adapter
from optc.core.ops.lora import lora_delta_grouped
from optc.kernels import cpu_ext
from optc.runtime.request import Request

FACTOR_DTYPES = {"bfloat16": torch.bfloat16}  # the activations' dtype -> the factors' (float32 otherwise)


@dataclass
class _Table:
    a: torch.Tensor  # (S, R, K) float32 or bfloat16 (FACTOR_DTYPES)
    bt: torch.Tensor  # (S, R, N): B transposed, the scaling folded in
    parts: torch.Tensor  # (S, P, 2) int64: per slot and split output, its first rank column and rank (0: none)
    ranks: list[int]  # per slot: the columns in use (0: no adapter of that slot targets this linear)
    offsets: list[int]  # per split output: its first row of the linear's output
    sizes: list[int]  # per split output: its rows

    @property
    def b(self) -> torch.Tensor:
        """(S, N, R): B as peft writes it (a view of bt)."""
        return self.bt.transpose(1, 2)


class LoraSlots:
    """Slot tables of `max_loras` adapters of rank <= max_rank over `graph`'s targetable linears."""

    def __init__(self, graph: Graph, max_loras: int, max_rank: int, device: torch.device) -> None:
        if max_loras < 1 or max_rank < 1:
            raise InputError(f"max_loras and max_lora_rank must be >= 1, got {max_loras} and {max_rank}")
        self.graph = graph
        # the C++ extension on the CPU (lora.cpp's lora_add; None where it cannot be built), the Triton kernel on CUDA
        self.kernel = cpu_ext.load() if device.type == "cpu" else TRITON if device.type == "cuda" else None
        self.max_loras, self.max_rank = max_loras, max_rank
        self.targets = linear_targets(graph)
        dtype = FACTOR_DTYPES.get(graph.config.dtype, torch.float32)
        self.tables: dict[str, _Table] = {}
        for node in graph.nodes:
            if node.op != "linear" or not any(o.rsplit(".", 1)[-1] in TARGETS for o in node.outputs):
                continue
            sizes = list(node.attrs.get("split") or [node.attrs["out_features"]])
            r, k, n = max_rank * len(sizes), node.attrs["in_features"], node.attrs["out_features"]
            offsets = [sum(sizes[:i]) for i in range(len(sizes))]
            self.tables[node.name] = _Table(torch.zeros(max_loras, r, k, dtype=dtype, device=device),
                                            torch.zeros(max_loras, r, n, dtype=dtype, device=device),
                                            torch.zeros(max_loras, len(sizes), 2, dtype=torch.int64, device=device),
                                            [0] * max_loras, offsets, sizes)

    @property
    def nbytes(self) -> int:
        return sum(t.a.nbytes + t.bt.nbytes + t.parts.nbytes for t in self.tables.values())

    def load(self, adapter: LoraAdapter, slot: int) -> None:
        """Write `adapter`'s factors into `slot` (every linear's columns of that slot are rewritten)."""
        if adapter.rank > self.max_rank:
            raise AdapterError(f"{adapter.path}: rank {adapter.rank} is above the maximum rank {self.max_rank} "
                               "(--max-lora-rank)")
        self.clear(slot)
        by_node: dict[str, list] = {}
        for module, (a, b) in adapter.factors.items():
            target = self.targets.get(module)
            if target is None or target.node not in self.tables:
                raise AdapterError(f"{adapter.path}: {module} is not a linear of this model adapters may target")
            by_node.setdefault(target.node, []).append((target.index, target, a, b))
        for node, parts in by_node.items():
            table, col = self.tables[node], 0
            # in split order: the columns of a fused linear's projections follow its rows
            for _, target, a, b in sorted(parts, key=lambda p: p[0]):
                r = a.shape[0]
                table.a[slot, col:col + r] = a
                table.bt[slot, col:col + r, target.offset:target.offset + target.rows] = b.T
                table.parts[slot, target.index] = torch.tensor([col, r])
                col += r
            table.ranks[slot] = col

    def clear(self, slot: int) -> None:
        for table in self.tables.values():
            table.a[slot].zero_()
            table.bt[slot].zero_()
            table.parts[slot].zero_()
            table.ranks[slot] = 0

    def apply(self, name: str, x: torch.Tensor, outputs: list[torch.Tensor], slots: torch.Tensor,
              groups: list[tuple[int, torch.Tensor]] | None) -> list[torch.Tensor]:
        """Linear `name`'s outputs (its split outputs) plus the deltas of its input rows x (T, K) under `slots` (T,):
        lora.cpp's lora_add in place where `kernel` is loaded, else one adapter's rows at a time over `groups`
        (`lora_delta_grouped`), the sum rounded once to the outputs' dtype either way."""
        table = self.tables[name]
        if self.kernel is not None:
            self.kernel.lora_add(x, outputs, slots, table.a, table.bt, table.parts)
            return outputs
        if not any(table.ranks[slot] for slot, _ in groups):
            return outputs
        delta = lora_delta_grouped(x, groups, table.a, table.b, table.ranks)  # (T, N) float32
        return [(y.float() + delta[:, o:o + n]).to(y.dtype)
                for y, o, n in zip(outputs, table.offsets, table.sizes, strict=True)]


class _Triton:
    """kernels/lora_bgmv.py behind lora.cpp's call (it reads a slot's every column: no `parts`)."""

    @staticmethod
    def lora_add(x, outs, slots, a, bt, parts) -> None:
        from optc.kernels.lora_bgmv import lora_add

        lora_add(x, outs, slots, a, bt)


TRITON = _Triton()


class LoraNames:
    """The engine's adapters: name -> slot of the model's LoraSlots, the names being unloaded, and the requests."""

    def __init__(self, tables: LoraSlots) -> None:
        self.tables = tables
        self.slots: dict[str, int] = {}
        self.adapters: dict[str, LoraAdapter] = {}
        self.unloading: set[str] = set()

    def names(self) -> list[str]:
        """The adapters requests may name now."""
        return sorted(set(self.slots) - self.unloading)

    def load(self, name: str, path: str | Path) -> LoraAdapter:
        """Read the adapter in folder `path` and write it into a free slot under `name` (AdapterError naming its
        file and tensor; InputError when the name is taken or every slot is held)."""
        if name in self.slots:
            raise InputError(f"an adapter named {name!r} is loaded already", "lora_name")
        free = [s for s in range(self.tables.max_loras) if s not in set(self.slots.values())]
        if not free:
            raise InputError(f"all {self.tables.max_loras} adapter slots are in use (--max-loras); unload one "
                             "first", "lora_name")
        adapter = load_adapter(path, self.tables.graph, name, self.tables.max_rank)
        self.tables.load(adapter, free[0])
        self.slots[name], self.adapters[name] = free[0], adapter
        return adapter

    def assign(self, request: Request, name: str) -> None:
        """Run `request` under adapter `name`: its slot, and its prefix-cache key (the name and weights' hash)."""
        if name not in self.slots or name in self.unloading:
            raise UnknownAdapterError(f"the model {name!r} does not exist (loaded adapters: "
                                      f"{', '.join(self.names()) or 'none'})", "model")
        request.lora_name, request.lora_slot = name, self.slots[name]
        request.lora_key = f"lora:{name}:{self.adapters[name].sha256}".encode()

    def unload(self, name: str) -> None:
        """No request may name `name` from now on; its slot is freed by `release` once its requests finish."""
        if name not in self.slots or name in self.unloading:
            raise UnknownAdapterError(f"the model {name!r} does not exist (loaded adapters: "
                                      f"{', '.join(self.names()) or 'none'})", "lora_name")
        self.unloading.add(name)

    def release(self, pending: Iterable[Request]) -> None:
        """Free the slots of the adapters being unloaded that none of the `pending` requests runs under."""
        in_use = {r.lora_name for r in pending}
        for name in [n for n in self.unloading if n not in in_use]:
            self.tables.clear(self.slots.pop(name))
            del self.adapters[name]
            self.unloading.discard(name)


class UnknownAdapterError(InputError):
    """A request names an adapter that is not loaded (the server answers 404, as OpenAI does an unknown model)."""
