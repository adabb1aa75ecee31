// lora.cpp's entry point (bindings.cpp binds it, step.cpp's targeted linears call it).
#pragma once

#include <ATen/core/Tensor.h>

#include <vector>

namespace optc::lora {

// a linear's output parts += their rows' LoRA deltas, in place
void lora_add(const at::Tensor& x, std::vector<at::Tensor> outs, const at::Tensor& slots, const at::Tensor& a,
              const at::Tensor& bt, const at::Tensor& parts);

}  // namespace optc::lora
