// AVX-512 + AVX512-BF16 + AMX (tile, bf16) kernels: the paired kernel's QK and PV as tile products.
// Library headers come before the target pragma so nothing with external linkage is compiled for
// this ISA; the table itself is built at the baseline target.
#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

#include "writescope/kernel_args.h"

#if defined(__x86_64__)
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma,f16c,amx-tile,amx-bf16")
#include "writescope/attention_kernel.h"
#include "writescope/dense_kernel.h"
#include "writescope/merge_kernel.h"
#include "writescope/roofline_kernel.h"
#include "writescope/simd_avx512bf16.h"

namespace writescope {
namespace {
// AMX bf16 tile products: each is [16 x 16] += [16 x 32] x [32 x 16], 16 x 16 x 32 multiply-adds.
struct TileBurst {
  static constexpr int64_t kFlopsPerIteration = int64_t{4} * 2 * 16 * 16 * 32;

  static double run(int64_t iterations) {
    alignas(64) uint16_t operand[16 * 32];
    for (auto& x : operand) x = 0x3F80u;  // 1.0
    alignas(64) float result[16 * 16];
    alignas(64) struct {
      uint8_t palette = 1, start_row = 0, reserved[14] = {};
      uint16_t colsb[16] = {64, 64, 64, 64, 64, 64, 64, 64};
      uint8_t rows[16] = {16, 16, 16, 16, 16, 16, 16, 16};
    } cfg;
    _tile_loadconfig(&cfg);
    _tile_loadd(4, operand, 64);
    _tile_loadd(5, operand, 64);
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t it = 0; it < iterations; ++it) {
      _tile_dpbf16ps(0, 4, 5);
      _tile_dpbf16ps(1, 4, 5);
      _tile_dpbf16ps(2, 4, 5);
      _tile_dpbf16ps(3, 4, 5);
    }
    _tile_stored(0, result, 64);
    _tile_release();
    return result[0];
  }
};

void attend_item_amx(const PagedAttentionArgs& args, const WorkItem& item, Workspace ws) {
  attend_item<Avx512AmxSimd>(args, item, ws);
}
double read_sum_amx(const float* data, int64_t count) { return read_sum<Avx512AmxSimd>(data, count); }
double fma_burst_amx(int64_t iterations) { return FmaBurst<Avx512AmxSimd>::run(iterations); }
double dot_burst_amx(int64_t iterations) { return DotBurst<Avx512AmxSimd>::run(iterations); }
double tile_burst_amx(int64_t iterations) { return TileBurst::run(iterations); }
void dot_rows_amx(const float* x_split, int64_t rows, int64_t padded_pairs, const uint16_t* w, int64_t w_stride,
                   int64_t pairs, int64_t n_begin, int64_t n_end, float* out, int64_t out_stride) {
  dot_rows<Avx512AmxSimd>(x_split, rows, padded_pairs, w, w_stride, pairs, n_begin, n_end, out, out_stride);
}
void merge_rows_amx(int64_t parts, int64_t rows, int64_t dim, const float* outs, int64_t out_part_stride,
                const float* lses, int64_t lse_part_stride, float* out, float* lse) {
  merge_rows<Avx512AmxSimd>(parts, rows, dim, outs, out_part_stride, lses, lse_part_stride, out, lse);
}
}  // namespace
}  // namespace writescope
#pragma GCC pop_options

namespace writescope {
const IsaKernels& amx_kernels() {
  static const IsaKernels kernels{"amx", &attend_item_amx, &read_sum_amx, &fma_burst_amx,
                                  FmaBurst<Avx512AmxSimd>::kFlopsPerIteration, &dot_burst_amx,
                                  DotBurst<Avx512AmxSimd>::kFlopsPerIteration, &tile_burst_amx,
                                  TileBurst::kFlopsPerIteration, &dot_rows_amx, &merge_rows_amx};
  return kernels;
}
}  // namespace writescope
#endif
