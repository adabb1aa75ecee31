"""optc's graph IR: a layer-level dataflow graph of `Node`s over named values, serialized as JSON.

What it is: the model config, graph inputs/outputs, nodes in execution order, and the tensor table
(logical name -> shape and storage format). What it is not: it holds no tensor data (that is the
TensorStore's) and knows nothing of kernels beyond the `kernel` attr `select_kernels` records
(`Node.kernel`: that attr, or `REFERENCE_KERNEL`, the op's torch reference in optc.core.ops).
"""

from __future__ import annotations

import copy
import json
import math
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

from optc.core.formats import Format

GRAPH_INPUTS = ("input_ids", "positions")
FULL_ATTENTION = "full_attention"  # a layer whose queries see every earlier key (transformers' layer type names)
SLIDING_ATTENTION = "sliding_attention"  # a layer whose queries see the last `sliding_window` keys, themselves included
LAYER_TYPES = (FULL_ATTENTION, SLIDING_ATTENTION)
HIDDEN_ACTS = ("silu", "gelu_tanh")  # the gated MLP's activation of its gate half
GRAPH_OUTPUTS = ("logits",)
REFERENCE_KERNEL = "torch"  # a node without a `kernel` attr runs its op's torch reference


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False
    rope_scaling: dict | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    dtype: str = "float32"  # activations between nodes (and the default KV cache dtype)
    # per-layer attention: () is every layer full; else one of LAYER_TYPES per layer
    layer_types: tuple[str, ...] = ()
    sliding_window: int | None = None  # keys a sliding layer's query sees, itself included
    local_rope_theta: float | None = None  # sliding layers' own unscaled rope base (Gemma 3); None: the global table
    rotary_dim: int | None = None  # leading dims of each head that rotate (partial rotary); None: all of head_dim
    hidden_act: str = "silu"  # one of HIDDEN_ACTS
    query_pre_attn_scalar: float | None = None  # attention scores scale by its -1/2 power; None: head_dim's
    attn_logit_softcap: float | None = None  # scores -> cap * tanh(scores / cap) before the mask
    final_logit_softcap: float | None = None  # logits -> cap * tanh(logits / cap)
    # Mixture of Experts: 0 experts is a dense model; else every layer's MLP is a `moe` block of
    # `num_experts` experts of `moe_intermediate_size`, `num_experts_per_tok` of them per token, but the
    # `dense_layers` (Qwen3-MoE's mlp_only_layers and decoder_sparse_step), whose MLP is dense of intermediate_size
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True  # the top-k routing weights renormalized to sum to 1 (Mixtral always)
    dense_layers: tuple[int, ...] = ()
    # DeepSeek-V2's MoE: shared experts (a dense gated MLP of this width, 0: none) added to the routed output;
    # routing weights times `routed_scaling_factor`; group-limited top-k when num_expert_groups > 1 (the top
    # `topk_groups` groups by their best expert's score, then top-k among their experts); the router in fp32
    shared_expert_intermediate_size: int = 0
    routed_scaling_factor: float = 1.0
    num_expert_groups: int = 1
    topk_groups: int = 1
    # Multi-head Latent Attention (DeepSeek-V2): kv_lora_rank > 0 makes every layer's attention an `mla_attention`
    # whose cache holds one latent (kv_lora_rank) + rope key (head_dim, transformers' qk_rope_head_dim) per token;
    # q_lora_rank 0 is a plain q_proj; heads read qk_nope_head_dim + head_dim query/key dims and v_head_dim values
    kv_lora_rank: int = 0
    q_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    v_head_dim: int = 0

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        object.__setattr__(self, "eos_token_ids", tuple(self.eos_token_ids))
        object.__setattr__(self, "layer_types", tuple(self.layer_types))
        object.__setattr__(self, "dense_layers", tuple(self.dense_layers))
        if self.layer_types and len(self.layer_types) != self.num_layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries for {self.num_layers} layers")
        unknown = sorted(set(self.layer_types) - set(LAYER_TYPES))
        if unknown:
            raise ValueError(f"layer types {unknown} are not supported; supported: {', '.join(LAYER_TYPES)}")
        if SLIDING_ATTENTION in self.layer_types and not (isinstance(self.sliding_window, int)
                                                          and self.sliding_window >= 1):
            raise ValueError(f"sliding layers need a sliding_window >= 1, got {self.sliding_window!r}")
        if self.rotary_dim is not None and not (0 < self.rotary_dim <= self.head_dim and self.rotary_dim % 2 == 0):
            raise ValueError(f"rotary_dim {self.rotary_dim} must be even and in 2..head_dim ({self.head_dim})")
        if self.hidden_act not in HIDDEN_ACTS:
            raise ValueError(f"hidden_act {self.hidden_act!r} is not supported; supported: {', '.join(HIDDEN_ACTS)}")
        if self.num_experts and not (1 <= self.num_experts_per_tok <= self.num_experts
                                     and self.moe_intermediate_size >= 1):
            raise ValueError(f"a MoE model needs 1 <= num_experts_per_tok ({self.num_experts_per_tok}) <= "
                             f"num_experts ({self.num_experts}) and moe_intermediate_size >= 1 "
                             f"({self.moe_intermediate_size})")
        if any(not 0 <= i < self.num_layers for i in self.dense_layers):
            raise ValueError(f"dense_layers {list(self.dense_layers)} name layers outside 0..{self.num_layers - 1}")
        if self.num_experts and (self.num_experts % self.num_expert_groups
                                 or not 1 <= self.topk_groups <= self.num_expert_groups):
            raise ValueError(f"num_experts {self.num_experts} must split into num_expert_groups "
                             f"{self.num_expert_groups} groups, 1 <= topk_groups ({self.topk_groups}) <= groups")
        if self.kv_lora_rank and (self.num_kv_heads != self.num_heads or self.layer_types
                                  or self.qk_nope_head_dim < 1 or self.v_head_dim < 1):
            raise ValueError("an MLA model needs num_kv_heads == num_heads, every layer full attention, "
                             "qk_nope_head_dim >= 1 and v_head_dim >= 1")

    def is_moe(self, layer: int) -> bool:
        """Whether a layer's MLP is a `moe` block (a MoE model's layer not in `dense_layers`)."""
        return self.num_experts > 0 and layer not in self.dense_layers

    @property
    def is_mla(self) -> bool:
        """Whether attention is Multi-head Latent Attention (a latent KV cache)."""
        return self.kv_lora_rank > 0

    @property
    def latent_dim(self) -> int:
        """Values one token holds in an MLA layer's cache: the latent and the rope key, one copy for all heads."""
        return self.kv_lora_rank + self.head_dim

    def layer_type(self, layer: int) -> str:
        return self.layer_types[layer] if self.layer_types else FULL_ATTENTION

    def window(self, layer: int) -> int | None:
        """The sliding window of a layer; None for a full-attention layer."""
        return self.sliding_window if self.layer_type(layer) == SLIDING_ATTENTION else None

    @property
    def attention_scale(self) -> float:
        if self.is_mla:  # a head's query/key: its no-rope and its rope dims; DeepSeek's yarn mscale squared
            rs = self.rope_scaling or {}
            scale = (self.qk_nope_head_dim + self.head_dim) ** -0.5
            factor, mscale_all_dim = rs.get("factor", 1.0), rs.get("mscale_all_dim", 0)
            if rs and mscale_all_dim and factor > 1:  # transformers' yarn_apply_mscale (yarn_mscale in core.rope)
                scale *= (0.1 * mscale_all_dim * math.log(factor) + 1.0) ** 2
            return scale
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def to_json(self) -> dict:
        d = asdict(self)
        d["eos_token_ids"] = list(self.eos_token_ids)
        d["layer_types"] = list(self.layer_types)
        d["dense_layers"] = list(self.dense_layers)
        return d

    @staticmethod
    def from_json(d: dict) -> ModelConfig:
        known = {f.name for f in fields(ModelConfig)}
        return ModelConfig(**{k: v for k, v in d.items() if k in known})


