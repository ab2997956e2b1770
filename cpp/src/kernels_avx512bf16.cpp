// AVX-512 + AVX512-BF16 kernels (bf16 dot products for bf16 q.K). Library headers come before the target pragma so nothing with
// external linkage is compiled for this ISA; the table itself is built at the baseline target.
#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "writescope/kernel_args.h"

#if defined(__x86_64__)
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma,f16c")
#include "writescope/attention_kernel.h"
#include "writescope/dense_kernel.h"
#include "writescope/merge_kernel.h"
#include "writescope/roofline_kernel.h"
#include "writescope/simd_avx512bf16.h"

namespace writescope {
namespace {
void attend_item_avx512bf16(const PagedAttentionArgs& args, const WorkItem& item, Workspace ws) {
  attend_item<Avx512Bf16Simd>(args, item, ws);
}
double read_sum_avx512bf16(const float* data, int64_t count) { return read_sum<Avx512Bf16Simd>(data, count); }
double fma_burst_avx512bf16(int64_t iterations) { return FmaBurst<Avx512Bf16Simd>::run(iterations); }
double dot_burst_avx512bf16(int64_t iterations) { return DotBurst<Avx512Bf16Simd>::run(iterations); }
void dot_rows_avx512bf16(const float* x_split, int64_t rows, int64_t padded_pairs, const uint16_t* w, int64_t w_stride,
                   int64_t pairs, int64_t n_begin, int64_t n_end, float* out, int64_t out_stride) {
  dot_rows<Avx512Bf16Simd>(x_split, rows, padded_pairs, w, w_stride, pairs, n_begin, n_end, out, out_stride);
}
void merge_rows_avx512bf16(int64_t parts, int64_t rows, int64_t dim, const float* outs, int64_t out_part_stride,
                const float* lses, int64_t lse_part_stride, float* out, float* lse) {
  merge_rows<Avx512Bf16Simd>(parts, rows, dim, outs, out_part_stride, lses, lse_part_stride, out, lse);
}
}  // namespace
}  // namespace writescope
#pragma GCC pop_options

namespace writescope {
const IsaKernels& avx512bf16_kernels() {
  static const IsaKernels kernels{"avx512bf16", &attend_item_avx512bf16, &read_sum_avx512bf16, &fma_burst_avx512bf16,
                                  FmaBurst<Avx512Bf16Simd>::kFlopsPerIteration, &dot_burst_avx512bf16,
                                  DotBurst<Avx512Bf16Simd>::kFlopsPerIteration, nullptr, 0, &dot_rows_avx512bf16, &merge_rows_avx512bf16};
  return kernels;
}
}  // namespace writescope
#endif
