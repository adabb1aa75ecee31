// A planned run of a decode or verification step's graph nodes in one C++ call (kernels/cpu_ext/step.py binds it;
// passes/plan_cpu_step.py plans the runs): an interpreter over the nodes, in the way ggml's ggml_compute_forward
// switches on each node's op. Each node carries its op kind, its value slots, its attributes and its weights, and
// runs the very function its graph node binds one at a time (ops.cpp's norms, rotary + KV store, row attention and
// silu gate, the reference's ATen ops for the gates it runs, qdot.cpp's qlinear, bf16dot.cpp's bf16dot, torch's
// packed int4 matmuls, a dense linear), in node order on the same tensors: the results are the node-by-node step's,
// bit for bit. What it removes is the Python between the nodes (op adapters, kernel-table routing, launcher checks):
// at batch 1 on SmolLM2 about a third of the step (docs/PERF.md, "the decode step's time, node by node"). Which
// attributes each op reads is declared in kernels/cpu_ext/step_takes.py, which the plan asks.
//
// A linear that LoRA adapters target carries its slot tables (Run::set_lora): on a step with adapter rows, lora.cpp's
// lora_add adds their deltas to its output, the function runtime/lora.py calls after the node's own kernel.
#include <ATen/ATen.h>

#include <cmath>
#include <cstdint>
#include <tuple>
#include <vector>

#include "bf16dot.h"
#include "lora.h"
#include "ops.h"
#include "qdot.h"
#include "step.h"

namespace optc::step {

using ops::rms_norm;
using ops::rope_kv_store;
using ops::row_attention;
using ops::silu_mul;
using qdot::qlinear;

// DENSE_ROWS2: a dense bfloat16 weight whose one-row product runs as two rows, as the linear node's does (torch's
// one-row gemv sums in another order than the GEMM of more rows; optc/core/ops/linear.py)
// BF16DOT: bf16dot.cpp's kernel (its launcher's: float32 sums rounded to bfloat16)
// INT4X2: an int8_gf weight as two packed int4 matmuls summed (kernels/gf_cpu.py's int8gf_int4x2_linear)
// INT8PACK: an int8_wo weight on torch's int8 weight-only matmul (kernels/int8_cpu.py's int8pack_linear)
enum Kind : int64_t { DENSE = 0, INT4PACK = 1, QDOT = 2, DENSE_ROWS2 = 3, BF16DOT = 4, INT4X2 = 5, INT8PACK = 6 };
constexpr int64_t ALIGNMENT = 64;  // kernels/int8_cpu.py's: where _weight_int8pack_mm's operands start

// _weight_int8pack_mm of x as int8pack_linear runs it: x 2-D and 64-byte aligned (a copy where it is not), the
// scales in x's dtype
at::Tensor int8pack_mm(const at::Tensor& x, const at::Tensor& qweight, const at::Tensor& scales) {
  auto x2 = x.reshape({-1, qweight.size(1)}).contiguous();
  if (reinterpret_cast<uintptr_t>(x2.data_ptr()) % ALIGNMENT) x2 = x2.clone();
  return at::_weight_int8pack_mm(x2, qweight, scales.to(x.scalar_type()));
}

// one kernel of a linear, for calls of at most `max_rows` rows (< 0: any); tensors by kind:
// DENSE, DENSE_ROWS2, BF16DOT {weight (N, K)} (BF16DOT: `isa` its path, `group` the most rows it sums, more
// run at::linear as its launcher's do); INT4PACK {packed, scales_and_zeros}; QDOT {qweight, scales, mins, soff};
// INT4X2 {high, high_table, low, low_table}; INT8PACK {qweight (aligned: prepare_int8pack's), scales}
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
  std::vector<at::Tensor> lora;  // {a, bt, parts}: lora.cpp's lora_add's slot tables, where adapters target it

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
      case INT4X2: {
        const auto x2 = x.contiguous();
        return at::_weight_int4pack_mm_for_cpu(x2, c->t[0], c->group, c->t[1]) +
               at::_weight_int4pack_mm_for_cpu(x2, c->t[2], c->group, c->t[3]);
      }
      case INT8PACK: return int8pack_mm(x, c->t[0], c->t[1]);
      default: return qlinear(x, c->t[0], c->bits, c->group, c->t[1], c->t[2], c->t[3], c->offset, c->isa);
    }
  }
};


