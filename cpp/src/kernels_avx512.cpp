// AVX-512 (F, BW, VL) kernels. Library headers come before the target pragma so nothing with
// external linkage is compiled for this ISA; the table itself is built at the baseline target.
#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "writescope/kernel_args.h"

#if defined(__x86_64__)
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")
#include "writescope/attention_kernel.h"
#include "writescope/roofline_kernel.h"
#include "writescope/simd_avx512.h"

namespace writescope {
namespace {
void attend_item_avx512(const PagedAttentionArgs& args, const WorkItem& item, Workspace ws) {
  attend_item<Avx512Simd>(args, item, ws);
}
double read_sum_avx512(const float* data, int64_t count) { return read_sum<Avx512Simd>(data, count); }
double fma_burst_avx512(int64_t iterations) { return FmaBurst<Avx512Simd>::run(iterations); }
}  // namespace
}  // namespace writescope
#pragma GCC pop_options

namespace writescope {
const IsaKernels& avx512_kernels() {
  static const IsaKernels kernels{"avx512", &attend_item_avx512, &read_sum_avx512, &fma_burst_avx512,
                                  FmaBurst<Avx512Simd>::kFlopsPerIteration, nullptr, 0, nullptr, 0};
  return kernels;
}
}  // namespace writescope
#endif
