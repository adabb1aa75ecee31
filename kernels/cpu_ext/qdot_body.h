// The ISA-specific half of qdot.cpp, included once per ISA inside a `#pragma GCC target` region and a namespace
// of its own, with QDOT_VNNI 0 (AVX2: vpmaddubsw + vpmaddwd) or 1 (AVX-512 VNNI: vpdpbusd on 256-bit registers,
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

// sum of u * a over each 4 bytes (u unsigned, a signed) into 8 int32 lanes, added to acc
inline __m256i dot_add(__m256i acc, __m256i u, __m256i a) {
#if QDOT_VNNI
  return _mm256_dpbusd_epi32(acc, u, a);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, a), _mm256_set1_epi16(1)));
#endif
}

// int4: the 8 blocks' sums of code * xq for rows r0 .. r0 + ROWS. A pair of blocks is 32 bytes of codes: its low
// nibbles [b even codes | b + 1 even codes] and high nibbles [b odd | b + 1 odd] meet the pair's 64 activation
// bytes (quantize's layout), giving lanes [b x 4 | b + 1 x 4]; an unpaired last block is 16 bytes, [even | odd].
template <int ROWS>
void sums_int4(const Acts& a, const uint8_t* codes, int64_t c, int64_t nb, int64_t k, int64_t r0, __m256i* out) {
  const __m256i nib = _mm256_set1_epi8(0x0F);
  __m256i dp[ROWS][4];
  for (int p = 0; p < 4; ++p) {
    const int64_t b = c + 2 * p;
    for (int j = 0; j < ROWS; ++j) dp[j][p] = _mm256_setzero_si256();
    if (b >= nb) continue;
    if (b + 1 < nb) {
      const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + b * 16));
      const __m256i lo = _mm256_and_si256(raw, nib), hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), nib);
      for (int j = 0; j < ROWS; ++j) {
        const int8_t* x = a.xq + (r0 + j) * k + b * BLOCK;
        dp[j][p] = dot_add(dot_add(_mm256_setzero_si256(), lo, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x))),
                           hi, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + BLOCK)));
      }
    } else {
      const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + b * 16));
      const __m256i u = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), nib);
      for (int j = 0; j < ROWS; ++j) {
        const int8_t* x = a.xq + (r0 + j) * k + b * BLOCK;
        const __m256i d = dot_add(_mm256_setzero_si256(), u, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x)));
        const __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(d), _mm256_extracti128_si256(d, 1));
        dp[j][p] = _mm256_set_m128i(_mm_setzero_si128(), s4);  // lanes 4..7: block b + 1, which does not exist
      }
    }
  }
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int j = 0; j < ROWS; ++j) {  // [b0 b2 b4 b6 | b1 b3 b5 b7] -> [b0 .. b7]
    const __m256i h = _mm256_hadd_epi32(_mm256_hadd_epi32(dp[j][0], dp[j][1]), _mm256_hadd_epi32(dp[j][2], dp[j][3]));
    out[j] = _mm256_permutevar8x32_epi32(h, order);
  }
}

// int8: signed codes as |w| (unsigned) against xq carrying w's sign, so that on AVX2 no pair of products
// (at most 128 * 127 each) saturates vpmaddubsw's int16
template <int ROWS>
void sums_int8(const Acts& a, const uint8_t* codes, int64_t c, int64_t nb, int64_t k, int64_t r0, __m256i* out) {
  __m256i h[ROWS][4];
  for (int p = 0; p < 4; ++p) {
    __m256i d[ROWS][2];
    for (int e = 0; e < 2; ++e) {
      const int64_t b = c + 2 * p + e;
      for (int j = 0; j < ROWS; ++j) d[j][e] = _mm256_setzero_si256();
      if (b >= nb) continue;
      const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + b * BLOCK));
      const __m256i wu = _mm256_sign_epi8(w, w);
      for (int j = 0; j < ROWS; ++j) {
        const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.xq + (r0 + j) * k + b * BLOCK));
        d[j][e] = dot_add(_mm256_setzero_si256(), wu, _mm256_sign_epi8(x, w));
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
    if (w.bits == 4) {
      sums_int4<ROWS>(a, codes, c, nb, a.k, r0, sums);
    } else {
      sums_int8<ROWS>(a, codes, c, nb, a.k, r0, sums);
    }
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
