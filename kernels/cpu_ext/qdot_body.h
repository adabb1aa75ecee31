// The ISA-specific half of qdot.cpp, included once per ISA inside a `#pragma GCC target` region and a namespace
// of its own, with QDOT_VNNI 0 (AVX2: vpmaddubsw, vpmaddwd, vpaddd) or 1 (AVX-512 VNNI: vpdpbusd, vpdpwssd on
// 256-bit registers, AVX512VL). Everything here is compiled for that ISA only, so the AVX2 copy never runs an
// AVX-512 instruction.
//
// A weight row is walked in chunks of 8 blocks of 32: each block's integer dot product is reduced to one lane of
// a chunk vector [B0 .. B7] (vphaddd tree), and the fp32 arithmetic then runs on 8 blocks at once:
// acc += B * s * dx + min * sum(x) - s * offset * dx * sum(xq), the per-group values spread over their blocks'
// lanes (group_vector). int4 codes are read two blocks (32 bytes) at a time, so a dot product gives 4 lanes a
// block and the tree is 3 vphaddd a chunk; int8 codes, one block at a time, 8 lanes a block and 7 vphaddd.

// 32 int32 lanes (4 vectors, elements 0..31, each within int8) -> 32 int8 in element order
inline __m256i pack_bytes(const __m256i* v) {
  const __m256i lo = _mm256_permute4x64_epi64(_mm256_packs_epi32(v[0], v[1]), 0xD8);
  const __m256i hi = _mm256_permute4x64_epi64(_mm256_packs_epi32(v[2], v[3]), 0xD8);
  return _mm256_permute4x64_epi64(_mm256_packs_epi16(lo, hi), 0xD8);
}

// a block's 32 bytes -> its 16 even elements at out, its 16 odd ones at out + 32 (quantize's pair layout)
inline void store_even_odd(__m256i v, int8_t* out) {
  const __m256i split = _mm256_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15,
                                         0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
  const __m256i eo = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(v, split), 0xD8);  // [evens | odds]
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm256_castsi256_si128(eo));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 32), _mm256_extracti128_si256(eo, 1));
}

