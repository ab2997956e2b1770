// The decode attention kernel over the paired layout (KvLayout::kPaired), written once over a SIMD
// traits type S; included by each ISA translation unit after attention_kernel.h, in the same
// anonymous namespace.
//
// One work item = one kv head of one sequence over a token range that starts on a block boundary.
// Tokens are visited in tiles of whole blocks (paired_tile_blocks). Per tile:
//   scores  vectors over W consecutive tokens: each K load is one dim pair of W tokens, widened
//           to (even dim, odd dim) float32 vectors, times the broadcast q of every head of the
//           group: no horizontal sum, and each K byte is loaded once per head tile.
//           With a bf16 q where the bf16 dot is faster, the K load is the dot's operand as it is.
//   softmax once per head and tile: a vector max, exp and sum over the tile's scores; the running
//           output is rescaled only when the head's max grows.
//   values  vectors over W dims: each V load is a dim range of a token pair, widened to (token t,
//           token t + 1) vectors, times the broadcast probabilities of every head in the tile.
//           On the bf16 dot path the load is the dot's operand as it is, and the probabilities are
//           rounded to bf16 once (dot_values).
// Everything accumulates in float32; results match the float32 reference to rounding, except that
// the dot path's bf16 probabilities move an output dim by at most 2^-9 of the largest |V| it averages.
#pragma once

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "writescope/attention_kernel.h"
#include "writescope/kernel_args.h"
#include "writescope/line_prefetcher.h"
#include "writescope/pacing.h"
#include "writescope/phase_timers.h"

namespace writescope {
namespace {

// What a thread keeps of a shape between work items: its pace controller (pacing.h), and the steps
// a whole tile took, which spread the prefetches of an item's second tile (the first tile of an item
// has no earlier tile to count: it asked for one line a step and left half the next tile's lines to
// a burst at its end; measured on a 2-vCPU Zen 4, Qwen3-MoE 4K in cache, one thread, items of 256
// tokens: 20% of the item loop's samples on that burst).
struct ShapeMemory {
  PaceController pace;
  int64_t tile_steps = 0;  // 0: no whole tile seen yet
};

// This thread's memories, one per shape it ran recently: a pool thread keeps its own across calls,
// so each pace searches under the load it actually meets.
class ShapeTable {
 public:
  // The memory of shape `key` (nonzero), taking the oldest slot for a shape not seen recently.
  ShapeMemory& find(int64_t key) {
    for (int i = 0; i < kSlots; ++i)
      if (keys_[i] == key) return memories_[i];
    const int slot = next_;
    next_ = (next_ + 1) % kSlots;
    keys_[slot] = key;
    memories_[slot] = ShapeMemory{};
    return memories_[slot];
  }

 private:
  static constexpr int kSlots = 8;
  int64_t keys_[kSlots] = {};
  ShapeMemory memories_[kSlots];
  int next_ = 0;
};

inline ShapeTable& this_thread_shapes() {
  thread_local ShapeTable table;
  return table;
}

template <class S, class Kv>
struct PairedKernel {
  using V = typename S::V;
  using T = typename Kv::Elem;
  static constexpr int W = S::kWidth;
  // Heads x token vectors of one score step: 2 * GT * TV accumulators (even and odd dims apart, so
  // no two FMAs in a row wait on each other) within the register file, and per dim pair TV K loads
  // plus 2 * GT q broadcasts for 2 * GT * TV FMAs, which keeps the load ports below the FMA rate.
  // With 16 registers (AVX2) four heads share each widened K vector, with the even and odd dims
  // chained into one accumulator (GT * TV of them): eight chains of two FMAs still cover the FMA
  // latency, and each K vector's widening (a shift and a mask, on the vector pipes the FMAs and
  // broadcasts use) serves twice the FMAs of two heads. Measured on a 2-vCPU Zen 3, one thread, 1K
  // tokens of the Qwen3 shape in L2, three runs each: 84-105 us with two heads unchained, 63-84 us.
  static constexpr bool kWide = S::kRegisters >= 32;
  static constexpr int64_t kMaxPrefetchBlocks = 64;
  static constexpr int kScoreHeads = 4;
  // With 32 registers, eight or four heads take two or four token vectors (every vector of a tile of
  // 16-token blocks), their even and odd dims chained into 16 accumulators: each q broadcast then
  // serves two or four FMAs where it served one, taking half or more of the loads and the fused
  // broadcasts off the step. Measured on a 2-vCPU Xeon (avx512bf16 and avx512 forced: the FMA
  // loops), one thread, 8K in L3, interleaved against one vector of eight heads and two of four,
  // unchained: Qwen3-MoE 1.04-1.07x, Mixtral 1.06x; from DRAM, 2 threads, Qwen3-MoE 1.01x at 8K and
  // 1.03x at 32K, Mixtral (memory-bound) 1.00x. A single head over eight vectors measured 0.86x:
  // a tile has four.
  static constexpr bool chained_scores(int heads, int vectors) { return kWide ? heads * vectors >= 16 : heads >= 4; }
  // Measured on a 2-vCPU Xeon at 32K (Qwen3 and Mixtral shapes): one tile ahead, spread over the
  // inner iterations, beat bursts per tile (1-4 tiles ahead) by 20-40% and no prefetch by 30%.
  static constexpr int kPrefetchTiles = 1;
  // A single head takes more token vectors so there are still eight FMA chains in flight.
  static constexpr int score_vectors(int heads) {
    return heads >= 8 ? 2 : heads >= 4 ? (kWide ? 4 : 2) : heads >= 2 ? 2 : 4;
  }

  // One token vector: up to W consecutive tokens of one block.
  struct TokenVector {
    const T* k;       // the block's K at the vector's first token: pair (p, t) at k[(p * block_size + t) * 2]
    int64_t lanes;    // valid tokens, 1..W
    int64_t column;   // its first token's position in the tile's scores
  };


  const PagedAttentionArgs& a;
  const int64_t group, dim_qk, dim_v, block_size, tile_blocks, tile_tokens, stride;
  // bf16 q.K through the variant's bf16 dot (S::kBf16Dot, bf16 q and KV, measured faster here): a
  // paired K load is the dot's operand as stored (W tokens x one dim pair), each head's q pair is
  // broadcast as it is, and products of bf16 values are exact in float32, so it is as accurate as
  // widening K for two FMAs, in one instruction per head where the FMA path takes two plus the
  // widening. The scale is applied to the sums. Measured on a 2-vCPU Zen 4 (avx512bf16) at 32K,
  // interleaved with the FMA path: Qwen3-MoE 1.20x, Mixtral 1.11x. The same path takes PV through
  // the dot too (dot_values). Tried and not kept: PV with the probabilities split into bf16 high and
  // low words (two dots per head and pair, float32-exact) 0.97-0.98x in-core; an FMA taking its
  // broadcast from memory 1.02x.
  bool bf16_dot = false;
  uint32_t* q_pairs = nullptr;  // q32's memory: [dim_qk / 2, heads, bf16 pair] per score chunk
  // Pre-scaled q. AMX reads it as [group, dim_qk]; the FMA path pair-major within each chunk of
  // heads a score step takes (for_each_score_chunk), [dim_qk / 2, heads, 2] from the chunk's first
  // head's row, so the step's broadcasts are constant offsets from one pointer and the chunk's q
  // stays as compact as its rows were (MLA's 16 x 576 q does not fit in L1 whole).
  float* q32;
  float* scores;   // [group, stride]: scores, then probabilities
  float* row_max;  // [group]
  float* row_sum;  // [group]
  const T** k_blocks;  // [tile_blocks] this tile's blocks, K
  const T** v_blocks;  // [tile_blocks] and V
  TokenVector* vectors;  // [tile_tokens + tile_blocks] this tile's token vectors
  int64_t kv_head = 0;