@dataclass(frozen=True)
class TensorInfo:
    shape: tuple[int, ...]
    format: Format

    def to_json(self) -> dict:
        return {"shape": list(self.shape), "format": self.format.to_json()}

    @staticmethod
    def from_json(d: dict) -> TensorInfo:
        return TensorInfo(tuple(d["shape"]), Format.from_json(d["format"]))


@dataclass
class Node:
    name: str
    op: str
    inputs: list[str]
    outputs: list[str]
    attrs: dict[str, Any] = field(default_factory=dict)
    params: dict[str, str] = field(default_factory=dict)  # role -> logical tensor name

    @property
    def kernel(self) -> str:
        """The implementation the node is bound to: a kernel name, or the op's torch reference."""
        return self.attrs.get("kernel", REFERENCE_KERNEL)

    def to_json(self) -> dict:
        return {
            "name": self.name,
            "op": self.op,
            "inputs": self.inputs,
            "outputs": self.outputs,
            "attrs": self.attrs,
            "params": self.params,
        }


@dataclass
class Graph:
    config: ModelConfig
    nodes: list[Node]
    tensors: dict[str, TensorInfo]
    inputs: tuple[str, ...] = GRAPH_INPUTS
    outputs: tuple[str, ...] = GRAPH_OUTPUTS

    def copy(self) -> Graph:
        """A deep copy of nodes and the tensor table; passes edit the copy, never their input."""
        return replace(self, nodes=copy.deepcopy(self.nodes), tensors=dict(self.tensors))

    def producers(self) -> dict[str, Node]:
        return {out: n for n in self.nodes for out in n.outputs}

    def consumers(self) -> dict[str, list[Node]]:
        users: dict[str, list[Node]] = {}
        for n in self.nodes:
            for v in n.inputs:
                users.setdefault(v, []).append(n)
        for v in self.outputs:
            users.setdefault(v, [])
        return users

    def node(self, name: str) -> Node:
        for n in self.nodes:
            if n.name == name:
                return n
        raise KeyError(f"no node named {name!r}")

    def used_tensors(self) -> list[str]:
        """Logical tensors referenced by nodes, in first-use order, each once."""
        return list(dict.fromkeys(t for n in self.nodes for t in n.params.values()))

    def to_json(self) -> dict:
        return {
            "config": self.config.to_json(),
            "inputs": list(self.inputs),
            "outputs": list(self.outputs),
            "nodes": [n.to_json() for n in self.nodes],
            "tensors": {k: self.tensors[k].to_json() for k in sorted(self.tensors)},
        }

    def dumps(self) -> str:
        return json.dumps(self.to_json(), indent=1, sort_keys=True) + "\n"

    @staticmethod
    def from_json(d: dict) -> Graph:
        nodes = [Node(**n) for n in d["nodes"]]
        tensors = {k: TensorInfo.from_json(v) for k, v in d["tensors"].items()}
        return Graph(ModelConfig.from_json(d["config"]), nodes, tensors, tuple(d["inputs"]), tuple(d["outputs"]))

    def text(self) -> str:
        """A readable dump: one line per node, `outs = op(ins) {attrs} [role=tensor:format]`."""
        lines = [f"graph({', '.join(self.inputs)}) -> {', '.join(self.outputs)}"]
        for n in self.nodes:
            attrs = ", ".join(f"{k}={v}" for k, v in n.attrs.items())
            params = ", ".join(
                f"{r}={t}:{self.tensors[t].format.kind.value}{list(self.tensors[t].shape)}"
                for r, t in n.params.items()
                if t in self.tensors
            )
            lines.append(
                f"  {', '.join(n.outputs)} = {n.op}({', '.join(n.inputs)})"
                + (f" {{{attrs}}}" if attrs else "")
                + (f" [{params}]" if params else "")
            )
        return "\n".join(lines) + "\n"
