// What every translation unit of optc's C++ CPU extension shares (kernels/cpu_ext/__init__.py builds them into one
// module, bindings.cpp its only module definition): the ISA paths and their probe, the one horizontal sum, the
// widening load of 8 factors, and at::parallel_for's grain sizes.
//
// The extension is compiled with AVX2 and F16C for the whole file (kernels/cpu_ext/__init__.py's FLAGS) and built only
// where torch runs an AVX2 path, so these helpers are AVX2 code; AVX-512 kernels keep their own `#pragma GCC target`
// regions, which may call them (a function of a narrower target inlines into a wider one).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>

#include <immintrin.h>

#include <cstdint>

namespace optc {

// a kernel family's ISA path, the `isa` argument of qdot's qlinear and bf16dot's bf16dot: kernels/cpu_ext/__init__.py's
// AVX2, AVX512_VNNI and AVX512_BF16 (tests/test_kernels_cpu_constants.py holds them equal); NONE: no path on this CPU
enum Isa : int64_t { NONE = 0, AVX2 = 2, AVX512_VNNI = 3, AVX512_BF16 = 4 };

// the best path of each family that chooses one per CPU
struct IsaPaths {
  Isa qdot;  // AVX512_VNNI (with VL: 256-bit VNNI), else AVX2 (with FMA), else NONE
  Isa bf16dot;  // AVX512_BF16 (with BW and VL), else AVX2 (with FMA), else NONE
};

inline IsaPaths best_isa() {
  __builtin_cpu_init();
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  const bool vl = __builtin_cpu_supports("avx512vl");
  const Isa base = avx2 ? AVX2 : NONE;
  return {__builtin_cpu_supports("avx512vnni") && vl ? AVX512_VNNI : base,
          __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512bw") && vl ? AVX512_BF16 : base};
}

// at::parallel_for's grain sizes: the fewest items a task takes (a range under two grains runs on one thread)
constexpr int64_t GRAIN_ITEM = 1;  // items of enough work each: tokens, attention items, rows of silu, LoRA chunks
constexpr int64_t GRAIN_QDOT_ROWS = 16;  // qdot's weight rows
constexpr int64_t GRAIN_BF16DOT_ROWS = 64;  // bf16dot's weight rows
constexpr int64_t GRAIN_NORM_ROWS = 16;  // the norms' activation rows
constexpr int64_t GRAIN_LORA_COLUMNS = 8;  // the LoRA shrink's (slot, rank column) tasks

// the sum of v's 8 lanes in one fixed order on every path: s_i = v_i + v_{i+4}, then s_i + s_{i+2}, then s_0 + s_1
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// 8 values from p as float32 lanes: float32 as they are, bfloat16 widened (its bits are a float32's high half)
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}

}  // namespace optc