  const char* prefetch_ranges[2 * kMaxPrefetchBlocks];
  LinePrefetcher pf;
  int64_t whole_tile_steps = 0;  // the steps of this item's last whole tile; 0: none

  PairedKernel(const PagedAttentionArgs& args, Workspace ws)
      : a(args),
        group(args.num_q_heads / args.num_kv_heads),
        dim_qk(args.head_dim_qk),
        dim_v(args.head_dim_v),
        block_size(args.block_size),
        tile_blocks(paired_tile_blocks(args.block_size)),
        tile_tokens(paired_tile_blocks(args.block_size) * args.block_size),
        stride(tile_score_stride(tile_tokens)) {
    const ScratchHead head(ws, group, dim_qk, stride);
    q32 = head.q32, scores = head.scores, row_max = head.row_max, row_sum = head.row_sum;
    k_blocks = reinterpret_cast<const T**>(head.pointers);
    v_blocks = k_blocks + tile_blocks;
    vectors = reinterpret_cast<TokenVector*>(v_blocks + tile_blocks);
    char* p = static_cast<char*>(ws.data) + amx_workspace_offset(group, dim_qk, scratch_block_size(a.layout, block_size));
    p = reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(p) + 63) & ~uintptr_t(63));
    q_hi = reinterpret_cast<uint16_t*>(p);
    q_lo = q_hi + group * dim_qk;
    p_hi = q_lo + group * dim_qk;
    p_lo = p_hi + group * stride;
    v_clean = reinterpret_cast<T*>(
        (reinterpret_cast<uintptr_t>(p_lo + group * stride) + 63) & ~uintptr_t(63));
    if constexpr (S::kAmx && std::is_same_v<Kv, Bf16Kv>) amx = paired_tiles_fit(group, dim_qk, dim_v, block_size);
  }

  // ------------------------------------------------------------------ AMX (S::kAmx, bf16 KV)
  // QK: scores [heads, 16 tokens] += q [heads, 32 dims] x K [16 dim pairs, 16 tokens x 2]: the
  // paired K block is the B operand as stored, four 16-token groups per q chunk loaded. PV: out
  // [heads, 16 dims] += P [heads, 32 tokens] x V [16 token pairs, 16 dims x 2]: the paired V blocks
  // likewise, 32 tokens deep where two 16-token blocks lie one after the other (an extent's
  // consecutive ids), else 16. q (when not bf16) is split into a bf16 high part and a bf16 low part
  // (x = hi + lo to 2^-17), two tile products each, so the scores keep float32 accuracy; the scale
  // is applied to the scores, so a bf16 q has no low part. P is split likewise, unless q and KV are
  // bf16: then it is rounded to bf16 once (round_probabilities). Both products run under one tile
  // configuration, and the next tile's lines are asked for once per K or V tile loaded (one a q
  // chunk or a 32-token group gave bursts of ~80 lines that stalled on the fill buffers). Measured
  // on a 2-vCPU Xeon (Emerald Rapids class), Qwen3-MoE at 32K from DRAM, 2 threads, interleaved
  // with the previous tile loops (one product per 16-token group, a configuration per product):
  // 1.11-1.12x (26 -> 29 GB/s); Mixtral 1.06x over the FMA loops at 8K and 32K.
  bool amx = false;
  bool q_has_low = false;
  // P's low part takes tile products too, unless bf16 q and KV may have it rounded to bf16
  // (PagedAttentionArgs::round_probabilities), as the bf16 dot path and the GPU kernel round it.
  bool p_has_low = true;
  uint16_t* q_hi;  // [group, dim_qk] bf16
  uint16_t* q_lo;
  uint16_t* p_hi;  // [group, stride] bf16
  uint16_t* p_lo;
  T* v_clean;      // one V block [block_size / 2, dim_v, 2], slots past the sequence's end zeroed
  AmxTiles<S> tiles;
  phase_timers::ItemLaps laps;  // from the kernel's construction (the item's start) to its end

  // q32 -> bf16 high and low parts, 16 at a time (group * dim_qk is a multiple of 32 here: a scalar
  // loop was ~10% of a Qwen3-MoE item of 1K tokens on a 2-vCPU Xeon, in cache); a bf16 q is
  // already in q_hi.
  void split_queries() {
    if (a.q_dtype == DType::kBFloat16) {  // load_queries put it in q_hi as it is
      q_has_low = false;
      return;
    }
    if constexpr (S::kAmx) {
      uint32_t any_low = 0;
      for (int64_t i = 0; i < group * dim_qk; i += 16) {
        S::split_bf16(q32 + i, q_hi + i, q_lo + i);
        for (int64_t j = 0; j < 16; ++j) any_low |= q_lo[i + j] & 0x7FFFu;
      }
      q_has_low = any_low != 0;
    }
  }

  // Scores of the tile's 16-token groups, four at a time in accumulators 0-3, so each q chunk
  // loaded serves four K tiles (B operands 6 and 7 in turn).
  void amx_scores(int64_t blocks) {
    if constexpr (S::kAmx) {
      const int64_t groups = blocks * block_size / 16;
      for (int64_t g0 = 0; g0 < group; g0 += 16) {
        tiles.configure_paired(group - g0 < 16 ? group - g0 : 16);
        for (int64_t u0 = 0; u0 < groups; u0 += 4) {
          switch (groups - u0 < 4 ? groups - u0 : 4) {
            case 1: amx_score_groups<1>(g0, u0); break;
            case 2: amx_score_groups<2>(g0, u0); break;
            case 3: amx_score_groups<3>(g0, u0); break;
            default: amx_score_groups<4>(g0, u0); break;
          }
        }
      }
    }
  }

  // Heads [g0, g0 + 16) x the N 16-token groups from u0: scores [heads, 16 N] into `scores`.
  template <int N>
  void amx_score_groups(int64_t g0, int64_t u0) {
    if constexpr (S::kAmx) {
      const int64_t k_stride_bytes = block_size * 4;  // one dim pair of a block's tokens
      const T* k[N];
      WS_UNROLL
      for (int u = 0; u < N; ++u) k[u] = k_blocks[(u0 + u) * 16 / block_size] + ((u0 + u) * 16 % block_size) * 2;
      S::template tile_zero<0>();
      if constexpr (N > 1) S::template tile_zero<1>();
      if constexpr (N > 2) S::template tile_zero<2>();
      if constexpr (N > 3) S::template tile_zero<3>();
      LinePrefetcher prefetch = pf;
      const uint16_t* q_row = q_hi + g0 * dim_qk;
      if (q_has_low) {
        for (int64_t c = 0; c < dim_qk; c += 32) {
          S::template tile_load<4>(q_row + c, dim_qk * 2);
          S::template tile_load<5>(q_lo + g0 * dim_qk + c, dim_qk * 2);
          amx_score_chunk<N, 4, true>(prefetch, k, (c / 2) * block_size * 2, k_stride_bytes);
        }
      } else {
        // A bf16 q has no low part: its chunks go to tiles 4 and 5 in turn, so a chunk's load need
        // not wait for the last product reading the chunk before.
        int64_t c = 0;
        for (; c + 64 <= dim_qk; c += 64) {
          S::template tile_load<4>(q_row + c, dim_qk * 2);
          amx_score_chunk<N, 4, false>(prefetch, k, (c / 2) * block_size * 2, k_stride_bytes);
          S::template tile_load<5>(q_row + c + 32, dim_qk * 2);
          amx_score_chunk<N, 5, false>(prefetch, k, (c / 2 + 16) * block_size * 2, k_stride_bytes);
        }
        if (c < dim_qk) {
          S::template tile_load<4>(q_row + c, dim_qk * 2);
          amx_score_chunk<N, 4, false>(prefetch, k, (c / 2) * block_size * 2, k_stride_bytes);
        }
      }
      pf = prefetch;
      touch_deferred();
      float* out = scores + g0 * stride + u0 * 16;
      S::template tile_store<0>(out, stride * 4);
      if constexpr (N > 1) S::template tile_store<1>(out + 16, stride * 4);
      if constexpr (N > 2) S::template tile_store<2>(out + 32, stride * 4);
      if constexpr (N > 3) S::template tile_store<3>(out + 48, stride * 4);
    }
  }