// x (M, K) float32 -> the integers of Acts (xq or pairs: the other null) and its per-block vectors (padded
// rows of `padded` blocks, pads zero). int4 codes: blocks 2p and 2p + 1 are pair p, PAIR_BYTES bytes
// [q even | q odd | r even | r odd], each 32 bytes [block 2p | block 2p + 1] of 16: the order in which 32 bytes
// of k8_lsb codes (two blocks) unpack into low nibbles (even elements) and high nibbles (odd); an odd last block
// pairs with zeros. Vector code, compiled per ISA: the same instructions and order on both paths, so their
// integers are equal.
void quantize(const float* x, int64_t m, int64_t k, int16_t* xq, int8_t* pairs, int64_t pair_row, float* dx,
              float* dxsum, float* fsum, int64_t padded) {
  const int64_t nb = k / BLOCK;
  const float qmax = pairs ? QMAX4 : QMAX8;
  if (pairs && nb % 2) {  // the odd last block's partner: zeros
    for (int64_t r = 0; r < m; ++r) {
      int8_t* last = pairs + r * pair_row + nb / 2 * PAIR_BYTES + 16;
      for (int h = 0; h < 4; ++h) std::fill(last + 32 * h, last + 32 * h + 16, int8_t{0});
    }
  }
  for (int64_t r = 0; r < m; ++r) {
    for (int64_t b = 0; b < padded; ++b) {
      const int64_t at = r * padded + b;
      if (b >= nb) {
        dx[at] = dxsum[at] = fsum[at] = 0.f;
        continue;
      }
      const float* v = x + r * k + b * BLOCK;
      __m256 vs[4], mx = _mm256_setzero_ps();
      const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
      for (int j = 0; j < 4; ++j) {
        vs[j] = _mm256_loadu_ps(v + 8 * j);
        mx = _mm256_max_ps(mx, _mm256_and_ps(vs[j], magnitude));
      }
      // the float sum as a tree (its order fixed here, the same on both paths), not a chain of 32 dependent adds
      const float sum = hsum(_mm256_add_ps(_mm256_add_ps(vs[0], vs[1]), _mm256_add_ps(vs[2], vs[3])));
      __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
      m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
      const float amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
      const float d = amax / qmax;
      const float id = d > 0.f ? 1.f / d : 0.f;
      __m256i xi[4];  // round(x / dx): vcvtps2dq rounds to nearest even (MXCSR's default), as nearbyint
      for (int j = 0; j < 4; ++j) xi[j] = _mm256_cvtps_epi32(_mm256_mul_ps(vs[j], _mm256_set1_ps(id)));
      __m256i total = _mm256_add_epi32(_mm256_add_epi32(xi[0], xi[1]), _mm256_add_epi32(xi[2], xi[3]));
      __m128i t4 = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
      t4 = _mm_add_epi32(t4, _mm_shuffle_epi32(t4, 0x4E));
      const int isum = _mm_cvtsi128_si32(_mm_add_epi32(t4, _mm_shuffle_epi32(t4, 0xB1)));
      if (!pairs) {  // packs interleaves the 128-bit halves; the 64-bit permute puts the elements back in order
        int16_t* out = xq + r * k + b * BLOCK;
        for (int h = 0; h < 2; ++h) {
          const __m256i v16 = _mm256_permute4x64_epi64(_mm256_packs_epi32(xi[2 * h], xi[2 * h + 1]), 0xD8);
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 16 * h), v16);
        }
      } else {
        int8_t* out = pairs + r * pair_row + b / 2 * PAIR_BYTES + (b % 2) * 16;
        __m256i q[4], rest[4];
        for (int j = 0; j < 4; ++j) {  // q = round(xi / 128), so |xi - 128 q| <= 64
          q[j] = _mm256_srai_epi32(_mm256_add_epi32(xi[j], _mm256_set1_epi32(64)), 7);
          rest[j] = _mm256_sub_epi32(xi[j], _mm256_slli_epi32(q[j], 7));
        }
        store_even_odd(pack_bytes(q), out);
        store_even_odd(pack_bytes(rest), out + 2 * BLOCK);
      }
      dx[at] = d;
      dxsum[at] = d * static_cast<float>(isum);
      fsum[at] = sum;
    }
  }
}

// int8 codes: block b's 32 codes (two vectors of 16 int16) dotted with its 32 int16 activations: 8 int32 lanes
inline __m256i block_dot(const uint8_t* codes, const int16_t* x) {
  const __m256i w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes)));
  const __m256i w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + 16)));
  const __m256i x0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
  const __m256i x1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 16));
#if QDOT_VNNI
  return _mm256_dpwssd_epi32(_mm256_madd_epi16(w0, x0), w1, x1);
#else
  return _mm256_add_epi32(_mm256_madd_epi16(w0, x0), _mm256_madd_epi16(w1, x1));
#endif
}

// int4 codes of a pair of blocks (32 bytes; `single`: only the first block's 16, the rest of the row not read)
// as unsigned bytes: lo [block 0 even elements | block 1 even], hi [.. odd | .. odd], quantize's pair order
inline void pair_codes(const uint8_t* codes, bool single, __m256i& lo, __m256i& hi) {
  const __m256i both = single ? _mm256_zextsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes)))
                              : _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes));
  const __m256i nibble = _mm256_set1_epi8(0x0F);
  lo = _mm256_and_si256(both, nibble);
  hi = _mm256_and_si256(_mm256_srli_epi16(both, 4), nibble);
}

// the pair's code . xq = 128 (code . q) + code . r as 8 int32 lanes [block 0: 4 | block 1: 4]; x is the pair's
// PAIR_BYTES of activations. AVX2: each vpmaddubsw lane sums 2 products (|.| <= 2 * 15 * 127: no saturation) and
// two of them add in int16 (<= 7620), then vpmaddwd by 128 (q) or 1 (r) sums lane pairs into int32
inline __m256i pair_dot(__m256i lo, __m256i hi, const int8_t* x) {
  const __m256i q0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
  const __m256i q1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 32));
  const __m256i r0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 64));
  const __m256i r1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 96));
