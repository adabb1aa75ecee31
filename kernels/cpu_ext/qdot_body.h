// The ISA-specific half of qdot.cpp, included once per ISA inside a `#pragma GCC target` region and a namespace
// of its own, with QDOT_VNNI 0 (AVX2: vpmaddwd + vpaddd) or 1 (AVX-512 VNNI: vpdpwssd on 256-bit registers,
// AVX512VL). Everything here is compiled for that ISA only, so the AVX2 copy never runs an AVX-512 instruction.
//
// A weight row is walked in chunks of 8 blocks of 32: each block's integer dot product (8 int32 lanes) is
// reduced to one lane of a chunk vector [B0 .. B7] (vphaddd tree), and the fp32 arithmetic then runs on 8
// blocks at once: acc += B * s * dx + min * sum(x) - s * offset * dx * sum(xq), the per-group values spread
// over their blocks' lanes (group_vector).

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// sum of w * x over each pair of int16 lanes into 8 int32 lanes, added to acc
inline __m256i dot_add(__m256i acc, __m256i w, __m256i x) {
#if QDOT_VNNI
  return _mm256_dpwssd_epi32(acc, w, x);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(w, x));
#endif
}

// block b's 32 codes as two vectors of 16 int16 (int4: the low nibbles, even elements, then the high nibbles, odd
// elements: quantize's int4 layout), dotted with the block's 32 int16 activations: 8 int32 lanes
inline __m256i block_dot(const uint8_t* codes, int bits, const int16_t* x, __m256i acc) {
  __m256i w0, w1;
  if (bits == 4) {  // each byte widened to int16 holds two codes: low nibble (even element), high (odd)
    const __m256i both = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes)));
    w0 = _mm256_and_si256(both, _mm256_set1_epi16(0x0F));
    w1 = _mm256_srli_epi16(both, 4);
  } else {
    w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes)));
    w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + 16)));
  }
  acc = dot_add(acc, w0, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x)));
  return dot_add(acc, w1, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 16)));
}

// the 8 blocks' sums of code * xq from chunk c for rows r0 .. r0 + ROWS, one lane a block (blocks past the row:
// zero). Per row: 8 vectors of 8 lanes reduced by a vphaddd tree to [b0 .. b7]
template <int ROWS>
void chunk_sums(const Acts& a, const uint8_t* codes, int bits, int64_t c, int64_t r0, __m256i* out) {
  const int64_t block_bytes = bits * BLOCK / 8;
  __m256i h[ROWS][4];
  for (int p = 0; p < 4; ++p) {
    __m256i d[ROWS][2];
    for (int e = 0; e < 2; ++e) {
      const int64_t b = c + 2 * p + e;
      for (int j = 0; j < ROWS; ++j) {
        d[j][e] = b < a.num_blocks ? block_dot(codes + b * block_bytes, bits, a.xq + (r0 + j) * a.k + b * BLOCK,
                                               _mm256_setzero_si256())
                                   : _mm256_setzero_si256();
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

// y (M, N) float32, columns [lo, hi)
void rows_dot(const Acts& a, const Weights& w, int64_t m, int64_t lo, int64_t hi, float* y, int64_t n_total) {
  float out[MAX_ROWS];
  for (int64_t n = lo; n < hi; ++n) {
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
