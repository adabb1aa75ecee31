// The decode step's non-matmul ops in one call each, for the CPU (kernels/cpu_ext/ops.py binds them).
//
// The torch references (optc.core.ops) run each of these as 5-15 small eager ops; at batch 1 a SmolLM2 step
// spent most of its non-matmul time in their dispatch, not in arithmetic. Each function here is the reference's
// math, element for element: fp32 where the reference computes in fp32, and a rounding to the activation dtype
// wherever the reference rounds (so a norm's output rounds the normed row before the weight multiplies it, as
// `weight * normed.to(x.dtype)` does). Sums run in a different order than torch's vectorized reductions, so
// results can differ from the reference by the last bit of a sum (tests/test_kernels_cpu_ops.py bounds them).
// Built with -ffp-contract=off: a fused multiply-add would round differently from the reference's separate
// product and sum.
#include <ATen/ATen.h>

#include <ATen/Parallel.h>
#include <c10/util/Float8_e4m3fn.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#include "cpu_ext.h"
#include "ops.h"

namespace optc::ops {

template <typename T>
inline float f32(T v) { return static_cast<float>(v); }

template <typename T>
inline T round_to(float v) { return static_cast<T>(v); }

void check_cpu(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor");
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
}

template <typename T>
void norm_rows(const T* x, const T* residual, const T* weight, T* out, T* summed, int64_t rows, int64_t width,
               float eps, float offset) {
  at::parallel_for(0, rows, GRAIN_NORM_ROWS, [&](int64_t begin, int64_t end) {
    std::vector<float> row(width);
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * width;
      float squares = 0.f;
      for (int64_t i = 0; i < width; ++i) {
        // x + residual is rounded to the activation dtype first (the reference adds in that dtype)
        const float v = residual ? f32(round_to<T>(f32(xr[i]) + f32(residual[r * width + i]))) : f32(xr[i]);
        row[i] = v;
        squares += v * v;
        if (summed) summed[r * width + i] = round_to<T>(v);
      }
      const float inv = 1.f / std::sqrt(squares / static_cast<float>(width) + eps);
      T* o = out + r * width;
      if (offset != 0.f) {
        for (int64_t i = 0; i < width; ++i) o[i] = round_to<T>(row[i] * inv * (offset + f32(weight[i])));
      } else {
        for (int64_t i = 0; i < width; ++i) o[i] = round_to<T>(f32(weight[i]) * f32(round_to<T>(row[i] * inv)));
      }
    }
  });
}

// rms_norm(x) and add_rms_norm(x, residual): x (rows, width); returns [normed] or [normed, x + residual]
std::vector<at::Tensor> rms_norm(at::Tensor x, c10::optional<at::Tensor> residual, at::Tensor weight, double eps,
                                 double offset) {
  check_cpu(x, "x");
  check_cpu(weight, "weight");
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 1 && weight.size(0) == x.size(1), "x (rows, width), weight (width,)");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type(), "weight and x must share a dtype");
  auto out = at::empty_like(x);
  at::Tensor summed;
  if (residual) {
    check_cpu(*residual, "residual");
    TORCH_CHECK(residual->sizes() == x.sizes() && residual->scalar_type() == x.scalar_type(),
                "residual must match x");
    summed = at::empty_like(x);
  }
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "rms_norm", [&] {
    norm_rows<scalar_t>(x.data_ptr<scalar_t>(), residual ? residual->data_ptr<scalar_t>() : nullptr,
                        weight.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(),
                        residual ? summed.data_ptr<scalar_t>() : nullptr, x.size(0), x.size(1),
                        static_cast<float>(eps), static_cast<float>(offset));
  });
  if (residual) return {out, summed};
  return {out};
}