#if QDOT_VNNI
  const __m256i q = _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(_mm256_setzero_si256(), lo, q0), hi, q1);
  return _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(_mm256_slli_epi32(q, 7), lo, r0), hi, r1);
#else
  const __m256i q = _mm256_add_epi16(_mm256_maddubs_epi16(lo, q0), _mm256_maddubs_epi16(hi, q1));
  const __m256i r = _mm256_add_epi16(_mm256_maddubs_epi16(lo, r0), _mm256_maddubs_epi16(hi, r1));
  return _mm256_add_epi32(_mm256_madd_epi16(q, _mm256_set1_epi16(128)), _mm256_madd_epi16(r, _mm256_set1_epi16(1)));
#endif
}

// the 8 blocks' sums of code * xq from chunk c for rows r0 .. r0 + ROWS, one lane a block (blocks past the row:
// zero), each block's codes loaded once for all rows
template <int ROWS>
void chunk_sums(const Acts& a, const uint8_t* codes, int bits, int64_t c, int64_t r0, __m256i* out) {
  const __m256i zero = _mm256_setzero_si256();
  if (bits == 4) {  // per row: 4 pairs [b 4 lanes | b + 1 4 lanes] -> [b0 b2 b4 b6 | b1 b3 b5 b7] -> [b0 .. b7]
    __m256i h[ROWS][2];
    for (int half = 0; half < 2; ++half) {
      __m256i d[ROWS][2];
      for (int e = 0; e < 2; ++e) {
        const int64_t b = c + 4 * half + 2 * e;
        if (b >= a.num_blocks) {
          for (int j = 0; j < ROWS; ++j) d[j][e] = zero;
          continue;
        }
        __m256i lo, hi;
        pair_codes(codes + b * BLOCK / 2, b + 1 == a.num_blocks, lo, hi);
        for (int j = 0; j < ROWS; ++j) d[j][e] = pair_dot(lo, hi, a.pairs + (r0 + j) * a.pair_row + b / 2 * PAIR_BYTES);
      }
      for (int j = 0; j < ROWS; ++j) h[j][half] = _mm256_hadd_epi32(d[j][0], d[j][1]);
    }
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (int j = 0; j < ROWS; ++j) out[j] = _mm256_permutevar8x32_epi32(_mm256_hadd_epi32(h[j][0], h[j][1]), order);
    return;
  }
  __m256i h[ROWS][4];  // per row: 8 blocks of 8 lanes, a vphaddd tree to [b0 .. b7]
  for (int p = 0; p < 4; ++p) {
    __m256i d[ROWS][2];
    for (int e = 0; e < 2; ++e) {
      const int64_t b = c + 2 * p + e;
      for (int j = 0; j < ROWS; ++j) {
        d[j][e] = b < a.num_blocks ? block_dot(codes + b * BLOCK, a.xq + (r0 + j) * a.k + b * BLOCK) : zero;
      }
    }
    for (int j = 0; j < ROWS; ++j) h[j][p] = _mm256_hadd_epi32(d[j][0], d[j][1]);
  }
  for (int j = 0; j < ROWS; ++j) {  // [d0..d3 low halves | high halves], [d4..d7 ..] -> [d0 .. d7]
    const __m256i lo = _mm256_hadd_epi32(h[j][0], h[j][1]), hi = _mm256_hadd_epi32(h[j][2], h[j][3]);
    out[j] = _mm256_add_epi32(_mm256_permute2x128_si256(lo, hi, 0x20), _mm256_permute2x128_si256(lo, hi, 0x31));
  }
}

// a weight row's per-group values for the 8 blocks of chunk c, one lane a block (groups past the row: zero)
inline __m256 group_vector(const float* row, const Weights& w, int64_t c) {
  if (w.num_groups == 1) return _mm256_set1_ps(row[0]);
  const int64_t bpg = w.blocks_per_group, g0 = c / bpg;
  const int valid = static_cast<int>(std::min<int64_t>(8 / bpg, w.num_groups - g0));
  const __m256 v = _mm256_maskload_ps(row + g0, _mm256_cmpgt_epi32(_mm256_set1_epi32(valid),
                                                                     _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)));
  if (bpg == 1) return v;
  const int shift = bpg == 2 ? 1 : bpg == 4 ? 2 : 3;  // lane j reads group j / bpg
  return _mm256_permutevar8x32_ps(v, _mm256_srli_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), shift));
}

