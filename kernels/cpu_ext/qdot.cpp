// Grouped integer-code linears for batch-1 / few-row decode on the CPU: y (M, N) = x (M, K) @ W^T.
//
// W is the artifact's own parts: codes (int4 packed k8_lsb in int32 words, or int8 row-major), a float32
// scale per row and group of G inputs (G a multiple of 32), optionally a float32 minimum per group and an
// integer zero point z per group (held as the float32 product s * z) or a constant code offset:
//     w = s * (code - offset_or_z) + min
// The activation row is quantized once per call in blocks of 32 to integers xq = round(x / dx), with the block's
// integer sum and its exact float sum. A block's product is then one integer dot product (codes x xq, exact in
// int32) and fp32 terms:
//     sum_i w_i x_i ~= s * dx * (sum_i code_i xq_i - offset * sum_i xq_i) + min * sum_i x_i
// The only rounding beyond fp32's is x -> dx * xq (at most dx / 2 an element).
//
// int8 codes: xq is int16, dx = max|x| / 32767 (2^-16 of the block's largest |x|), multiplied with vpmaddwd.
// int4 codes: xq = 128 * q + r, dx = max|x| / (127 * 128) (2^-15 of the largest |x|), held as an int8 pair:
// q = round(xq / 128) in [-127, 127] and r = xq - 128 q in [-64, 64]. The codes are unsigned nibbles (0..15), so
// both halves go through llama.cpp's u8 x s8 instructions (vpmaddubsw, vpdpbusd: 32 products an instruction)
// without a sign trick or saturation (2 * 15 * 127 < 2^15), and code . xq = 128 (code . q) + code . r exactly.
// Why not llama.cpp's single int8 (q alone, 2^-8 of the largest |x|): SmolLM2's kept Q4_1 build lost +0.015 KL
// and 4.8% top-1 against its references with it (docs/PERF.md), the rounding of the small elements of a block
// that holds an outlier; the pair keeps int16's accuracy at int8's instruction count.
//
// Two ISA paths over 256-bit vectors (qdot_body.h, compiled once per ISA), chosen by the caller (`isa`): AVX2
// (vpmaddubsw / vpmaddwd) and AVX-512 VNNI (vpdpbusd / vpdpwssd on 256-bit registers, AVX512VL).
// Rows of W are split across threads (at::parallel_for); a pass over a weight row serves up to 4 rows of x.
#include <torch/types.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "cpu_ext.h"
#include "qdot.h"