// a node's op kind: kernels/cpu_ext/step.py's OPS, in this order
enum Op : int64_t {
  LINEAR = 0, RMS_NORM = 1, ADD_RMS_NORM = 2, GATED_ACT = 3, ROPE_KV_STORE = 4, ATTENTION = 5, ADD = 6, MOE = 7,
  MLA_ATTENTION = 8
};
enum Act : int64_t { SILU = 0, GELU_TANH = 1 };

// one planned node: its op, the value slots it reads and writes, the slots that die after it, and its attributes
// by op (kernels/cpu_ext/step.py `_node` writes them):
//   LINEAR         linear, split
//   RMS_NORM       ints {head_dim (0: whole rows)}, floats {eps, offset}, tensors {weight}
//   ADD_RMS_NORM   floats {eps, offset}, tensors {weight}; reads (x, residual), writes (normed, x + residual)
//   GATED_ACT      ints {act, is ops.cpp's silu_mul (else the reference's ATen ops)}
//   ROPE_KV_STORE  ints {H_q, H_kv, D, layer, rope table, KV group (0: the batch's tables, g + 1: group g)}
//   ATTENTION      ints {H_q, D, layer, window (0: none), KV group}, floats {scale, softcap (0: none)}
//   ADD            x + y, the reference's ATen add
//   MOE            ints {top_k, renormalize, act, round_weights, num_groups, topk_groups, float_router, experts'
//                  kind, group size}, floats {routed_scale}, tensors {router (E, H), then the experts: DENSE_EXPERTS
//                  gate_up (E, 2I, H), down (E, H, I); INT8PACK / INT4PACK_EXPERTS each expert's gate_up parts,
//                  then each one's down parts, two a matmul}: moe_ref's ATen ops (optc/core/ops/moe.py) with the
//                  per-expert matmuls of the node's kernel (kernels/moe_cpu.py's moe_packed)
//   MLA_ATTENTION  ints {H, Dn, Dv, layer, rope table, KV group}, floats {scale, eps}, tensors {kv_norm, kv_b};
//                  reads (q, kv_a): mla_attention_ref's ATen ops (optc/core/ops/mla.py), absorbed at one query row
struct Node {
  int64_t op;
  std::vector<int64_t> in, out, release;
  std::vector<int64_t> ints;
  std::vector<double> floats;
  std::vector<at::Tensor> tensors;
  Linear linear;
};

// a moe node's experts: dense (the reference's F.linear), or moe_packed's int8_wo / int4_g packed matmuls
enum Experts : int64_t { DENSE_EXPERTS = 0, INT8PACK_EXPERTS = 1, INT4PACK_EXPERTS = 2 };

// expert e's matmul `which` (0: gate_up, 1: down) of h (T_e, K), as the node's kernel runs it
at::Tensor expert_linear(const Node& n, int64_t e, int64_t which, const at::Tensor& h) {
  if (n.ints[7] == DENSE_EXPERTS) return at::linear(h, n.tensors[1 + which][e]);
  const int64_t part = 1 + 2 * (which * n.tensors[0].size(0) + e);  // router (E, H) first, then two a matmul
  const at::Tensor &w = n.tensors[part], &table = n.tensors[part + 1];
  if (n.ints[7] == INT8PACK_EXPERTS) return int8pack_mm(h, w, table);
  // int4pack_linear: torch's packed int4 matmul over its (K / G, N, 2) scales and zeros
  const int64_t group = n.ints[8];
  return at::_weight_int4pack_mm_for_cpu(h.reshape({-1, table.size(0) * group}).contiguous(), w, group, table);
}

at::Tensor act_mul(const at::Tensor& gate, const at::Tensor& up, int64_t act) {
  return (act == GELU_TANH ? at::gelu(gate, "tanh") : at::silu(gate)) * up;
}