  // Accumulators 0..N-1 += q chunk (tile A; kLow: its low part in tile 5 too) x the K chunk at
  // k[u] + at of each group u.
  template <int N, int A, bool kLow>
  WS_INLINE void amx_score_chunk(LinePrefetcher& prefetch, const T* const* k, int64_t at, int64_t k_stride_bytes) {
    if constexpr (S::kAmx) {
      amx_score_product<0, A, kLow>(prefetch, k[0] + at, k_stride_bytes);
      if constexpr (N > 1) amx_score_product<1, A, kLow>(prefetch, k[1] + at, k_stride_bytes);
      if constexpr (N > 2) amx_score_product<2, A, kLow>(prefetch, k[2] + at, k_stride_bytes);
      if constexpr (N > 3) amx_score_product<3, A, kLow>(prefetch, k[3] + at, k_stride_bytes);
    }
  }
  template <int C, int A, bool kLow>
  WS_INLINE void amx_score_product(LinePrefetcher& prefetch, const void* b, int64_t stride_bytes) {
    if constexpr (S::kAmx) {
      constexpr int B = 6 + (C & 1);
      prefetch.step();
      S::template tile_load<B>(b, stride_bytes);
      S::template tile_dot<C, A, B>();
      if constexpr (kLow) S::template tile_dot<C, 5, B>();
    }
  }

  // The probabilities of [0, count) as bf16 high and low parts (zero past count, to the tile's end).
  void split_probabilities(int64_t count, int64_t blocks) {
    const int64_t end = blocks * block_size;
    for (int64_t g = 0; g < group; ++g) {
      const float* row = scores + g * stride;
      uint16_t* hi = p_hi + g * stride;
      uint16_t* lo = p_lo + g * stride;
      int64_t t = 0;
      if constexpr (S::kAmx) {
        for (; t + 16 <= count; t += 16) S::split_bf16(row + t, hi + t, lo + t);
      }
      for (; t < count; ++t) {
        hi[t] = bf16_round(row[t]);
        lo[t] = bf16_round(row[t] - bf16_bits_to_float(hi[t]));  // finite: probabilities are in [0, 1]
      }
      for (; t < end; ++t) hi[t] = lo[t] = 0;
    }
  }

  // The rounded probabilities (update_softmax's, to count rounded up to the vector width) zeroed
  // from there to the tile's end.
  void zero_rounded_tail(int64_t count, int64_t blocks) {
    const int64_t from = (count + W - 1) / W * W, end = blocks * block_size;
    for (int64_t g = 0; g < group && from < end; ++g) std::memset(p_hi + g * stride + from, 0, (end - from) * 2);
  }

  // A partial last block's V with the slots from `valid` on zeroed: a zero probability times a NaN
  // left in an unused slot would still be NaN in a tile product.
  const T* clean_block(const T* v_block, int64_t valid) {
    const int64_t pair_elements = dim_v * 2;
    for (int64_t tp = 0; tp < block_size / 2; ++tp) {
      for (int64_t d = 0; d < dim_v; ++d) {
        const int64_t first = 2 * tp, at = tp * pair_elements + d * 2;
        v_clean[at] = first < valid ? v_block[at] : T(0);
        v_clean[at + 1] = first + 1 < valid ? v_block[at + 1] : T(0);
      }
    }
    return v_clean;
  }

  void amx_values(int64_t blocks, int64_t count, float* acc) {
    if constexpr (S::kAmx) {
      if (p_has_low) split_probabilities(count, blocks);
      else zero_rounded_tail(count, blocks);
      const int64_t last_valid = count - (blocks - 1) * block_size;
      if (last_valid < block_size) v_blocks[blocks - 1] = clean_block(v_blocks[blocks - 1], last_valid);
      if (token_pairs_span_32(blocks)) {
        for (int64_t g0 = 0; g0 < group; g0 += 16) amx_values_32(g0, group - g0 < 16 ? group - g0 : 16, blocks, acc);
        return;
      }
      const int64_t per_block = block_size / 16;
      for (int64_t g0 = 0; g0 < group; g0 += 16) {
        const int64_t rows = group - g0 < 16 ? group - g0 : 16;
        LinePrefetcher prefetch = pf;
        // 16-token group k is tokens [16 k, 16 k + 16) of the tile: block k / per_block, its token
        // pairs from 8 (k % per_block); 64 dims from d0 are 4 B operands 32 elements apart
        tiles.values(acc + g0 * dim_v, dim_v, rows, p_hi + g0 * stride, p_has_low ? p_lo + g0 * stride : nullptr, stride,
                     blocks * per_block, 16, [&](int64_t k, int64_t d0) {
                       prefetch.step();
                       const T* v = v_blocks[k / per_block] + ((k % per_block) * 8 * dim_v + d0) * 2;
                       return VSlice{v, dim_v * 4, 32};
                     });
        pf = prefetch;
      }
    }
  }

  // Whether each 32 tokens of the tile's V are 16 token pairs dim_v * 4 bytes apart: one B operand
  // of full depth, where a 16-token group fills half of a tile product. Always so within blocks of
  // a multiple of 32 tokens; for smaller blocks, where each two of the tile's blocks lie one after
  // the other (consecutive ids of an allocator extent).
  bool token_pairs_span_32(int64_t blocks) const {
    if (block_size % 32 == 0) return true;
    if ((blocks * block_size) % 32 != 0 || 32 % block_size != 0) return false;
    const int64_t per_group = 32 / block_size;
    for (int64_t j = 0; j < blocks; j += per_group)
      for (int64_t i = 1; i < per_group; ++i)
        if (v_blocks[j + i] != v_blocks[j] + i * block_size * dim_v) return false;
    return true;
  }

