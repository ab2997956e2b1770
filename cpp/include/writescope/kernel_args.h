// The plain-data interface between the launcher (argument checks, work split, thread pool) and the
// per-ISA kernels. Only C types cross it, so each ISA translation unit can be compiled for its own
// target without sharing inline C++ library code with the others.
#pragma once

#include <cstdint>

namespace writescope {

enum class DType : int32_t { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };

// Decode attention of one query token per sequence over a paged, head-major KV cache.
// Every stride is in elements; the last dimension of every tensor is contiguous.
struct PagedAttentionArgs {
  // q [num_seqs, num_q_heads, head_dim_qk]
  const void* q;
  DType q_dtype;
  int64_t q_seq_stride, q_head_stride;
  // k [num_blocks, num_kv_heads, block_size, head_dim_qk], v [..., head_dim_v]
  const void* k;
  const void* v;
  DType kv_dtype;
  int64_t k_block_stride, k_head_stride, k_token_stride;
  int64_t v_block_stride, v_head_stride, v_token_stride;
  // block_table [num_seqs, max_blocks_per_seq] int32, seq_lens [num_seqs] int32
  const int32_t* block_table;
  int64_t block_table_stride;
  const int32_t* seq_lens;
  int64_t num_seqs, num_q_heads, num_kv_heads, head_dim_qk, head_dim_v, block_size;
  float scale;
};

// One work item: one kv head of one sequence over tokens [token_begin, token_end).
// Writes the normalised partial out [group, head_dim_v] and its natural-log lse [group].
struct WorkItem {
  int64_t seq, kv_head, token_begin, token_end;
  float* out;
  float* lse;
};

// Per-thread scratch the kernel may use; sized by kernel_workspace_bytes().
struct Workspace {
  void* data;
  int64_t bytes;
};

constexpr int64_t kTileTokens = 64;  // tokens per online-softmax step inside a work item

inline int64_t kernel_workspace_bytes(int64_t group, int64_t head_dim_qk) {
  const int64_t q_bytes = group * head_dim_qk * 4;
  const int64_t scores_bytes = group * kTileTokens * 4;
  const int64_t softmax_state_bytes = 2 * group * 4;
  const int64_t row_pointer_bytes = 2 * kTileTokens * 8;
  return q_bytes + scores_bytes + softmax_state_bytes + 64 + row_pointer_bytes;
}

// What each ISA translation unit exports.
struct IsaKernels {
  const char* name;
  void (*attend_item)(const PagedAttentionArgs& args, const WorkItem& item, Workspace ws);
  double (*read_sum)(const float* data, int64_t count);  // sum of data, streamed once
  double (*fma_burst)(int64_t iterations);                // returns a value so it is not elided
  int64_t fma_flops_per_iteration;
};

const IsaKernels& scalar_kernels();
const IsaKernels& avx2_kernels();
const IsaKernels& avx512_kernels();
const IsaKernels& avx512bf16_kernels();

}  // namespace writescope