// moe_ref (optc/core/ops/moe.py) op for op: `route`, then `run_experts` with the experts' matmuls
at::Tensor moe(const Node& n, const at::Tensor& x) {
  const int64_t top_k = n.ints[0], act = n.ints[2], num_groups = n.ints[4], topk_groups = n.ints[5];
  const at::Tensor& router = n.tensors[0];
  const at::Tensor logits = n.ints[6] ? at::linear(x.to(at::kFloat), router.to(at::kFloat))
                                      : at::linear(x, router.to(x.scalar_type()));
  at::Tensor probs = at::softmax(logits.to(at::kFloat), -1);  // (T, E)
  if (num_groups > 1) {  // group-limited: the experts of the topk_groups best groups, by their best expert
    const auto grouped = probs.view({probs.size(0), num_groups, -1});
    const auto best = std::get<1>(grouped.amax(-1).topk(topk_groups, -1));
    const auto keep = at::zeros_like(grouped.select(-1, 0), at::kBool).scatter_(1, best, true);
    probs = grouped.masked_fill(keep.logical_not().unsqueeze(-1), 0.0).view_as(probs);
  }
  auto [weights, ids] = probs.topk(top_k, -1);
  if (n.ints[1]) weights = weights / weights.sum(-1, true);
  if (n.floats[0] != 1.0) weights = weights * n.floats[0];
  if (n.ints[3]) weights = weights.to(x.scalar_type());
  auto out = at::zeros_like(x);
  const auto flat = ids.flatten();  // row r is token r / k's choice r % k
  const auto order = flat.argsort(true);
  const auto counts = at::bincount(flat, {}, router.size(0));
  const auto flat_weights = weights.flatten();
  int64_t start = 0;
  for (int64_t e = 0; e < counts.size(0); ++e) {
    const int64_t count = counts[e].item<int64_t>();
    if (!count) continue;
    const auto rows = order.slice(0, start, start + count);
    start += count;
    const auto tokens = at::floor_divide(rows, top_k);
    const auto gu = expert_linear(n, e, 0, x.index({tokens})).chunk(2, -1);
    const auto y = expert_linear(n, e, 1, act_mul(gu[0], gu[1], act));
    out.index_add_(0, tokens, (y * flat_weights.index({rows}).unsqueeze(1)).to(out.scalar_type()));
  }
  return out;
}

// rms_norm_ref (optc/core/ops/norm.py) without an offset, op for op
at::Tensor rms_norm_ref(const at::Tensor& x, const at::Tensor& weight, double eps) {
  const auto xf = x.to(at::kFloat);
  return weight * (xf * at::rsqrt(xf.pow(2).mean(-1, true) + eps)).to(x.scalar_type());
}

// rope_interleaved_ref (optc/core/ops/mla.py): x (T, H, Dr), pairs (x[2i], x[2i+1]) rotated by frequency i
at::Tensor rope_interleaved_ref(const at::Tensor& x, const at::Tensor& positions, const at::Tensor& cos_sin) {
  const int64_t half = cos_sin.size(-1) / 2;
  const auto cs = cos_sin.index({positions}).unsqueeze(1);
  const auto cos = cs.slice(-1, 0, half), sin = cs.slice(-1, half);
  const auto pairs = x.to(at::kFloat).unflatten(-1, {half, 2});
  const auto x1 = pairs.select(-1, 0), x2 = pairs.select(-1, 1);
  return at::stack({x1 * cos - x2 * sin, x2 * cos + x1 * sin}, -1).flatten(-2).to(x.scalar_type());
}