  // out [heads g0.., dim_v] += P x V over the tile's 32-token groups, 64 dims (four accumulators)
  // at a time: P's high and low parts in tiles 4 and 5, a group's 16 token pairs of 16 dims as the
  // B operand.
  void amx_values_32(int64_t g0, int64_t rows, int64_t blocks, float* acc) {
    if constexpr (S::kAmx) {
      tiles.configure_paired(rows);
      const int64_t groups = blocks * block_size / 32;
      const int64_t out_stride = dim_v * 4, v_stride = dim_v * 4;
      float* out = acc + g0 * dim_v;
      LinePrefetcher prefetch = pf;
      for (int64_t d0 = 0; d0 < dim_v; d0 += 64) {
        const int64_t n = (dim_v - d0) / 16 < 4 ? (dim_v - d0) / 16 : 4;
        tiles.load_accumulators(out + d0, out_stride, n);
        for (int64_t k = 0; k < groups; ++k) {
          S::template tile_load<4>(p_hi + g0 * stride + 32 * k, stride * 2);
          if (p_has_low) S::template tile_load<5>(p_lo + g0 * stride + 32 * k, stride * 2);
          const int64_t token = 32 * k;
          const T* v = v_blocks[token / block_size] + ((token % block_size) / 2 * dim_v + d0) * 2;
          value_products<0>(prefetch, v, v_stride, n);
          if (n > 2) value_products<2>(prefetch, v + 64, v_stride, n - 2);
        }
        tiles.store_accumulators(out + d0, out_stride, n);
      }
      pf = prefetch;
    }
  }

  // Accumulators C and, for count > 1, C + 1 += P x the V tiles of 16 dims at v and v + 32 (B tiles 6
  // and 7); an accumulator's products of P's two parts apart, so neither waits on the other's result.
  template <int C>
  WS_INLINE void value_products(LinePrefetcher& prefetch, const T* v, int64_t v_stride, int64_t count) {
    if constexpr (S::kAmx) {
      prefetch.step();
      S::template tile_load<6>(v, v_stride);
      S::template tile_dot<C, 4, 6>();
      if (count > 1) {
        prefetch.step();
        S::template tile_load<7>(v + 32, v_stride);
        S::template tile_dot<C + 1, 4, 7>();
      }
      if (p_has_low) {
        S::template tile_dot<C, 5, 6>();
        if (count > 1) S::template tile_dot<C + 1, 5, 7>();
      }
    }
  }

  // The shape's key in this thread's ShapeTable: group, dims, KV element size and q dtype (which
  // picks the dot or the FMA loops).
  int64_t shape_key() const {
    return 1 + group + (dim_qk << 12) + (dim_v << 28) + (static_cast<int64_t>(sizeof(T)) << 44) +
           (static_cast<int64_t>(a.q_dtype) << 48);
  }

  void run(const WorkItem& item) {
    ShapeMemory& memory = this_thread_shapes().find(shape_key());
    pf.steps = memory.tile_steps;
    if (!a.pace_loops) {
      attend(item);
    } else {
      const int level = memory.pace.choose();
      pf.delay = pace_delay(level);
      const auto started = std::chrono::steady_clock::now();
      attend(item);
      const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
      memory.pace.record(level, seconds / static_cast<double>(item.token_end - item.token_begin));
    }
    if (whole_tile_steps > 0) memory.tile_steps = whole_tile_steps;
  }

  void attend(const WorkItem& item) {
    kv_head = item.kv_head;
    load_queries(item);
    if (amx) split_queries();
    p_has_low = !(a.round_probabilities && a.q_dtype == DType::kBFloat16);
    for (int64_t i = 0; i < group * dim_v; ++i) item.out[i] = 0.0f;
    for (int64_t g = 0; g < group; ++g) {
      row_max[g] = kNegInf;
      row_sum[g] = 0.0f;
    }
    const int32_t* table = a.block_table + item.seq * a.block_table_stride;
    const int64_t first_block = item.token_begin / block_size;
    const int64_t end_block = (item.token_end + block_size - 1) / block_size;
    prefetch_blocks(table, first_block, first_block + kPrefetchTiles * tile_blocks, end_block);
    laps.lap(phase_timers::kItemStart);
    for (int64_t block = first_block; block < end_block; block += tile_blocks) {
      const int64_t begin = block * block_size;
      const int64_t count = item.token_end - begin < tile_tokens ? item.token_end - begin : tile_tokens;
      const bool first = block == first_block, last = !first && begin + count == item.token_end;
      const int64_t blocks = (count + block_size - 1) / block_size;
      for (int64_t j = 0; j < blocks; ++j) {
        const int64_t physical = table[block + j];
        k_blocks[j] = static_cast<const T*>(a.k) + item.kv_head * a.k_head_stride + physical * a.k_block_stride;
        v_blocks[j] = static_cast<const T*>(a.v) + item.kv_head * a.v_head_stride + physical * a.v_block_stride;
      }
      const BlockSpan touched = tile_ahead(item, block, kPrefetchTiles + 1);
      if (amx) deferred_touch = touched;  // touch_deferred: later
      else touch_blocks(touched);
      queue_prefetch(tile_ahead(item, block, kPrefetchTiles));
      laps.part(phase_timers::kGather, first, last);
      compute_scores(blocks, count);
      laps.part(phase_timers::kScores, first, last);
      update_softmax(count, item.out);
      laps.part(phase_timers::kSoftmax, first, last);
      accumulate_values(blocks, count, item.out);
      if (count == tile_tokens) whole_tile_steps = pf.steps;
      pf.finish();
      laps.part(phase_timers::kValues, first, last);
      laps.end_tile(first, last);
    }
    for (int64_t g = 0; g < group; ++g) {
      const float inv = 1.0f / row_sum[g];
      for (int64_t d = 0; d < dim_v; ++d) item.out[g * dim_v + d] *= inv;
      item.lse[g] = row_max[g] + std::log(row_sum[g]);
    }
    if constexpr (S::kAmx) {
      if (amx) S::tile_release();  // a thread holding no tile state saves and restores less on a switch
    }
    laps.lap(phase_timers::kItemEnd);
  }

  void load_queries(const WorkItem& item) {
    if constexpr (S::kBf16Dot && std::is_same_v<Kv, Bf16Kv>) {
      bf16_dot = a.q_dtype == DType::kBFloat16 && a.use_bf16_dot && !amx;
      if (bf16_dot) return load_query_pairs(item);
    }
    switch (a.q_dtype) {
      case DType::kFloat32: return load_queries_as(item, F32Kv{});
      case DType::kBFloat16: return load_queries_as(item, Bf16Kv{});
      case DType::kFloat16: return load_queries_as(item, Fp16Kv{});
    }
  }

  // The chunks of heads the score loop takes together, in order: (first head, heads).
  template <class F>
  void for_each_score_chunk(F&& chunk) const {
    int64_t g = 0;
    if constexpr (kWide) {
      for (; g + 8 <= group; g += 8) chunk(g, 8);
    }
    for (; g + kScoreHeads <= group; g += kScoreHeads) chunk(g, kScoreHeads);
    for (; g + 2 <= group; g += 2) chunk(g, 2);
    for (; g < group; ++g) chunk(g, 1);
  }

  template <class Q>
  void load_queries_as(const WorkItem& item, Q) {
    const auto* q = static_cast<const typename Q::Elem*>(a.q) + item.seq * a.q_seq_stride;
    const auto* first_row = q + item.kv_head * group * a.q_head_stride;
    if (amx) {  // the AMX path scales the scores instead
      if constexpr (std::is_same_v<Q, Bf16Kv>) {
        // bf16 q is its tile operand as it is: no float copy, no low part (split_queries skips it)
        for (int64_t g = 0; g < group; ++g) std::memcpy(q_hi + g * dim_qk, first_row + g * a.q_head_stride, dim_qk * 2);
        return;
      }
      for (int64_t g = 0; g < group; ++g)
        for (int64_t d = 0; d < dim_qk; ++d) q32[g * dim_qk + d] = Q::one(first_row + g * a.q_head_stride + d);
      return;
    }
    // Locals: a store to the chunk may alias any float the compiler reads through `a` (2.9% of the
    // FMA loops' samples for Qwen3-MoE in cache, when it reloaded the scale after every store).
    const float scale = a.scale;
    const int64_t head_stride = a.q_head_stride, pairs = dim_qk / 2;
    for_each_score_chunk([&](int64_t g0, int heads) {
      float* chunk = q32 + g0 * dim_qk;
      for (int gi = 0; gi < heads; ++gi) {
        const auto* row = first_row + (g0 + gi) * head_stride;
        float* pair = chunk + 2 * gi;
        for (int64_t p = 0; p < pairs; ++p, pair += 2 * heads) {
          pair[0] = Q::one(row + 2 * p) * scale;
          pair[1] = Q::one(row + 2 * p + 1) * scale;
        }
      }
    });
  }

