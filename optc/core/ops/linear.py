"""The ops that read a weight matrix: `embedding` (a row lookup), `linear` and `lm_head` (x @ W^T).

The matmul reference is optc.core.formats.linear_ref for every weight format (dense, int8_wo, int4_g):
W is dequantized in x's dtype before the matmul; the Triton w4a16 / w8a16 launchers share its
signature. A linear with a `split` attr is the fusion of sibling linears: its output is split
along features into the siblings' outputs. `lm_head` computes the logits of the step's selected
rows only, in float32 (`logits_ref`: never rounded to a 16-bit activation dtype where it matters).

Two attributes of the families beyond Llama live in the adapters, so every implementation gets them:
an embedding's `scale` (Gemma's sqrt(hidden), rounded to the activation dtype and multiplied in it, as
transformers does) and an lm_head's `softcap` (Gemma 2's final logit soft-capping, logits ->
softcap * tanh(logits / softcap) in float32; monotonic, so the exactly recomputed best rows stay best).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from optc.core.formats import Format, dequantize, linear_ref
from optc.core.ir import ModelConfig, Node
from optc.core.ops.spec import OpSpec, matmul_rows, vocab_weight

# logits recomputed exactly per row: the greedy token is the float32 argmax unless more than this
# many logits lie within 16-bit rounding of the row's maximum (a tie that wide is a tie)
EXACT_TOP_LOGITS = 16


def logits_ref(x: torch.Tensor, parts: dict[str, torch.Tensor], fmt: Format) -> torch.Tensor:
    """float32 logits x @ W^T, accumulated in fp32 and not rounded to x's dtype at the top.

    A bfloat16 matmul rounds its output to bfloat16: at |logit| ~ 20 one step is 0.125, about the
    gap between the two best tokens of many real prompts, so near-ties become exact ties that argmax
    breaks by token id, and two CPUs whose kernels round the hidden states differently answer
    differently (docs/PERF.md, "bf16 on AVX2 CPUs"). The whole product in float32 costs ~10x on the
    CPU (the weight cast), so the matmul in x's dtype ranks the vocabulary and the EXACT_TOP_LOGITS best of
    each row are recomputed in fp32 from x and their weight rows. No host sync: CUDA graphs capture it.
    """
    # x: (M, K) -> (M, V) float32
    return exact_top_logits(linear_ref(x, parts, fmt).float(), x, parts, fmt)


def exact_top_logits(logits: torch.Tensor, x: torch.Tensor, parts: dict[str, torch.Tensor],
                     fmt: Format, top_k=None) -> torch.Tensor:
    """`logits` (M, V) float32, computed by any matmul in x's dtype, with each row's EXACT_TOP_LOGITS
    largest recomputed in fp32 from x and the weight's stored `parts` (the lm_head kernels share
    logits_ref's rounding this way). float32 x: `logits` as they are. `top_k(logits, k)` -> (M, k) indices
    finds the largest (a kernel's faster pass; torch.topk's by default)."""
    if x.dtype == torch.float32:
        return logits
    k = min(EXACT_TOP_LOGITS, logits.shape[-1])
    top = logits.topk(k, dim=-1).indices if top_k is None else top_k(logits, k)  # (M, k)
    ids = top.flatten()
    # every part but act_order's input permutation is indexed by output row
    rows = dequantize({r: p if r == "perm" else p.index_select(0, ids) for r, p in parts.items()}, fmt,
                      torch.float32)  # (M * k, K)
    # a product and a sum per row, not bmm: torch's batched matmul takes another path for M > 1 than for one row,
    # so a row's logits would depend on how many rows its step has (speculative verification against decoding)
    exact = rows.view(*top.shape, -1).mul_(x.float()[:, None, :]).sum(-1)  # (M, k)
    return logits.scatter_(-1, top, exact)


def embedding_ref(ids: torch.Tensor, parts: dict[str, torch.Tensor], fmt: Format) -> torch.Tensor:
    """Rows `ids` (T,) of the weight -> (T, K) in the format's dtype. A quantized weight (a GGUF embedding kept
    as it is) dequantizes only the rows it reads: every part of its formats is indexed by row."""
    if not fmt.is_quantized:
        return F.embedding(ids, dequantize(parts, fmt))
    flat = ids.reshape(-1)
    return dequantize({r: p.index_select(0, flat) for r, p in parts.items()}, fmt).reshape(*ids.shape, -1)


def _embedding_call(fn, node, inputs, params, step):
    # embedding(input_ids) {vocab_start?, scale?} [weight] -> hidden
    w = params["weight"]
    if "vocab_start" not in node.attrs:
        out = fn(inputs[0], w.parts, w.format)
    else:  # a vocab-parallel shard holds rows vocab_start ..: ids outside it give 0 (summed over ranks later)
        rows = next(iter(w.parts.values())).shape[0]
        ids = inputs[0] - node.attrs["vocab_start"]
        inside = (ids >= 0) & (ids < rows)
        out = torch.where(inside[:, None], fn(ids.clamp(0, rows - 1), w.parts, w.format), 0)
    scale = node.attrs.get("scale")
    return [out if scale is None else out * torch.tensor(scale, dtype=out.dtype)]


@functools.cache
def onednn_bf16_gemm() -> bool:
    """Whether torch's CPU bfloat16 matmuls of more than one row run oneDNN's GEMM (AVX-512): then bfloat16 is
    the fast kind (half the bytes); capped to AVX2, torch runs bfloat16 products row by row and float32 is."""
    return torch.backends.cpu.get_cpu_capability().startswith("AVX512")


def one_row_as_two(device: torch.device) -> bool:
    """Whether the reference's one-row bfloat16 product of an unquantized weight runs as two rows (the first kept;
    cpu.bf16dot, the kernel such weights bind on the CPU, sums a row alike at any row count). With AVX-512,
    torch computes one row with its own gemv and two or more with oneDNN's GEMM, whose sums run in another order
    (SmolLM2's down_proj, K = 1536: rows differ in the last bit); as two rows a decode step's row rounds as the same
    row in a speculative verification does, for 1-2% of a bf16 decode step. Capped to AVX2, torch runs every row
    count row by row (a second row costs a whole one), so the rows agree already and one stays one."""
    return device.type == "cpu" and onednn_bf16_gemm()


def _linear_call(fn, node, inputs, params, step):
    # linear(x) {split?} [weight, bias?] -> y, or its split along features
    w, x = params["weight"], inputs[0]
    bias = params["bias"].dense() if "bias" in params else None
    if (fn is linear_ref and x.shape[0] == 1 and x.dtype == torch.bfloat16 and not w.format.is_quantized
            and one_row_as_two(x.device)):
        y = fn(x.expand(2, -1).contiguous(), w.parts, w.format, bias)[:1]
    else:
        y = fn(x, w.parts, w.format, bias)
    split = node.attrs.get("split")
    return list(y.split(split, dim=-1)) if split else [y]


def _lm_head_call(fn, node, inputs, params, step):
    # lm_head(hidden) {softcap?} [weight] -> float32 logits of the rows step.logits_indices selects (None, or
    # no step: all)
    indices = None if step is None else step.logits_indices
    x = inputs[0] if indices is None else inputs[0][indices]
    w = params["weight"]
    logits = fn(x, w.parts, w.format)
    cap = node.attrs.get("softcap")
    return [logits if not cap else torch.tanh(logits / cap) * cap]


def _lm_head_rows(inputs, step) -> int:
    # the rows its matmul computes: the selected ones
    if step is None or step.logits_indices is None:
        return matmul_rows(inputs, step)
    return step.logits_indices.numel()


def _linear_shapes(node: Node, cfg: ModelConfig) -> dict:
    n, k = node.attrs["out_features"], node.attrs["in_features"]
    return {"weight": (n, k), "bias": (n,)}


EMBEDDING = OpSpec(1, 1, (), ("weight",), vocab_weight, embedding_ref, _embedding_call)
LINEAR = OpSpec(1, None, ("in_features", "out_features"), ("weight",), _linear_shapes, linear_ref, _linear_call,
                optional_params=("bias",))
LM_HEAD = OpSpec(1, 1, (), ("weight",), vocab_weight, logits_ref, _lm_head_call, rows=_lm_head_rows)