// mla_attention_ref (optc/core/ops/mla.py) op for op over a float latent cache (NB, 1, block, 1, R + Dr): the
// tokens' [latent | rotated k_pe] stored, then each request's queries over its cached context, absorbed (W_UK folded
// into the query, W_UV after the attention) when every request has one query row, expanded otherwise
at::Tensor mla(const Node& n, const at::Tensor& q_in, const at::Tensor& kv_a, const at::Tensor& positions,
               const at::Tensor& cos_sin, const at::Tensor& cache, const at::Tensor& table_in,
               const at::Tensor& slot_mapping, const at::Tensor& seq_lens, const at::Tensor& query_start_loc) {
  const int64_t num_heads = n.ints[0], dn = n.ints[1], dv = n.ints[2], dr = cos_sin.size(-1);
  const int64_t num_tokens = q_in.size(0), rank = kv_a.size(-1) - dr;
  const auto q = q_in.view({num_tokens, num_heads, dn + dr});
  // store_latents
  const auto latent = rms_norm_ref(kv_a.slice(1, 0, rank), n.tensors[0], n.floats[1]);
  const auto k_pe = rope_interleaved_ref(kv_a.slice(1, rank).unsqueeze(1), positions, cos_sin).select(1, 0);
  auto row_values = at::cat({latent, k_pe}, -1);
  auto slots = slot_mapping;
  const auto keep = slots >= 0;
  if (!keep.all().item<bool>()) {
    slots = slots.index({keep});
    row_values = row_values.index({keep});
  }
  const int64_t block_size = cache.size(2);
  cache.select(1, 0).index_put_({at::floor_divide(slots, block_size), slots.remainder(block_size)},
                                row_values.unsqueeze(1).to(cache.scalar_type()));
  const auto q_nope = q.slice(-1, 0, dn).to(at::kFloat);
  const auto q_pe = rope_interleaved_ref(q.slice(-1, dn), positions, cos_sin).to(at::kFloat);
  // the attention
  const int64_t num_requests = seq_lens.size(0);
  const auto query_lens = (query_start_loc.slice(0, 1) - query_start_loc.slice(0, 0, -1)).to(at::kLong);
  if (num_tokens == 0 || num_requests == 0) return q.new_empty({num_tokens, num_heads * dv});
  const int64_t max_query = query_lens.max().item<int64_t>();
  const int64_t num_blocks = (seq_lens.max().item<int64_t>() + block_size - 1) / block_size;
  const auto table = table_in.slice(1, 0, num_blocks).to(at::kLong);
  const auto cached = cache.index({table}).to(at::kFloat).reshape({num_requests, -1, rank + dr});
  const auto c = cached.slice(-1, 0, rank), kr = cached.slice(-1, rank);
  const auto w = n.tensors[1].to(at::kFloat).view({num_heads, dn + dv, rank});
  const auto w_uk = w.slice(1, 0, dn), w_uv = w.slice(1, dn);
  const auto opts = q.options().dtype(at::kLong);
  const auto request = at::repeat_interleave(at::arange(num_requests, opts), query_lens);
  const auto row = at::arange(num_tokens, opts) - query_start_loc.index({request}).to(at::kLong);
  auto qn = q_nope.new_zeros({num_requests, max_query, num_heads, dn});
  auto qr = q_pe.new_zeros({num_requests, max_query, num_heads, dr});
  qn.index_put_({request, row}, q_nope);
  qr.index_put_({request, row}, q_pe);
  const auto rope_scores = at::einsum("bqhd,bld->bhql", {qr, kr});
  const bool absorbed = max_query == 1;
  const auto scores = absorbed
      ? at::einsum("bqhr,blr->bhql", {at::einsum("bqhd,hdr->bqhr", {qn, w_uk}), c}) + rope_scores
      : at::einsum("bqhd,bhld->bhql", {qn, at::einsum("blr,hdr->bhld", {c, w_uk})}) + rope_scores;
  const auto query_pos = (seq_lens.to(at::kLong) - query_lens).unsqueeze(1) + at::arange(max_query, opts);
  const auto masked = at::arange(c.size(1), opts).unsqueeze(0).unsqueeze(0) > query_pos.unsqueeze(2);
  const auto probs = (scores * n.floats[0]).masked_fill_(masked.unsqueeze(1), -INFINITY).softmax(-1);
  const auto out = absorbed ? at::einsum("bhqr,hvr->bqhv", {at::matmul(probs, c.unsqueeze(1)), w_uv})
                            : at::matmul(probs, at::einsum("blr,hvr->bhlv", {c, w_uv})).transpose(1, 2);
  return out.index({request, row}).flatten(1).to(q.scalar_type());
}

