// qdot.cpp's entry points (bindings.cpp binds them, step.cpp's linears call qlinear).
#pragma once

#include <torch/types.h>

namespace optc::qdot {

// x (M, K) @ W^T over W's integer codes with x quantized per block of 32, on the ISA path `isa` (qdot.cpp)
torch::Tensor qlinear(torch::Tensor x, torch::Tensor qweight, int64_t bits, int64_t group_size, torch::Tensor scales,
                      torch::Tensor mins, torch::Tensor soff, double offset, int64_t isa);

// how many threads an at::parallel_for of `items` ran on
int64_t threads_used(int64_t items);

}  // namespace optc::qdot
