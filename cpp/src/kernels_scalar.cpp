// The scalar fallback: compiled for the baseline target, runs on any CPU.
#include "writescope/attention_kernel.h"
#include "writescope/dense_kernel.h"
#include "writescope/kernel_args.h"
#include "writescope/merge_kernel.h"
#include "writescope/roofline_kernel.h"
#include "writescope/simd_scalar.h"

namespace writescope {

const IsaKernels& scalar_kernels() {
  static const IsaKernels kernels{
      "scalar", &attend_item<ScalarSimd>, &read_sum<ScalarSimd>, &FmaBurst<ScalarSimd>::run,
      FmaBurst<ScalarSimd>::kFlopsPerIteration, nullptr, 0, nullptr, 0, &dot_rows<ScalarSimd>, &merge_rows<ScalarSimd>};
  return kernels;
}

}  // namespace writescope
