// Portable one-lane "vector": the fallback every x86-64 (and any other) CPU runs.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

namespace writescope {
namespace {

inline float bf16_bits_to_float(uint16_t bits) {
  const uint32_t wide = static_cast<uint32_t>(bits) << 16;
  float out;
  std::memcpy(&out, &wide, sizeof(out));
  return out;
}

// IEEE binary16 -> binary32, exact for normals, subnormals, infinities and NaNs.
inline float fp16_bits_to_float(uint16_t bits) {
  const uint32_t sign = static_cast<uint32_t>(bits & 0x8000u) << 16;
  uint32_t exponent = (bits >> 10) & 0x1fu;
  uint32_t mantissa = bits & 0x3ffu;
  uint32_t wide;
  if (exponent == 0x1fu) {
    wide = sign | 0x7f800000u | (mantissa << 13);
  } else if (exponent != 0) {
    wide = sign | ((exponent + 112u) << 23) | (mantissa << 13);
  } else if (mantissa == 0) {
    wide = sign;
  } else {  // subnormal half: normalise into a float
    exponent = 113;
    while ((mantissa & 0x400u) == 0) {
      mantissa <<= 1;
      --exponent;
    }
    wide = sign | (exponent << 23) | ((mantissa & 0x3ffu) << 13);
  }
  float out;
  std::memcpy(&out, &wide, sizeof(out));
  return out;
}

struct ScalarSimd {
  using V = float;
  static constexpr int kWidth = 1;
  static constexpr bool kBf16Dot = false;
  static constexpr int kRegisters = 16;
  static constexpr bool kAmx = false;
  static V zero() { return 0.0f; }
  static V set1(float x) { return x; }
  static V load(const float* p) { return *p; }
  static V load_bf16(const uint16_t* p) { return bf16_bits_to_float(*p); }
  static V load_fp16(const uint16_t* p) { return fp16_bits_to_float(*p); }
  static void store(float* p, V x) { *p = x; }
  static void store_partial(float* p, V x, int64_t n) {
    if (n > 0) *p = x;
  }
  static void load_pairs_bf16(const uint16_t* p, int64_t n, V& even, V& odd) {
    even = n > 0 ? bf16_bits_to_float(p[0]) : 0.0f;
    odd = n > 0 ? bf16_bits_to_float(p[1]) : 0.0f;
  }
  static void load_pairs_fp16(const uint16_t* p, int64_t n, V& even, V& odd) {
    even = n > 0 ? fp16_bits_to_float(p[0]) : 0.0f;
    odd = n > 0 ? fp16_bits_to_float(p[1]) : 0.0f;
  }
  static void load_pairs_f32(const float* p, int64_t n, V& even, V& odd) {
    even = n > 0 ? p[0] : 0.0f;
    odd = n > 0 ? p[1] : 0.0f;
  }
  static V fma(V a, V b, V c) { return a * b + c; }
  static V mul(V a, V b) { return a * b; }
  static V add(V a, V b) { return a + b; }
  static V sub(V a, V b) { return a - b; }
  static V max(V a, V b) { return a > b ? a : b; }
  static float reduce_add(V x) { return x; }
  static float reduce_max(V x) { return x; }
  static bool any_greater(V x, float bound) { return x > bound; }
  static void reduce_add_8(V x0, V x1, V x2, V x3, V x4, V x5, V x6, V x7, float* out) {
    out[0] = x0, out[1] = x1, out[2] = x2, out[3] = x3, out[4] = x4, out[5] = x5, out[6] = x6, out[7] = x7;
  }
  static V exp(V x) { return std::exp(x); }
};

}  // namespace
}  // namespace writescope