// out[j] = y[r0 + j, n] for j < ROWS: one pass over weight row n, each block's codes loaded once for all rows
template <int ROWS>
void row_dot(const Acts& a, const Weights& w, int64_t n, int64_t r0, float* out) {
  __m256 acc[ROWS];
  for (int j = 0; j < ROWS; ++j) acc[j] = _mm256_setzero_ps();
  const uint8_t* codes = w.codes + n * w.row_bytes;
  const int64_t at = n * w.num_groups, nb = a.num_blocks;
  for (int64_t c = 0; c < nb; c += 8) {
    __m256i sums[ROWS];
    chunk_sums<ROWS>(a, codes, w.bits, c, r0, sums);
    const __m256 s = group_vector(w.scales + at, w, c);
    const __m256 soff = w.soff ? group_vector(w.soff + at, w, c) : _mm256_mul_ps(s, _mm256_set1_ps(w.offset));
    for (int j = 0; j < ROWS; ++j) {  // the activation's per-block vectors are padded with zeros to whole chunks
      const int64_t ab = (r0 + j) * a.padded_blocks + c;
      acc[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[j]), _mm256_mul_ps(s, _mm256_loadu_ps(a.dx + ab)), acc[j]);
      acc[j] = _mm256_fnmadd_ps(soff, _mm256_loadu_ps(a.dxsum + ab), acc[j]);
    }
    if (w.mins) {
      const __m256 mn = group_vector(w.mins + at, w, c);
      for (int j = 0; j < ROWS; ++j) {
        acc[j] = _mm256_fmadd_ps(mn, _mm256_loadu_ps(a.fsum + (r0 + j) * a.padded_blocks + c), acc[j]);
      }
    }
  }
  for (int j = 0; j < ROWS; ++j) out[j] = hsum(acc[j]);
}

// weight row n's codes and per-group values into L1, a few rows ahead of their use: the hardware prefetchers
// follow the codes but not the short per-row runs of scales and minimums, whose misses then stall each row.
// always_inline: GCC takes a function that only prefetches for one without side effects and drops its calls
__attribute__((always_inline)) inline void prefetch_row(const Weights& w, int64_t n) {
  const char* codes = reinterpret_cast<const char*>(w.codes + n * w.row_bytes);
  for (int64_t i = 0; i < w.row_bytes; i += 64) _mm_prefetch(codes + i, _MM_HINT_T0);
  const int64_t at = n * w.num_groups, bytes = w.num_groups * 4;
  const char* scales = reinterpret_cast<const char*>(w.scales + at);
  const char* mins = reinterpret_cast<const char*>((w.mins ? w.mins : w.soff ? w.soff : w.scales) + at);
  for (int64_t i = 0; i < bytes; i += 64) {  // int4_g's zero points or GGUF's minimums: one or neither
    _mm_prefetch(scales + i, _MM_HINT_T0);
    _mm_prefetch(mins + i, _MM_HINT_T0);
  }
}

// y (M, N) float32, columns [lo, hi)
void rows_dot(const Acts& a, const Weights& w, int64_t m, int64_t lo, int64_t hi, float* y, int64_t n_total) {
  float out[MAX_ROWS];
  for (int64_t n = lo; n < hi; ++n) {
    prefetch_row(w, n + PREFETCH_ROWS);  // past the last row: harmless, a prefetch never faults
    for (int64_t r0 = 0; r0 < m; r0 += MAX_ROWS) {
      const int64_t rows = std::min<int64_t>(MAX_ROWS, m - r0);
      switch (rows) {
        case 4: row_dot<4>(a, w, n, r0, out); break;
        case 3: row_dot<3>(a, w, n, r0, out); break;
        case 2: row_dot<2>(a, w, n, r0, out); break;
        default: row_dot<1>(a, w, n, r0, out); break;
      }
      for (int64_t j = 0; j < rows; ++j) y[(r0 + j) * n_total + n] = out[j];
    }
  }
}