// A quantized KV cache (int8, fp8_e4m3) holds one float32 scale per (token, KV head) beside its codes:
// optc/core/kv_cache.py's `quantize` and `dequantize`, expression for expression (so the codes and scales are
// the reference's bits): s = amax * (1 / qmax), code = clamp(x * (qmax / amax), -qmax, qmax) (int8: rounded half
// up), read back as code * s.
inline float cache_qmax(at::ScalarType dtype) { return dtype == at::kChar ? 127.f : 448.f; }

inline void store_code(float y, int8_t* dst) { *dst = static_cast<int8_t>(std::floor(y + 0.5f)); }
inline void store_code(float y, c10::Float8_e4m3fn* dst) { *dst = c10::Float8_e4m3fn(y); }

// one (token, head) row of d values into codes and its scale
template <typename T, typename C>
void quantize_row(const T* x, C* codes, float* scale, int64_t d, float qmax) {
  float amax = 0.f;
  for (int64_t j = 0; j < d; ++j) amax = std::max(amax, std::fabs(f32(x[j])));
  *scale = amax * static_cast<float>(1.0 / static_cast<double>(qmax));
  const float inv = amax > 0.f ? (1.f / amax) * qmax : 0.f;
  for (int64_t j = 0; j < d; ++j) store_code(std::min(std::max(f32(x[j]) * inv, -qmax), qmax), codes + j);
}

// rope_kv_store: q (T, Hq, D), k, v (T, Hkv, D) in one dtype, positions (T,) int64, cos_sin (P, R) fp32, cache
// (num_blocks, 2, block_size, Hkv, D) of that dtype (or int8 / fp8 codes with scales (num_blocks, 2, block_size,
// Hkv) float32), slots (T,) int64 (< 0: not stored). Rotates the first R dims of every head of q and k (the rest
// pass through), writes rotated k and v at their slots; returns q.
template <typename T, typename C>
void rope_store(const T* q, const T* k, const T* v, const int64_t* positions, const float* cos_sin, C* cache,
                float* scales, const int64_t* slots, T* q_out, int64_t tokens, int64_t hq, int64_t hkv, int64_t d,
                int64_t r, int64_t block_size, float qmax) {
  const int64_t half = r / 2;
  auto rotate = [&](const T* src, T* dst, const float* cs) {
    for (int64_t j = 0; j < half; ++j) {
      const float x1 = f32(src[j]), x2 = f32(src[half + j]), c = cs[j], s = cs[half + j];
      const float a = x1 * c, b = x2 * s, e = x2 * c, g = x1 * s;
      dst[j] = round_to<T>(a - b);
      dst[half + j] = round_to<T>(e + g);
    }
    for (int64_t j = r; j < d; ++j) dst[j] = src[j];
  };
  at::parallel_for(0, tokens, GRAIN_ITEM, [&](int64_t begin, int64_t end) {
    std::vector<T> rotated(d);
    for (int64_t t = begin; t < end; ++t) {
      const float* cs = cos_sin + positions[t] * r;
      for (int64_t h = 0; h < hq; ++h) rotate(q + (t * hq + h) * d, q_out + (t * hq + h) * d, cs);
      const int64_t slot = slots[t];
      if (slot < 0) continue;
      // cache[block, 0 | 1, offset] is (Hkv, D): K then V of the token; scales[block, 0 | 1, offset] (Hkv,)
      const int64_t row = (slot / block_size) * 2 * block_size + slot % block_size;
      C* key = cache + row * hkv * d;
      C* value = key + block_size * hkv * d;
      if constexpr (std::is_same_v<C, T>) {
        for (int64_t h = 0; h < hkv; ++h) rotate(k + (t * hkv + h) * d, key + h * d, cs);
        std::copy(v + t * hkv * d, v + (t + 1) * hkv * d, value);
      } else {
        float* key_scales = scales + row * hkv;
        float* value_scales = key_scales + block_size * hkv;
        for (int64_t h = 0; h < hkv; ++h) {
          rotate(k + (t * hkv + h) * d, rotated.data(), cs);
          quantize_row(rotated.data(), key + h * d, key_scales + h, d, qmax);
          quantize_row(v + (t * hkv + h) * d, value + h * d, value_scales + h, d, qmax);
        }
      }
    }
  });
}