  // q's bf16 dim pairs as 32-bit words, pair-major within each score chunk like q32's floats.
  void load_query_pairs(const WorkItem& item) {
    q_pairs = reinterpret_cast<uint32_t*>(q32);
    const auto* first_row = static_cast<const uint16_t*>(a.q) + item.seq * a.q_seq_stride +
                            item.kv_head * group * a.q_head_stride;
    const int64_t pairs = dim_qk / 2;
    for_each_score_chunk([&](int64_t g0, int heads) {
      uint32_t* chunk = q_pairs + g0 * pairs;
      for (int gi = 0; gi < heads; ++gi) {
        const uint16_t* row = first_row + (g0 + gi) * a.q_head_stride;
        for (int64_t p = 0; p < pairs; ++p)
          chunk[p * heads + gi] = uint32_t{row[2 * p]} | (uint32_t{row[2 * p + 1]} << 16);
      }
    });
  }

  // Blocks [from, to) of the item (clipped to end_block), K and V whole, into L1: the item's first
  // tiles, before there is compute to hide them behind.
  void prefetch_blocks(const int32_t* table, int64_t from, int64_t to, int64_t end_block) const {
    const int64_t k_bytes = dim_qk * block_size * static_cast<int64_t>(sizeof(T));
    const int64_t v_bytes = dim_v * block_size * static_cast<int64_t>(sizeof(T));
    for (int64_t b = from < 0 ? 0 : from; b < to && b < end_block; ++b) {
      const int64_t physical = table[b];
      prefetch_range(block_bytes_at(a.k, physical, a.k_block_stride, a.k_head_stride, kv_head), k_bytes);
      prefetch_range(block_bytes_at(a.v, physical, a.v_block_stride, a.v_head_stride, kv_head), v_bytes);
    }
  }

  // A tile's blocks: [from, to) of a sequence's table, clipped to end_block, kv head `head`; empty
  // where table is null.
  struct BlockSpan {
    const int32_t* table = nullptr;
    int64_t from = 0, to = 0, end_block = 0, head = 0;
  };

  // The tile `tiles` tiles after the one at `block`: in this item, or past its last tile in the item
  // this thread likely takes next, counted from that item's first tile. So the prefetcher asks for
  // the next item's first tile during this item's last (otherwise the item starts by waiting for
  // memory): measured on a 2-vCPU Zen 3 (AVX2), KV read cold, interleaved against the build without
  // it, 1.02-1.06x at 8K (items of 512-1024 tokens) for the Qwen3-MoE and Mixtral shapes, 1.01-1.02x
  // at 32K (items of 2-4K), MHA unchanged. And the pages of the next item's first two tiles are
  // touched a tile before their lines are asked for, as every other tile's are: untouched, their
  // page walks held up the line requests (perf, Qwen3-MoE 8K from DRAM, 2 threads: 14.9% of the
  // samples on the requests at items of 512 tokens, 11.0% at 4096, 9.8% with the touches, which
  // take the walks a tile earlier, behind compute: their samples grew from 3.7% to 9.2%). Measured
  // on a 2-vCPU Xeon (AMX), interleaved, from DRAM: Qwen3-MoE 8K 1.01-1.04x (1.02x over 300 rounds,
  // twice), Mixtral 8K 1.02x, Qwen3-MoE 32K and MHA 8K 1.00x; 0.99-1.00x in L3 (one thread).
  BlockSpan tile_ahead(const WorkItem& item, int64_t block, int64_t tiles) const {
    const int64_t first = item.token_begin / block_size;
    const int64_t end = (item.token_end + block_size - 1) / block_size;
    const int64_t from = block + tiles * tile_blocks;
    if (from < end) {
      return {a.block_table + item.seq * a.block_table_stride, from, from + tile_blocks, end, item.kv_head};
    }
    const WorkItem* next = item.next;
    if (next == nullptr) return {};
    const int64_t index = (from - first) / tile_blocks - (end - first + tile_blocks - 1) / tile_blocks;
    const int64_t next_from = next->token_begin / block_size + index * tile_blocks;
    return {a.block_table + next->seq * a.block_table_stride, next_from, next_from + tile_blocks,
            (next->token_end + block_size - 1) / block_size, next->kv_head};
  }

  // A tile's blocks, asked for over the next tile's steps.
  void queue_prefetch(const BlockSpan& span) {
    pf.k_bytes = dim_qk * block_size * static_cast<int64_t>(sizeof(T));
    pf.v_bytes = dim_v * block_size * static_cast<int64_t>(sizeof(T));
    int64_t count = 0;
    for (int64_t b = span.from; b < span.to && b < span.end_block && count < 2 * kMaxPrefetchBlocks; ++b) {
      const int64_t physical = span.table[b];
      prefetch_ranges[count++] = block_bytes_at(a.k, physical, a.k_block_stride, a.k_head_stride, span.head);
      prefetch_ranges[count++] = block_bytes_at(a.v, physical, a.v_block_stride, a.v_head_stride, span.head);
    }
    pf.ranges = prefetch_ranges;
    pf.reset(count / 2 * (pf.k_bytes + pf.v_bytes) / 64, count);
  }

  const char* block_bytes_at(const void* base, int64_t physical, int64_t block_stride, int64_t head_stride,
                             int64_t head) const {
    return reinterpret_cast<const char*>(static_cast<const T*>(base) + head * head_stride + physical * block_stride);
  }

  // On the tiles, touch_blocks' pages are asked for once a tile's last score products are issued:
  // their page walks run while the accumulators' stores wait for those products (as the token-major
  // kernel's). Measured on a 2-vCPU Xeon (AMX), interleaved, from DRAM: Qwen3-MoE 1.02x at 8K and
  // 1.06x at 32K, Mixtral 1.02x at 8K; in L3 (one thread) 1.00x.
  BlockSpan deferred_touch;
  void touch_deferred() {
    if (deferred_touch.table == nullptr) return;
    touch_blocks(deferred_touch);
    deferred_touch.table = nullptr;
  }

  // The pages of a tile's blocks, K and V: the tile after the one the prefetcher asks for.
  void touch_blocks(const BlockSpan& span) const {
    const int64_t k_bytes = dim_qk * block_size * static_cast<int64_t>(sizeof(T));
    const int64_t v_bytes = dim_v * block_size * static_cast<int64_t>(sizeof(T));
    for (int64_t b = span.from; b < span.to && b < span.end_block; ++b) {
      const int64_t physical = span.table[b];
      touch_pages(block_bytes_at(a.k, physical, a.k_block_stride, a.k_head_stride, span.head), k_bytes);
      touch_pages(block_bytes_at(a.v, physical, a.v_block_stride, a.v_head_stride, span.head), v_bytes);
    }
  }

