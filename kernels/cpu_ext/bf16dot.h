// bf16dot.cpp's entry point (bindings.cpp binds it, step.cpp's linears call it).
#pragma once

#include <ATen/core/Tensor.h>

namespace optc::bf16dot {

// x (M, K) bfloat16 @ w (N, K)^T bfloat16 with float32 sums -> (M, N) float32, on the ISA path `isa`
at::Tensor bf16dot(const at::Tensor& x, const at::Tensor& w, int64_t isa);

}  // namespace optc::bf16dot