// the cache's codes and scales checked against its data: a float cache of `dtype` without scales, or int8 / fp8
// codes with float32 scales (num_blocks, 2, block_size, Hkv); the scales' pointer (null for a float cache)
float* checked_scales(const at::Tensor& cache, const c10::optional<at::Tensor>& scales, at::ScalarType dtype) {
  const auto kind = cache.scalar_type();
  if (kind == dtype) {
    TORCH_CHECK(!scales || !scales->defined() || scales->numel() == 0, "a float cache takes no scales");
    return nullptr;
  }
  TORCH_CHECK(kind == at::kChar || kind == at::kFloat8_e4m3fn,
              "the cache must have the activations' dtype, or be int8 / fp8_e4m3 with scales");
  TORCH_CHECK(scales && scales->defined() && scales->scalar_type() == at::kFloat && scales->is_contiguous() &&
                  scales->dim() == 4 && scales->sizes() == cache.sizes().slice(0, 4),
              "a quantized cache needs float32 scales (num_blocks, 2, block_size, Hkv)");
  return scales->data_ptr<float>();
}

// f(typed pointer to the cache's elements): int8 or fp8 codes, else the activations' type T (checked_scales first)
template <typename T, typename F>
void with_cache_elements(const at::Tensor& cache, F&& f) {
  if (cache.scalar_type() == at::kChar) {
    f(cache.data_ptr<int8_t>());
  } else if (cache.scalar_type() == at::kFloat8_e4m3fn) {
    f(cache.data_ptr<c10::Float8_e4m3fn>());
  } else {
    f(cache.data_ptr<T>());
  }
}

at::Tensor rope_kv_store(at::Tensor q, at::Tensor k, at::Tensor v, at::Tensor positions, at::Tensor cos_sin,
                         at::Tensor cache, at::Tensor slots, c10::optional<at::Tensor> scales) {
  for (auto& [t, name] : {std::pair{&q, "q"}, {&k, "k"}, {&v, "v"}, {&positions, "positions"},
                          {&cos_sin, "cos_sin"}, {&cache, "cache"}, {&slots, "slot_mapping"}})
    check_cpu(*t, name);
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.sizes() == k.sizes() && cache.dim() == 5, "shapes");
  TORCH_CHECK(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(), "q, k, v share a dtype");
  float* scale_data = checked_scales(cache, scales, q.scalar_type());
  TORCH_CHECK(cos_sin.scalar_type() == at::kFloat && positions.scalar_type() == at::kLong &&
                  slots.scalar_type() == at::kLong, "cos_sin float32, positions and slots int64");
  const int64_t d = q.size(2), r = cos_sin.size(1);
  TORCH_CHECK(r % 2 == 0 && r <= d && cache.size(4) == d && cache.size(3) == k.size(1), "rotary and cache dims");
  auto out = at::empty_like(q);
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, q.scalar_type(), "rope_kv_store", [&] {
    with_cache_elements<scalar_t>(cache, [&](auto* typed_cache) {
      using C = std::remove_pointer_t<decltype(typed_cache)>;
      rope_store<scalar_t, C>(q.data_ptr<scalar_t>(), k.data_ptr<scalar_t>(), v.data_ptr<scalar_t>(),
                              positions.data_ptr<int64_t>(), cos_sin.data_ptr<float>(), typed_cache, scale_data,
                              slots.data_ptr<int64_t>(), out.data_ptr<scalar_t>(), q.size(0), q.size(1), k.size(1),
                              d, r, cache.size(2), cache_qmax(cache.scalar_type()));
    });
  });
  return out;
}

