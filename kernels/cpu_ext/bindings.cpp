// The module definition of optc's C++ CPU extension (kernels/cpu_ext/__init__.py `load`): every kernel's entry
// point from its own translation unit, step.cpp's Run, and the ISA probe.
#include <torch/csrc/utils/pybind.h>

#include <map>
#include <string>

#include "bf16dot.h"
#include "cpu_ext.h"
#include "lora.h"
#include "ops.h"
#include "qdot.h"
#include "step.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("best_isa", [] {
    const optc::IsaPaths paths = optc::best_isa();
    return std::map<std::string, int64_t>{{"qdot", paths.qdot}, {"bf16dot", paths.bf16dot}};
  }, "the best ISA path of each kernel family on this CPU: {family: path}, 0 for none");
  m.def("threads_used", &optc::qdot::threads_used, "threads an at::parallel_for of `items` ran on");
  m.def("qlinear", &optc::qdot::qlinear, "grouped integer-code linear with integer activations per block of 32");
  m.def("bf16dot", &optc::bf16dot::bf16dot,
        "x (M, K) @ w (N, K)^T in bfloat16 with float32 sums -> (M, N) float32");
  m.def("rms_norm", &optc::ops::rms_norm, "rms_norm / add_rms_norm");
  m.def("rope_kv_store", &optc::ops::rope_kv_store, "rotary on q and k, k and v into the paged cache");
  m.def("row_attention", &optc::ops::row_attention, "each query row on its own over the paged cache");
  m.def("silu_mul", &optc::ops::silu_mul, "silu(gate) * up");
  m.def("top_k", &optc::ops::top_k, "each row's k largest values' indices, largest first (k = 1: argmax)");
  m.def("lora_add", &optc::lora::lora_add, "a linear's output parts += their rows' LoRA deltas, in place");
  optc::step::bind(m);
}
