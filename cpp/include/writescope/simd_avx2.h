// Eight float lanes with AVX2 + FMA + F16C. Include only in a translation unit compiled for them.
#pragma once

#include <immintrin.h>

#include <cstdint>

namespace writescope {
namespace {

struct Avx2Simd {
  using V = __m256;
  static constexpr int kWidth = 8;
  static constexpr bool kBf16Dot = false;
  static constexpr int kRegisters = 16;
  static constexpr bool kAmx = false;
  static V zero() { return _mm256_setzero_ps(); }
  static V set1(float x) { return _mm256_set1_ps(x); }
  static V load(const float* p) { return _mm256_loadu_ps(p); }
  static V load_bf16(const uint16_t* p) {
    const __m128i half = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16));
  }
  static V load_fp16(const uint16_t* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static void store(float* p, V x) { _mm256_storeu_ps(p, x); }
  // 16 floats [8 even dims | 8 odd dims] -> natural order, each multiplied by `scale`, in place.
  static void pairs_to_natural(float* slice, V scale) {
    const V even = _mm256_mul_ps(scale, _mm256_loadu_ps(slice));
    const V odd = _mm256_mul_ps(scale, _mm256_loadu_ps(slice + 8));
    const V low = _mm256_unpacklo_ps(even, odd);   // dims 0-3 | 8-11
    const V high = _mm256_unpackhi_ps(even, odd);  // dims 4-7 | 12-15
    _mm256_storeu_ps(slice, _mm256_permute2f128_ps(low, high, 0x20));
    _mm256_storeu_ps(slice + 8, _mm256_permute2f128_ps(low, high, 0x31));
  }
  static __m256i first_lanes(int64_t n) {
    const int count = n > 8 ? 8 : n < 0 ? 0 : static_cast<int>(n);
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(count), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  }
  // A whole vector takes a plain store: a masked store costs several times more on Zen 3.
  static void store_partial(float* p, V x, int64_t n) {
    if (n >= 8) return _mm256_storeu_ps(p, x);
    _mm256_maskstore_ps(p, first_lanes(n), x);
  }
  // n <= 8 consecutive (even, odd) element pairs -> lane i holds pair i's even and odd element, as
  // float32; lanes from n on are 0 and nothing past pair n is read.
  // Whole vectors take a plain load: a masked load from memory costs several times more on Zen 3.
  static __m256i load_words(const uint16_t* p, int64_t n) {
    if (n >= 8) return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm256_maskload_epi32(reinterpret_cast<const int*>(p), first_lanes(n));
  }
  static void load_pairs_bf16(const uint16_t* p, int64_t n, V& even, V& odd) {
    const __m256i words = load_words(p, n);
    even = _mm256_castsi256_ps(_mm256_slli_epi32(words, 16));
    odd = _mm256_castsi256_ps(_mm256_and_si256(words, _mm256_set1_epi32(int(0xFFFF0000u))));
  }
  static void load_pairs_fp16(const uint16_t* p, int64_t n, V& even, V& odd) {
    const __m256i words = load_words(p, n);
    const __m256i low = _mm256_and_si256(words, _mm256_set1_epi32(0xFFFF));
    const __m256i high = _mm256_srli_epi32(words, 16);
    // packus within 128-bit lanes gives [low 0-3, high 0-3, low 4-7, high 4-7]; permute 64-bit
    // quarters to [low 0-7 | high 0-7]
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(low, high), 0xD8);
    even = _mm256_cvtph_ps(_mm256_castsi256_si128(packed));
    odd = _mm256_cvtph_ps(_mm256_extracti128_si256(packed, 1));
  }
  static void load_pairs_f32(const float* p, int64_t n, V& even, V& odd) {
    const __m256 lo = _mm256_maskload_ps(p, first_lanes(2 * n));
    const __m256 hi = _mm256_maskload_ps(p + 8, first_lanes(2 * n - 8));
    // shuffle within 128-bit lanes: [lo0 lo2 hi0 hi2 | lo4 lo6 hi4 hi6], then fix the quarters
    const __m256 e = _mm256_shuffle_ps(lo, hi, 0x88), o = _mm256_shuffle_ps(lo, hi, 0xDD);
    even = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(e), 0xD8));
    odd = _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(o), 0xD8));
  }
  static V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static V add(V a, V b) { return _mm256_add_ps(a, b); }
  static V sub(V a, V b) { return _mm256_sub_ps(a, b); }
  static V max(V a, V b) { return _mm256_max_ps(a, b); }
  static bool any_greater(V x, float bound) { return _mm256_movemask_ps(_mm256_cmp_ps(x, set1(bound), _CMP_GT_OQ)) != 0; }
  static float reduce_add(V x) {
    __m128 sum = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    sum = _mm_add_ps(sum, _mm_movehl_ps(sum, sum));
    sum = _mm_add_ss(sum, _mm_movehdup_ps(sum));
    return _mm_cvtss_f32(sum);
  }
  // Eight horizontal sums at once: out[i] = sum of the lanes of x[i].
  static void reduce_add_8(V x0, V x1, V x2, V x3, V x4, V x5, V x6, V x7, float* out) {
    _mm256_storeu_ps(out, transpose_sum_8(x0, x1, x2, x3, x4, x5, x6, x7));
  }
  static __m256 transpose_sum_8(__m256 x0, __m256 x1, __m256 x2, __m256 x3, __m256 x4, __m256 x5, __m256 x6,
                                __m256 x7) {
    const __m256 s01 = _mm256_hadd_ps(x0, x1), s23 = _mm256_hadd_ps(x2, x3);
    const __m256 s45 = _mm256_hadd_ps(x4, x5), s67 = _mm256_hadd_ps(x6, x7);
    const __m256 s0123 = _mm256_hadd_ps(s01, s23), s4567 = _mm256_hadd_ps(s45, s67);
    return _mm256_add_ps(_mm256_permute2f128_ps(s0123, s4567, 0x20), _mm256_permute2f128_ps(s0123, s4567, 0x31));
  }
  static float reduce_max(V x) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    return _mm_cvtss_f32(m);
  }
  // Cephes-style exp: range reduction by ln 2, degree-6 polynomial, 2^n through the exponent.
  // Inputs below -87.3 give exactly 0 (exp(-inf) == 0 matters for empty partials).
  static V exp(V x) {
    const V max_input = _mm256_set1_ps(88.3762626647949f);
    const V min_input = _mm256_set1_ps(-87.3365447505531f);
    const __m256 underflow = _mm256_cmp_ps(x, min_input, _CMP_GE_OQ);
    x = _mm256_min_ps(x, max_input);
    x = _mm256_max_ps(x, min_input);
    __m256 n = _mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f));
    n = _mm256_floor_ps(n);
    x = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
    const __m256i exponent = _mm256_slli_epi32(
        _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    y = _mm256_mul_ps(y, _mm256_castsi256_ps(exponent));
    return _mm256_and_ps(y, underflow);
  }
};

}  // namespace
}  // namespace writescope