// row attention: each query row on its own, as a decode step computes its one query, for decode (one row per
// request) and speculative verification (k + 1 rows), so that a row's result does not depend on how many rows
// its request or its batch has. q (T, Hq, D), cache (num_blocks, 2, block_size, Hkv, D) of q's dtype (or int8 /
// fp8 codes with their scales (num_blocks, 2, block_size, Hkv), read as code * scale),
// block_tables (B, W) int32, seq_lens (B,) int32, query_start_loc (B + 1,) int32. Row i of a request with n
// rows sits at position seq_len - n + i and sees keys (position - window, position] (window 0: all). Scores in
// fp32, times scale, soft-capped (softcap 0: none), softmax, times V in fp32, rounded to q's dtype. A request
// with more than max_rows rows (a prefill) is skipped: its output rows are left for the caller to fill.
// tree_mask (T,) int64, or null: the rows of a request are a draft tree (at most 64 rows, no window), and row i
// sees the context (positions before seq_len - n) and the query rows j of its request whose bit j is set in
// tree_mask[row] (its ancestors and itself): query row j's key sits at position seq_len - n + j.
template <typename T, typename C>
void row_attention_impl(const T* q, const C* cache, const float* cache_scales, const int32_t* tables,
                        const int32_t* seq_lens, const int32_t* query_start, T* out, int64_t batch, int64_t hq,
                        int64_t hkv, int64_t d,
                        int64_t block_size, int64_t width, float scale, float softcap, int64_t window,
                        int64_t max_rows, const int64_t* tree_mask) {
  const int64_t group = hq / hkv, vec = d / 8 * 8;  // dims [0, vec) in 8 fp32 lanes, the rest one by one
  std::vector<int64_t> short_requests;  // the requests computed here: those with at most max_rows rows
  for (int64_t b = 0; b < batch; ++b)
    if (query_start[b + 1] - query_start[b] <= max_rows) short_requests.push_back(b);
  const int64_t num_items = static_cast<int64_t>(short_requests.size()) * hkv;
  // one item: a request's rows on one KV head; each key and value is read once for all its rows, and each
  // (row, query head) is computed alone, in the same order whatever the number of rows
  at::parallel_for(0, num_items, GRAIN_ITEM, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, acc, query, keys, values, totals;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = short_requests[item / hkv], h = item % hkv, t0 = query_start[b];
      const int64_t n = query_start[b + 1] - t0, length = seq_lens[b];
      if (n == 0) continue;
      // row i sits at position length - n + i and sees keys [first(i), length - n + 1 + i), or with a tree
      // mask the context and its ancestors
      const int64_t context = length - n;
      auto first = [&](int64_t i) { return window > 0 ? std::max<int64_t>(0, context + 1 + i - window) : 0L; };
      auto sees = [&](int64_t i, int64_t pos) {
        if (pos < first(i)) return false;
        if (pos < context) return true;
        return tree_mask ? ((tree_mask[t0 + i] >> (pos - context)) & 1) != 0 : pos <= context + i;
      };
      const int64_t lo = first(0), span = length - lo, chains = n * group;  // chain c: row c / group, head c % group
      scores.assign(chains * span, 0.f);
      query.resize(chains * d);
      for (int64_t i = 0; i < n; ++i)
        for (int64_t g = 0; g < group; ++g)
          for (int64_t j = 0; j < d; ++j)
            query[(i * group + g) * d + j] = f32(q[((t0 + i) * hq + h * group + g) * d + j]);
      // the key (kv 0) or value (1) of position pos, head h, in fp32 (a quantized cache's: code * scale)
      auto widen = [&](int64_t pos, int kv, float* dst) {
        const int64_t block = tables[b * width + pos / block_size];
        const int64_t at = ((block * 2 + kv) * block_size + pos % block_size) * hkv + h;
        const C* src = cache + at * d;
        if constexpr (std::is_same_v<C, T>) {
          for (int64_t j = 0; j < vec; j += 8) _mm256_storeu_ps(dst + j, load8(src + j));
          for (int64_t j = vec; j < d; ++j) dst[j] = f32(src[j]);
        } else if constexpr (std::is_same_v<C, int8_t>) {
          const float s = cache_scales[at];
          const __m256 s8 = _mm256_set1_ps(s);
          for (int64_t j = 0; j < vec; j += 8) {
            const __m128i codes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(src + j));
            _mm256_storeu_ps(dst + j, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(codes)), s8));
          }
          for (int64_t j = vec; j < d; ++j) dst[j] = static_cast<float>(src[j]) * s;
        } else {
          const float s = cache_scales[at];
          for (int64_t j = 0; j < d; ++j) dst[j] = static_cast<float>(src[j]) * s;
        }
      };
      // K and V of positions lo .. length - 1 in fp32, read once for all the request's rows: [(pos - lo) * d + j]
      keys.resize(span * d);
      values.resize(span * d);
      for (int64_t pos = lo; pos < length; ++pos) {
        widen(pos, 0, keys.data() + (pos - lo) * d);
        widen(pos, 1, values.data() + (pos - lo) * d);
      }
      // a score: q . k per lane over [0, vec), the lanes summed (hsum), then the tail dims in order, scaled,
      // soft-capped; four positions at a time where a row sees all four (each score's sums are the same)
      auto finish = [&](__m256 lanes, const float* qc, const float* k) {
        float s = hsum(lanes);
        for (int64_t j = vec; j < d; ++j) s += qc[j] * k[j];
        s *= scale;
        return softcap > 0.f ? std::tanh(s / softcap) * softcap : s;
      };
      for (int64_t c = 0; c < chains; ++c) {
        const int64_t i = c / group;
        const float* qc = query.data() + c * d;
        float* sc = scores.data() + c * span;  // sc[pos - lo]
        for (int64_t pos = lo; pos < length;) {
          const float* k = keys.data() + (pos - lo) * d;
          if (pos + 4 <= length && sees(i, pos) && sees(i, pos + 3) && sees(i, pos + 1) && sees(i, pos + 2)) {
            __m256 l0 = _mm256_setzero_ps(), l1 = l0, l2 = l0, l3 = l0;
            for (int64_t j = 0; j < vec; j += 8) {
              const __m256 qj = _mm256_loadu_ps(qc + j);
              l0 = _mm256_add_ps(l0, _mm256_mul_ps(qj, _mm256_loadu_ps(k + j)));
              l1 = _mm256_add_ps(l1, _mm256_mul_ps(qj, _mm256_loadu_ps(k + d + j)));
              l2 = _mm256_add_ps(l2, _mm256_mul_ps(qj, _mm256_loadu_ps(k + 2 * d + j)));
              l3 = _mm256_add_ps(l3, _mm256_mul_ps(qj, _mm256_loadu_ps(k + 3 * d + j)));
            }
            sc[pos - lo] = finish(l0, qc, k);
            sc[pos - lo + 1] = finish(l1, qc, k + d);
            sc[pos - lo + 2] = finish(l2, qc, k + 2 * d);
            sc[pos - lo + 3] = finish(l3, qc, k + 3 * d);
            pos += 4;
            continue;
          }
          if (sees(i, pos)) {
            __m256 lanes = _mm256_setzero_ps();
            for (int64_t j = 0; j < vec; j += 8)
              lanes = _mm256_add_ps(lanes, _mm256_mul_ps(_mm256_loadu_ps(qc + j), _mm256_loadu_ps(k + j)));
            sc[pos - lo] = finish(lanes, qc, k);
          }
          ++pos;
        }
      }
      // softmax of each chain over its keys, in position order
      totals.resize(chains);
      for (int64_t c = 0; c < chains; ++c) {
        float* sc = scores.data() + c * span;  // sc[pos - lo]
        float top = -std::numeric_limits<float>::infinity();
        for (int64_t pos = lo; pos < length; ++pos)
          if (sees(c / group, pos)) top = std::max(top, sc[pos - lo]);
        float total = 0.f;
        for (int64_t pos = lo; pos < length; ++pos)
          if (sees(c / group, pos)) total += (sc[pos - lo] = std::exp(sc[pos - lo] - top));
        // the weights e^s / total, 0 where the row does not see the position
        for (int64_t pos = lo; pos < length; ++pos) sc[pos - lo] = sees(c / group, pos) ? sc[pos - lo] / total : 0.f;
      }
      // out = sum over the positions a row sees, in order, of weight * v: each dim its own running sum, held in
      // registers 64 dims at a time
      acc.assign(chains * d, 0.f);
      for (int64_t c = 0; c < chains; ++c) {
        const int64_t i = c / group;
        const float* w = scores.data() + c * span;
        float* a = acc.data() + c * d;
        int64_t j0 = 0;
        for (; j0 + 64 <= vec; j0 += 64) {
          __m256 r[8];
          for (int u = 0; u < 8; ++u) r[u] = _mm256_setzero_ps();
          for (int64_t pos = lo; pos < length; ++pos) {
            if (!sees(i, pos)) continue;
            const __m256 w8 = _mm256_set1_ps(w[pos - lo]);
            const float* v = values.data() + (pos - lo) * d + j0;
            for (int u = 0; u < 8; ++u) r[u] = _mm256_add_ps(r[u], _mm256_mul_ps(w8, _mm256_loadu_ps(v + 8 * u)));
          }
          for (int u = 0; u < 8; ++u) _mm256_storeu_ps(a + j0 + 8 * u, r[u]);
        }
        for (; j0 < vec; j0 += 8) {
          __m256 r = _mm256_setzero_ps();
          for (int64_t pos = lo; pos < length; ++pos)
            if (sees(i, pos))
              r = _mm256_add_ps(r, _mm256_mul_ps(_mm256_set1_ps(w[pos - lo]),
                                                 _mm256_loadu_ps(values.data() + (pos - lo) * d + j0)));
          _mm256_storeu_ps(a + j0, r);
        }
        for (int64_t j = vec; j < d; ++j)
          for (int64_t pos = lo; pos < length; ++pos)
            if (sees(i, pos)) a[j] += w[pos - lo] * values[(pos - lo) * d + j];
      }
      for (int64_t c = 0; c < chains; ++c) {
        T* o = out + ((t0 + c / group) * hq + h * group + c % group) * d;
        for (int64_t j = 0; j < d; ++j) o[j] = round_to<T>(acc[c * d + j]);
      }
    }
  });
}