// y (the linear's whole output) += the LoRA deltas of x's rows under `slots`, through y's split parts' views
void add_lora(const Linear& linear, const at::Tensor& x, const at::Tensor& y, const at::Tensor& slots) {
  const auto parts = linear.split.size() == 1 ? std::vector<at::Tensor>{y} : y.split_with_sizes(linear.split, -1);
  lora::lora_add(x, parts, slots, linear.lora[0], linear.lora[1], linear.lora[2]);
}

class Run {
 public:
  void add(int64_t op, std::vector<int64_t> in, std::vector<int64_t> out, std::vector<int64_t> release,
           std::vector<int64_t> ints, std::vector<double> floats, std::vector<at::Tensor> tensors) {
    TORCH_CHECK(op > LINEAR && op <= MLA_ATTENTION, "unknown op kind ", op);
    static const size_t num_ints[] = {0, 1, 0, 2, 6, 5, 0, 9, 6};
    TORCH_CHECK(ints.size() == num_ints[op], "op kind ", op, " takes ", num_ints[op], " ints");
    nodes_.push_back({op, in, out, release, ints, floats, tensors, {}});
  }

  void add_linear(std::vector<int64_t> in, std::vector<int64_t> out, std::vector<int64_t> release,
                  std::vector<ChoiceArgs> choices, std::vector<int64_t> split) {
    Node node{LINEAR, in, out, release, {}, {}, {}, {}};
    for (auto& [max_rows, kind, tensors, group, bits, isa, offset] : choices) {
      TORCH_CHECK(kind >= DENSE && kind <= INT8PACK, "unknown linear kind");
      node.linear.choices.push_back({max_rows, kind, tensors, group, bits, isa, offset});
    }
    TORCH_CHECK(!node.linear.choices.empty(), "a linear needs a kernel");
    TORCH_CHECK(split.size() == out.size(), "a linear writes one value per split part");
    node.linear.split = split;
    nodes_.push_back(std::move(node));
  }

  // node `index`, a linear, adds the LoRA deltas of lora_add's tables a, bt and parts on steps with adapter rows
  void set_lora(int64_t index, at::Tensor a, at::Tensor b, at::Tensor parts) {
    TORCH_CHECK(index >= 0 && index < size() && nodes_[index].op == LINEAR, "node ", index, " is not a linear");
    nodes_[index].linear.lora = {a, b, parts};
  }

