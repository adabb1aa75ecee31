"""Runtime settings: the typed home of what a recipe's `runtime:` section, an artifact's manifest
and the engine's `EngineConfig` say about serving, one name per concept.

- `max_num_seqs`: requests per step (the scheduler's batch);
- `SpeculativeConfig.disable_above_num_requests`: the speculation cut-off, a step with more running
  requests than this does not speculate;
- `CUDA_GRAPH_BATCH_SIZES`: the default decode buckets the `cuda_graphs` pass plans; the largest
  bucket an engine captures is its graph config's `max_capture_size`;
- `tensor_parallel_size`: ranks the model is split over (runtime/distributed.py), one per GPU; the KV
  budget (`kv_cache_memory`, `gpu_memory_utilization`) is each rank's;
- `pipeline_parallel_size`: stages its layers are cut into (runtime/pipeline.py), each stage over
  `tensor_parallel_size` ranks: P x T ranks in all.

This module imports neither the recipe nor the runtime: both import it. Not here: the KV cache's
layout (optc/core/kv_cache.py) or options of the compiler passes.
"""

from __future__ import annotations

import enum
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from optc.core.errors import InputError

# decode batch sizes captured as CUDA graphs: the cuda_graphs pass's default plan
CUDA_GRAPH_BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64)
MAX_SPECULATIVE_TOKENS = 16
# Defaults measured with benchmarks/speculative.py on SmolLM2 (docs/PERF.md): one more query token
# costs ~token_cost of a decode step at batch 1; draft tokens also cost the draft's own step.
DEFAULT_DISABLE_ABOVE_NUM_REQUESTS = 4
# an EAGLE draft tree (`eagle-tree:D:TOPK:NODES`): its verification rows are the request's last token and the
# nodes, one bit each in the tree attention's int64 mask (kernels/cpu_ext/ops.py MAX_TREE_NODES)
TREE = "eagle-tree"
MAX_TREE_NODES = 63
MAX_TREE_TOP_K = 8
# SmolLM2 bf16 at 2 threads on cpu.bf16dot (AVX-512 and capped to AVX2 alike), batch 1 (docs/PERF.md, 2026-11-27):
# a verification row 0.09-0.19 of a decode step, an EAGLE head step (bfloat16 on bf16dot) 0.06, the int4 RTN
# draft's forward 0.6 (6.7 against 11.3 ms) plus its row
DEFAULT_TOKEN_COST = {"ngram": 0.15, "draft": 0.7, "eagle": 0.21}
# an EAGLE tree of depth d and n nodes costs 1 + TREE_NODE_COST * n + TREE_DEPTH_COST * d decode steps (times
# token_cost / eagle's default): a verification row per node, a head forward per depth (its expanded nodes at once)
TREE_NODE_COST = 0.2
TREE_DEPTH_COST = 0.09