  static void prefetch_range(const char* bytes, int64_t size) {
    for (int64_t offset = 0; offset < size; offset += 64) __builtin_prefetch(bytes + offset, 0, 3);
  }

  // ------------------------------------------------------------------ scores
  // How a score step's TV token vectors lie: some partial, all whole, or whole and consecutive in
  // one block (one K pointer serves them all).
  enum class Vectors { kPartial, kWhole, kAdjacent };

  template <int GT, int TV, Vectors kVectors>
  WS_INLINE void score_step(int64_t g0, const TokenVector* tv) {
    constexpr bool kChained = chained_scores(GT, TV);
    V even_acc[GT * TV], odd_acc[GT * TV];
    WS_UNROLL
    for (int i = 0; i < GT * TV; ++i) even_acc[i] = odd_acc[i] = S::zero();
    const int64_t pairs = dim_qk / 2;
    const int64_t pair_stride = block_size * 2;
    const float* q = q32 + g0 * dim_qk;  // pair-major over the chunk's GT heads
    constexpr int64_t q_stride = 2 * GT;
    const T* k = tv[0].k;
    LinePrefetcher prefetch = pf;
    for (int64_t p = 0; p < pairs; ++p, q += q_stride, k += pair_stride) {
      prefetch.step();
      V even[TV], odd[TV];
      WS_UNROLL
      for (int ti = 0; ti < TV; ++ti) {
        if constexpr (kVectors == Vectors::kAdjacent) Kv::template pairs<S>(k + ti * W * 2, W, even[ti], odd[ti]);
        else if constexpr (kVectors == Vectors::kWhole) Kv::template pairs<S>(tv[ti].k + p * pair_stride, W, even[ti], odd[ti]);
        else Kv::template pairs<S>(tv[ti].k + p * pair_stride, tv[ti].lanes, even[ti], odd[ti]);
      }
      WS_UNROLL
      for (int gi = 0; gi < GT; ++gi) {
        const V qe = S::set1(q[2 * gi]);
        const V qo = S::set1(q[2 * gi + 1]);
        WS_UNROLL
        for (int ti = 0; ti < TV; ++ti) {
          if constexpr (kChained) {
            even_acc[gi * TV + ti] = S::fma(qo, odd[ti], S::fma(qe, even[ti], even_acc[gi * TV + ti]));
          } else {
            even_acc[gi * TV + ti] = S::fma(qe, even[ti], even_acc[gi * TV + ti]);
            odd_acc[gi * TV + ti] = S::fma(qo, odd[ti], odd_acc[gi * TV + ti]);
          }
        }
      }
    }
    pf = prefetch;
    WS_UNROLL
    for (int gi = 0; gi < GT; ++gi)
      WS_UNROLL
      for (int ti = 0; ti < TV; ++ti)
        S::store_partial(scores + (g0 + gi) * stride + tv[ti].column,
                         kChained ? even_acc[gi * TV + ti] : S::add(even_acc[gi * TV + ti], odd_acc[gi * TV + ti]),
                         tv[ti].lanes);
  }

  // The dot path's score step: GT heads x TV token vectors of bf16 dots. With fewer than 12
  // accumulators, even and odd dim pairs sum apart, so enough dots are in flight to cover the
  // instruction's latency.
  template <int GT, int TV, Vectors kVectors>
  WS_INLINE void dot_score_step(int64_t g0, const TokenVector* tv) {
    if constexpr (S::kBf16Dot && std::is_same_v<Kv, Bf16Kv>) {
      constexpr int kSets = GT * TV >= 12 ? 1 : 2;
      V acc[kSets][GT * TV];
      WS_UNROLL
      for (int s = 0; s < kSets; ++s)
        WS_UNROLL
        for (int i = 0; i < GT * TV; ++i) acc[s][i] = S::zero();
      const int64_t pairs = dim_qk / 2;
      const int64_t pair_stride = block_size * 2;
      const uint32_t* q = q_pairs + g0 * pairs;  // pair p's head gi at q[p * GT + gi]
      LinePrefetcher prefetch = pf;
      const auto pair_step = [&](int64_t p, V* sums) __attribute__((always_inline)) {
        prefetch.step();
        typename S::Raw k[TV];
        WS_UNROLL
        for (int ti = 0; ti < TV; ++ti) {
          if constexpr (kVectors == Vectors::kAdjacent) k[ti] = S::load_raw(tv[0].k + p * pair_stride + ti * W * 2);
          else if constexpr (kVectors == Vectors::kWhole) k[ti] = S::load_raw(tv[ti].k + p * pair_stride);
          else k[ti] = S::load_raw_words(tv[ti].k + p * pair_stride, tv[ti].lanes);
        }
        WS_UNROLL
        for (int gi = 0; gi < GT; ++gi) {
          const typename S::Raw qp = S::raw_set1(q[p * GT + gi]);
          WS_UNROLL
          for (int ti = 0; ti < TV; ++ti) sums[gi * TV + ti] = S::dot_bf16(sums[gi * TV + ti], qp, k[ti]);
        }
      };
      int64_t p = 0;
      for (; p + kSets <= pairs; p += kSets)
        WS_UNROLL
        for (int s = 0; s < kSets; ++s) pair_step(p + s, acc[s]);
      for (; p < pairs; ++p) pair_step(p, acc[0]);
      pf = prefetch;
      const V scale = S::set1(a.scale);
      WS_UNROLL
      for (int i = 0; i < GT * TV; ++i) {
        V sum = acc[0][i];
        WS_UNROLL
        for (int s = 1; s < kSets; ++s) sum = S::add(sum, acc[s][i]);
        const int gi = i / TV, ti = i % TV;
        S::store_partial(scores + (g0 + gi) * stride + tv[ti].column, S::mul(scale, sum), tv[ti].lanes);
      }
    }
  }

  // Token vectors per dot score step: sixteen accumulators where the tile's four vectors allow.
  static constexpr int dot_score_vectors(int heads) { return heads >= 8 ? 2 : 4; }

  template <int GT>
  void score_heads(int64_t g0, const TokenVector* tv, int64_t num_vectors) {
    if (bf16_dot) return score_vectors_with<GT, dot_score_vectors(GT), true>(g0, tv, num_vectors);
    score_vectors_with<GT, score_vectors(GT), false>(g0, tv, num_vectors);
  }

  template <int GT, int TV, bool kDot>
  void score_vectors_with(int64_t g0, const TokenVector* tv, int64_t num_vectors) {
    const auto step = [&](auto vectors, auto tvs, const TokenVector* at) {
      constexpr Vectors kVectors = decltype(vectors)::value;
      constexpr int kTV = decltype(tvs)::value;
      if constexpr (kDot) dot_score_step<GT, kTV, kVectors>(g0, at);
      else score_step<GT, kTV, kVectors>(g0, at);
    };
    using Adjacent = std::integral_constant<Vectors, Vectors::kAdjacent>;
    using Whole = std::integral_constant<Vectors, Vectors::kWhole>;
    using Partial = std::integral_constant<Vectors, Vectors::kPartial>;
    int64_t i = 0;
    for (; i + TV <= num_vectors; i += TV) {
      bool whole = true, adjacent = true;
      for (int ti = 0; ti < TV; ++ti) {
        whole = whole && tv[i + ti].lanes == W;
        adjacent = adjacent && tv[i + ti].k == tv[i].k + ti * W * 2;
      }
      if (whole && adjacent) step(Adjacent{}, std::integral_constant<int, TV>{}, tv + i);
      else if (whole) step(Whole{}, std::integral_constant<int, TV>{}, tv + i);
      else step(Partial{}, std::integral_constant<int, TV>{}, tv + i);
    }
    for (; i < num_vectors; ++i) step(Partial{}, std::integral_constant<int, 1>{}, tv + i);
  }

