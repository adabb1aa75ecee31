"""The engine `optc serve` runs, from its options: loaded in the serving process, or in each Ray Serve replica
(runtime/server/replicas.py), the same way."""

from __future__ import annotations

from typing import Any

from optc.core.lora import DEFAULT_MAX_RANK, adapter_rank
from optc.runtime.config import PARALLEL_OPTIONS
from optc.runtime.engine import Engine


def load_engine(options: Any) -> Engine:
    """The Engine `options` (runtime.server.ServeOptions) describe, with its --lora adapters (a bad adapter: its
    AdapterError, exit 2)."""
    names = ("max_num_seqs", *PARALLEL_OPTIONS)
    overrides = {n: getattr(options, n) for n in names if getattr(options, n) is not None}
    overrides |= _lora_overrides(options)
    engine = Engine.load(options.artifact, device=options.device, verify=options.verify,
                         chat_template=options.chat_template, **overrides)
    for name, folder in options.loras:  # a bad adapter fails the load: its AdapterError names it (exit 2)
        engine.load_lora(name, folder)
    return engine


def _lora_overrides(options: Any) -> dict:
    """The engine's max_loras and max_lora_rank: slots for every --lora, of their largest rank, unless given."""
    max_loras = len(options.loras) if options.max_loras is None else options.max_loras
    if not max_loras:
        return {}
    rank = options.max_lora_rank or max((adapter_rank(folder) for _, folder in options.loras), default=DEFAULT_MAX_RANK)
    return {"max_loras": max_loras, "max_lora_rank": rank}
