// AVX2 + FMA + F16C kernels. Library headers come before the target pragma so nothing with
// external linkage is compiled for this ISA; the table itself is built at the baseline target.
#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "writescope/kernel_args.h"

#if defined(__x86_64__)
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#include "writescope/attention_kernel.h"
#include "writescope/dense_kernel.h"
#include "writescope/merge_kernel.h"
#include "writescope/roofline_kernel.h"
#include "writescope/simd_avx2.h"

namespace writescope {
namespace {
void attend_item_avx2(const PagedAttentionArgs& args, const WorkItem& item, Workspace ws) {
  attend_item<Avx2Simd>(args, item, ws);
}
double read_sum_avx2(const float* data, int64_t count) { return read_sum<Avx2Simd>(data, count); }
double fma_burst_avx2(int64_t iterations) { return FmaBurst<Avx2Simd>::run(iterations); }
void dot_rows_avx2(const float* x_split, int64_t rows, int64_t padded_pairs, const uint16_t* w, int64_t w_stride,
                   int64_t pairs, int64_t n_begin, int64_t n_end, float* out, int64_t out_stride) {
  dot_rows<Avx2Simd>(x_split, rows, padded_pairs, w, w_stride, pairs, n_begin, n_end, out, out_stride);
}
void merge_rows_avx2(int64_t parts, int64_t rows, int64_t dim, const float* outs, int64_t out_part_stride,
                const float* lses, int64_t lse_part_stride, float* out, float* lse) {
  merge_rows<Avx2Simd>(parts, rows, dim, outs, out_part_stride, lses, lse_part_stride, out, lse);
}
}  // namespace
}  // namespace writescope
#pragma GCC pop_options

namespace writescope {
const IsaKernels& avx2_kernels() {
  static const IsaKernels kernels{"avx2", &attend_item_avx2, &read_sum_avx2, &fma_burst_avx2,
                                  FmaBurst<Avx2Simd>::kFlopsPerIteration, nullptr, 0, nullptr, 0, &dot_rows_avx2, &merge_rows_avx2};
  return kernels;
}
}  // namespace writescope
#endif