  void compute_scores(int64_t blocks, int64_t count) {
    if (amx) {
      amx_scores(blocks);
      const V scale = S::set1(a.scale);
      const int64_t padded = (count + W - 1) / W * W;
      for (int64_t g = 0; g < group; ++g)
        for (int64_t t = 0; t < padded; t += W) S::store(scores + g * stride + t, S::mul(scale, S::load(scores + g * stride + t)));
      return;
    }
    // At most tile_tokens / W + tile_blocks vectors: a block whose size is not a multiple of W ends
    // in a partial one.
    TokenVector* tv = vectors;
    int64_t num_vectors = 0;
    for (int64_t j = 0; j < blocks; ++j) {
      const int64_t valid = count - j * block_size < block_size ? count - j * block_size : block_size;
      for (int64_t t = 0; t < valid; t += W)
        tv[num_vectors++] = TokenVector{k_blocks[j] + t * 2, valid - t < W ? valid - t : W, j * block_size + t};
    }
    for_each_score_chunk([&](int64_t g0, int heads) {
      switch (heads) {
        case 8: if constexpr (kWide) score_heads<8>(g0, tv, num_vectors); break;
        case kScoreHeads: score_heads<kScoreHeads>(g0, tv, num_vectors); break;
        case 2: score_heads<2>(g0, tv, num_vectors); break;
        default: score_heads<1>(g0, tv, num_vectors); break;
      }
    });
  }

  // ------------------------------------------------------------------ softmax
  void update_softmax(int64_t count, float* acc) {
    // The dot path's and the tiles' rounded probabilities come from the softmax's own pass.
    const bool rounded = bf16_dot || (amx && !p_has_low);
    online_softmax<S>(scores, stride, group, count, row_max, row_sum, acc, dim_v, rounded ? p_hi : nullptr);
  }

  // ------------------------------------------------------------------ values
  // GT heads x NV vectors of W dims, over the tile's tokens. kRow: the scores' row stride when it is
  // the usual kTileTokens (blocks of 16-64 tokens), so the GT heads' probabilities are constant
  // offsets from one pointer; 0: `stride`, read at run time.
  template <int GT, int NV, int64_t kRow>
  WS_INLINE void value_step(int64_t g0, int64_t d0, int64_t blocks, int64_t count, float* acc) {
    const int64_t row = kRow != 0 ? kRow : stride;
    V sum[GT][NV];
    WS_UNROLL
    for (int gi = 0; gi < GT; ++gi)
      WS_UNROLL
      for (int vi = 0; vi < NV; ++vi) sum[gi][vi] = S::load(acc + (g0 + gi) * dim_v + d0 + vi * W);
    const int64_t pair_stride = dim_v * 2;
    LinePrefetcher prefetch = pf;
    for (int64_t j = 0; j < blocks; ++j) {
      const int64_t valid = count - j * block_size < block_size ? count - j * block_size : block_size;
      const T* v = v_blocks[j] + d0 * 2;
      const float* p = scores + g0 * row + j * block_size;  // head g0 + gi's at p[gi * row]
      // A lone last token (odd count) pairs with a token past the end: only its even half is used,
      // so garbage (even NaN) in the unused half never reaches the sum.
      const int64_t full_pairs = valid / 2;
      for (int64_t tp = 0; tp < full_pairs; ++tp, v += pair_stride, p += 2) {
        prefetch.step();
        V first[NV], second[NV];
        for (int vi = 0; vi < NV; ++vi) Kv::template pairs<S>(v + vi * W * 2, W, first[vi], second[vi]);
        for (int gi = 0; gi < GT; ++gi) {
          const V pf = S::set1(p[gi * row]);
          const V ps = S::set1(p[gi * row + 1]);
          for (int vi = 0; vi < NV; ++vi) sum[gi][vi] = S::fma(ps, second[vi], S::fma(pf, first[vi], sum[gi][vi]));
        }
      }
      if (valid % 2) lone_token<GT, NV>(sum, v, p, row);
    }
    pf = prefetch;
    for (int gi = 0; gi < GT; ++gi)
      for (int vi = 0; vi < NV; ++vi) S::store(acc + (g0 + gi) * dim_v + d0 + vi * W, sum[gi][vi]);
  }

  // A lone last token (odd count): its pair's first half at v times its float32 probability at
  // p[gi * row] for head gi; the pair's second half is past the end, may hold NaN, and is not read
  // into the sums.
  template <int GT, int NV>
  WS_INLINE void lone_token(V (&sum)[GT][NV], const T* v, const float* p, int64_t row) {
    V first[NV], unused[NV];
    WS_UNROLL
    for (int vi = 0; vi < NV; ++vi) Kv::template pairs<S>(v + vi * W * 2, W, first[vi], unused[vi]);
    WS_UNROLL
    for (int gi = 0; gi < GT; ++gi) {
      const V pt = S::set1(p[gi * row]);
      WS_UNROLL
      for (int vi = 0; vi < NV; ++vi) sum[gi][vi] = S::fma(pt, first[vi], sum[gi][vi]);
    }
  }

  // kDot: the steps through the bf16 dot (dot_value_step), else through FMAs (value_step).
  template <int GT, int NV, bool kDot = false>
  void value_heads(int64_t g0, int64_t blocks, int64_t count, float* acc) {
    if (stride == kTileTokens) value_dims<GT, NV, kTileTokens, kDot>(g0, blocks, count, acc);
    else value_dims<GT, NV, 0, kDot>(g0, blocks, count, acc);
  }

  template <int GT, int NV, int64_t kRow, bool kDot>
  WS_INLINE void value_step_with(int64_t g0, int64_t d0, int64_t blocks, int64_t count, float* acc) {
    if constexpr (kDot) dot_value_step<GT, NV, kRow>(g0, d0, blocks, count, acc);
    else value_step<GT, NV, kRow>(g0, d0, blocks, count, acc);
  }

  template <int GT, int NV, int64_t kRow, bool kDot>
  void value_dims(int64_t g0, int64_t blocks, int64_t count, float* acc) {
    int64_t d = 0;
    for (; d + NV * W <= dim_v; d += NV * W) value_step_with<GT, NV, kRow, kDot>(g0, d, blocks, count, acc);
    for (; d + W <= dim_v; d += W) value_step_with<GT, 1, kRow, kDot>(g0, d, blocks, count, acc);
    if (d < dim_v) value_tail<GT>(g0, d, blocks, count, acc);
  }