@dataclass(frozen=True)
class RuntimeSettings:
    """Engine defaults an artifact carries (the recipe's `runtime:` section, the manifest's `runtime`)."""

    max_num_seqs: int = field(default=64, metadata={"min": 1, "help": "max requests per step"})
    max_seq_len: int | None = field(default=None, metadata={"min": 1, "help": "context limit; default: the model's"})
    gpu_memory_utilization: float = field(
        default=0.9, metadata={"gt": 0.0, "max": 1.0, "help": "share of GPU memory for weights + KV"}
    )
    kv_cache_memory: int | None = field(
        default=None, metadata={"min": 1, "help": "KV pool bytes (target and draft together); default: from memory"})
    max_num_batched_tokens: int = field(default=2048, metadata={"min": 1, "help": "token budget per step"})
    speculative: str | None = field(
        default=None,
        metadata={"help": "default speculative decoding: ngram[:K], draft:PATH[:K], eagle[:K] (the artifact's "
                          "trained draft head; K draft tokens, 1..16) or eagle-tree:D:TOPK:NODES (that head's "
                          "draft trees: see --speculative)"},
    )
    tensor_parallel_size: int = field(
        default=1, metadata={"min": 1, "help": "ranks the model is split over (tensor parallelism, one per GPU)"})
    pipeline_parallel_size: int = field(
        default=1, metadata={"min": 1, "help": "stages the model's layers are cut into (pipeline parallelism), "
                                               "each over tensor_parallel_size ranks"})

    def __post_init__(self) -> None:
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise InputError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        for name in ("tensor_parallel_size", "pipeline_parallel_size"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise InputError(f"{name} must be an integer >= 1, got {getattr(self, name)!r}")

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @staticmethod
    def from_json(d: dict[str, Any]) -> RuntimeSettings:
        """The manifest's section; one of schema 2 names requests per step `max_batch_size`."""
        d = dict(d)
        if "max_batch_size" in d:
            d["max_num_seqs"] = d.pop("max_batch_size")
        return RuntimeSettings(**d)


class SpeculativeMethod(enum.StrEnum):
    NGRAM = "ngram"  # prompt lookup: continue an earlier occurrence of the tokens' suffix
    DRAFT = "draft"  # a second, cheaper artifact with the same tokenizer
    EAGLE = "eagle"  # the artifact's own draft head over the target's features (passes/train_draft_head.py)


@dataclass(frozen=True)
class SpeculativeConfig:
    method: SpeculativeMethod | str
    num_speculative_tokens: int = 4  # k: drafts per request per step (the most; adaptive picks fewer)
    draft: Path | str | None = None  # the draft artifact (method draft)
    prompt_lookup_min: int = 2  # n-gram sizes tried, longest first
    prompt_lookup_max: int = 4
    disable_above_num_requests: int = DEFAULT_DISABLE_ABOVE_NUM_REQUESTS  # more running requests: no drafts
    adaptive: bool = True  # pick k per request from its acceptance rate
    token_cost: float | None = None  # step cost of one speculative token / a decode step; None = measured default
    # eagle only: draft a tree (runtime/eagle.py) of depth num_speculative_tokens, expanding the tree_top_k most
    # probable nodes of each depth into their tree_top_k most probable children, and verify its tree_num_nodes
    # most probable nodes; None: a chain of num_speculative_tokens drafts
    tree_top_k: int | None = None
    tree_num_nodes: int | None = None

    def __post_init__(self) -> None:
        allowed = ", ".join(m.value for m in SpeculativeMethod)
        try:
            object.__setattr__(self, "method", SpeculativeMethod(self.method))
        except ValueError:
            raise InputError(f"unknown speculative method {self.method!r}; allowed: {allowed}") from None
        k = self.num_speculative_tokens
        if not isinstance(k, int) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise InputError(f"num_speculative_tokens must be in 1..{MAX_SPECULATIVE_TOKENS}, got {k!r}")
        if self.method is SpeculativeMethod.DRAFT and self.draft is None:
            raise InputError("speculative method draft needs a draft artifact: draft:PATH[:K]")
        if self.method is not SpeculativeMethod.DRAFT and self.draft is not None:
            raise InputError(f"speculative method {self.method.value} takes no draft artifact, got {self.draft}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise InputError(
                f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got {self.prompt_lookup_min} and "
                f"{self.prompt_lookup_max}"
            )
        if self.disable_above_num_requests < 1:
            raise InputError(f"speculative disable_above_num_requests must be >= 1, got "
                             f"{self.disable_above_num_requests}")
        if self.token_cost is not None and self.token_cost < 0:
            raise InputError(f"speculative token_cost must be >= 0, got {self.token_cost}")
        if (self.tree_top_k is None) != (self.tree_num_nodes is None):
            raise InputError("a speculative tree needs both tree_top_k and tree_num_nodes")
        if self.tree_top_k is not None:
            if self.method is not SpeculativeMethod.EAGLE:
                raise InputError(f"speculative method {self.method.value} drafts chains only; trees: eagle-tree")
            if not 1 <= self.tree_top_k <= MAX_TREE_TOP_K or not 1 <= self.tree_num_nodes <= MAX_TREE_NODES:
                raise InputError(f"a speculative tree needs TOPK in 1..{MAX_TREE_TOP_K} and NODES in "
                                 f"1..{MAX_TREE_NODES}, got {self.tree_top_k} and {self.tree_num_nodes}")

    @property
    def is_tree(self) -> bool:
        return self.tree_top_k is not None

    @property
    def cost(self) -> float:
        return self.token_cost if self.token_cost is not None else DEFAULT_TOKEN_COST[self.method.value]

    @classmethod
    def parse(cls, text: str) -> SpeculativeConfig:
        """`ngram[:K]`, `draft:PATH[:K]`, `eagle[:K]` or `eagle-tree:D:TOPK:NODES` (the --speculative option)."""
        method, _, rest = text.partition(":")
        if method == TREE:
            fields = rest.split(":")
            if len(fields) != 3 or not all(f.isdigit() for f in fields):
                raise InputError(f"--speculative {text!r}: expected {TREE}:D:TOPK:NODES with integers")
            depth, top_k, num_nodes = map(int, fields)
            return cls(SpeculativeMethod.EAGLE, depth, tree_top_k=top_k, tree_num_nodes=num_nodes)
        if method in (SpeculativeMethod.NGRAM, SpeculativeMethod.EAGLE):
            if rest and not rest.isdigit():
                raise InputError(f"--speculative {text!r}: expected {method}[:K] with K an integer")
            return cls(method, int(rest) if rest else 4)
        if method == SpeculativeMethod.DRAFT:
            path, _, k = rest.rpartition(":")
            if not (path and k.isdigit()):
                path, k = rest, ""
            if not path:
                raise InputError(f"--speculative {text!r}: expected draft:PATH[:K]")
            return cls(method, int(k) if k else 4, draft=path)
        return cls(method)  # raises: unknown method

    def describe(self) -> str:
        """The --speculative spelling of this config."""
        if self.method is SpeculativeMethod.DRAFT:
            return f"draft:{self.draft}:{self.num_speculative_tokens}"
        if self.is_tree:
            return f"{TREE}:{self.num_speculative_tokens}:{self.tree_top_k}:{self.tree_num_nodes}"
        return f"{self.method.value}:{self.num_speculative_tokens}"