namespace optc::qdot {

namespace {

constexpr int BLOCK = 32;  // inputs per activation block
constexpr int MAX_ROWS = 4;  // rows of x per pass over a weight row
constexpr int64_t PREFETCH_ROWS = 6;  // weight rows ahead that rows_dot prefetches
constexpr float QMAX8 = 32767.f;  // int8 codes: int16 activations
constexpr float QMAX4 = 127.f * 128.f;  // int4 codes: 128 * q + r, q in [-127, 127], r in [-64, 64]
constexpr int PAIR_BYTES = 4 * BLOCK;  // int4 codes: a pair of blocks' activations, q then r (quantize's layout)

struct Acts {  // x quantized per block: xq (M, K) int16 (int8 codes) or pairs (M, pairs * PAIR_BYTES) int8 (int4
              // codes; quantize's layouts), and per row, padded with zeros to whole chunks of 8 blocks: dx,
              // dx * sum(xq), sum(x)
  const int16_t* xq;
  const int8_t* pairs;
  int64_t pair_row;  // bytes of a row of `pairs`
  const float* dx;
  const float* dxsum;
  const float* fsum;
  int64_t k;
  int64_t num_blocks;
  int64_t padded_blocks;
};

struct Weights {
  const uint8_t* codes;  // row n: bytes [n * row_bytes, (n + 1) * row_bytes)
  int64_t row_bytes;
  const float* scales;  // (N, K / G)
  const float* mins;  // (N, K / G) or null
  const float* soff;  // (N, K / G) scale * zero point, or null: then scale * `offset`
  float offset;
  int64_t blocks_per_group;  // G / 32: 1, 2, 4 or 8, or any when num_groups is 1
  int64_t num_groups;
  int bits;
};

}  // namespace

namespace avx2 {
#pragma GCC push_options
#pragma GCC target("avx2,fma")
#define QDOT_VNNI 0
#include "qdot_body.h"
#undef QDOT_VNNI
#pragma GCC pop_options
}  // namespace avx2

namespace avx512 {
#pragma GCC push_options
#pragma GCC target("avx2,fma,avx512f,avx512bw,avx512vl,avx512vnni")
#define QDOT_VNNI 1
#include "qdot_body.h"
#undef QDOT_VNNI
#pragma GCC pop_options
}  // namespace avx512

// x (M, K) float32 or bfloat16; qweight (N, K / 8) int32 (bits 4) or (N, K) int8 (bits 8); scales (N, K / G)
// float32; mins and soff (scale * zero point): (N, K / G) float32 or empty. Returns (M, N) in x's dtype.
torch::Tensor qlinear(torch::Tensor x, torch::Tensor qweight, int64_t bits, int64_t group_size, torch::Tensor scales,
                      torch::Tensor mins, torch::Tensor soff, double offset, int64_t isa) {
  TORCH_CHECK(x.dim() == 2 && qweight.dim() == 2, "x and qweight must be 2-D");
  TORCH_CHECK(bits == 4 || bits == 8, "bits must be 4 or 8");
  TORCH_CHECK(isa == AVX2 || isa == AVX512_VNNI, "isa must be 2 (AVX2) or 3 (AVX-512 VNNI)");
  const int64_t m = x.size(0), k = x.size(1), n = qweight.size(0);
  TORCH_CHECK(group_size % BLOCK == 0 && k % group_size == 0, "K must be a multiple of G, G of 32");
  TORCH_CHECK(qweight.is_contiguous() && qweight.size(1) * qweight.element_size() * 8 == k * bits,
              "qweight must be contiguous (N, K * bits / 8 bytes)");
  TORCH_CHECK(bits == 4 ? qweight.scalar_type() == at::kInt : qweight.scalar_type() == at::kChar,
              "qweight must be int32 for bits 4, int8 for bits 8");
  const int64_t num_groups = k / group_size;
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.numel() == n * num_groups,
              "scales must be contiguous float32 (N, K / G)");
  TORCH_CHECK(!mins.numel() || (mins.scalar_type() == at::kFloat && mins.is_contiguous() &&
                                mins.numel() == n * num_groups), "mins must be contiguous float32 (N, K / G)");
  TORCH_CHECK(!soff.numel() || (soff.scalar_type() == at::kFloat && soff.is_contiguous() &&
                                soff.numel() == n * num_groups), "soff must be contiguous float32 (N, K / G)");
  TORCH_CHECK(num_groups == 1 || 256 % group_size == 0, "G must divide 256 (or be K)");
  const torch::Tensor xf = x.to(at::kFloat).contiguous();
  const int64_t nb = k / BLOCK, padded = (nb + 7) / 8 * 8;
  const int64_t pair_row = bits == 4 ? (nb + 1) / 2 * PAIR_BYTES : 0;
  torch::Tensor xq = bits == 4 ? torch::empty({m, pair_row}, x.options().dtype(at::kChar))
                               : torch::empty({m, k}, x.options().dtype(at::kShort));
  int16_t* xq16 = bits == 4 ? nullptr : xq.data_ptr<int16_t>();
  int8_t* pairs = bits == 4 ? xq.data_ptr<int8_t>() : nullptr;
  torch::Tensor stats = torch::empty({3, m, padded}, x.options().dtype(at::kFloat));
  float* st = stats.data_ptr<float>();
  float *dx = st, *dxsum = st + m * padded, *fsum = st + 2 * m * padded;
  if (isa == AVX512_VNNI) {
    avx512::quantize(xf.data_ptr<float>(), m, k, xq16, pairs, pair_row, dx, dxsum, fsum, padded);
  } else {
    avx2::quantize(xf.data_ptr<float>(), m, k, xq16, pairs, pair_row, dx, dxsum, fsum, padded);
  }
  const Acts a{xq16, pairs, pair_row, dx, dxsum, fsum, k, nb, padded};
  const Weights w{static_cast<const uint8_t*>(qweight.data_ptr()), k * bits / 8, scales.data_ptr<float>(),
                  mins.numel() ? mins.data_ptr<float>() : nullptr, soff.numel() ? soff.data_ptr<float>() : nullptr,
                  static_cast<float>(offset), group_size / BLOCK, num_groups, static_cast<int>(bits)};
  torch::Tensor y = torch::empty({m, n}, x.options().dtype(at::kFloat));
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, n, GRAIN_QDOT_ROWS, [&](int64_t lo, int64_t hi) {
    if (isa == AVX512_VNNI) {
      avx512::rows_dot(a, w, m, lo, hi, yp, n);
    } else {
      avx2::rows_dot(a, w, m, lo, hi, yp, n);
    }
  });
  return x.scalar_type() == at::kFloat ? y : y.to(x.scalar_type());
}

// how many threads an at::parallel_for of `items` ran on: more than one only where this file was compiled with
// OpenMP (at::parallel_for is a header; without it the whole range runs on the calling thread)
int64_t threads_used(int64_t items) {
  std::vector<int> used(at::get_num_threads(), 0);
  at::parallel_for(0, items, GRAIN_ITEM, [&](int64_t, int64_t) { used[at::get_thread_num()] = 1; });
  int64_t n = 0;
  for (int u : used) n += u;
  return n;
}

}  // namespace optc::qdot
