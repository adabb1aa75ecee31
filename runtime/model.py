"""Model: an artifact's graph bound to kernels on a device; one forward step over a ForwardBatch.

It owns the weights and the rope table, not the KV cache: the caller allocates the per-layer caches
(`allocate_kv_caches`) and passes them to every `forward`.
"""

from __future__ import annotations

import torch

from optc.execute import Executor, Impl, Step, bind_params
from optc.formats import DTYPES
from optc.ir import Graph
from optc.rope import cos_sin_table
from optc.runtime.batch import ForwardBatch
from optc.store import TensorStore


class Model:
    def __init__(
        self,
        graph: Graph,
        store: TensorStore,
        device: str | torch.device = "cpu",
        kv_dtype: str | None = None,
        impls: dict[str, Impl] | None = None,
    ):
        c = graph.config
        self.graph = graph
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:  # as tensors report it: no re-move per step
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.executor = Executor(graph, bind_params(graph, store, self.device), impls)
        self.num_layers, self.num_kv_heads, self.head_dim = c.num_layers, c.num_kv_heads, c.head_dim
        self.vocab_size = c.vocab_size
        self.max_position_embeddings = c.max_position_embeddings
        self.eos_token_ids = list(c.eos_token_ids)
        self.dtype = DTYPES[c.dtype]
        self.kv_dtype = DTYPES[kv_dtype] if kv_dtype else self.dtype
        self.cos_sin = cos_sin_table(c, c.max_position_embeddings).to(self.device)

    def kv_bytes_per_block(self, block_size: int) -> int:
        return self.num_layers * 2 * block_size * self.num_kv_heads * self.head_dim * self.kv_dtype.itemsize

    def allocate_kv_caches(self, num_blocks: int, block_size: int) -> list[torch.Tensor]:
        shape = (num_blocks, 2, block_size, self.num_kv_heads, self.head_dim)
        return [torch.zeros(shape, dtype=self.kv_dtype, device=self.device) for _ in range(self.num_layers)]

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, kv_caches: list[torch.Tensor]) -> torch.Tensor:
        """float32 logits (len(batch.logits_indices), vocab) for the batch's selected rows."""
        if batch.input_ids.device != self.device:
            batch = batch.to(self.device)
        step = Step(batch.positions, batch, self.cos_sin, batch.logits_indices, kv_caches)
        return self.executor.run(batch.input_ids, step)["logits"]
