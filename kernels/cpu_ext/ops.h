// ops.cpp's entry points: a decode step's non-matmul ops, one call each (bindings.cpp binds them, step.cpp's nodes
// call them).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>

#include <vector>

namespace optc::ops {

// rms_norm(x) and add_rms_norm(x, residual): [normed] or [normed, x + residual]
std::vector<at::Tensor> rms_norm(at::Tensor x, c10::optional<at::Tensor> residual, at::Tensor weight, double eps,
                                 double offset);

// rotary on q and k, k and v into the paged cache at their slots (a quantized cache: codes and `scales`); returns
// the rotated q
at::Tensor rope_kv_store(at::Tensor q, at::Tensor k, at::Tensor v, at::Tensor positions, at::Tensor cos_sin,
                         at::Tensor cache, at::Tensor slots, c10::optional<at::Tensor> scales);

// each query row on its own over the paged cache (a quantized cache: codes and `scales`)
at::Tensor row_attention(at::Tensor q, at::Tensor cache, at::Tensor block_tables, at::Tensor seq_lens,
                         at::Tensor query_start_loc, double scale, double softcap, int64_t window, int64_t max_rows,
                         c10::optional<at::Tensor> tree_mask, c10::optional<at::Tensor> scales);

// silu(gate) * up
at::Tensor silu_mul(at::Tensor gate, at::Tensor up);

// each row's k largest logits' indices (M, k) int64, largest first: torch.topk's order with ties to the smaller
// index, NaN above every number; k = 1 is argmax
at::Tensor top_k(at::Tensor logits, int64_t k);

}  // namespace optc::ops