at::Tensor row_attention(at::Tensor q, at::Tensor cache, at::Tensor block_tables, at::Tensor seq_lens,
                         at::Tensor query_start_loc, double scale, double softcap, int64_t window, int64_t max_rows,
                         c10::optional<at::Tensor> tree_mask, c10::optional<at::Tensor> scales) {
  for (auto& [t, name] : {std::pair{&q, "q"}, {&cache, "cache"}, {&block_tables, "block_tables"},
                          {&seq_lens, "seq_lens"}, {&query_start_loc, "query_start_loc"}})
    check_cpu(*t, name);
  TORCH_CHECK(q.dim() == 3 && cache.dim() == 5 && cache.size(4) == q.size(2) && q.size(1) % cache.size(3) == 0,
              "q (T, Hq, D), cache (blocks, 2, block_size, Hkv, D)");
  const float* scale_data = checked_scales(cache, scales, q.scalar_type());
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt &&
                  query_start_loc.scalar_type() == at::kInt, "block_tables, seq_lens and query_start_loc int32");
  const int64_t batch = seq_lens.size(0);
  TORCH_CHECK(block_tables.size(0) == batch && query_start_loc.size(0) == batch + 1, "one table row per request");
  const int32_t* starts = query_start_loc.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  TORCH_CHECK(starts[0] == 0 && starts[batch] == q.size(0), "query_start_loc must span q's rows");
  for (int64_t b = 0; b < batch; ++b)
    TORCH_CHECK(starts[b] <= starts[b + 1] && starts[b + 1] - starts[b] <= lens[b] &&
                    (lens[b] + cache.size(2) - 1) / cache.size(2) <= block_tables.size(1),
                "request ", b, ": rows within its context, its context within its block table");
  const int64_t* mask = nullptr;
  if (tree_mask) {
    check_cpu(*tree_mask, "tree_mask");
    TORCH_CHECK(tree_mask->scalar_type() == at::kLong && tree_mask->dim() == 1 && tree_mask->size(0) == q.size(0),
                "tree_mask: (T,) int64, one per query row");
    TORCH_CHECK(window == 0 && max_rows <= 64, "a tree mask takes no window and at most 64 rows per request");
    mask = tree_mask->data_ptr<int64_t>();
  }
  auto out = at::empty_like(q);
  auto run = [&](auto* typed_q) {
    using T = std::remove_pointer_t<decltype(typed_q)>;
    with_cache_elements<T>(cache, [&](auto* typed_cache) {
      using C = std::remove_pointer_t<decltype(typed_cache)>;
      row_attention_impl<T, C>(typed_q, typed_cache, scale_data, block_tables.data_ptr<int32_t>(), lens, starts,
                               out.data_ptr<T>(), batch, q.size(1), cache.size(3), q.size(2), cache.size(2),
                               block_tables.size(1), static_cast<float>(scale), static_cast<float>(softcap), window,
                               max_rows, mask);
    });
  };
  if (q.scalar_type() == at::kFloat) {
    run(q.data_ptr<float>());
  } else {
    TORCH_CHECK(q.scalar_type() == at::kBFloat16, "row_attention takes bfloat16 or float32");
    run(q.data_ptr<at::BFloat16>());
  }
  return out;
}

