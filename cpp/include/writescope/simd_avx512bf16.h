// AVX-512 plus AVX512-BF16. Include only in a translation unit compiled for them.
#pragma once

#include <immintrin.h>

#include <cstdint>

#include "writescope/simd_avx512.h"

namespace writescope {
namespace {

// AVX-512 plus the bf16 dot product (vdpbf16ps): 32 bf16 products per instruction, no widening.
struct Avx512Bf16Simd : Avx512Simd {
  static constexpr bool kBf16Dot = true;
  static constexpr bool kAmx = false;
  using Raw = __m512i;
  static constexpr int kBf16PerRaw = 32;
  static Raw load_raw(const uint16_t* p) { return _mm512_loadu_si512(p); }
  static Raw raw_set1(uint32_t bits) { return _mm512_set1_epi32(static_cast<int>(bits)); }
  static Raw raw_set1_64(uint64_t bits) { return _mm512_set1_epi64(static_cast<long long>(bits)); }
  // Lanes (2 j, 2 j + 1) of a, then of b, summed: 16 sums, a's 8 first.
  static V add_lane_pairs(V a, V b) {
    const V a_sums = _mm512_add_ps(a, _mm512_permute_ps(a, 0xB1));  // both lanes of a pair hold its sum
    const V b_sums = _mm512_add_ps(b, _mm512_permute_ps(b, 0xB1));
    const __m512i even = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
    return _mm512_permutex2var_ps(a_sums, even, b_sums);
  }
  // The first n (<= 16) 32-bit words at p (a bf16 pair each), zeros past them; nothing past word n is read.
  static Raw load_raw_words(const uint16_t* p, int64_t n) { return _mm512_maskz_loadu_epi32(first_lanes(n), p); }
  static V dot_bf16(V acc, Raw a, Raw b) { return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)b); }
  // 32 dims of two token rows a and b (bf16) -> their [dim][2] pairs (a's element first): dims
  // [0, 16) in `low`, [16, 32) in `high`, each the bf16 dot's operand for a token pair.
  static void pair_rows(const uint16_t* a, const uint16_t* b, Raw& low, Raw& high) {
    const __m512i low_index = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7,
                                               38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
    const __m512i high_index = _mm512_add_epi16(low_index, _mm512_set1_epi16(16));
    const __m512i x = _mm512_loadu_si512(a);
    const __m512i y = _mm512_loadu_si512(b);
    low = _mm512_permutex2var_epi16(x, low_index, y);
    high = _mm512_permutex2var_epi16(x, high_index, y);
  }
  // 32 dims of two token rows a and b (bf16) -> their (a, b) pairs in unpack order: lanes 4k..4k+3
  // of `low` hold dims 8k..8k+3 and the same lanes of `high` dims 8k+4..8k+7 (k < 4), the order of
  // one unpack per 128-bit lane. One in-lane shuffle each where pair_rows' natural order takes a
  // two-source word permute; the caller keeps its sums in this order and restores the natural one
  // once per item (unpacked_to_natural). Measured on a 2-vCPU Zen 4, MLA interleaved with
  // pair_rows: 1.02x one thread at 4K in L3, 1.01x two threads at 8K from DRAM.
  static void unpack_rows(const uint16_t* a, const uint16_t* b, Raw& low, Raw& high) {
    const __m512i x = _mm512_loadu_si512(a);
    const __m512i y = _mm512_loadu_si512(b);
    low = _mm512_unpacklo_epi16(x, y);
    high = _mm512_unpackhi_epi16(x, y);
  }
  // One token row's 32 dims widened to float32 in unpack_rows' order.
  static void unpack_row(const uint16_t* a, V& low, V& high) {
    const __m512i x = _mm512_loadu_si512(a);
    low = _mm512_castsi512_ps(_mm512_unpacklo_epi16(_mm512_setzero_si512(), x));
    high = _mm512_castsi512_ps(_mm512_unpackhi_epi16(_mm512_setzero_si512(), x));
  }
  // 32 floats in unpack_rows' order -> natural order, in place.
  static void unpacked_to_natural(float* slice) {
    store_natural(slice, _mm512_loadu_ps(slice), _mm512_loadu_ps(slice + 16));
  }
  // The same, each float first multiplied by `scale`.
  static void unpacked_to_natural(float* slice, V scale) {
    store_natural(slice, _mm512_mul_ps(scale, _mm512_loadu_ps(slice)), _mm512_mul_ps(scale, _mm512_loadu_ps(slice + 16)));
  }
  // natural dims 8k..8k+7 = low lanes 4k..4k+3, then high lanes 4k..4k+3
  static void store_natural(float* slice, __m512 low, __m512 high) {
    const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    const __m512i second = _mm512_add_epi32(first, _mm512_set1_epi32(8));
    _mm512_storeu_ps(slice, _mm512_permutex2var_ps(low, first, high));
    _mm512_storeu_ps(slice + 16, _mm512_permutex2var_ps(low, second, high));
  }
  // 16 floats each of a and b -> bf16 (nearest even) as 16 words (a[i], b[i]) at p, a's in the low half.
  static void store_bf16_pairs(uint32_t* p, V a, V b) {
    const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(b, a);  // a's 16 bf16, then b's
    const __m512i zip = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6,
                                         21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    _mm512_storeu_si512(p, _mm512_permutexvar_epi16(zip, both));
  }
  // Two token rows of `dims` (a multiple of 32) bf16 -> [dims][2] pairs (a's element first); b null: zeros.
  static void interleave_rows(const uint16_t* a, const uint16_t* b, uint16_t* out, int64_t dims) {
    alignas(64) static const uint16_t zeros[32] = {};
    for (int64_t d = 0; d < dims; d += 32) {
      Raw low, high;
      pair_rows(a + d, b ? b + d : zeros, low, high);
      _mm512_storeu_si512(out + 2 * d, low);
      _mm512_storeu_si512(out + 2 * d + 32, high);
    }
  }
  // 16 floats -> bf16 (nearest even) at p.
  static void store_bf16(uint16_t* p, V x) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), (__m256i)_mm512_cvtneps_pbh(x));
  }
};

