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
  using Raw = __m512i;
  static constexpr int kBf16PerRaw = 32;
  static Raw load_raw(const uint16_t* p) { return _mm512_loadu_si512(p); }
  static Raw raw_set1(uint32_t bits) { return _mm512_set1_epi32(static_cast<int>(bits)); }
  static V dot_bf16(V acc, Raw a, Raw b) { return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)b); }
};

}  // namespace
}  // namespace writescope