// silu(gate) * up, gate and up (rows, I) with unit column stride (views of the gate_up linear's split output):
// silu rounded to the dtype, then the product (the reference's two dtype ops)
template <typename T>
void silu_mul_rows(const T* gate, const T* up, T* out, int64_t rows, int64_t inter, int64_t gate_stride,
                   int64_t up_stride) {
  at::parallel_for(0, rows, GRAIN_ITEM, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* g_row = gate + r * gate_stride;
      const T* u_row = up + r * up_stride;
      for (int64_t i = 0; i < inter; ++i) {
        const float g = f32(g_row[i]);
        out[r * inter + i] = round_to<T>(f32(round_to<T>(g / (1.f + std::exp(-g)))) * f32(u_row[i]));
      }
    }
  });
}

at::Tensor silu_mul(at::Tensor gate, at::Tensor up) {
  TORCH_CHECK(gate.device().is_cpu() && up.device().is_cpu(), "gate and up must be CPU tensors");
  TORCH_CHECK(gate.dim() == 2 && up.sizes() == gate.sizes() && up.scalar_type() == gate.scalar_type(),
              "gate and up (rows, I) of one dtype");
  TORCH_CHECK(gate.stride(1) == 1 && up.stride(1) == 1, "gate and up need unit column strides");
  auto out = at::empty(gate.sizes(), gate.options().memory_format(at::MemoryFormat::Contiguous));
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, gate.scalar_type(), "silu_mul", [&] {
    silu_mul_rows<scalar_t>(gate.data_ptr<scalar_t>(), up.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(),
                            gate.size(0), gate.size(1), gate.stride(0), up.stride(0));
  });
  return out;
}

