// A decode or verification step's decoder layers in one C++ call (kernels/cpu_ext/step.py binds it): per layer the
// qkv linear, rotary + KV store, row attention (each request's rows, causal or a draft tree's), o linear, add +
// RMSNorm, gate_up linear, silu gate, down linear and the next add + RMSNorm, each the very function its graph node
// binds one at a time (ops.cpp's norms, rotary, attention and silu, qdot.cpp's qlinear, bf16dot.cpp's bf16dot,
// torch's packed int4 matmul, a dense linear), called in the same order on the same tensors: the results are those
// of the node-by-node step, bit for bit. What it removes is the Python between them (op adapters, kernel-table
// routing, launcher checks): at batch 1 on SmolLM2 about a third of the step (docs/PERF.md, "the decode step's time,
// node by node").
//
// ops.cpp, qdot.cpp and bf16dot.cpp are compiled into this file (each its own extension too): their module
// definitions are renamed to unused functions around the includes, so this extension defines only its own.
#include <torch/extension.h>

#pragma push_macro("PYBIND11_MODULE")
#undef PYBIND11_MODULE
#define PYBIND11_MODULE(name, m) [[maybe_unused]] static void ops_module_unused(pybind11::module_& m)
#include "ops.cpp"
#undef PYBIND11_MODULE
#define PYBIND11_MODULE(name, m) [[maybe_unused]] static void qdot_module_unused(pybind11::module_& m)
#include "qdot.cpp"
#undef PYBIND11_MODULE
#define PYBIND11_MODULE(name, m) [[maybe_unused]] static void bf16dot_module_unused(pybind11::module_& m)
#include "bf16dot.cpp"
#undef PYBIND11_MODULE
#pragma pop_macro("PYBIND11_MODULE")

#include <tuple>
#include <vector>

namespace {

// DENSE_ROWS2: a dense bfloat16 weight whose one-row product runs as two rows, as the linear node's does (torch's
// one-row gemv sums in another order than the GEMM of more rows; optc/core/ops/linear.py)
// BF16DOT: bf16dot.cpp's kernel (its launcher's: float32 sums rounded to bfloat16)
enum Kind : int64_t { DENSE = 0, INT4PACK = 1, QDOT = 2, DENSE_ROWS2 = 3, BF16DOT = 4 };

// one kernel of a linear, for calls of at most `max_rows` rows (< 0: any); tensors by kind:
// DENSE, DENSE_ROWS2, BF16DOT {weight (N, K)} (BF16DOT: `isa` its path, `group` the most rows it sums, more
// run at::linear as its launcher's do); INT4PACK {packed, scales_and_zeros}; QDOT {qweight, scales, mins, soff}
struct Choice {
  int64_t max_rows;
  int64_t kind;
  std::vector<at::Tensor> t;
  int64_t group, bits, isa;
  double offset;
};

using ChoiceArgs = std::tuple<int64_t, int64_t, std::vector<at::Tensor>, int64_t, int64_t, int64_t, double>;

struct Linear {
  std::vector<Choice> choices;
  std::vector<int64_t> split;  // output features of each part ({N}: no split)

