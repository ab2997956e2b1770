// Sixteen float lanes with AVX-512F (+BW/VL for the 16-bit loads). Include only in a translation
// unit compiled for them.
#pragma once

#include <immintrin.h>

#include <cstdint>

#include "writescope/simd_avx2.h"

namespace writescope {
namespace {

using Avx2Fold = Avx2Simd;

struct Avx512Simd {
  using V = __m512;
  static constexpr int kWidth = 16;
  static constexpr bool kBf16Dot = false;
  static constexpr int kRegisters = 32;
  static constexpr bool kAmx = false;
  static V zero() { return _mm512_setzero_ps(); }
  static V set1(float x) { return _mm512_set1_ps(x); }
  static V load(const float* p) { return _mm512_loadu_ps(p); }
  static V load_bf16(const uint16_t* p) {
    const __m256i half = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
  }
  static V load_fp16(const uint16_t* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static void store(float* p, V x) { _mm512_storeu_ps(p, x); }
  // 32 floats [16 even dims | 16 odd dims] -> natural order, each multiplied by `scale`, in place.
  static void pairs_to_natural(float* slice, V scale) {
    const V even = _mm512_mul_ps(scale, _mm512_loadu_ps(slice));
    const V odd = _mm512_mul_ps(scale, _mm512_loadu_ps(slice + 16));
    const __m512i first = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
    const __m512i second = _mm512_add_epi32(first, _mm512_set1_epi32(8));
    _mm512_storeu_ps(slice, _mm512_permutex2var_ps(even, first, odd));
    _mm512_storeu_ps(slice + 16, _mm512_permutex2var_ps(even, second, odd));
  }
  static __mmask16 first_lanes(int64_t n) {
    return n >= 16 ? __mmask16(0xFFFF) : n <= 0 ? __mmask16(0) : __mmask16((1u << n) - 1);
  }
  static void store_partial(float* p, V x, int64_t n) { _mm512_mask_storeu_ps(p, first_lanes(n), x); }
  // n <= 16 consecutive (even, odd) element pairs -> lane i holds pair i's even and odd element, as
  // float32; lanes from n on are 0 and nothing past pair n is read.
  static void load_pairs_bf16(const uint16_t* p, int64_t n, V& even, V& odd) {
    const __m512i words = _mm512_maskz_loadu_epi32(first_lanes(n), p);
    even = _mm512_castsi512_ps(_mm512_slli_epi32(words, 16));
    odd = _mm512_castsi512_ps(_mm512_and_si512(words, _mm512_set1_epi32(int(0xFFFF0000u))));
  }
  static void load_pairs_fp16(const uint16_t* p, int64_t n, V& even, V& odd) {
    const __m512i words = _mm512_maskz_loadu_epi32(first_lanes(n), p);
    even = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(words));
    odd = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(words, 16)));
  }
  static void load_pairs_f32(const float* p, int64_t n, V& even, V& odd) {
    const __m512 lo = _mm512_maskz_loadu_ps(first_lanes(2 * n), p);
    const __m512 hi = _mm512_maskz_loadu_ps(first_lanes(2 * n - 16), p + 16);
    const __m512i even_index = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    even = _mm512_permutex2var_ps(lo, even_index, hi);
    odd = _mm512_permutex2var_ps(lo, _mm512_add_epi32(even_index, _mm512_set1_epi32(1)), hi);
  }
  static V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static V add(V a, V b) { return _mm512_add_ps(a, b); }
  static V sub(V a, V b) { return _mm512_sub_ps(a, b); }
  static V max(V a, V b) { return _mm512_max_ps(a, b); }
  static float reduce_add(V x) { return _mm512_reduce_add_ps(x); }
  static float reduce_max(V x) { return _mm512_reduce_max_ps(x); }
  static bool any_greater(V x, float bound) { return _mm512_cmp_ps_mask(x, set1(bound), _CMP_GT_OQ) != 0; }
  static __mmask16 greater_lanes(V a, V b) { return _mm512_cmp_ps_mask(a, b, _CMP_GT_OQ); }
  static V take_lanes(__mmask16 lanes, V from, V into) { return _mm512_mask_mov_ps(into, lanes, from); }
  // Eight horizontal sums at once: fold each vector to 256 bits, then one hadd tree.
  static void reduce_add_8(V x0, V x1, V x2, V x3, V x4, V x5, V x6, V x7, float* out) {
    _mm256_storeu_ps(out, Avx2Fold::transpose_sum_8(fold(x0), fold(x1), fold(x2), fold(x3), fold(x4), fold(x5),
                                                    fold(x6), fold(x7)));
  }
  static __m256 fold(V x) {
    return _mm256_add_ps(_mm512_castps512_ps256(x), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1)));
  }
  // exp(x) = 2^n e^r, n = round(x / ln 2), r = x - n ln 2 in [-ln 2 / 2, ln 2 / 2] (ln 2 in two parts,
  // so r is exact for every n this range gives); e^r = 1 + r + r^2 P(r), P of degree 3 (fitted to the
  // relative error: at most 2e-7 over the range, float32's rounding); scalef applies 2^n, giving inf
  // above 88.7 and denormals, then 0, below -87.3. x is first raised to -110, where 2^n is below half
  // the least denormal: exp(-inf) and exp(NaN) are exactly 0 (an empty partial's weight), with no
  // compare or mask. 13 instructions a vector where the degree-6 polynomial with clamps and a mask
  // took 17 (most of the softmax's instructions are its exps): 1.01-1.02x on the Qwen3-MoE and
  // Mixtral shapes, one thread in L3 (2-vCPU Zen 4).
  static V exp(V x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-110.0f));  // NaN -> -110 too: max returns its second operand
    __m512 n = _mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f));
    n = _mm512_roundscale_ps(n, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    x = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    x = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), x);
    __m512 y = _mm512_set1_ps(8.3125252277e-3f);
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(4.1890114546e-2f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.6667114198e-1f));
    y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(4.9999231100e-1f));
    y = _mm512_fmadd_ps(y, _mm512_mul_ps(x, x), _mm512_add_ps(x, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(y, n);
  }
};

}  // namespace
}  // namespace writescope