namespace {

struct Candidate {
  float value;
  int64_t index;
};

// a ranks before b: the larger value, NaN above every number (as torch.topk and argmax rank it), the smaller index
// on a tie (argmax's first occurrence)
inline bool ranks_before(const Candidate& a, const Candidate& b) {
  const bool a_nan = std::isnan(a.value), b_nan = std::isnan(b.value);
  if (a_nan || b_nan) return a_nan && (!b_nan || a.index < b.index);
  return a.value > b.value || (a.value == b.value && a.index < b.index);
}

// the k best of v[begin, end) into best[0 .. k), best first; k <= end - begin. Scanning in index order, a value
// equal to the k-th best comes later and loses, so 8 values at a time are skipped unless one is above the k-th or
// NaN (not <= it); at most k insertions a row are typical.
void top_of_range(const float* v, int64_t begin, int64_t end, int64_t k, Candidate* best) {
  int64_t n = 0;
  auto offer = [&](int64_t i) {
    const Candidate c{v[i], i};
    if (n == k && !ranks_before(c, best[k - 1])) return;
    int64_t j = n < k ? n++ : k - 1;
    for (; j > 0 && ranks_before(c, best[j - 1]); --j) best[j] = best[j - 1];
    best[j] = c;
  };
  int64_t i = begin;
  for (; i < end && n < k; ++i) offer(i);
  __m256 kth = _mm256_set1_ps(best[k - 1].value);
  for (; i + 32 <= end; i += 32) {
    const __m256 above = _mm256_or_ps(
        _mm256_or_ps(_mm256_cmp_ps(_mm256_loadu_ps(v + i), kth, _CMP_NLE_UQ),
                     _mm256_cmp_ps(_mm256_loadu_ps(v + i + 8), kth, _CMP_NLE_UQ)),
        _mm256_or_ps(_mm256_cmp_ps(_mm256_loadu_ps(v + i + 16), kth, _CMP_NLE_UQ),
                     _mm256_cmp_ps(_mm256_loadu_ps(v + i + 24), kth, _CMP_NLE_UQ)));
    if (_mm256_movemask_ps(above) == 0) continue;
    for (int64_t j = i; j < i + 32; ++j) offer(j);
    kth = _mm256_set1_ps(best[k - 1].value);
  }
  for (; i < end; ++i) offer(i);
}

}  // namespace