  at::Tensor operator()(const at::Tensor& x) const {
    const int64_t m = x.size(0);
    const Choice* c = &choices.back();
    for (const auto& ch : choices) {
      if (ch.max_rows < 0 || m <= ch.max_rows) {
        c = &ch;
        break;
      }
    }
    switch (c->kind) {
      case DENSE: return at::linear(x, c->t[0]);
      case DENSE_ROWS2:
        if (m == 1 && x.scalar_type() == at::kBFloat16)
          return at::linear(x.expand({2, -1}).contiguous(), c->t[0]).narrow(0, 0, 1);
        return at::linear(x, c->t[0]);
      case BF16DOT:
        if (m <= c->group) return bf16dot::bf16dot(x, c->t[0], c->isa).to(at::kBFloat16);
        return at::linear(x, c->t[0]);
      case INT4PACK: return at::_weight_int4pack_mm_for_cpu(x.contiguous(), c->t[0], c->group, c->t[1]);
      default: return qlinear(x, c->t[0], c->bits, c->group, c->t[1], c->t[2], c->t[3], c->offset, c->isa);
    }
  }
};

struct Layer {
  Linear qkv, o, gate_up, down;
  at::Tensor post_norm, next_norm;  // post-attention add + RMSNorm; the next layer's (or the final) add + RMSNorm
  double post_eps, next_eps;
  int64_t hq, hkv, d, cache_index;
  double scale;
};

class Stack {
 public:
  void add(std::vector<std::vector<ChoiceArgs>> linears, std::vector<std::vector<int64_t>> splits,
           at::Tensor post_norm, double post_eps, at::Tensor next_norm, double next_eps, int64_t hq, int64_t hkv,
           int64_t d, double scale, int64_t cache_index) {
    TORCH_CHECK(linears.size() == 4 && splits.size() == 4, "four linears a layer: qkv, o, gate_up, down");
    Layer layer;
    Linear* slots[4] = {&layer.qkv, &layer.o, &layer.gate_up, &layer.down};
    for (int i = 0; i < 4; ++i) {
      for (auto& [max_rows, kind, tensors, group, bits, isa, offset] : linears[i]) {
        TORCH_CHECK(kind >= DENSE && kind <= BF16DOT, "unknown linear kind");
        slots[i]->choices.push_back({max_rows, kind, tensors, group, bits, isa, offset});
      }
      TORCH_CHECK(!slots[i]->choices.empty(), "a linear needs a kernel");
      slots[i]->split = splits[i];
    }
    TORCH_CHECK(layer.qkv.split.size() == 3 && layer.gate_up.split.size() == 2, "qkv splits in 3, gate_up in 2");
    layer.post_norm = post_norm;
    layer.next_norm = next_norm;
    layer.post_eps = post_eps;
    layer.next_eps = next_eps;
    layer.hq = hq;
    layer.hkv = hkv;
    layer.d = d;
    layer.scale = scale;
    layer.cache_index = cache_index;
    layers_.push_back(std::move(layer));
  }

  // x (T, H): the first layer's normed input, residual (T, H) its residual; starts (B + 1,) int32: each
  // request's first row; tree_mask: draft trees' row bits (row_attention's), or none; caches: per KV layer.
  // Returns the last layer's (normed, summed): what its trailing add + RMSNorm node outputs.
  std::vector<at::Tensor> forward(at::Tensor x, at::Tensor residual, at::Tensor positions, at::Tensor cos_sin,
                                  at::Tensor slots, at::Tensor block_tables, at::Tensor seq_lens, at::Tensor starts,
                                  c10::optional<at::Tensor> tree_mask, std::vector<at::Tensor> caches,
                                  int64_t max_rows) {
    const int64_t t = x.size(0);
    for (const Layer& l : layers_) {
      const at::Tensor& cache = caches.at(l.cache_index);
      auto qkv = l.qkv(x).split_with_sizes(l.qkv.split, -1);
      auto q = rope_kv_store(qkv[0].view({t, l.hq, l.d}).contiguous(), qkv[1].view({t, l.hkv, l.d}).contiguous(),
                             qkv[2].view({t, l.hkv, l.d}).contiguous(), positions, cos_sin, cache, slots);
      auto attn = row_attention(q, cache, block_tables, seq_lens, starts, l.scale, 0.0, 0, max_rows, tree_mask)
                      .flatten(1);
      // the add + RMSNorm nodes' operands in their order: the residual stream, then the new value
      auto post = rms_norm(residual, l.o(attn).contiguous(), l.post_norm, l.post_eps, 0.0);
      auto gu = l.gate_up(post[0]).split_with_sizes(l.gate_up.split, -1);
      auto act = silu_mul(gu[0], gu[1]);
      auto next = rms_norm(post[1], l.down(act).contiguous(), l.next_norm, l.next_eps, 0.0);
      x = next[0];
      residual = next[1];
    }
    return {x, residual};
  }

  int64_t size() const { return static_cast<int64_t>(layers_.size()); }

 private:
  std::vector<Layer> layers_;
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  pybind11::class_<Stack>(m, "Stack")
      .def(pybind11::init<>())
      .def("add", &Stack::add, "append a decoder layer")
      .def("forward", &Stack::forward, "every layer of a decode or verification step")
      .def("__len__", &Stack::size);
}
