// Dense products of a decode step's few rows with bf16 weights, written once over a SIMD traits
// type S; included by each ISA translation unit after attention_kernel.h, in the same anonymous
// namespace.
//
// A decode step multiplies a handful of rows (one per sequence) by each weight matrix, so the
// weights are read once for all rows and the product is a dot product per (row, output): each
// weight load is W dim pairs of one output's row, widened to (even dim, odd dim) float32 vectors,
// times the rows' even and odd dims, which were split apart once per call. Everything accumulates in
// float32, as torch's bf16 matmul does; only the order of the sums differs.
#pragma once

#include <cstdint>

#include "writescope/attention_kernel.h"

namespace writescope {
namespace {

// sums[r * NO + o] = sum_k x[r, k] w_o[k] for R rows and NO = 8 / R weight rows: eight dot
// products at once, each a chain of FMAs (even dims, then odd), summed across lanes together.
// x0: R rows of x_split ([even | odd] dims, padded_pairs apart); w: NO weight rows of `pairs` pairs.
template <class S, int R, int NO>
inline __attribute__((always_inline)) void dot_tile(const float* x0, int64_t padded_pairs, const uint16_t* const* w, int64_t pairs, float* sums) {
  static_assert(R * NO == 8, "eight dot products per tile");
  using V = typename S::V;
  constexpr int W = S::kWidth;
  V acc[8];
  for (int i = 0; i < 8; ++i) acc[i] = S::zero();
  int64_t p = 0;
  for (; p < pairs; p += W) {
    const int64_t lanes = pairs - p < W ? pairs - p : W;  // past `pairs`: 0, times x's zero padding
    for (int o = 0; o < NO; ++o) {
      V even, odd;
      S::load_pairs_bf16(w[o] + 2 * p, lanes, even, odd);
      for (int r = 0; r < R; ++r) {
        const float* x = x0 + r * 2 * padded_pairs + p;
        acc[r * NO + o] = S::fma(S::load(x + padded_pairs), odd, S::fma(S::load(x), even, acc[r * NO + o]));
      }
    }
  }
  S::reduce_add_8(acc[0], acc[1], acc[2], acc[3], acc[4], acc[5], acc[6], acc[7], sums);
}

// R rows of x times weight rows [n_begin, n_end), NO = 8 / R of them a tile (the last tile repeats
// the last row where fewer are left, and stores only the real ones).
template <class S, int R>
void dot_row_block(const float* x0, int64_t padded_pairs, const uint16_t* w, int64_t w_stride, int64_t pairs,
                   int64_t n_begin, int64_t n_end, float* out, int64_t out_stride) {
  constexpr int NO = 8 / R;
  alignas(32) float sums[8];
  const uint16_t* rows[NO];
  for (int64_t n0 = n_begin; n0 < n_end; n0 += NO) {
    for (int o = 0; o < NO; ++o) rows[o] = w + (n0 + o < n_end ? n0 + o : n_end - 1) * w_stride;
    dot_tile<S, R, NO>(x0, padded_pairs, rows, pairs, sums);
    for (int r = 0; r < R; ++r)
      for (int o = 0; o < NO && n0 + o < n_end; ++o) out[r * out_stride + n0 + o] = sums[r * NO + o];
  }
}

// out[r * out_stride + n] = sum_k x[r, k] w[n, k] for rows r < rows and outputs n in [n_begin, n_end).
// x_split [rows, 2, padded_pairs] float32: each row's even dims, then its odd dims, zero past
// `pairs` up to padded_pairs (a multiple of 16); w [*, 2 * pairs] bf16 rows w_stride elements apart.
// Rows go four at a time (each weight load serves four rows), the rest two or one at a time.
template <class S>
void dot_rows(const float* x_split, int64_t rows, int64_t padded_pairs, const uint16_t* w, int64_t w_stride,
              int64_t pairs, int64_t n_begin, int64_t n_end, float* out, int64_t out_stride) {
  int64_t r = 0;
  for (; r + 4 <= rows; r += 4)
    dot_row_block<S, 4>(x_split + r * 2 * padded_pairs, padded_pairs, w, w_stride, pairs, n_begin, n_end,
                        out + r * out_stride, out_stride);
  for (; r + 2 <= rows; r += 2)
    dot_row_block<S, 2>(x_split + r * 2 * padded_pairs, padded_pairs, w, w_stride, pairs, n_begin, n_end,
                        out + r * out_stride, out_stride);
  for (; r < rows; ++r)
    dot_row_block<S, 1>(x_split + r * 2 * padded_pairs, padded_pairs, w, w_stride, pairs, n_begin, n_end,
                        out + r * out_stride, out_stride);
}

}  // namespace
}  // namespace writescope
