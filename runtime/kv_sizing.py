"""How many KV blocks the engine allocates: from an explicit byte budget, from free GPU memory after
profiling one full-budget step, or (on the CPU) from what the configured requests can use.

One budget serves every model the engine runs: with a speculative draft model, the target's and
the draft's pools hold the same number of blocks (a request's blocks in both), so a block costs
the sum of the models' bytes per block and the two pools together stay within the budget. The pool
always has the null block (block 0) on top of the budget's blocks. A block holds one layer per slot
of a model's KV-cache groups (optc/core/kv_cache.py), and a request holds blocks in every group: a
full-attention group one per `block_size` tokens, a sliding-window group at most its window and one
step's tokens (what the CPU default counts per request). Not here: allocating the caches
(the model does, from its KV spec) or handing blocks out (the BlockPool does).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from optc.core.errors import UserError
from optc.runtime.batch import ForwardBatch
from optc.runtime.kv_cache_manager import max_request_blocks
from optc.runtime.model import kv_windows

DEFAULT_CPU_KV_CACHE_MEMORY = 1 << 30  # upper bound of the CPU default pool, bytes


def num_kv_blocks(models: Sequence[Any], config: Any, max_model_len: int) -> int:
    """Blocks of each model's KV pool (null block included) for an EngineConfig `config`; `models[0]`
    is the target (its device, its profiled step), the others share the budget block for block."""
    model = models[0]
    bytes_per_block = sum(m.kv_bytes_per_block(config.block_size) for m in models)
    device = torch.device(model.device)
    if config.kv_cache_memory is not None:
        budget = config.kv_cache_memory
    elif device.type == "cuda":
        activation_bytes = profile_activation_bytes(model, config, max_model_len)
        free, total = torch.cuda.mem_get_info(device)
        budget = int(total * config.gpu_memory_utilization) - (total - free) - activation_bytes
    else:
        blocks_per_request = max(max_request_blocks(kv_windows(m), -(-max_model_len // config.block_size),
                                                    config.block_size, config.max_num_batched_tokens) for m in models)
        wanted = config.max_num_seqs * blocks_per_request * bytes_per_block
        budget = min(DEFAULT_CPU_KV_CACHE_MEMORY, wanted)
    num_blocks = budget // bytes_per_block + 1
    if num_blocks < 2:
        raise UserError(
            f"the KV pool budget of {budget} bytes is less than one block ({bytes_per_block} bytes); "
            "raise kv_cache_memory or gpu_memory_utilization"
        )
    return int(num_blocks)


def profile_activation_bytes(model: Any, config: Any, max_model_len: int) -> int:
    """Peak CUDA memory of one full-budget step, run on a throwaway 1-block cache (every token
    written to block 0), so the KV pool leaves room for it."""
    device = torch.device(model.device)
    num_tokens = min(config.max_num_batched_tokens, max_model_len)
    size = config.block_size
    caches = model.allocate_kv_caches(1, size)
    num_groups = len(kv_windows(model))
    batch = ForwardBatch.build([[0] * num_tokens], [0], [[0] * (-(-num_tokens // size) * num_groups)], size,
                               num_groups=num_groups)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    if getattr(model, "kv_layers", None) is not None:  # a pipeline stage: some layers (runtime/pipeline.py)
        # what it receives from the stage before is zeros here
        hidden = model.graph.config.hidden_size
        received = {v: torch.zeros((num_tokens, hidden), dtype=model.dtype, device=device) for v in model.receives}
        model.run_stage(batch.to(device), caches, received)
    else:
        model.forward(batch.to(device), caches)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before
    del caches
    torch.cuda.empty_cache()
    return int(peak)