  // The last dim_v % W dims: a partial vector, loaded and stored with a lane mask (the
  // accumulator row is read through a copy so nothing past the row is touched).
  template <int GT>
  void value_tail(int64_t g0, int64_t d0, int64_t blocks, int64_t count, float* acc) {
    const int64_t lanes = dim_v - d0;
    if constexpr (W > 1) {
      alignas(64) float padded[GT * W];
      WS_UNROLL
      for (int gi = 0; gi < GT; ++gi)
        for (int64_t l = 0; l < W; ++l) padded[gi * W + l] = l < lanes ? acc[(g0 + gi) * dim_v + d0 + l] : 0.0f;
      V sum[GT];
      WS_UNROLL
      for (int gi = 0; gi < GT; ++gi) sum[gi] = S::load(padded + gi * W);
      const int64_t pair_stride = dim_v * 2;
      for (int64_t j = 0; j < blocks; ++j) {
        const int64_t valid = count - j * block_size < block_size ? count - j * block_size : block_size;
        const T* v_block = v_blocks[j] + d0 * 2;
        const float* p_block = scores + j * block_size;
        for (int64_t t = 0; t < valid; t += 2) {
          V first, second;
          Kv::template pairs<S>(v_block + (t / 2) * pair_stride, lanes, first, second);
          WS_UNROLL
          for (int gi = 0; gi < GT; ++gi) {
            sum[gi] = S::fma(S::set1(p_block[(g0 + gi) * stride + t]), first, sum[gi]);
            if (t + 1 < valid) sum[gi] = S::fma(S::set1(p_block[(g0 + gi) * stride + t + 1]), second, sum[gi]);
          }
        }
      }
      WS_UNROLL
      for (int gi = 0; gi < GT; ++gi) S::store_partial(acc + (g0 + gi) * dim_v + d0, sum[gi], lanes);
    }
  }

  // ------------------------------------------------------------------ values through the bf16 dot
  // With the dot path on (bf16 q and KV, the dot measured faster), P [heads, tile] is rounded to
  // bf16 once, as the GPU kernel's tensor-core dot and transformers' bf16 attention round it: a
  // paired V load (16 dims of a token pair) is then the dot's operand as stored, and a token pair's
  // two probabilities one 32-bit word to broadcast, so one instruction takes two tokens of a head
  // where the FMA path takes two plus the widening. The running sums and the softmax's sums stay
  // float32; each probability's relative error is at most 2^-9, so an output dim moves by at most
  // 2^-9 of the largest |V| it averages. Measured on a 2-vCPU Zen 4, interleaved with the FMA
  // values at 32K: Qwen3-MoE 1.17x, Mixtral 1.04x, MHA 1.01x (memory-bound); from L3 at 4K,
  // Qwen3-MoE 1.16x, Mixtral 1.07x. Asking for the lines two tiles ahead instead of one measured
  // 0.95x and 1.02x for Qwen3-MoE and Mixtral. The rounding is update_softmax's (online_softmax's
  // bf16_out).

  // GT heads x NV vectors of W dims, over the tile's token pairs; a lone last token through an FMA
  // of its float32 probability (lone_token: its pair's second slot may hold NaN, which a zero
  // probability would not cancel in a dot).
  template <int GT, int NV, int64_t kRow>
  WS_INLINE void dot_value_step(int64_t g0, int64_t d0, int64_t blocks, int64_t count, float* acc) {
    if constexpr (S::kBf16Dot && std::is_same_v<Kv, Bf16Kv>) {
      const int64_t row = kRow != 0 ? kRow : stride;
      const int64_t row_words = row / 2;
      V sum[GT][NV];
      WS_UNROLL
      for (int gi = 0; gi < GT; ++gi)
        WS_UNROLL
        for (int vi = 0; vi < NV; ++vi) sum[gi][vi] = S::load(acc + (g0 + gi) * dim_v + d0 + vi * W);
      const int64_t pair_stride = dim_v * 2;
      LinePrefetcher prefetch = pf;
      for (int64_t j = 0; j < blocks; ++j) {
        const int64_t valid = count - j * block_size < block_size ? count - j * block_size : block_size;
        const T* v = v_blocks[j] + d0 * 2;
        // head g0 + gi's token pair tp of the block at p[gi * row_words + tp]
        const uint32_t* p = reinterpret_cast<const uint32_t*>(p_hi + g0 * row + j * block_size);
        const int64_t full_pairs = valid / 2;
        for (int64_t tp = 0; tp < full_pairs; ++tp, v += pair_stride) {
          prefetch.step();
          typename S::Raw pair[NV];
          WS_UNROLL
          for (int vi = 0; vi < NV; ++vi) pair[vi] = S::load_raw(v + vi * W * 2);
          WS_UNROLL
          for (int gi = 0; gi < GT; ++gi) {
            const typename S::Raw probabilities = S::raw_set1(p[gi * row_words + tp]);
            WS_UNROLL
            for (int vi = 0; vi < NV; ++vi) sum[gi][vi] = S::dot_bf16(sum[gi][vi], probabilities, pair[vi]);
          }
        }
        if (valid % 2) lone_token<GT, NV>(sum, v, scores + g0 * row + j * block_size + valid - 1, row);
      }
      pf = prefetch;
      WS_UNROLL
      for (int gi = 0; gi < GT; ++gi)
        WS_UNROLL
        for (int vi = 0; vi < NV; ++vi) S::store(acc + (g0 + gi) * dim_v + d0 + vi * W, sum[gi][vi]);
    }
  }

  // Sixteen accumulators where the dims allow (GT x NV); V and the broadcasts stay within the load
  // ports.
  void dot_values(int64_t blocks, int64_t count, float* acc) {
    int64_t g = 0;  // the probabilities in bf16: rounded by update_softmax
    for (; g + 8 <= group; g += 8) value_heads<8, 2, true>(g, blocks, count, acc);
    for (; g + 4 <= group; g += 4) value_heads<4, 4, true>(g, blocks, count, acc);
    for (; g + 2 <= group; g += 2) value_heads<2, 8, true>(g, blocks, count, acc);
    for (; g < group; ++g) value_heads<1, 8, true>(g, blocks, count, acc);
  }

  void accumulate_values(int64_t blocks, int64_t count, float* acc) {
    if (amx) return amx_values(blocks, count, acc);
    if constexpr (S::kBf16Dot && std::is_same_v<Kv, Bf16Kv>) {
      if (bf16_dot) return dot_values(blocks, count, acc);
    }
    // Accumulators GT x NV, the V vectors 2 x NV and two broadcasts within the register file; more
    // heads per step widen each V vector once for more FMAs. Each accumulator takes a chain of two
    // FMAs per token pair, so at least eight of them keep the FMA pipes busy (16 registers: 4 x 2
    // and 2 x 4 where 4 x 1 and 2 x 2 were latency-bound; measured on a 2-vCPU Zen 3: 57 -> 43 us
    // per 1K tokens of the Mixtral shape in L2).
    int64_t g = 0;
    if constexpr (kWide) {
      for (; g + 8 <= group; g += 8) value_heads<8, 2>(g, blocks, count, acc);
    }
    for (; g + 4 <= group; g += 4) value_heads<4, kWide ? 4 : 2>(g, blocks, count, acc);
    for (; g + 2 <= group; g += 2) value_heads<2, 4>(g, blocks, count, acc);
    for (; g < group; ++g) value_heads<1, kWide ? 8 : 4>(g, blocks, count, acc);
  }
};

template <class S, class Kv>
void attend_item_as(const PagedAttentionArgs& args, const WorkItem& item, Workspace ws) {
  if (args.layout == KvLayout::kPaired) PairedKernel<S, Kv>(args, ws).run(item);
  else ItemKernel<S, Kv>(args, ws).run(item);
}

template <class S>
void attend_item(const PagedAttentionArgs& args, const WorkItem& item, Workspace ws) {
  switch (args.kv_dtype) {
    case DType::kFloat32: attend_item_as<S, F32Kv>(args, item, ws); break;
    case DType::kBFloat16: attend_item_as<S, Bf16Kv>(args, item, ws); break;
    case DType::kFloat16: attend_item_as<S, Fp16Kv>(args, item, ws); break;
  }
}

#undef WS_INLINE
#undef WS_UNROLL

}  // namespace
}  // namespace writescope
