// The plain-data interface between the launcher (argument checks, work split, thread pool) and the
// per-ISA kernels. Only C types cross it, so each ISA translation unit can be compiled for its own
// target without sharing inline C++ library code with the others.
#pragma once

#include <cstdint>

namespace writescope {

enum class DType : int32_t { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };

// How one (block, kv head) of K and V is laid out in memory.
//   kTokenMajor  k [block_size, head_dim_qk], v [block_size, head_dim_v]: a token's row contiguous
//   kPaired      k [head_dim_qk / 2, block_size, 2]: K transposed within the block in pairs of dims,
//                so one vector load holds a dim pair of consecutive tokens (QK vectorises over
//                tokens, with no horizontal sum per score, and is the operand layout of a bf16 dot);
//                v [block_size / 2, head_dim_v, 2]: V in pairs of tokens, so one load holds a dim
//                range of two tokens (PV vectorises over dims, and is a bf16 dot's layout too).
//                The block's K and V are each contiguous.
enum class KvLayout : int32_t { kTokenMajor = 0, kPaired = 1 };

// Decode attention of one query token per sequence over a paged, head-major KV cache.
// Every stride is in elements; the last dimension of every tensor is contiguous.
struct PagedAttentionArgs {
  KvLayout layout;
  // q [num_seqs, num_q_heads, head_dim_qk]
  const void* q;
  DType q_dtype;
  int64_t q_seq_stride, q_head_stride;
  // kTokenMajor: k [num_blocks, num_kv_heads, block_size, head_dim_qk], v [..., head_dim_v], strides
  // of the first three dims below. kPaired: k [num_blocks, num_kv_heads, head_dim_qk / 2, block_size, 2],
  // v [num_blocks, num_kv_heads, block_size / 2, head_dim_v, 2]; block and head strides below, the
  // rest contiguous (token strides unused).
  const void* k;
  const void* v;
  DType kv_dtype;
  int64_t k_block_stride, k_head_stride, k_token_stride;
  int64_t v_block_stride, v_head_stride, v_token_stride;
  // block_table [num_seqs, max_blocks_per_seq] int32, seq_lens [num_seqs] int32
  const int32_t* block_table;
  int64_t block_table_stride;
  const int32_t* seq_lens;
  bool use_bf16_dot;  // bf16 q.K through the variant's bf16 dot (where it has one and it is the faster here)
  // bf16 q and KV: the probabilities may be rounded to bf16 before PV (the bf16 dot path's and the AMX
  // tiles' contract: ops.cpu_rounds_probabilities)
  bool round_probabilities;
  bool pace_loops;    // the paired kernel's loops paced to the memory rate, searched online (pacing.h)
  int64_t num_seqs, num_q_heads, num_kv_heads, head_dim_qk, head_dim_v, block_size;
  float scale;
};

// One work item: one kv head of one sequence over tokens [token_begin, token_end).
// Writes the normalised partial out [group, head_dim_v] and its natural-log lse [group].
struct WorkItem {
  int64_t seq, kv_head, token_begin, token_end;
  float* out;
  float* lse;
  // The item this thread will likely take next (nullptr: none). The paired kernel asks for its first
  // tile during this item's last, so the next item does not start by waiting for memory. Only a
  // guess (threads claim items from a counter; with items of equal size they take them in turns),
  // and only ever prefetched: a wrong guess costs one tile of bandwidth, never a wrong result.
  const WorkItem* next = nullptr;
};

// Per-thread scratch the kernel may use; sized by kernel_workspace_bytes().
struct Workspace {
  void* data;
  int64_t bytes;
};

// V read from inside K's rows (MLA: V a prefix of the latent): its lines are K's, read once.
inline bool value_inside_key(const PagedAttentionArgs& a) {
  return a.v == a.k && a.v_head_stride == a.k_head_stride && a.v_block_stride == a.k_block_stride &&
         a.v_token_stride == a.k_token_stride;
}

constexpr int64_t kTileTokens = 64;  // tokens per online-softmax step inside a work item

// The paired kernel's tile is whole blocks: as many as make kTileTokens, at least one.
inline int64_t paired_tile_blocks(int64_t block_size) {
  return block_size >= kTileTokens ? 1 : kTileTokens / block_size;
}
// Scores of one head in a tile, rounded up to the widest vector (16 floats).
inline int64_t tile_score_stride(int64_t tile_tokens) { return (tile_tokens + 15) / 16 * 16; }

// The block size the scratch is sized by: the paired kernel's tiles are whole blocks; the token-major
// kernel's are kTileTokens whatever the block (a one-block sequence of 1M tokens needs no more).
inline int64_t scratch_block_size(KvLayout layout, int64_t block_size) {
  return layout == KvLayout::kPaired ? block_size : 0;
}

// The kernels' scratch before their AMX operands: q, scores, softmax state, row pointers, token
// vectors. block_size: scratch_block_size's.
inline int64_t amx_workspace_offset(int64_t group, int64_t head_dim_qk, int64_t block_size) {
  const int64_t tile_tokens = kTileTokens > block_size ? kTileTokens : block_size;
  const int64_t q_bytes = group * head_dim_qk * 4;
  const int64_t scores_bytes = group * tile_score_stride(tile_tokens) * 4;
  const int64_t softmax_state_bytes = 2 * group * 4;
  const int64_t row_pointer_bytes = 2 * tile_tokens * 8;
  const int64_t token_vector_bytes = (2 * tile_tokens) * 24;  // the paired kernel's, at most a tile's tokens + blocks
  return q_bytes + scores_bytes + softmax_state_bytes + 64 + row_pointer_bytes + token_vector_bytes;
}

// block_size: scratch_block_size's.
inline int64_t kernel_workspace_bytes(int64_t group, int64_t head_dim_qk, int64_t head_dim_v, int64_t block_size) {
  const int64_t tile_tokens = kTileTokens > block_size ? kTileTokens : block_size;
  // The AMX paths' operands: q (and its transpose) and probabilities split in bf16 high and low
  // halves; one block of V with the slots past a sequence's end zeroed, one 16-token group's 64
  // dims of 32 tokens in token pairs, or 16 V rows with those past the end zeroed; the transposed
  // scores of a tile [tile_tokens, group] float32; the probabilities as bf16 in 32-bit words, even
  // and odd [group, tile_tokens] each; alignment.
  int64_t v_bytes = block_size * head_dim_v * 2 > 16 * 64 * 2 * 2 ? block_size * head_dim_v * 2 : 16 * 64 * 2 * 2;
  v_bytes = v_bytes > 16 * head_dim_v * 2 ? v_bytes : 16 * head_dim_v * 2;
  const int64_t amx_bytes = 4 * group * head_dim_qk * 2 + 2 * group * tile_score_stride(tile_tokens) * 2 + v_bytes +
                            tile_tokens * group * 4 + 2 * group * tile_tokens * 4 + 7 * 64;
  return amx_workspace_offset(group, head_dim_qk, block_size) + amx_bytes;
}

// Where the AMX variant runs QK and PV as tile products (bf16 KV), measured to pay on a 2-vCPU Xeon
// (Sapphire Rapids class): from 8 heads per kv head (Qwen3 +10% at 128K, MLA 2x); at 1 (MHA) the FMA
// loops overlap memory better (-19%). The paired kernel takes 4 heads (Mixtral) too since its tile
// products share one configuration and take 32 tokens of V each: measured on a 2-vCPU Xeon (Emerald
// Rapids class) at 8K and 32K, interleaved against the FMA loops, 1.06x at both. The shapes must fill
// whole tiles.
inline bool paired_tiles_fit(int64_t group, int64_t head_dim_qk, int64_t head_dim_v, int64_t block_size) {
  return group >= 4 && block_size % 16 == 0 && head_dim_qk % 32 == 0 && head_dim_v % 16 == 0;
}
inline bool token_major_tiles_fit(int64_t group, int64_t head_dim_qk, int64_t head_dim_v, int64_t block_size) {
  return group >= 8 && group <= 16 && block_size % 16 == 0 && head_dim_qk % 32 == 0 && head_dim_v % 32 == 0;
}

// What each ISA translation unit exports.
struct IsaKernels {
  const char* name;
  void (*attend_item)(const PagedAttentionArgs& args, const WorkItem& item, Workspace ws);
  double (*read_sum)(const float* data, int64_t count);  // sum of data, streamed once
  double (*fma_burst)(int64_t iterations);                // returns a value so it is not elided
  int64_t fma_flops_per_iteration;
  double (*dot_burst)(int64_t iterations);  // the bf16 dot product's peak (vdpbf16ps); nullptr: none
  int64_t dot_flops_per_iteration;
  double (*tile_burst)(int64_t iterations);  // AMX bf16 tile products' peak; nullptr: none
  int64_t tile_flops_per_iteration;
  // Rows x bf16 weights, dot_rows in dense_kernel.h.
  void (*dot_rows)(const float* x_split, int64_t rows, int64_t padded_pairs, const uint16_t* w, int64_t w_stride,
                   int64_t pairs, int64_t n_begin, int64_t n_end, float* out, int64_t out_stride);
  // The merge of normalised partials, merge_rows in merge_kernel.h.
  void (*merge_rows)(int64_t parts, int64_t rows, int64_t dim, const float* outs, int64_t out_part_stride,
                     const float* lses, int64_t lse_part_stride, float* out, float* lse);
};

const IsaKernels& scalar_kernels();
const IsaKernels& avx2_kernels();
const IsaKernels& avx512_kernels();
const IsaKernels& avx512bf16_kernels();
const IsaKernels& amx_kernels();

}  // namespace writescope
