// Dense bfloat16 linears for decode and speculative verification on the CPU: y (M, N) = x (M, K) @ W^T, x and W
// bfloat16, sums in float32, one pass over W for every row of x.
//
// Why: torch's bfloat16 matmul on the CPU reads the weight once per row where it cannot run oneDNN's GEMM (capped
// to AVX2, every row is a gemv: a verification's k + 1 rows cost k + 1 decode steps), and its one-row gemv and its
// few-row GEMM sum in different orders, so a decode row and the same row in a verification differ in the last bit
// (the linear node paid for two rows at every decode step to agree). Here a row's sums do not depend on how many
// rows the call has: each output is the same sequence of operations whatever M is and wherever the row sits.
//
// The sums are AVX-512 BF16's: W's row and x's row are walked in chunks of 32 elements, 16 float32 lanes, lane i
// accumulating the pair (2i, 2i + 1) of every chunk as vdpbf16ps does (the odd product, then the even one; a
// bfloat16 product is exact in float32), and the 16 lanes are summed in a fixed tree. The AVX2 path computes the
// same lanes with FMAs on the pairs' halves, so both paths give equal results (except where vdpbf16ps flushes a
// subnormal input or sum to zero). Threads split the output features (at::parallel_for) and walk their weight
// rows in memory order (`Path`: the passes over them).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <cstdint>
#include <algorithm>

#include "bf16dot.h"
#include "cpu_ext.h"

namespace optc::bf16dot {

constexpr int64_t CHUNK = 32;  // elements of K per step: 16 lanes of pairs

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512bf16")
// out[m * ldo + j] for NR weight rows from w and MR rows of x: NR x MR accumulators, one vdpbf16ps chain each
template <int NR, int MR>
void rows_avx512(const uint16_t* w, const uint16_t* x, int64_t k, float* out, int64_t ldo) {
  __m512 acc[NR][MR];
  for (int j = 0; j < NR; ++j)
    for (int m = 0; m < MR; ++m) acc[j][m] = _mm512_setzero_ps();
  for (int64_t c = 0; c < k; c += CHUNK) {
    __m512bh wv[NR];
    for (int j = 0; j < NR; ++j) wv[j] = (__m512bh)_mm512_loadu_si512(w + j * k + c);
    for (int m = 0; m < MR; ++m) {
      const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + m * k + c);
      for (int j = 0; j < NR; ++j) acc[j][m] = _mm512_dpbf16_ps(acc[j][m], xv, wv[j]);
    }
  }
  for (int j = 0; j < NR; ++j)
    for (int m = 0; m < MR; ++m)
      out[m * ldo + j] = hsum(_mm256_add_ps(
          _mm512_castps512_ps256(acc[j][m]), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc[j][m]), 1))));
}
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma")
// a chunk's half (16 elements: pairs 8h .. 8h + 7) as its odd and its even elements in float32
inline void halves(const uint16_t* p, __m256& odd, __m256& even) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  odd = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
  even = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
}

template <int MR>
void rows_avx2(const uint16_t* w, const uint16_t* x, int64_t k, float* out, int64_t ldo) {
  __m256 acc[MR][2];
  for (int m = 0; m < MR; ++m) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
  for (int64_t c = 0; c < k; c += CHUNK) {
    for (int h = 0; h < 2; ++h) {
      __m256 wo, we, xo, xe;
      halves(w + c + 16 * h, wo, we);
      for (int m = 0; m < MR; ++m) {
        halves(x + m * k + c + 16 * h, xo, xe);
        acc[m][h] = _mm256_fmadd_ps(xe, we, _mm256_fmadd_ps(xo, wo, acc[m][h]));
      }
    }
  }
  for (int m = 0; m < MR; ++m) out[m * ldo] = hsum(_mm256_add_ps(acc[m][0], acc[m][1]));
}
#pragma GCC pop_options

// A path's passes: up to `mr` rows of x over one weight row at a time (decode and short verifications: one
// sequential stream a thread, which the hardware prefetchers follow; 4 rows at a time read 25% less bandwidth),
// and from `tile_from` rows of x on, `mr_tile` rows over `nr` weight rows at a time (fewer loads a product, for
// longer verifications and prefills). AVX-512: 8 rows (8 independent vdpbf16ps chains hide its latency), tiles of
// 4 x 6 (24 of 32 zmm registers); AVX2: 4 rows (16 ymm registers: 8 accumulators, the weight's and x's halves).
using Rows = void (*)(const uint16_t*, const uint16_t*, int64_t, float*, int64_t);

struct Path {
  int64_t mr;
  Rows rows[8];  // [mr - 1]: one weight row
  int64_t tile_from, nr, mr_tile;  // tile_from 0: no tiles
  Rows tiles[6];  // [mr - 1]: nr weight rows
};

const Path& path(int64_t isa) {
  static const Path avx512{8,
                           {rows_avx512<1, 1>, rows_avx512<1, 2>, rows_avx512<1, 3>, rows_avx512<1, 4>,
                            rows_avx512<1, 5>, rows_avx512<1, 6>, rows_avx512<1, 7>, rows_avx512<1, 8>},
                           9, 4, 6,
                           {rows_avx512<4, 1>, rows_avx512<4, 2>, rows_avx512<4, 3>, rows_avx512<4, 4>,
                            rows_avx512<4, 5>, rows_avx512<4, 6>}};
  static const Path avx2{4, {rows_avx2<1>, rows_avx2<2>, rows_avx2<3>, rows_avx2<4>}, 0, 1, 0, {}};
  TORCH_CHECK(isa == AVX512_BF16 || isa == AVX2, "bf16dot: unknown isa ", isa);
  return isa == AVX512_BF16 ? avx512 : avx2;
}

// x (M, K) bfloat16, w (N, K) bfloat16, K a multiple of 32 -> (M, N) float32
at::Tensor bf16dot(const at::Tensor& x, const at::Tensor& w, int64_t isa) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "bf16dot: x (M, K) and w (N, K)");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16, "bf16dot: bfloat16 x and w");
  TORCH_CHECK(x.size(1) % CHUNK == 0, "bf16dot: K must be a multiple of 32, got ", x.size(1));
  const at::Tensor xc = x.contiguous(), wc = w.contiguous();
  const int64_t m = xc.size(0), n = wc.size(0), k = xc.size(1);
  at::Tensor out = at::empty({m, n}, x.options().dtype(at::kFloat));
  const Path& p = path(isa);
  const auto* xp = reinterpret_cast<const uint16_t*>(xc.data_ptr<at::BFloat16>());
  const auto* wp = reinterpret_cast<const uint16_t*>(wc.data_ptr<at::BFloat16>());
  float* op = out.data_ptr<float>();
  const bool tiled = p.tile_from > 0 && m >= p.tile_from;
  at::parallel_for(0, n, GRAIN_BF16DOT_ROWS, [&](int64_t begin, int64_t end) {
    int64_t r = begin;
    for (; tiled && r + p.nr <= end; r += p.nr)
      for (int64_t m0 = 0; m0 < m; m0 += p.mr_tile)
        p.tiles[std::min(p.mr_tile, m - m0) - 1](wp + r * k, xp + m0 * k, k, op + m0 * n + r, n);
    for (; r < end; ++r)
      for (int64_t m0 = 0; m0 < m; m0 += p.mr)
        p.rows[std::min(p.mr, m - m0) - 1](wp + r * k, xp + m0 * k, k, op + m0 * n + r, n);
  });
  return out;
}

}  // namespace optc::bf16dot
