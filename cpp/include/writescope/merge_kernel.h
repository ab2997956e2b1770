// The exact merge of normalised attention partials, with the ISA of the attention kernel.
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>

namespace writescope {
namespace {

// Merges `parts` normalised partials row by row, in part order (so results are deterministic):
// out_r = sum_p w_p out_{p,r} / sum_p w_p with w_p = exp(lse_{p,r} - max_p lse_{p,r});
// lse_r = max + log(sum_p w_p). All parts empty (-inf) gives zeros and -inf.
// outs [parts, rows, dim] with part stride out_part_stride; lses [parts, rows] with lse_part_stride.
// A row's dims are summed kMergeVectors vectors at a time over every part, so each partial is read
// once and the output written once (the baseline build's loop re-read and re-wrote the output row
// for every part, four floats at a time: ~30-45 us of one thread for 16 partials of 16 x 512 on a
// Zen 4, while the pool's other threads waited).
template <class S>
void merge_rows(int64_t parts, int64_t rows, int64_t dim, const float* outs, int64_t out_part_stride,
                const float* lses, int64_t lse_part_stride, float* out, float* lse) {
  using V = typename S::V;
  constexpr int W = S::kWidth;
  constexpr int kMergeVectors = 4;
  constexpr int64_t kBatch = 64;  // parts whose weights are held at once
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  float weights[kBatch];
  for (int64_t r = 0; r < rows; ++r) {
    float* dst = out + r * dim;
    float max_lse = kNegInf;
    for (int64_t p = 0; p < parts; ++p) max_lse = std::fmax(max_lse, lses[p * lse_part_stride + r]);
    if (max_lse == kNegInf) {
      for (int64_t d = 0; d < dim; ++d) dst[d] = 0.0f;
      lse[r] = kNegInf;
      continue;
    }
    float total = 0.0f;
    for (int64_t p0 = 0; p0 < parts; p0 += kBatch) {
      const int64_t batch = parts - p0 < kBatch ? parts - p0 : kBatch;
      for (int64_t i = 0; i < batch; ++i) {
        weights[i] = std::exp(lses[(p0 + i) * lse_part_stride + r] - max_lse);
        total += weights[i];
      }
      const float* src = outs + p0 * out_part_stride + r * dim;
      int64_t d = 0;
      for (; d + kMergeVectors * W <= dim; d += kMergeVectors * W) {
        V acc[kMergeVectors];
#pragma GCC unroll 4
        for (int k = 0; k < kMergeVectors; ++k) acc[k] = p0 == 0 ? S::zero() : S::load(dst + d + k * W);
        for (int64_t i = 0; i < batch; ++i) {
          if (weights[i] == 0.0f) continue;  // an empty part (its output may be anything)
          const V w = S::set1(weights[i]);
#pragma GCC unroll 4
          for (int k = 0; k < kMergeVectors; ++k)
            acc[k] = S::fma(w, S::load(src + i * out_part_stride + d + k * W), acc[k]);
        }
#pragma GCC unroll 4
        for (int k = 0; k < kMergeVectors; ++k) S::store(dst + d + k * W, acc[k]);
      }
      for (; d < dim; ++d) {
        float acc = p0 == 0 ? 0.0f : dst[d];
        for (int64_t i = 0; i < batch; ++i)
          if (weights[i] != 0.0f) acc += weights[i] * src[i * out_part_stride + d];
        dst[d] = acc;
      }
    }
    const float inv = 1.0f / total;
    const V vinv = S::set1(inv);
    int64_t d = 0;
    for (; d + W <= dim; d += W) S::store(dst + d, S::mul(vinv, S::load(dst + d)));
    for (; d < dim; ++d) dst[d] *= inv;
    lse[r] = max_lse + std::log(total);
  }
}

}  // namespace
}  // namespace writescope