  // inputs: the run's input values in slot order; num_values: every slot; outputs: the slots returned.
  // positions (T,) int64; cos_sin: the rope tables by index; tables, slots: the block tables and slot mappings by
  // KV group (index 0: the batch's own); starts (B + 1,) int32: each request's first row; tree_mask: draft trees'
  // row bits (row_attention's), or none; caches: per layer, and their scales (an empty tensor for a float cache);
  // max_rows: row_attention's rows per request;
  // lora_slots (T,) int64: each row's LoRA adapter slot (-1: none), or none on a step without adapter rows.
  std::vector<at::Tensor> forward(std::vector<at::Tensor> inputs, int64_t num_values, std::vector<int64_t> outputs,
                                  at::Tensor positions, std::vector<at::Tensor> cos_sin,
                                  std::vector<at::Tensor> tables, std::vector<at::Tensor> slots,
                                  at::Tensor seq_lens, at::Tensor starts, c10::optional<at::Tensor> tree_mask,
                                  std::vector<at::Tensor> caches, std::vector<at::Tensor> cache_scales,
                                  int64_t max_rows, c10::optional<at::Tensor> lora_slots) {
    auto scales_of = [&](int64_t layer) -> c10::optional<at::Tensor> {
      const at::Tensor& s = cache_scales.at(layer);
      return s.numel() ? c10::optional<at::Tensor>(s) : c10::nullopt;
    };
    std::vector<at::Tensor> v(num_values);
    for (size_t i = 0; i < inputs.size(); ++i) v[i] = inputs[i];
    const int64_t t = inputs.at(0).size(0);
    for (const Node& n : nodes_) {
      const at::Tensor& x = v[n.in[0]];
      switch (n.op) {
        case LINEAR: {
          auto y = n.linear(x);
          if (lora_slots && !n.linear.lora.empty()) add_lora(n.linear, x, y, *lora_slots);
          if (n.out.size() == 1) {
            v[n.out[0]] = y;
          } else {
            auto parts = y.split_with_sizes(n.linear.split, -1);
            for (size_t i = 0; i < parts.size(); ++i) v[n.out[i]] = parts[i];
          }
          break;
        }
        case RMS_NORM: {  // a per-head norm (head_dim) normalizes rows of D: (T, H * D) as (T * H, D)
          const int64_t d = n.ints[0];
          auto rows = d ? x.reshape({-1, d}) : x;
          auto out = rms_norm(rows.contiguous(), c10::nullopt, n.tensors[0], n.floats[0], n.floats[1])[0];
          v[n.out[0]] = d ? out.view(x.sizes()) : out;
          break;
        }
        case ADD_RMS_NORM: {  // the node's operands in its order: the residual stream, then the new value
          auto out = rms_norm(x.contiguous(), v[n.in[1]].contiguous(), n.tensors[0], n.floats[0], n.floats[1]);
          v[n.out[0]] = out[0];
          v[n.out[1]] = out[1];
          break;
        }
        case GATED_ACT: {  // act(gate) * up: ops.cpp's silu_mul where the launcher calls it, else the reference's
          const at::Tensor& up = v[n.in[1]];
          if (n.ints[1] && x.dim() == 2 && up.scalar_type() == x.scalar_type() && x.stride(-1) == 1 &&
              up.stride(-1) == 1) {
            v[n.out[0]] = silu_mul(x, up);
          } else {
            v[n.out[0]] = act_mul(x, up, n.ints[0]);
          }
          break;
        }
        case ROPE_KV_STORE: {
          const int64_t hq = n.ints[0], hkv = n.ints[1], d = n.ints[2];
          v[n.out[0]] = rope_kv_store(x.view({t, hq, d}).contiguous(), v[n.in[1]].view({t, hkv, d}).contiguous(),
                                      v[n.in[2]].view({t, hkv, d}).contiguous(), positions, cos_sin.at(n.ints[4]),
                                      caches.at(n.ints[3]), slots.at(n.ints[5]), scales_of(n.ints[3]));
          break;
        }
        case ATTENTION: {
          const int64_t hq = n.ints[0], d = n.ints[1];
          v[n.out[0]] = row_attention(x.view({t, hq, d}).contiguous(), caches.at(n.ints[2]), tables.at(n.ints[4]),
                                      seq_lens, starts, n.floats[0], n.floats[1], n.ints[3], max_rows, tree_mask,
                                      scales_of(n.ints[2]))
                            .flatten(1);
          break;
        }
        case ADD:
          v[n.out[0]] = x + v[n.in[1]];
          break;
        case MOE:
          v[n.out[0]] = moe(n, x);
          break;
        case MLA_ATTENTION:
          v[n.out[0]] = mla(n, x, v[n.in[1]], positions, cos_sin.at(n.ints[4]), caches.at(n.ints[3]),
                            tables.at(n.ints[5]), slots.at(n.ints[5]), seq_lens, starts);
          break;
      }
      for (int64_t r : n.release) v[r] = at::Tensor();
    }
    std::vector<at::Tensor> out;
    out.reserve(outputs.size());
    for (int64_t o : outputs) out.push_back(v[o]);
    return out;
  }

  int64_t size() const { return static_cast<int64_t>(nodes_.size()); }

 private:
  std::vector<Node> nodes_;
};

void bind(pybind11::module_& m) {
  pybind11::class_<Run>(m, "Run")
      .def(pybind11::init<>())
      .def("add", &Run::add, "append a planned node other than a linear")
      .def("add_linear", &Run::add_linear, "append a planned linear node")
      .def("set_lora", &Run::set_lora, "a linear node's LoRA slot tables")
      // without the GIL: a step's other threads (the grammar masks of structured outputs) run beside it
      .def("forward", &Run::forward, "the run's nodes over one decode or verification step",
           pybind11::call_guard<pybind11::gil_scoped_release>())
      .def("__len__", &Run::size);
}

}  // namespace optc::step
