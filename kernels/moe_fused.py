"""The moe block on the GPU as two grouped GEMMs (vLLM's fused MoE): the (token, slot) rows of the step,
sorted by expert and padded per expert to whole tiles of BLOCK_M rows, go through ONE launch over all
experts for gate_up with the gated activation in its epilogue, and ONE for down with the routing weights
in its epilogue; each program reads its tile's expert from a per-tile table, so every weight tile it
loads belongs to one expert.

The routing is the op's (optc.core.ops.moe.`route`: every scoring attr, groups, renormalize, routed_scale,
round_weights), in torch, so kernel and reference pick the same experts with the same weights. The sort
is torch on the device (argsort, bincount, cumsum, searchsorted) with no host sync: the tile count is the
bound T * k / BLOCK_M + min(E, T * k), and tiles past the last expert's exit at once. Weights: dense
(any float dtype), int8_wo (one scale per output channel) and int4_g (k8_lsb words, group scales, optional
zero points), each dequantized per tile in fp32 and rounded to x's dtype, as their reference linears do.

Numerical policy (the reference's roundings, in order): matmuls accumulate in fp32; the gate_up output is
rounded to x's dtype, then act(gate) (rounded) times up (rounded), stored in x's dtype; the down output is
rounded to x's dtype, multiplied by the routing weight in fp32 and rounded, one row per (token, slot);
the launcher sums a token's top_k rows in slot order (deterministic: no atomics). The reference adds the
experts' rows in expert order in x's dtype: at top_k 2 the same bits, beyond it one rounding fewer.

Not bound by default (select_kernels binds it when its `enable` names it): it has been checked under the
Triton interpreter and compiled for sm_90, never run on a GPU. A fixed tile per M (CONFIGS), no autotune.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from optc.core.formats import INT4_PACKING, Activations, Format, FormatKind
from optc.core.ops.moe import route
from optc.kernels._dot import dot, fp32_dot, rne_bf16, to_dtype
from optc.kernels.activation import ACTS, gated

KINDS = (FormatKind.DENSE, FormatKind.INT8_WO, FormatKind.INT4_G)  # the WEIGHT constexpr is the index
# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages): decode-sized tiles while experts see few rows each
CONFIGS = {"small": (16, 64, 64, 4, 3), "large": (64, 64, 64, 4, 3)}
SMALL_ROWS = 32  # up to this many (token, slot) rows per expert on average: the small tiles


@triton.jit
def _weight_tile(
    # pointers: one expert's weight (N, K) (int4: (N, K // 8) words), scales, zeros
    w_ptr, scales_ptr, zeros_ptr,
    # the tile: output rows (BLOCK_N,), K offsets (BLOCK_K,), their masks, the K start
    rows_n, mask_n, offs_k, mask_k, k0, group_size,
    # strides (row n)
    stride_wn, stride_sn, stride_zn,
    # meta: WEIGHT 0 dense, 1 int8_wo, 2 int4_g
    DTYPE: tl.constexpr, RNE_BF16: tl.constexpr, WEIGHT: tl.constexpr, HAS_ZEROS: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    # W^T's (BLOCK_K, BLOCK_N) tile in DTYPE: dequantized in fp32 and rounded once, as the reference does
    if WEIGHT == 0:
        w = tl.load(w_ptr + rows_n[None, :] * stride_wn + offs_k[:, None], mask=mask_k[:, None] & mask_n[None, :],
                    other=0.0)
        w = to_dtype(w.to(tl.float32), DTYPE, RNE_BF16)
    elif WEIGHT == 1:
        q = tl.load(w_ptr + rows_n[None, :] * stride_wn + offs_k[:, None], mask=mask_k[:, None] & mask_n[None, :],
                    other=0)
        s = tl.load(scales_ptr + rows_n * stride_sn, mask=mask_n, other=0.0).to(tl.float32)
        w = to_dtype(q.to(tl.float32) * s[None, :], DTYPE, RNE_BF16)
    else:  # nibble k % 8 of word k // 8; BLOCK_K divides the group size and K: whole tiles, masked along N only
        offs_w = tl.multiple_of(k0 // 8, BLOCK_K // 8) + tl.arange(0, BLOCK_K // 8)
        words = tl.load(w_ptr + rows_n[None, :] * stride_wn + offs_w[:, None], mask=mask_n[None, :], other=0)
        shifts = tl.arange(0, 8) * 4
        q = tl.reshape((words[:, None, :] >> shifts[None, :, None]) & 0xF, (BLOCK_K, BLOCK_N))
        group = k0 // group_size
        s = tl.load(scales_ptr + rows_n * stride_sn + group, mask=mask_n, other=0.0).to(tl.float32)
        if HAS_ZEROS:
            z = tl.load(zeros_ptr + rows_n * stride_zn + group, mask=mask_n, other=0).to(tl.float32)
        else:
            z = tl.full([BLOCK_N], 8.0, tl.float32)
        w = to_dtype((q.to(tl.float32) - z[None, :]) * s[None, :], DTYPE, RNE_BF16)
    return w


@triton.jit
def _moe_gemm_kernel(
    # pointers: a (rows, K) (x: gathered by token), the sorted rows (tiles * BLOCK_M,) int32, the tiles'
    # experts (tiles,) int32, weights (E, N_w, K) with scales and zeros, routing weights (T * k,), out
    a_ptr, sorted_rows_ptr, tile_expert_ptr, w_ptr, scales_ptr, zeros_ptr, route_w_ptr, out_ptr,
    # sizes: (token, slot) rows, k, output columns N (gate_up: I of the 2I weight rows), K, int4 group
    num_rows, top_k, N, K, group_size,
    # strides: a (row), weight (expert, row n), scales, zeros (expert, row n), out (row)
    stride_am, stride_we, stride_wn, stride_se, stride_sn, stride_ze, stride_zn, stride_om,
    # meta: GATE_UP (a is x, rows read token row // k; two weight tiles, n and I + n; act epilogue) or down
    # (a is h by row; routing weight epilogue)
    GATE_UP: tl.constexpr, ACT: tl.constexpr, WEIGHT: tl.constexpr, HAS_ZEROS: tl.constexpr,
    FP32_DOT: tl.constexpr, RNE_BF16: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    DTYPE: tl.constexpr = out_ptr.dtype.element_ty
    tile = tl.program_id(0)
    expert = tl.load(tile_expert_ptr + tile)
    if expert < 0:  # a tile past the last expert's rows (the grid is an upper bound)
        return
    rows = tl.load(sorted_rows_ptr + tile * BLOCK_M + tl.arange(0, BLOCK_M))  # (BLOCK_M,): padding is num_rows
    mask_m = rows < num_rows
    rows = rows.to(tl.int64)
    if GATE_UP:
        a_rows = rows // top_k  # row r is token r // k's slot r % k
    else:
        a_rows = rows
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    rows_n = offs_n.to(tl.int64)
    e = expert.to(tl.int64)
    w_e, s_e, z_e = w_ptr + e * stride_we, scales_ptr + e * stride_se, zeros_ptr + e * stride_ze
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)  # gate_up: the up half
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        a = tl.load(a_ptr + a_rows[:, None] * stride_am + offs_k[None, :], mask=mask_m[:, None] & mask_k[None, :],
                    other=0.0)
        w = _weight_tile(w_e, s_e, z_e, rows_n, mask_n, offs_k, mask_k, k0, group_size, stride_wn, stride_sn,
                         stride_zn, DTYPE, RNE_BF16, WEIGHT, HAS_ZEROS, BLOCK_N, BLOCK_K)
        acc += dot(a, w, FP32_DOT)
        if GATE_UP:
            w_up = _weight_tile(w_e, s_e, z_e, rows_n + N, mask_n, offs_k, mask_k, k0, group_size, stride_wn,
                                stride_sn, stride_zn, DTYPE, RNE_BF16, WEIGHT, HAS_ZEROS, BLOCK_N, BLOCK_K)
            acc_up += dot(a, w_up, FP32_DOT)
    # the reference rounds each matmul's output to x's dtype before the epilogue
    acc = to_dtype(acc, DTYPE, RNE_BF16).to(tl.float32)
    if GATE_UP:
        y = gated(acc, to_dtype(acc_up, DTYPE, RNE_BF16).to(tl.float32), ACT, DTYPE, RNE_BF16)
    else:
        route_w = tl.load(route_w_ptr + rows, mask=mask_m, other=0.0).to(tl.float32)
        y = to_dtype(acc * route_w[:, None], DTYPE, RNE_BF16)
    tl.store(out_ptr + rows[:, None] * stride_om + offs_n[None, :], y, mask=mask_m[:, None] & mask_n[None, :])


def fused_moe(x: torch.Tensor, router: torch.Tensor, gate_up: dict[str, torch.Tensor], gate_up_format: Format,
              down: dict[str, torch.Tensor], down_format: Format, top_k: int, renormalize: bool, act: str = "silu",
              round_weights: bool = False, **routing) -> torch.Tensor:
    """moe_ref with the experts in two grouped-GEMM launches: x (T, H) -> (T, H) (`routing`: moe_ref's)."""
    assert x.dim() == 2 and x.dtype in (torch.float16, torch.bfloat16, torch.float32), \
        f"x must be (T, H) in a float dtype, got {list(x.shape)} {x.dtype}"
    assert act in ACTS, f"activation {act!r}: the kernel computes {' and '.join(ACTS)}"
    num_experts, (num_tokens, hidden) = router.shape[0], x.shape
    x = x.contiguous()
    weights, ids = route(x, router, top_k, renormalize, round_weights, **routing)  # (T, k) each
    if num_tokens == 0:
        return torch.zeros_like(x)
    num_rows = num_tokens * top_k
    block_m, block_n, block_k, warps, stages = CONFIGS["small" if num_rows <= SMALL_ROWS * num_experts else "large"]
    sorted_rows, tile_expert = _sort_by_expert(ids.flatten(), num_experts, block_m)
    common = dict(sorted_rows_ptr=sorted_rows, tile_expert_ptr=tile_expert, num_rows=num_rows, top_k=top_k,
                  FP32_DOT=fp32_dot(x), RNE_BF16=rne_bf16(x), BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps,
                  num_stages=stages)
    two_inter = _expert_shape(gate_up, gate_up_format, num_experts, hidden)[0]
    assert two_inter % 2 == 0, f"gate_up has {two_inter} rows per expert: [gate | up] must be even"
    inter = two_inter // 2
    h = torch.empty(num_rows, inter, dtype=x.dtype, device=x.device)  # act(gate) * up per (token, slot) row
    _launch(x, gate_up, gate_up_format, h, inter, hidden, weights, block_k, GATE_UP=True, ACT=ACTS.index(act),
            **common)
    assert _expert_shape(down, down_format, num_experts, inter) == (hidden, inter), "down must be (E, H, I)"
    y = torch.empty(num_rows, hidden, dtype=x.dtype, device=x.device)  # weighted down output per row
    _launch(h, down, down_format, y, hidden, inter, weights.flatten().contiguous(), block_k, GATE_UP=False, ACT=0,
            **common)
    return y.view(num_tokens, top_k, hidden).sum(1)  # slot order, one rounding


def _launch(a: torch.Tensor, parts: dict[str, torch.Tensor], fmt: Format, out: torch.Tensor, n: int, k: int,
            route_w: torch.Tensor, block_k: int, **meta) -> None:
    """One grouped GEMM over all experts: out rows (sorted_rows) = epilogue(a rows @ W[e]^T), n columns."""
    kind = fmt.kind
    w = parts["qweight"] if kind is not FormatKind.DENSE else parts["weight"]
    scales = parts.get("scales", w)
    zeros = parts.get("zeros")
    if kind is FormatKind.INT4_G:
        block_k = min(block_k, fmt.group_size)  # one group per K tile, K whole tiles (K % group == 0)
        assert k % fmt.group_size == 0, f"K={k} is not a multiple of the group size {fmt.group_size}"
        assert (zeros is not None) == fmt.zero_point, "zeros present iff the format has a zero point"
    assert w.stride(-1) == 1 and scales.stride(-1) == 1, "weights and scales must be contiguous along K"
    assert zeros is None or zeros.stride(-1) == 1, "zeros must be contiguous along K"
    tiles = meta["tile_expert_ptr"].shape[0]
    grid = (tiles, triton.cdiv(n, meta["BLOCK_N"]))
    _moe_gemm_kernel[grid](
        a, w_ptr=w, scales_ptr=scales, zeros_ptr=zeros if zeros is not None else scales, route_w_ptr=route_w,
        out_ptr=out, N=n, K=k, group_size=fmt.group_size or 1, stride_am=a.stride(0), stride_we=w.stride(0),
        stride_wn=w.stride(1), stride_se=scales.stride(0), stride_sn=scales.stride(1) if scales.dim() == 3 else 1,
        stride_ze=zeros.stride(0) if zeros is not None else 0, stride_zn=zeros.stride(1) if zeros is not None else 0,
        stride_om=out.stride(0), WEIGHT=KINDS.index(kind), HAS_ZEROS=zeros is not None, BLOCK_K=block_k, **meta,
    )


def _expert_shape(parts: dict[str, torch.Tensor], fmt: Format, num_experts: int, k: int) -> tuple[int, int]:
    """One expert's logical (N, K), after asserting the parts are `fmt`'s stacked over `num_experts`."""
    assert fmt.kind in KINDS, f"expert weights {fmt.kind.value}: the kernel reads {', '.join(k.value for k in KINDS)}"
    assert fmt.kind is not FormatKind.INT8_WO or fmt.group_size is None, "int8_wo must be per channel"
    assert fmt.kind is not FormatKind.INT4_G or (fmt.packing == INT4_PACKING and not fmt.act_order), \
        "int4_g must be k8_lsb packed without act_order"
    assert fmt.activations is Activations.NONE, f"{fmt.label}: weight-only formats only"
    w = parts["weight"] if fmt.kind is FormatKind.DENSE else parts["qweight"]
    assert w.dim() == 3 and w.shape[0] == num_experts, f"experts {list(w.shape)}: a leading axis of {num_experts}"
    n, cols = w.shape[1], w.shape[2] * (8 if fmt.kind is FormatKind.INT4_G else 1)
    assert cols == k, f"experts have {cols} input features, expected {k}"
    return n, cols


def _sort_by_expert(flat_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """flat_ids (T * k,) -> (sorted_rows (tiles * BLOCK_M,) int32, tile_expert (tiles,) int32): each expert's
    rows (in row order) padded to whole tiles, padding rows = T * k, tiles past the last expert's = -1."""
    num_rows = flat_ids.numel()
    device = flat_ids.device
    order = flat_ids.argsort(stable=True)
    sorted_ids = flat_ids[order]
    counts = torch.bincount(flat_ids, minlength=num_experts)  # (E,)
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = padded.cumsum(0)
    rank = torch.arange(num_rows, device=device) - (counts.cumsum(0) - counts)[sorted_ids]
    tiles = triton.cdiv(num_rows, block_m) + min(num_experts, num_rows)  # every used expert pads < one tile
    sorted_rows = torch.full((tiles * block_m,), num_rows, dtype=torch.int32, device=device)
    sorted_rows[(padded_end - padded)[sorted_ids] + rank] = order.to(torch.int32)
    tile_start = torch.arange(tiles, device=device) * block_m
    tile_expert = torch.searchsorted(padded_end, tile_start, right=True)
    return sorted_rows, torch.where(tile_expert < num_experts, tile_expert, -1).to(torch.int32)