#define WS_EACH_TILE(M) M(0) M(1) M(2) M(3) M(4) M(5) M(6) M(7)

// The same plus AMX (amx-tile, amx-bf16): the paired kernel's QK and PV run as tile dot products.
struct Avx512AmxSimd : Avx512Bf16Simd {
  static constexpr bool kAmx = true;
  static void tile_config(const void* config) { _tile_loadconfig(config); }
  static void tile_release() { _tile_release(); }
  // GCC's tile intrinsics paste the tile number into their assembly, so it must be a literal: each
  // template maps its constant to one.
  template <int T> static void tile_zero() {
#define WS_TILE(N) if constexpr (T == N) _tile_zero(N);
    WS_EACH_TILE(WS_TILE)
#undef WS_TILE
  }
  template <int T> static void tile_load(const void* p, int64_t stride_bytes) {
#define WS_TILE(N) if constexpr (T == N) _tile_loadd(N, p, stride_bytes);
    WS_EACH_TILE(WS_TILE)
#undef WS_TILE
  }
  template <int T> static void tile_store(void* p, int64_t stride_bytes) {
#define WS_TILE(N) if constexpr (T == N) _tile_stored(N, p, stride_bytes);
    WS_EACH_TILE(WS_TILE)
#undef WS_TILE
  }
  template <int C, int A, int B> static void tile_dot() {
#define WS_DOT(C_, A_, B_) if constexpr (C == C_ && A == A_ && B == B_) _tile_dpbf16ps(C_, A_, B_);
    WS_DOT(0, 1, 3) WS_DOT(0, 2, 3) WS_DOT(0, 1, 2)
#define WS_DOT_AB(C_) WS_DOT(C_, 4, 6) WS_DOT(C_, 5, 6) WS_DOT(C_, 4, 7) WS_DOT(C_, 5, 7)
    WS_DOT_AB(0) WS_DOT_AB(1) WS_DOT_AB(2) WS_DOT_AB(3)
#define WS_DOT_BA(C_) WS_DOT(C_, 6, 4) WS_DOT(C_, 7, 4) WS_DOT(C_, 6, 5) WS_DOT(C_, 7, 5)
    WS_DOT_BA(0) WS_DOT_BA(1) WS_DOT_BA(2) WS_DOT_BA(3)
#undef WS_DOT_BA
#undef WS_DOT_AB
#undef WS_DOT
    static_assert((C == 0 && ((B == 3 && (A == 1 || A == 2)) || (A == 1 && B == 2))) ||
                      (C < 4 && (((B == 6 || B == 7) && (A == 4 || A == 5)) || ((A == 6 || A == 7) && (B == 4 || B == 5)))),
                  "add the tile combination to tile_dot");
  }
  // A 16 x 16 transpose of 32-bit values, the bits moved untouched: out[j * out_stride + i] =
  // in[i * in_stride + j].
  static void transpose_16x16(const float* in, int64_t in_stride, float* out, int64_t out_stride) {
    transpose_16x16_to(in, in_stride, [&](int64_t row, __m512 x) { _mm512_storeu_ps(out + row * out_stride, x); });
  }
  // 16 x 16 words [tokens, heads] of bf16 values in their high halves (`odd`'s tile operand format)
  // -> [heads, tokens] rows of `odd` and of `even` (the same values in the low halves).
  static void transpose_16x16_words(const uint32_t* in, uint32_t* odd, uint32_t* even, int64_t out_stride) {
    transpose_16x16_to(reinterpret_cast<const float*>(in), 16, [&](int64_t row, __m512 x) {
      const __m512i words = _mm512_castps_si512(x);
      _mm512_storeu_si512(odd + row * out_stride, words);
      _mm512_storeu_si512(even + row * out_stride, _mm512_srli_epi32(words, 16));
    });
  }
  // 16 floats -> bf16 (nearest even) in the high half of each 32-bit word, the low half zero.
  static __m512 bf16_high_words(__m512 x) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(x)), 16));
  }
  // The transpose, each row of the result handed to put(row, values). Unpacks of row pairs, then of
  // the pairs' 64-bit halves, leave column 4 l + j of rows 4 i .. 4 i + 3 in 128-bit lane l of
  // r[4 i + j]; a 4 x 4 transpose of those lanes puts each column together.
  template <class Put>
  static void transpose_16x16_to(const float* in, int64_t in_stride, Put put) {
    __m512 r[16], t[16];
    for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_ps(in + i * in_stride);
    for (int i = 0; i < 8; ++i) {
      t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
      t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; ++i) {
      const __m512d lo0 = _mm512_castps_pd(t[4 * i]), lo1 = _mm512_castps_pd(t[4 * i + 2]);
      const __m512d hi0 = _mm512_castps_pd(t[4 * i + 1]), hi1 = _mm512_castps_pd(t[4 * i + 3]);
      r[4 * i] = _mm512_castpd_ps(_mm512_unpacklo_pd(lo0, lo1));
      r[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(lo0, lo1));
      r[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(hi0, hi1));
      r[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(hi0, hi1));
    }
    for (int j = 0; j < 4; ++j) {
      const __m512 u0 = _mm512_shuffle_f32x4(r[j], r[4 + j], 0x88), u1 = _mm512_shuffle_f32x4(r[j], r[4 + j], 0xdd);
      const __m512 u2 = _mm512_shuffle_f32x4(r[8 + j], r[12 + j], 0x88);
      const __m512 u3 = _mm512_shuffle_f32x4(r[8 + j], r[12 + j], 0xdd);
      put(j, _mm512_shuffle_f32x4(u0, u2, 0x88));
      put(4 + j, _mm512_shuffle_f32x4(u1, u3, 0x88));
      put(8 + j, _mm512_shuffle_f32x4(u0, u2, 0xdd));
      put(12 + j, _mm512_shuffle_f32x4(u1, u3, 0xdd));
    }
  }
  // 16 floats -> bf16 (nearest even) as the low half of 32-bit words (`even`: the first of each
  // element pair of a tile operand row) and as their high half (`odd`), the other half zero.
  static void bf16_words(const float* x, uint32_t* even, uint32_t* odd) {
    const __m512i words = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(x)));
    _mm512_storeu_si512(even, words);
    _mm512_storeu_si512(odd, _mm512_slli_epi32(words, 16));
  }
  // 16 floats -> bf16 high parts (nearest even) and bf16 low parts of what the high parts leave.
  static void split_bf16(const float* x, uint16_t* hi, uint16_t* lo) {
    const __m512 value = _mm512_loadu_ps(x);
    const __m256bh high = _mm512_cvtneps_pbh(value);
    const __m512 back = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)high), 16));
    const __m256bh low = _mm512_cvtneps_pbh(_mm512_sub_ps(value, back));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(hi), (__m256i)high);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(lo), (__m256i)low);
  }
};

}  // namespace
}  // namespace writescope