at::Tensor top_k(at::Tensor logits, int64_t k) {
  check_cpu(logits, "logits");
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat, "logits (M, V) float32");
  const int64_t rows = logits.size(0), width = logits.size(1);
  TORCH_CHECK(k >= 1 && k <= width, "k must be in [1, ", width, "], got ", k);
  // a row split into chunks of at least CHUNK values (and k), one task each, merged in chunk order
  constexpr int64_t CHUNK = 16384;
  const int64_t chunks = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), width / std::max(CHUNK, k)));
  const int64_t span = (width + chunks - 1) / chunks;
  std::vector<Candidate> found(rows * chunks * k);
  std::vector<int64_t> counts(rows * chunks);
  const float* v = logits.data_ptr<float>();
  at::parallel_for(0, rows * chunks, GRAIN_ITEM, [&](int64_t first, int64_t last) {
    for (int64_t t = first; t < last; ++t) {
      const int64_t r = t / chunks, begin = (t % chunks) * span, end = std::min(width, begin + span);
      counts[t] = std::min(k, end - begin);
      top_of_range(v + r * width, begin, end, counts[t], found.data() + t * k);
    }
  });
  auto out = at::empty({rows, k}, logits.options().dtype(at::kLong));
  int64_t* o = out.data_ptr<int64_t>();
  std::vector<Candidate> merged;
  for (int64_t r = 0; r < rows; ++r) {
    merged.clear();
    for (int64_t c = 0; c < chunks; ++c) {
      const Candidate* f = found.data() + (r * chunks + c) * k;
      merged.insert(merged.end(), f, f + counts[r * chunks + c]);
    }
    std::partial_sort(merged.begin(), merged.begin() + k, merged.end(), ranks_before);
    for (int64_t j = 0; j < k; ++j) o[r * k + j] = merged[j].index;
  }
  return out;
}

}  // namespace optc::ops
