// The decode attention kernel, written once over a SIMD traits type S (ScalarSimd, Avx2Simd,
// Avx512Simd). Each ISA translation unit includes this after its target pragma; everything here
// lives in an anonymous namespace so no inline function compiled for one ISA is shared with another.
//
// One work item = one kv head of one sequence over a token range. All query heads of the kv head
// (the GQA group, or all MLA heads sharing the latent) are folded into the item, so each K/V byte
// is loaded from memory once per item. Tokens are visited in tiles of kTileTokens with an online
// softmax in float32; K/V are widened to float32 in registers.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

#include "writescope/kernel_args.h"
#include "writescope/phase_timers.h"
#include "writescope/simd_scalar.h"

namespace writescope {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// KV element kinds: the element type in memory and how a vector of it widens to float32.
struct F32Kv {
  using Elem = float;
  template <class S> static typename S::V vec(const float* p) { return S::load(p); }
  static float one(const float* p) { return *p; }
  template <class S> static void pairs(const float* p, int64_t n, typename S::V& e, typename S::V& o) {
    S::load_pairs_f32(p, n, e, o);
  }
};
struct Bf16Kv {
  using Elem = uint16_t;
  template <class S> static typename S::V vec(const uint16_t* p) { return S::load_bf16(p); }
  static float one(const uint16_t* p) { return bf16_bits_to_float(*p); }
  template <class S> static void pairs(const uint16_t* p, int64_t n, typename S::V& e, typename S::V& o) {
    S::load_pairs_bf16(p, n, e, o);
  }
};
struct Fp16Kv {
  using Elem = uint16_t;
  template <class S> static typename S::V vec(const uint16_t* p) { return S::load_fp16(p); }
  static float one(const uint16_t* p) { return fp16_bits_to_float(*p); }
  template <class S> static void pairs(const uint16_t* p, int64_t n, typename S::V& e, typename S::V& o) {
    S::load_pairs_fp16(p, n, e, o);
  }
};

#define WS_INLINE inline __attribute__((always_inline))
// Before a loop over a step's accumulators, loads or heads (constant trip counts): unrolled before
// GCC's scalar replacement of aggregates runs, or an accumulator array it still indexes in a loop
// stays in memory, and the compute loop stores every accumulator on every iteration (GCC 12 did
// that to the avx512 variant's score loop: Mixtral in L2, one thread, 1.57x once unrolled).
#define WS_UNROLL _Pragma("GCC unroll 32")

// A prefetch into L2 that the compiler keeps: GCC 12 at -O3 deletes a loop whose body is only
// __builtin_prefetch calls (the page touches below compiled to nothing until they used this).
WS_INLINE void prefetch_kept(const void* line) {
#if defined(__x86_64__)
  asm volatile("prefetcht1 %0" : : "m"(*static_cast<const char*>(line)));
#else
  __builtin_prefetch(line, 0, 2);
#endif
}

// One line in each 4 KB page of [bytes, bytes + size): the pages' address translations start two
// tiles before their lines are needed, so the line prefetches a tile ahead do not wait for a page
// walk (each 16-token block is its own page or pages, and every call's KV is new to the TLB).
WS_INLINE void touch_pages(const char* bytes, int64_t size) {
  for (int64_t offset = 0; offset < size; offset += 4096) prefetch_kept(bytes + offset);
  if (size > 0) prefetch_kept(bytes + size - 1);
}

inline uint16_t bf16_round(float x) {  // to nearest even; a NaN stays a quiet NaN
  if (x != x) return 0x7FC0u;
  uint32_t bits;
  std::memcpy(&bits, &x, 4);
  bits += 0x7FFFu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

// How far a tile's scores may rise above a head's running max before the max moves (the output and
// sum rescaled): ln 256, so a probability is at most 256 (FlashAttention-4's conditional rescaling
// by 8 powers of two). The running max is a reference point, not the maximum: the lse is
// max + log(sum) with the sum taken against that same point, so the result is the same to rounding.
// The point of the slack: the tile's exps no longer wait on its max. Each head's max is a chain of
// vector maxima and a horizontal reduction, and every exp of the head took it as its shift; now the
// shift is the running max, known before the tile, and the branch on the tile's max is predicted
// (after the first tile it is almost never taken), so the exps of every head run while the maxima
// are still being reduced. Measured on a 2-vCPU Zen 4 (avx512bf16), one thread, 4K tokens in L3,
// interleaved: Qwen3-MoE 1.06x, Mixtral 1.05x (online_softmax 13.5% -> 8.7% of Mixtral's samples);
// from DRAM at 32K 1.00-1.01x: those rows wait on their reads, not on the softmax.
constexpr float kRescaleSlack = 5.54517744f;

// The online softmax of one tile, for both kernels: scores [group, stride] of its first `count`
// tokens -> probabilities against each head's running max in place (0 in the padding up to a whole
// vector), each head's running max and sum updated, and its output row acc [group, dim_v] rescaled
// when the max moves (the first tile, or a score more than kRescaleSlack above it). bf16_out (the
// bf16 dot path's, else null): the probabilities rounded to bf16 as well, [group, stride], in the
// same pass (a pass of its own reloaded every vector from memory: ~3% of a Qwen3-MoE tile).
template <class S>
void online_softmax(float* scores, int64_t stride, int64_t group, int64_t count, float* row_max, float* row_sum,
                    float* acc, int64_t dim_v, uint16_t* bf16_out = nullptr) {
  using V = typename S::V;
  constexpr int W = S::kWidth;
  const int64_t padded = (count + W - 1) / W * W;
  for (int64_t g = 0; g < group; ++g) {
    float* row = scores + g * stride;
    for (int64_t t = count; t < padded; ++t) row[t] = kNegInf;  // exp -> 0 in the padding
    V vmax = S::set1(kNegInf);
    for (int64_t t = 0; t < padded; t += W) vmax = S::max(vmax, S::load(row + t));
    // -inf + slack stays -inf, so the first tile with a finite score moves the max
    if (S::any_greater(vmax, row_max[g] + kRescaleSlack)) {
      const float tile_max = S::reduce_max(vmax);
      const float alpha = row_max[g] == kNegInf ? 0.0f : std::exp(row_max[g] - tile_max);
      row_sum[g] *= alpha;
      float* out = acc + g * dim_v;
      for (int64_t d = 0; d < dim_v; ++d) out[d] *= alpha;
      row_max[g] = tile_max;
    }
    const V shift = S::set1(row_max[g]);
    V vsum = S::zero();
    if constexpr (S::kBf16Dot) {
      if (bf16_out != nullptr) {
        uint16_t* rounded = bf16_out + g * stride;
        for (int64_t t = 0; t < padded; t += W) {
          const V p = S::exp(S::sub(S::load(row + t), shift));
          S::store(row + t, p);
          S::store_bf16(rounded + t, p);
          vsum = S::add(vsum, p);
        }
      }
    }
    if (bf16_out == nullptr) {
      for (int64_t t = 0; t < padded; t += W) {
        const V p = S::exp(S::sub(S::load(row + t), shift));
        S::store(row + t, p);
        vsum = S::add(vsum, p);
      }
    }
    row_sum[g] += S::reduce_add(vsum);
  }
}

// The head of every kernel's scratch: q32 [group, dim_qk], scores [group, score_stride], the running
// max and sum [group] each, then 64-byte aligned room for row or block pointers.
struct ScratchHead {
  float* q32;
  float* scores;
  float* row_max;
  float* row_sum;
  char* pointers;

  ScratchHead(Workspace ws, int64_t group, int64_t dim_qk, int64_t score_stride) {
    char* p = static_cast<char*>(ws.data);
    q32 = reinterpret_cast<float*>(p);
    p += group * dim_qk * 4;
    scores = reinterpret_cast<float*>(p);
    p += group * score_stride * 4;
    row_max = reinterpret_cast<float*>(p);
    p += group * 4;
    row_sum = reinterpret_cast<float*>(p);
    p += group * 4;
    pointers = reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(p) + 63) & ~uintptr_t(63));
  }
};

// The next tile's rows, asked for a few rows at a time from inside the tile products (see the
// paired kernel's Prefetcher: spread out, the requests stay in flight while the tile computes). A
// step asks for whole rows, each a run of lines from one pointer: a walk line by line kept its row
// and offset in memory across the lines (the loops around it hold every register), about 12
// instructions and a store-to-load round trip a line; measured on a 2-vCPU Zen 3 (MLA, one thread,
// 4K in L3), 6.6% of the kernel's samples.
// Loops copy it into a local so its fields live in registers.
struct RowPrefetcher {
  const char* const* rows = nullptr;  // K row, V row of each token (V null when it is inside K)
  int64_t num_rows = 0, row = 0, k_bytes = 0, v_bytes = 0;
  int64_t rows_per_step = 8, steps = 0;
  // The next `count` tokens' rows, spread over as many steps as this tile took.
  void reset(int64_t count) {
    num_rows = 2 * count;
    rows_per_step = steps > 0 ? (num_rows + steps - 1) / steps : 8;
    row = steps = 0;
  }
  WS_INLINE void step() {
    ++steps;
    const int64_t end = num_rows - row < rows_per_step ? num_rows : row + rows_per_step;
    for (; row < end; ++row) ask_for_row(rows[row], (row & 1) ? v_bytes : k_bytes);
  }
  static WS_INLINE void ask_for_row(const char* first, int64_t bytes) {
    if (first == nullptr) return;
    for (int64_t offset = 0; offset < bytes; offset += 64) __builtin_prefetch(first + offset, 0, 2);
  }
  void finish() {
    const int64_t steps_taken = steps;
    rows_per_step = num_rows;
    step();
    steps = steps_taken;
  }
};

// An AMX tile configuration (palette 1): rows and bytes per row of each of the 8 tiles.
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// 64 dims of V for one 16-token group as AMX B operands: [8 token pairs, 16 dims x 2] each, the
// next one `next` elements on; rows `stride_bytes` apart.
struct VSlice {
  const void* v;
  int64_t stride_bytes;
  int64_t next;
};

// The tile products both kernels share (S::kAmx only; empty otherwise). Measured on a 2-vCPU Xeon
// (Emerald Rapids class), one thread: a 1 KB tile load from L1 takes about as long as a tile product
// (5.4 and 5.0 ns), a load and a product in turn 6.9 ns the pair, and products chained into one
// accumulator run at the rate of independent ones; so the loops are laid out to load fewer tiles
// (a q chunk for four K tiles, P for four V tiles), not to break accumulator chains.
template <class S>
struct AmxTiles {
  int64_t configured = -1;

  void load(const TileConfig& config, int64_t key) {
    if (configured == key) return;
    if constexpr (S::kAmx) S::tile_config(&config);
    configured = key;
  }

  // Accumulators 0..n-1 (n <= 4) from out's n 16-float columns, rows `stride_bytes` apart; and back.
  static void load_accumulators(const float* out, int64_t stride_bytes, int64_t n) {
    if constexpr (S::kAmx) {
      S::template tile_load<0>(out, stride_bytes);
      if (n > 1) S::template tile_load<1>(out + 16, stride_bytes);
      if (n > 2) S::template tile_load<2>(out + 32, stride_bytes);
      if (n > 3) S::template tile_load<3>(out + 48, stride_bytes);
    }
  }
  static void store_accumulators(float* out, int64_t stride_bytes, int64_t n) {
    if constexpr (S::kAmx) {
      S::template tile_store<0>(out, stride_bytes);
      if (n > 1) S::template tile_store<1>(out + 16, stride_bytes);
      if (n > 2) S::template tile_store<2>(out + 32, stride_bytes);
      if (n > 3) S::template tile_store<3>(out + 48, stride_bytes);
    }
  }

  // The paired kernel's QK and PV under one configuration (no reload between a tile's two
  // products): 0-3 accumulators [rows heads, 16] f32 (four 16-token score groups, or 64 output
  // dims); 4, 5 A operands [rows, 32] bf16 (q's high and low parts over 32 dims, or P's over 32
  // tokens); 6, 7 B operands [16, 32] bf16 (K: 16 dim pairs x 16 tokens; V: 16 token pairs x 16
  // dims), loaded in turn so a load need not wait for the product reading the other.
  void configure_paired(int64_t rows) {
    TileConfig cfg;
    for (int t = 0; t < 6; ++t) cfg.rows[t] = static_cast<uint8_t>(rows), cfg.colsb[t] = 64;
    cfg.rows[6] = cfg.rows[7] = 16, cfg.colsb[6] = cfg.colsb[7] = 64;
    load(cfg, 4000 + rows);
  }

  // The token-major kernel's scores, transposed, four 16-token groups at a time: 0-3 S^T [16 tokens,
  // heads] f32; 4, 5: q^T [16 dim pairs, heads x 2] bf16; 6, 7: K [16 tokens, 32 dims] bf16. At 16
  // heads it is configure_paired(16), so a tile's two products share one configuration.
  void configure_latent_scores4(int64_t heads) {
    if (heads == 16) return configure_paired(16);
    TileConfig cfg;
    for (int t = 0; t < 6; ++t) cfg.rows[t] = 16, cfg.colsb[t] = static_cast<uint16_t>(4 * heads);
    cfg.rows[6] = cfg.rows[7] = 16, cfg.colsb[6] = cfg.colsb[7] = 64;
    load(cfg, 5000 + heads);
  }

  // The token-major kernel's scores, transposed: 0: scores [16 tokens, heads] f32; 1: K [16 tokens,
  // 32 dims] bf16; 2, 3: q lo, hi [16 dim pairs, heads x 2] bf16.
  void configure_latent_scores(int64_t heads) {
    TileConfig cfg;
    const auto colsb = static_cast<uint16_t>(4 * heads);
    cfg.rows[0] = 16, cfg.colsb[0] = colsb;
    cfg.rows[1] = 16, cfg.colsb[1] = 64;
    cfg.rows[2] = cfg.rows[3] = 16, cfg.colsb[2] = cfg.colsb[3] = colsb;
    load(cfg, 3000 + heads);
  }

  // 0-3: out [rows, 16] f32; 4, 5: P hi, lo [rows, G tokens] bf16; 6: V [G / 2 pairs, 16 dims x 2]
  // bf16, for token groups of G = 16 or 32.
  void configure_values(int64_t rows, int64_t group_tokens) {
    TileConfig cfg;
    for (int t = 0; t < 4; ++t) cfg.rows[t] = static_cast<uint8_t>(rows), cfg.colsb[t] = 64;
    cfg.rows[4] = cfg.rows[5] = static_cast<uint8_t>(rows);
    cfg.colsb[4] = cfg.colsb[5] = static_cast<uint16_t>(group_tokens * 2);
    cfg.rows[6] = static_cast<uint8_t>(group_tokens / 2), cfg.colsb[6] = 64;
    load(cfg, 2000000 + rows * 100 + group_tokens);
  }

  // out [rows, dim_v] f32 (rows dim_v apart) += sum over groups k of group_tokens (16 or 32) tokens
  // of P[:, k G : k G + G] x V_k, with P = p_hi + p_lo (bf16, rows p_stride apart) and slice(k, d0)
  // giving V_k's 64 dims from d0. dim_v % 16 == 0.
  template <class Slice>
  void values(float* out, int64_t dim_v, int64_t rows, const uint16_t* p_hi, const uint16_t* p_lo, int64_t p_stride,
              int64_t groups, int64_t group_tokens, Slice slice) {
    if constexpr (S::kAmx) {
      configure_values(rows, group_tokens);
      const int64_t out_stride = dim_v * 4;
      for (int64_t d0 = 0; d0 < dim_v; d0 += 64) {
        const int64_t n = (dim_v - d0) / 16 < 4 ? (dim_v - d0) / 16 : 4;
        load_accumulators(out + d0, out_stride, n);
        for (int64_t k = 0; k < groups; ++k) {
          const VSlice v = slice(k, d0);
          const uint16_t* vv = static_cast<const uint16_t*>(v.v);
          S::template tile_load<4>(p_hi + k * group_tokens, p_stride * 2);
          if (p_lo != nullptr) S::template tile_load<5>(p_lo + k * group_tokens, p_stride * 2);
          S::template tile_load<6>(vv, v.stride_bytes);
          S::template tile_dot<0, 4, 6>();
          if (p_lo != nullptr) S::template tile_dot<0, 5, 6>();
          if (n > 1) {
            S::template tile_load<6>(vv + v.next, v.stride_bytes);
            S::template tile_dot<1, 4, 6>();
            if (p_lo != nullptr) S::template tile_dot<1, 5, 6>();
          }
          if (n > 2) {
            S::template tile_load<6>(vv + 2 * v.next, v.stride_bytes);
            S::template tile_dot<2, 4, 6>();
            if (p_lo != nullptr) S::template tile_dot<2, 5, 6>();
          }
          if (n > 3) {
            S::template tile_load<6>(vv + 3 * v.next, v.stride_bytes);
            S::template tile_dot<3, 4, 6>();
            if (p_lo != nullptr) S::template tile_dot<3, 5, 6>();
          }
        }
        store_accumulators(out + d0, out_stride, n);
      }
    } else {
      (void)out, (void)dim_v, (void)rows, (void)p_hi, (void)p_lo, (void)p_stride, (void)groups, (void)group_tokens;
      (void)slice;
    }
  }
};

template <class S, class Kv>
struct ItemKernel {
  using V = typename S::V;
  using T = typename Kv::Elem;
  static constexpr int W = S::kWidth;
  // Register blocking, sized so accumulators + operands fit the register file. Score tiles keep 4 heads so each step loads as many q as K vectors (loads, not FMAs, bound
  // a wider head tile); value tiles take 8 heads where registers allow, converting each V vector
  // once for more FMAs.
  static constexpr int kScoreHeadTile = 4;
  static constexpr int kValueHeadTile = S::kRegisters >= 32 ? 8 : 4;
  static constexpr int kScoreAccumulators = S::kRegisters >= 32 ? 16 : 8;
  static constexpr int kValueAccumulators = S::kRegisters >= 32 ? 16 : 8;

  // bf16 K and V widened a pair at a time: one 2W-element load gives the even dims (a shift) and the
  // odd dims (a mask) as two float32 vectors, one instruction per W values where a plain widening
  // takes two. q and the output accumulators of [0, split_*) hold each 2W-dim chunk as its W even
  // dims then its W odd dims; run() puts the output back in order at the end. Measured, MLA at 32K
  // on a 2-vCPU Xeon: avx512 6.86 -> 5.60 ms; avx2 unchanged (10.2 ms).
  static constexpr bool kSplitPairs = std::is_same_v<Kv, Bf16Kv> && (W > 1);
  // With 16 registers the split scores hold 2 heads' q (4 vectors) and widen one token at a time
  // (8 accumulators, 2 K vectors live). Holding 4 heads x 2 tokens, GCC spilled a q vector to the
  // stack every step, a store and reload inside the accumulators' chains. Measured on a 2-vCPU Zen 3,
  // one thread, 4K tokens in L3, interleaved: MLA 1.10-1.28x, GQA 32/4/128 1.11x, 32/8/128 1.04x.
  static constexpr bool kScoresByToken = kSplitPairs && S::kRegisters < 32;

  const PagedAttentionArgs& a;
  const int64_t group, dim_qk, dim_v;
  int64_t split_qk = 0, split_v = 0;  // dims [0, split_*) are in the split-pair order (none: 0)
  float* q32;     // [group, dim_qk], pre-scaled
  float* scores;  // [group, kTileTokens]: scores, then probabilities
  float* row_max;  // [group]
  float* row_sum;  // [group]
  const T** k_rows;  // [kTileTokens]
  const T** v_rows;  // [kTileTokens]

  // AMX (S::kAmx, bf16 KV, head dims of whole 32s, 16-token runs inside blocks): scores come
  // transposed, S^T [16 tokens, heads] += K [16 tokens, 32 dims] x q^T [16 dim pairs, heads x 2],
  // K rows read as stored; PV is out [heads, 16 dims] += P [heads, 16 tokens] x V [8 token pairs,
  // 16 dims x 2], with V rows put in token pairs per 16-token group and 64 dims. q (when not bf16)
  // and P are split into bf16 high and low halves, so the result keeps float32 accuracy.
  bool amx = false;
  bool q_has_low = false;
  uint16_t* qt_hi = nullptr;  // [dim_qk / 2, group, 2]
  uint16_t* qt_lo = nullptr;
  uint16_t* p_hi = nullptr;   // [group, kTileTokens]
  uint16_t* p_lo = nullptr;
  uint16_t* v_pairs = nullptr;  // [16, 64, 2]: 32 tokens' 64 dims in token pairs
  float* transposed = nullptr;  // [kTileTokens, group]: transposed scores
  uint16_t* q_rows_hi = nullptr;  // [group, dim_qk]: q's halves before the transpose
  uint16_t* q_rows_lo = nullptr;
  // bf16 q and KV (amx_words): q has no low part, so the tile's scores come four 16-token groups at
  // a time; P is rounded to bf16 once, as the bf16 dot path and the GPU kernel round it, and V is
  // the B operand as stored: out's even dims [heads, 16] += P_even [heads, 16 tokens x (p, 0)] x V
  // [16 tokens, 16 dim pairs], the odd dims likewise with (0, p), so no V row is rearranged (the
  // output is in split-pair order until run() puts it back). Twice the tile products of V in token
  // pairs, but those rows were rearranged for every 32 tokens and 64 dims and read back by the tile
  // loads at once. Measured on a 2-vCPU Xeon (Emerald Rapids class), MLA (16 heads, 576 / 512) at
  // 32K from DRAM, 2 threads, interleaved with the token-pair path: 1.20x (15.8 -> 18.9 GB/s); 1.27-
  // 1.30x at 1K and 4K in cache.
  bool amx_words = false;
  uint32_t* p_even = nullptr;  // [group, kTileTokens]: bf16 P in the low half of each word
  uint32_t* p_odd = nullptr;   // and in the high half
  bool amx_lanes = false;      // amx_words with one vector of heads (MLA's 16): amx_lane_softmax
  const char** ahead_rows = nullptr;  // [2 * kTileTokens]: the next tile's K and V rows
  RowPrefetcher prefetch;
  AmxTiles<S> tiles;
  phase_timers::ItemLaps laps;  // from the kernel's construction (the item's start) to its end
  // bf16 q against bf16 K with the CPU's bf16 dot product: products of bf16 values are exact in
  // float32, so this is as accurate as widening first (the scale is applied after the dot).
  bool bf16_dot = false;
  const uint16_t* q_bf16 = nullptr;  // [group, q_head_stride] rows of this item's heads
  bool lane_heads = false;  // the dot path's scores with heads in lanes (lane_scores)
  uint32_t* q_lanes = nullptr;

  ItemKernel(const PagedAttentionArgs& args, Workspace ws)
      : a(args),
        group(args.num_q_heads / args.num_kv_heads),
        dim_qk(args.head_dim_qk),
        dim_v(args.head_dim_v) {
    const ScratchHead head(ws, group, dim_qk, kTileTokens);
    q32 = head.q32, scores = head.scores, row_max = head.row_max, row_sum = head.row_sum;
    k_rows = reinterpret_cast<const T**>(head.pointers);
    v_rows = k_rows + kTileTokens;
    ahead_rows = reinterpret_cast<const char**>(v_rows + kTileTokens);  // in the token vectors' scratch
    if constexpr (S::kAmx && std::is_same_v<Kv, Bf16Kv>) {
      char* z = static_cast<char*>(ws.data) + amx_workspace_offset(group, dim_qk, scratch_block_size(args.layout,
                                                                                                   args.block_size));
      z = reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(z) + 63) & ~uintptr_t(63));
      qt_hi = reinterpret_cast<uint16_t*>(z);
      qt_lo = qt_hi + group * dim_qk;
      p_hi = qt_lo + group * dim_qk;
      p_lo = p_hi + group * kTileTokens;
      v_pairs = reinterpret_cast<uint16_t*>((reinterpret_cast<uintptr_t>(p_lo + group * kTileTokens) + 63) & ~uintptr_t(63));
      const int64_t v_elements = 16 * dim_v > 16 * 64 * 2 ? 16 * dim_v : 16 * 64 * 2;  // kernel_workspace_bytes' v_bytes
      transposed = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(v_pairs + v_elements) + 63) & ~uintptr_t(63));
      q_rows_hi = reinterpret_cast<uint16_t*>((reinterpret_cast<uintptr_t>(transposed + kTileTokens * group) + 63) &
                                              ~uintptr_t(63));
      q_rows_lo = q_rows_hi + group * dim_qk;
      p_even = reinterpret_cast<uint32_t*>((reinterpret_cast<uintptr_t>(q_rows_lo + group * dim_qk) + 63) & ~uintptr_t(63));
      p_odd = p_even + group * kTileTokens;
    } else if constexpr (S::kBf16Dot && std::is_same_v<Kv, Bf16Kv>) {
      char* z = static_cast<char*>(ws.data) + amx_workspace_offset(group, dim_qk, scratch_block_size(args.layout,
                                                                                                   args.block_size));
      z = reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(z) + 63) & ~uintptr_t(63));
      p_hi = reinterpret_cast<uint16_t*>(z) + 2 * group * dim_qk;  // where the AMX layout has it
    }
  }

  // 16-token runs of K rows must lie inside one block: the item starts on a multiple of 16.
  bool amx_fits(const WorkItem& item) const {
    if constexpr (S::kAmx && std::is_same_v<Kv, Bf16Kv>) {
      return token_major_tiles_fit(group, dim_qk, dim_v, a.block_size) && item.token_begin % 16 == 0;
    }
    (void)item;
    return false;
  }

  // q32 (unscaled) -> q^T [dim_qk / 2, group, 2] as bf16 high and low halves: split 16 floats at a
  // time, then a transpose of 32-bit dim pairs.
  void transpose_queries(const WorkItem& item) {
    if constexpr (S::kAmx && std::is_same_v<Kv, Bf16Kv>) {
      if (a.q_dtype == DType::kBFloat16) return transpose_bf16_queries(item);
      transpose_queries_amx();
    }
  }

  // A bf16 q is its own high half with no low half: q^T's dim pairs straight from its rows (no float
  // copy, split or check: those were ~15% of an MLA item of 512 tokens on a 2-vCPU Xeon, in cache).
  void transpose_bf16_queries(const WorkItem& item) {
    q_has_low = false;
    const auto* first = static_cast<const uint16_t*>(a.q) + item.seq * a.q_seq_stride +
                        item.kv_head * group * a.q_head_stride;
    const int64_t pairs = dim_qk / 2;
    uint32_t* to = reinterpret_cast<uint32_t*>(qt_hi);
    int64_t vector_pairs = 0;
    if constexpr (S::kAmx) {
      if (group == 16 && a.q_head_stride % 2 == 0) {  // 16 x 16 blocks of pairs in registers (~4% of MLA in L2)
        const auto* rows = reinterpret_cast<const float*>(first);  // each pair's 32 bits, moved untouched
        for (; vector_pairs + 16 <= pairs; vector_pairs += 16)
          S::transpose_16x16(rows + vector_pairs, a.q_head_stride / 2, reinterpret_cast<float*>(to + vector_pairs * 16),
                             16);
      }
    }
    for (int64_t g = 0; g < group; ++g) {
      const uint16_t* row = first + g * a.q_head_stride;
      for (int64_t p = vector_pairs; p < pairs; ++p)
        to[p * group + g] = uint32_t{row[2 * p]} | (uint32_t{row[2 * p + 1]} << 16);
    }
  }

  void transpose_queries_amx() {
    uint16_t* rows_hi = q_rows_hi;
    uint16_t* rows_lo = q_rows_lo;
    uint32_t any_low = 0;
    for (int64_t i = 0; i < group * dim_qk; i += 16) {
      S::split_bf16(q32 + i, rows_hi + i, rows_lo + i);
      for (int64_t j = 0; j < 16; ++j) any_low |= rows_lo[i + j] & 0x7FFFu;
    }
    q_has_low = any_low != 0;
    const int64_t pairs = dim_qk / 2;
    for (int half = 0; half < (q_has_low ? 2 : 1); ++half) {
      const uint32_t* from = reinterpret_cast<const uint32_t*>(half ? rows_lo : rows_hi);
      uint32_t* to = reinterpret_cast<uint32_t*>(half ? qt_lo : qt_hi);
      for (int64_t g = 0; g < group; ++g)
        for (int64_t p = 0; p < pairs; ++p) to[p * group + g] = from[g * pairs + p];
    }
  }

  void amx_scores(int64_t count) {
    if constexpr (S::kAmx && std::is_same_v<Kv, Bf16Kv>) {
      tiles.configure_latent_scores(group);
      RowPrefetcher local = prefetch;
      const int64_t k_stride_bytes = a.k_token_stride * 2;
      const int64_t qt_stride_bytes = group * 4;
      for (int64_t t0 = 0; t0 < count; t0 += 16) {
        const T* k0 = k_rows[t0];  // 16 consecutive rows of one block
        S::template tile_zero<0>();
        for (int64_t c = 0; c < dim_qk; c += 32) {
          local.step();
          S::template tile_load<1>(k0 + c, k_stride_bytes);
          S::template tile_load<3>(qt_hi + c * group, qt_stride_bytes);
          S::template tile_dot<0, 1, 3>();
          if (q_has_low) {
            S::template tile_load<2>(qt_lo + c * group, qt_stride_bytes);
            S::template tile_dot<0, 1, 2>();
          }
        }
        S::template tile_store<0>(transposed, group * 4);
        for (int64_t i = 0; i < 16 && t0 + i < kTileTokens; ++i)
          for (int64_t g = 0; g < group; ++g) scores[g * kTileTokens + t0 + i] = transposed[i * group + g] * a.scale;
      }
      prefetch = local;
    }
  }

  // Scores of the tile's 16-token groups (8 to 15 heads; 16 take amx_lane_softmax), scaled into
  // scores [group, kTileTokens].
  void amx_scores_words(int64_t count) {
    if constexpr (S::kAmx && std::is_same_v<Kv, Bf16Kv>) {
      const int64_t groups = amx_latent_tiles(count);
      for (int64_t g = 0; g < group; ++g) {
        float* row = scores + g * kTileTokens;
        for (int64_t t = 0; t < groups * 16; ++t) row[t] = transposed[t * group + g] * a.scale;
      }
    }
  }

  // The tile's scores, transposed and unscaled, into `transposed` [16 x groups tokens, group], four
  // 16-token groups at a time (accumulators 0-3): each q^T chunk loaded serves the four (chunks in
  // tiles 4 and 5 in turn, K in 6 and 7). Returns the groups.
  int64_t amx_latent_tiles(int64_t count) {
    tiles.configure_latent_scores4(group);
    const int64_t groups = (count + 15) / 16;
    switch (groups) {
      case 1: amx_latent_groups<1>(); break;
      case 2: amx_latent_groups<2>(); break;
      case 3: amx_latent_groups<3>(); break;
      default: amx_latent_groups<4>(); break;
    }
    return groups;
  }

  // The softmax of a tile on the tiles with 16 heads (MLA), heads in lanes: the transposed scores
  // are one vector a token, so the max and the sum run down the tokens (no horizontal reduction),
  // and the probabilities, rounded to bf16 in lanes, reach P's words (p_even, p_odd) through one
  // transpose. Before, the scores were transposed and scaled into rows (16 x 16 blocks in registers),
  // then a pass took each row's max, one its exps and one its words. Measured on a 2-vCPU Xeon (AMX),
  // MLA, interleaved against that (with the dims' order below): 1.06x at 8K in L3 (one thread), 1.07x
  // at 8K and 1.03x at 32K from DRAM (2 threads).
  void amx_lane_softmax(int64_t count, float* acc) {
    if constexpr (S::kAmx && std::is_same_v<Kv, Bf16Kv>) {
      static_assert(W == 16, "one vector holds the 16 heads");
      const int64_t padded = (count + 15) / 16 * 16;
      const V scale = S::set1(a.scale);
      V m0 = S::set1(kNegInf), m1 = m0;
      int64_t t = 0;
      for (; t + 2 <= count; t += 2) {
        m0 = S::max(m0, S::load(transposed + t * 16));
        m1 = S::max(m1, S::load(transposed + (t + 1) * 16));
      }
      if (t < count) m0 = S::max(m0, S::load(transposed + t * 16));
      // scale > 0 and rounding is monotonic: the max of the scaled scores is the scaled max
      const V tile_max = S::mul(S::max(m0, m1), scale);
      const V old_max = S::load(row_max);
      // -inf + slack stays -inf: the first tile with a finite score moves the max
      const auto moved = S::greater_lanes(tile_max, S::add(old_max, S::set1(kRescaleSlack)));
      const V new_max = moved ? S::take_lanes(moved, tile_max, old_max) : old_max;
      V sum = S::zero();
      for (t = 0; t < count; ++t) {
        const V p = S::exp(S::sub(S::mul(S::load(transposed + t * 16), scale), new_max));
        sum = S::add(sum, p);
        S::store(transposed + t * 16, S::bf16_high_words(p));
      }
      for (; t < padded; ++t) S::store(transposed + t * 16, S::zero());  // the last group's tokens past count
      if (moved) rescale_lanes(moved, old_max, new_max, acc, 0);
      S::store(row_sum, S::add(S::load(row_sum), sum));
      S::store(row_max, new_max);
      for (t = 0; t < padded; t += 16)
        S::transpose_16x16_words(reinterpret_cast<const uint32_t*>(transposed + t * 16), p_odd + t, p_even + t,
                                 kTileTokens);
    }
  }

  // Heads first_head + lane whose max moved (the lanes set in `moved`): their running sums and
  // output rows times exp(old max - new max).
  void rescale_lanes(uint32_t moved, V old_max, V new_max, float* acc, int64_t first_head) {
    alignas(64) float before[W], after[W];
    S::store(before, old_max);
    S::store(after, new_max);
    for (int64_t lane = 0; lane < W; ++lane) {
      if (!(moved >> lane & 1) || before[lane] == kNegInf) continue;  // before the first tile: no output yet
      const int64_t g = first_head + lane;
      const float alpha = std::exp(before[lane] - after[lane]);
      row_sum[g] *= alpha;
      const V factor = S::set1(alpha);
      for (int64_t d = 0; d < dim_v; d += W) S::store(acc + g * dim_v + d, S::mul(factor, S::load(acc + g * dim_v + d)));
    }
  }

  template <int N>
  void amx_latent_groups() {
    if constexpr (S::kAmx && std::is_same_v<Kv, Bf16Kv>) {
      static_assert(N * 16 <= kTileTokens, "four 16-token groups make a tile");
      const int64_t k_stride_bytes = a.k_token_stride * 2;
      const int64_t qt_stride_bytes = group * 4;
      S::template tile_zero<0>();
      if constexpr (N > 1) S::template tile_zero<1>();
      if constexpr (N > 2) S::template tile_zero<2>();
      if constexpr (N > 3) S::template tile_zero<3>();
      RowPrefetcher local = prefetch;
      // The dims from the last down: PV's first V tiles (dims 0, 32, ...) are then the K tiles loaded
      // last, still in L1 (a tile's 72 KB of latent is more than L1 holds).
      int64_t c = dim_qk;
      if (c % 64 != 0) {
        c -= 32;
        S::template tile_load<4>(qt_hi + c * group, qt_stride_bytes);
        latent_chunk<N, 4>(local, c, k_stride_bytes);
      }
      for (; c >= 64; c -= 64) {
        S::template tile_load<5>(qt_hi + (c - 32) * group, qt_stride_bytes);
        latent_chunk<N, 5>(local, c - 32, k_stride_bytes);
        S::template tile_load<4>(qt_hi + (c - 64) * group, qt_stride_bytes);
        latent_chunk<N, 4>(local, c - 64, k_stride_bytes);
      }
      prefetch = local;
      touch_deferred();
      S::template tile_store<0>(transposed, qt_stride_bytes);
      if constexpr (N > 1) S::template tile_store<1>(transposed + 16 * group, qt_stride_bytes);
      if constexpr (N > 2) S::template tile_store<2>(transposed + 32 * group, qt_stride_bytes);
      if constexpr (N > 3) S::template tile_store<3>(transposed + 48 * group, qt_stride_bytes);
    }
  }

  // Accumulators 0..N-1 += K rows of group u, dims [c, c + 32) x the q^T chunk in tile B.
  template <int N, int B>
  WS_INLINE void latent_chunk(RowPrefetcher& local, int64_t c, int64_t k_stride_bytes) {
    latent_product<0, B>(local, k_rows[0] + c, k_stride_bytes);
    if constexpr (N > 1) latent_product<1, B>(local, k_rows[16] + c, k_stride_bytes);
    if constexpr (N > 2) latent_product<2, B>(local, k_rows[32] + c, k_stride_bytes);
    if constexpr (N > 3) latent_product<3, B>(local, k_rows[48] + c, k_stride_bytes);
  }
  template <int C, int B>
  WS_INLINE void latent_product(RowPrefetcher& local, const T* k, int64_t k_stride_bytes) {
    if constexpr (S::kAmx && std::is_same_v<Kv, Bf16Kv>) {
      constexpr int A = 6 + (C & 1);
      local.step();
      S::template tile_load<A>(k, k_stride_bytes);
      S::template tile_dot<C, A, B>();
    }
  }

  // out [group, dim_v] (split-pair order) += P x V over the tile's 16-token groups, 64 dims (four
  // accumulators: two 32-dim chunks' even and odd dims) at a time.
  void amx_values_words(int64_t count, float* acc) {
    if constexpr (S::kAmx && std::is_same_v<Kv, Bf16Kv>) {
      const int64_t groups = (count + 15) / 16;
      for (int64_t g = 0; g < group; ++g)  // zero past count: the softmax's padding to 16
        for (int64_t t = 0; t < groups * 16; t += 16)
          S::bf16_words(scores + g * kTileTokens + t, p_even + g * kTileTokens + t, p_odd + g * kTileTokens + t);
      amx_value_products(count, acc);
    }
  }

  // out [group, dim_v] (split-pair order) += P x V from P's words (p_even, p_odd).
  void amx_value_products(int64_t count, float* acc) {
    if constexpr (S::kAmx && std::is_same_v<Kv, Bf16Kv>) {
      const int64_t groups = (count + 15) / 16;
      const T* v_group[kTileTokens / 16];
      int64_t v_stride_bytes[kTileTokens / 16];
      for (int64_t k = 0; k < groups; ++k) v_group[k] = v_rows[16 * k], v_stride_bytes[k] = a.v_token_stride * 2;
      if (count % 16 != 0) {  // the rows past count zeroed: a zero probability times a NaN is NaN in a tile product
        const int64_t first = 16 * (groups - 1);
        for (int64_t t = 0; t < 16; ++t) {
          if (first + t < count) std::memcpy(v_pairs + t * dim_v, v_rows[first + t], dim_v * 2);
          else std::memset(v_pairs + t * dim_v, 0, dim_v * 2);
        }
        v_group[groups - 1] = v_pairs, v_stride_bytes[groups - 1] = dim_v * 2;
      }
      tiles.configure_paired(group);
      RowPrefetcher local = prefetch;
      const int64_t chunks = dim_v / 32, half = groups / 2;
      const int64_t out_stride = dim_v * 4, p_stride = kTileTokens * 4;
      // Accumulators 0, 1 (set A) hold the even and odd dims of the even 32-dim chunks, a chunk for
      // all the groups; 2, 3 (set B) those of the odd chunks, B's chunk a + 1 taking the groups from
      // `half` with A's chunk a and those before `half` with A's chunk a + 2. So the two sets are
      // stored and reloaded at different groups, and one set's products run while the other's wait
      // for their stores and loads (with four accumulators moved together, every 64 dims waited for
      // the products to drain). Measured on a 2-vCPU Xeon (AMX), MLA, interleaved against that: 1.02x
      // at 2K and 8K in cache (one thread), 1.03x at 8K and 1.04x at 32K from DRAM (2 threads).
      int64_t b_chunk = -1;  // the chunk in set B
      S::template tile_load<0>(acc, out_stride);
      S::template tile_load<1>(acc + 16, out_stride);
      for (int64_t a_chunk = 0; a_chunk < chunks; a_chunk += 2) {
        for (int64_t k = 0; k < groups; ++k) {
          S::template tile_load<4>(p_even + 16 * k, p_stride);
          S::template tile_load<5>(p_odd + 16 * k, p_stride);
          if (k == half && a_chunk + 1 < chunks) {
            if (b_chunk >= 0) store_value_set<2>(acc + 32 * b_chunk, out_stride);
            b_chunk = a_chunk + 1;
            S::template tile_load<2>(acc + 32 * b_chunk, out_stride);
            S::template tile_load<3>(acc + 32 * b_chunk + 16, out_stride);
            value_products<0>(local, v_group[k] + 32 * a_chunk, v_stride_bytes[k]);  // A first: B is reloading
            value_products<2>(local, v_group[k] + 32 * b_chunk, v_stride_bytes[k]);
            continue;
          }
          if (b_chunk >= 0 && b_chunk == (k < half ? a_chunk - 1 : a_chunk + 1))
            value_products<2>(local, v_group[k] + 32 * b_chunk, v_stride_bytes[k]);
          value_products<0>(local, v_group[k] + 32 * a_chunk, v_stride_bytes[k]);
        }
        store_value_set<0>(acc + 32 * a_chunk, out_stride);
        if (a_chunk + 2 < chunks) {
          S::template tile_load<0>(acc + 32 * (a_chunk + 2), out_stride);
          S::template tile_load<1>(acc + 32 * (a_chunk + 2) + 16, out_stride);
        }
      }
      const int64_t last_a_chunk = (chunks - 1) / 2 * 2;
      if (b_chunk >= 0) {
        if (b_chunk == last_a_chunk + 1) {  // B's chunk after A's last: its groups before `half`
          for (int64_t k = 0; k < half; ++k) {
            S::template tile_load<4>(p_even + 16 * k, p_stride);
            S::template tile_load<5>(p_odd + 16 * k, p_stride);
            value_products<2>(local, v_group[k] + 32 * b_chunk, v_stride_bytes[k]);
          }
        }
        store_value_set<2>(acc + 32 * b_chunk, out_stride);
      }
      prefetch = local;
    }
  }

  // Accumulators C, C + 1 (a 32-dim chunk's even and odd dims) += P's words (tiles 4, 5) x the
  // chunk's V tile (6 for set A, 7 for set B).
  template <int C>
  WS_INLINE void value_products(RowPrefetcher& local, const T* v, int64_t v_stride_bytes) {
    if constexpr (S::kAmx && std::is_same_v<Kv, Bf16Kv>) {
      constexpr int B = C == 0 ? 6 : 7;
      local.step();
      S::template tile_load<B>(v, v_stride_bytes);
      S::template tile_dot<C, 4, B>();
      S::template tile_dot<C + 1, 5, B>();
    }
  }
  template <int C>
  static void store_value_set(float* chunk, int64_t out_stride) {
    if constexpr (S::kAmx) {
      S::template tile_store<C>(chunk, out_stride);
      S::template tile_store<C + 1>(chunk + 16, out_stride);
    }
  }

  void amx_values(int64_t count, float* acc) {
    if constexpr (S::kAmx && std::is_same_v<Kv, Bf16Kv>) {
      const int64_t padded = (count + 31) / 32 * 32;  // 32-token groups: twice the depth per tile product
      for (int64_t g = 0; g < group; ++g) {
        const float* row = scores + g * kTileTokens;
        uint16_t* hi = p_hi + g * kTileTokens;
        uint16_t* lo = p_lo + g * kTileTokens;
        int64_t t = 0;
        for (; t + 16 <= count; t += 16) S::split_bf16(row + t, hi + t, lo + t);
        for (; t < count; ++t) {
          hi[t] = bf16_round(row[t]);
          lo[t] = bf16_round(row[t] - bf16_bits_to_float(hi[t]));
        }
        for (; t < padded; ++t) hi[t] = lo[t] = 0;
      }
      RowPrefetcher local = prefetch;
      tiles.values(acc, dim_v, group, p_hi, p_lo, kTileTokens, padded / 32, 32, [&](int64_t k, int64_t d0) {
        local.step();
        const int64_t dims = dim_v - d0 < 64 ? dim_v - d0 : 64;
        for (int64_t pair = 0; pair < 16; ++pair) {
          const int64_t t = 32 * k + 2 * pair;  // rows past count are zeros, not whatever the block holds
          const uint16_t* first = t < count ? v_rows[t] + d0 : nullptr;
          const uint16_t* second = t + 1 < count ? v_rows[t + 1] + d0 : nullptr;
          if (first) S::interleave_rows(first, second, v_pairs + pair * 128, dims);
          else std::memset(v_pairs + pair * 128, 0, dims * 4);
        }
        return VSlice{v_pairs, 64 * 2 * 2, 32};
      });
      prefetch = local;
    }
  }

  void run(const WorkItem& item) {
    amx = amx_fits(item);
    load_queries(item);
    if (lane_heads) return run_lanes(item);
    if (amx) transpose_queries(item);
    amx_words = amx && a.q_dtype == DType::kBFloat16 && a.round_probabilities;  // a bf16 q has no low part
    if (amx_words) split_v = dim_v;
    amx_lanes = amx_words && group == W;
    for (int64_t i = 0; i < group * dim_v; ++i) item.out[i] = 0.0f;
    for (int64_t g = 0; g < group; ++g) {
      row_max[g] = kNegInf;
      row_sum[g] = 0.0f;
    }
    laps.lap(phase_timers::kItemStart);
    for (int64_t begin = item.token_begin; begin < item.token_end; begin += kTileTokens) {
      const int64_t count = item.token_end - begin < kTileTokens ? item.token_end - begin : kTileTokens;
      const bool first = begin == item.token_begin, last = !first && begin + count == item.token_end;
      gather_rows(item, begin, count);
      laps.part(phase_timers::kGather, first, last);
      if (amx_lanes) {
        amx_latent_tiles(count);
        laps.part(phase_timers::kScores, first, last);
        amx_lane_softmax(count, item.out);
        laps.part(phase_timers::kSoftmax, first, last);
        amx_value_products(count, item.out);
        laps.part(phase_timers::kValues, first, last);
        laps.end_tile(first, last);
        continue;
      }
      if (amx_words) amx_scores_words(count);
      else if (amx) amx_scores(count);
      else compute_scores(count);
      laps.part(phase_timers::kScores, first, last);
      update_softmax(count, item.out);
      laps.part(phase_timers::kSoftmax, first, last);
      if (amx_words) amx_values_words(count, item.out);
      else if (amx) amx_values(count, item.out);
      else if (bf16_dot) dot_values(count, item.out);
      else accumulate_values(count, item.out);
      laps.part(phase_timers::kValues, first, last);
      laps.end_tile(first, last);
    }
    if constexpr (S::kAmx) {
      if (amx) S::tile_release();
    }
    for (int64_t g = 0; g < group; ++g) {
      const float inv = 1.0f / row_sum[g];
      item.lse[g] = row_max[g] + std::log(row_sum[g]);
      if (split_v) {
        normalise_split(item.out + g * dim_v, inv);
        continue;
      }
      for (int64_t d = 0; d < dim_v; ++d) item.out[g * dim_v + d] *= inv;
      if constexpr (S::kBf16Dot && std::is_same_v<Kv, Bf16Kv>) {
        if (bf16_dot && !amx)
          for (int64_t d = 0; d + 2 * W <= dim_v; d += 2 * W) S::unpacked_to_natural(item.out + g * dim_v + d);
      }
    }
    laps.lap(phase_timers::kItemEnd);
  }

  // The item on the lane path: scores, probabilities and running max and sum all with heads in
  // lanes (no transpose to [head, token], a vertical softmax). The first tile's value sums start
  // from zero, so the output is neither zeroed nor rescaled before it; the end normalises and puts
  // the dims in natural order in one pass.
  void run_lanes(const WorkItem& item) {
    if constexpr (S::kBf16Dot && std::is_same_v<Kv, Bf16Kv>) {
      for (int64_t g = 0; g < group; ++g) {
        row_max[g] = kNegInf;
        row_sum[g] = 0.0f;
      }
      if (item.token_begin == item.token_end) {  // planned items hold tokens; the empty partial all the same
        for (int64_t i = 0; i < group * dim_v; ++i) item.out[i] = 0.0f;
        for (int64_t g = 0; g < group; ++g) item.lse[g] = kNegInf;
        return;
      }
      laps.lap(phase_timers::kItemStart);
      for (int64_t begin = item.token_begin; begin < item.token_end; begin += kTileTokens) {
        const int64_t count = item.token_end - begin < kTileTokens ? item.token_end - begin : kTileTokens;
        const bool first = begin == item.token_begin, last = !first && begin + count == item.token_end;
        gather_rows(item, begin, count);
        laps.part(phase_timers::kGather, first, last);
        lane_scores(count);
        laps.part(phase_timers::kScores, first, last);
        lane_softmax(count, item.out);
        laps.part(phase_timers::kSoftmax, first, last);
        lane_values(count, item.out, first);
        laps.part(phase_timers::kValues, first, last);
        laps.end_tile(first, last);
      }
      for (int64_t g = 0; g < group; ++g) {
        const V inv = S::set1(1.0f / row_sum[g]);
        for (int64_t d = 0; d < dim_v; d += 2 * W) S::unpacked_to_natural(item.out + g * dim_v + d, inv);
        item.lse[g] = row_max[g] + std::log(row_sum[g]);
      }
      laps.lap(phase_timers::kItemEnd);
    }
  }

  // One output row [dim_v] normalised by `inv`, its chunks of 2W floats [even dims | odd dims] in
  // [0, split_v) put back in natural order in the same pass. Measured on a 2-vCPU Xeon (Emerald
  // Rapids class) against a scalar pass each, interleaved: MLA on the tiles 1.05x at 8K from DRAM
  // and at 1K in cache; on avx512's FMA loops 1.01-1.03x at 8K.
  void normalise_split(float* row, float inv) {
    if constexpr (kSplitPairs) {
      const V scale = S::set1(inv);
      int64_t d = 0;
      for (; d < split_v; d += 2 * W) S::pairs_to_natural(row + d, scale);
      for (; d < dim_v; ++d) row[d] *= inv;
    } else {
      for (int64_t d = 0; d < dim_v; ++d) row[d] *= inv;
    }
  }

  void load_queries(const WorkItem& item) {
    if constexpr (S::kBf16Dot && std::is_same_v<Kv, Bf16Kv>) {
      bf16_dot = a.q_dtype == DType::kBFloat16 && a.use_bf16_dot && !amx;
      if (bf16_dot) {
        q_bf16 = static_cast<const uint16_t*>(a.q) + item.seq * a.q_seq_stride + item.kv_head * group * a.q_head_stride;
        lane_heads = group % W == 0 && dim_qk % 4 == 0 && dim_v % (2 * W) == 0;
        if (lane_heads) load_lane_queries();
        return;
      }
    }
    switch (a.q_dtype) {
      case DType::kFloat32: return load_queries_as(item, F32Kv{});
      case DType::kBFloat16: return load_queries_as(item, Bf16Kv{});
      case DType::kFloat16: return load_queries_as(item, Fp16Kv{});
    }
  }

  template <class Q>
  void load_queries_as(const WorkItem& item, Q) {
    if constexpr (kSplitPairs) {
      split_qk = amx ? 0 : dim_qk - dim_qk % (2 * W);
      split_v = amx ? 0 : dim_v - dim_v % (2 * W);
    }
    if constexpr (std::is_same_v<Q, Bf16Kv>) {
      if (amx) return;  // the tiles take bf16 q as it is (transpose_bf16_queries)
    }
    const float scale = amx ? 1.0f : a.scale;  // the AMX path scales the scores instead
    const auto* q = static_cast<const typename Q::Elem*>(a.q) + item.seq * a.q_seq_stride;
    const V vscale = S::set1(scale);
    for (int64_t g = 0; g < group; ++g) {
      const auto* row = q + (item.kv_head * group + g) * a.q_head_stride;
      float* to = q32 + g * dim_qk;
      int64_t d = 0;
      // Whole 2W-dim chunks a vector pair at a time (an item's every query, up to 128 x 576 values: one
      // value at a time was ~4% of an MLA item of 512 tokens on a Zen 3)
      for (; d < split_qk; d += 2 * W) {
        V even, odd;
        Q::template pairs<S>(row + d, W, even, odd);
        S::store(to + d, S::mul(even, vscale));
        S::store(to + d + W, S::mul(odd, vscale));
      }
      for (; d < dim_qk; ++d) to[d] = Q::one(row + d) * scale;
    }
  }

  // A row's lines, asked for at once (an item's first tile, into L1: nothing computes yet).
  template <int kLocality>
  static void prefetch_row(const T* row, int64_t dim) {
    const char* bytes = reinterpret_cast<const char*>(row);
    for (int64_t offset = 0; offset < dim * static_cast<int64_t>(sizeof(T)); offset += 64)
      __builtin_prefetch(bytes + offset, 0, kLocality);
  }

  // Row pointers of the tile's tokens, walking the block table without a division per token; the
  // next tile's rows (in an item's last tile, those of the first tile of the item this thread
  // likely takes next: next_item_rows) go to the prefetcher, which asks for their lines a few at a
  // time from inside the tile's score loops; the item's first tile is asked for into L1 here. MLA
  // at 16 heads (lane scores, a tile of 35K dots, time for the lines a tile ahead to come), measured
  // on a 2-vCPU Zen 4 interleaved against asking for the next three tiles at each tile's start:
  // 1.15x at 8K, 1.09x at 32K and 128K, then 1.08x / 1.04x at 8K / 32K for the next item's tile;
  // the avx512 variant 1.06-1.15x / 1.07x at 8K / 32K, avx2 0.98x at 8K. Asking every 8 lane steps
  // instead of 16 measured 0.95x.
  void gather_rows(const WorkItem& item, int64_t begin, int64_t count) {
    const int32_t* table = a.block_table + item.seq * a.block_table_stride;
    int64_t block = begin / a.block_size;
    int64_t offset = begin % a.block_size;
    const T* k_base = static_cast<const T*>(a.k) + item.kv_head * a.k_head_stride;
    const T* v_base = static_cast<const T*>(a.v) + item.kv_head * a.v_head_stride;
    const bool first_tile = begin == item.token_begin;
    const int64_t end = begin + count + kTileTokens < item.token_end ? begin + count + kTileTokens : item.token_end;
    const bool v_in_k = value_inside_key(a);
    prefetch.finish();
    if (prefetch.steps == 0 && !amx) prefetch.steps = lane_heads ? lane_steps(count) : vector_steps(count);
    prefetch.rows = ahead_rows;
    prefetch.k_bytes = dim_qk * static_cast<int64_t>(sizeof(T));
    prefetch.v_bytes = v_in_k ? 0 : dim_v * static_cast<int64_t>(sizeof(T));
    int64_t ahead = end - begin - count;
    // AMX (MLA): asking for the next item's first tile here measured 0.99-1.03x on a 2-vCPU Xeon; not done
    if (ahead == 0 && !amx) ahead = next_item_rows(item.next, v_in_k);
    prefetch.reset(ahead);
    const int64_t touch_end = end + kTileTokens < item.token_end ? end + kTileTokens : item.token_end;
    if (amx_words) deferred_touch = {&item, end, touch_end, v_in_k};  // touch_deferred: on the tiles, later
    else touch_blocks(item, end, touch_end, v_in_k);
    const int64_t k_token_stride = a.k_token_stride, v_token_stride = a.v_token_stride;
    const T** k_out = k_rows;
    const T** v_out = v_rows;
    const char** ahead_out = ahead_rows;
    // A block at a time, its rows by adding the token stride: one table read and no per-token tests
    // of the block's end (per token, with a's fields reloaded after every pointer store, the walk was
    // ~6% of an MLA call in L2 on a 2-vCPU Xeon). Measured there, interleaved: MLA on amx 1.03-1.05x at
    // 1K in L2 (one thread), 1.01-1.02x at 8K from DRAM; on avx512 1.03x, avx2 1.01x at 8K.
    for (int64_t t = 0; begin + t < end; ++block, offset = 0) {
      const int64_t physical = table[block];
      const T* k_row = k_base + physical * a.k_block_stride + offset * k_token_stride;
      const T* v_row = v_base + physical * a.v_block_stride + offset * v_token_stride;
      const int64_t run_end = t + (a.block_size - offset) < end - begin ? t + (a.block_size - offset) : end - begin;
      for (; t < run_end && t < count; ++t, k_row += k_token_stride, v_row += v_token_stride) {
        k_out[t] = k_row;
        v_out[t] = v_row;
      }
      for (; t < run_end; ++t, k_row += k_token_stride, v_row += v_token_stride) {
        ahead_out[2 * (t - count)] = reinterpret_cast<const char*>(k_row);
        ahead_out[2 * (t - count) + 1] = v_in_k ? nullptr : reinterpret_cast<const char*>(v_row);
      }
    }
    if (first_tile) {
      for (int64_t t = 0; t < count; ++t) {
        prefetch_row<3>(k_out[t], dim_qk);
        if (!v_in_k) prefetch_row<3>(v_out[t], dim_v);  // MLA: V's lines are K's
      }
    }
  }

  // On the tiles, touch_blocks' pages are asked for once the scores' last products are issued: the
  // stores of their accumulators wait for those products, and the page walks run in that wait, not
  // before the tile's first products. Measured on a 2-vCPU Xeon (AMX), interleaved: MLA 1.04-1.05x
  // at 8K in L3 (one thread), 1.02-1.03x at 8K from DRAM (2 threads).
  struct DeferredTouch {
    const WorkItem* item = nullptr;
    int64_t from = 0, to = 0;
    bool v_in_k = false;
  } deferred_touch;
  void touch_deferred() {
    if (deferred_touch.item == nullptr) return;
    touch_blocks(*deferred_touch.item, deferred_touch.from, deferred_touch.to, deferred_touch.v_in_k);
    deferred_touch.item = nullptr;
  }

  // The pages of tokens [from, to) of the item (the tile after the one the prefetcher asks for):
  // in each block holding some of them, the bytes from the first one's row to the end of the last
  // one's. Only those: a block of a whole sequence (partial_attention's one block of 16K tokens is
  // 4 MB of K) touched whole for every tile took 25 us a 64-token tile where the tile's scores take
  // 1.4 (Qwen3-MoE's shape on a 2-vCPU Xeon, one thread: 1.4 GB/s a call).
  void touch_blocks(const WorkItem& item, int64_t from, int64_t to, bool v_in_k) const {
    if (from >= to) return;
    const int32_t* table = a.block_table + item.seq * a.block_table_stride;
    const char* k_base = reinterpret_cast<const char*>(static_cast<const T*>(a.k) + item.kv_head * a.k_head_stride);
    const char* v_base = reinterpret_cast<const char*>(static_cast<const T*>(a.v) + item.kv_head * a.v_head_stride);
    constexpr int64_t kElement = static_cast<int64_t>(sizeof(T));
    for (int64_t block = from / a.block_size; block * a.block_size < to; ++block) {
      const int64_t start = block * a.block_size;  // the block's first token
      const int64_t first = from > start ? from - start : 0;
      const int64_t last = to < start + a.block_size ? to - start : a.block_size;  // past the block's last one asked
      const int64_t physical = table[block];
      touch_pages(k_base + (physical * a.k_block_stride + first * a.k_token_stride) * kElement,
                  ((last - 1 - first) * a.k_token_stride + dim_qk) * kElement);
      if (!v_in_k)
        touch_pages(v_base + (physical * a.v_block_stride + first * a.v_token_stride) * kElement,
                    ((last - 1 - first) * a.v_token_stride + dim_v) * kElement);
    }
  }

  // The first tile of the item this thread likely takes next, asked for during this item's last
  // (otherwise the next item starts by waiting for memory): its rows into ahead_rows; returns how
  // many.
  int64_t next_item_rows(const WorkItem* next, bool v_in_k) {
    if (next == nullptr) return 0;
    const int32_t* table = a.block_table + next->seq * a.block_table_stride;
    const T* k_base = static_cast<const T*>(a.k) + next->kv_head * a.k_head_stride;
    const T* v_base = static_cast<const T*>(a.v) + next->kv_head * a.v_head_stride;
    const int64_t rows = next->token_end - next->token_begin < kTileTokens ? next->token_end - next->token_begin
                                                                            : kTileTokens;
    for (int64_t t = 0; t < rows; ++t) {
      const int64_t token = next->token_begin + t;
      const int64_t physical = table[token / a.block_size], offset = token % a.block_size;
      ahead_rows[2 * t] = reinterpret_cast<const char*>(k_base + physical * a.k_block_stride + offset * a.k_token_stride);
      ahead_rows[2 * t + 1] = v_in_k ? nullptr
                                     : reinterpret_cast<const char*>(v_base + physical * a.v_block_stride +
                                                                     offset * a.v_token_stride);
    }
    return rows;
  }

  template <int GT, int TT>
  WS_INLINE void score_block(int64_t g0, int64_t t0) {
    V acc[GT * TT];
    for (int i = 0; i < GT * TT; ++i) acc[i] = S::zero();
    const int64_t vec_end = dim_qk - dim_qk % W;
    for (int64_t d = 0; d < vec_end; d += W) {
      V kv[TT];
      for (int ti = 0; ti < TT; ++ti) kv[ti] = Kv::template vec<S>(k_rows[t0 + ti] + d);
      for (int gi = 0; gi < GT; ++gi) {
        const V qv = S::load(q32 + (g0 + gi) * dim_qk + d);
        for (int ti = 0; ti < TT; ++ti) acc[gi * TT + ti] = S::fma(qv, kv[ti], acc[gi * TT + ti]);
      }
    }
    float sums[GT * TT];
    reduce_scores<GT * TT>(acc, sums);
    for (int gi = 0; gi < GT; ++gi) {
      for (int ti = 0; ti < TT; ++ti) {
        float s = sums[gi * TT + ti];
        for (int64_t d = vec_end; d < dim_qk; ++d)
          s += q32[(g0 + gi) * dim_qk + d] * Kv::one(k_rows[t0 + ti] + d);
        scores[(g0 + gi) * kTileTokens + t0 + ti] = s;
      }
    }
  }

  // A split score block's scores: each accumulator's horizontal sum plus the dims from split_qk.
  template <int GT, int TT>
  WS_INLINE void store_split_scores(int64_t g0, int64_t t0, V* acc) {
    float sums[GT * TT];
    reduce_scores<GT * TT>(acc, sums);
    if (split_qk == dim_qk) {  // no dims left: a head's TT scores are one copy
      for (int gi = 0; gi < GT; ++gi)
        std::memcpy(scores + (g0 + gi) * kTileTokens + t0, sums + gi * TT, sizeof(float) * TT);
      return;
    }
    for (int gi = 0; gi < GT; ++gi) {
      for (int ti = 0; ti < TT; ++ti) {
        float s = sums[gi * TT + ti];
        for (int64_t d = split_qk; d < dim_qk; ++d) s += q32[(g0 + gi) * dim_qk + d] * Kv::one(k_rows[t0 + ti] + d);
        scores[(g0 + gi) * kTileTokens + t0 + ti] = s;
      }
    }
  }

  template <int GT, int TT>
  WS_INLINE void score_block_split(int64_t g0, int64_t t0) {
    V acc[GT * TT];
    for (int i = 0; i < GT * TT; ++i) acc[i] = S::zero();
    for (int64_t d = 0; d < split_qk; d += 2 * W) {
      V even[TT], odd[TT];
      for (int ti = 0; ti < TT; ++ti) S::load_pairs_bf16(k_rows[t0 + ti] + d, W, even[ti], odd[ti]);
      for (int gi = 0; gi < GT; ++gi) {
        const V qe = S::load(q32 + (g0 + gi) * dim_qk + d);
        const V qo = S::load(q32 + (g0 + gi) * dim_qk + d + W);
        for (int ti = 0; ti < TT; ++ti)
          acc[gi * TT + ti] = S::fma(qo, odd[ti], S::fma(qe, even[ti], acc[gi * TT + ti]));
      }
    }
    store_split_scores<GT, TT>(g0, t0, acc);
  }

  // score_block_split with GT heads' q held in registers (2 GT vectors) and each token widened in
  // turn (kScoresByToken).
  template <int GT, int TT>
  WS_INLINE void score_block_split_by_token(int64_t g0, int64_t t0) {
    V acc[GT * TT];
    for (int i = 0; i < GT * TT; ++i) acc[i] = S::zero();
    const float* q_rows[GT];
    for (int gi = 0; gi < GT; ++gi) q_rows[gi] = q32 + (g0 + gi) * dim_qk;
    for (int64_t d = 0; d < split_qk; d += 2 * W) {
      V qe[GT], qo[GT];
      for (int gi = 0; gi < GT; ++gi) qe[gi] = S::load(q_rows[gi] + d), qo[gi] = S::load(q_rows[gi] + d + W);
      for (int ti = 0; ti < TT; ++ti) {
        V even, odd;
        S::load_pairs_bf16(k_rows[t0 + ti] + d, W, even, odd);
        for (int gi = 0; gi < GT; ++gi)
          acc[gi * TT + ti] = S::fma(qo[gi], odd, S::fma(qe[gi], even, acc[gi * TT + ti]));
      }
    }
    store_split_scores<GT, TT>(g0, t0, acc);
  }

  // GT heads x kScoreAccumulators / GT tokens per block: whole groups of eight horizontal sums.
  template <int GT>
  void score_heads(int64_t g0, int64_t count) {
    constexpr int TT = kScoreAccumulators / GT;
    int64_t t = 0;
    if constexpr (kSplitPairs) {
      for (; t + TT <= count; t += TT) {
        prefetch.step();
        if constexpr (kScoresByToken && GT == 2) score_block_split_by_token<GT, TT>(g0, t);
        else score_block_split<GT, TT>(g0, t);
      }
      for (; t < count; ++t) score_block_split<GT, 1>(g0, t);
      return;
    }
    for (; t + TT <= count; t += TT) {
      prefetch.step();
      score_block<GT, TT>(g0, t);
    }
    for (; t < count; ++t) score_block<GT, 1>(g0, t);
  }

  void compute_scores(int64_t count) {
    if constexpr (S::kBf16Dot && std::is_same_v<Kv, Bf16Kv>) {
      if (bf16_dot && lane_heads) return lane_scores(count);
      if (bf16_dot) {
        // Each head group over the whole tile. Every head group over 4 token rows before the next
        // rows (rows and all heads' q kept in L1) measured 0.96x from L3 on a 2-vCPU Zen 4 (MLA).
        int64_t g = 0;
        for (; g + kScoreHeadTile <= group; g += kScoreHeadTile) dot_heads<kScoreHeadTile>(g, count);
        for (; g < group; ++g) dot_heads<1>(g, count);
        return;
      }
    }
    int64_t g = 0;
    if constexpr (!kScoresByToken)  // two heads at a time
      for (; g + kScoreHeadTile <= group; g += kScoreHeadTile) score_heads<kScoreHeadTile>(g, count);
    for (; g + 2 <= group; g += 2) score_heads<2>(g, count);
    for (; g < group; ++g) score_heads<1>(g, count);
  }

  template <int GT>
  void dot_heads(int64_t g0, int64_t count) {
    constexpr int TT = kScoreAccumulators / GT;
    int64_t t = 0;
    for (; t + TT <= count; t += TT) {
      prefetch.step();
      dot_block<GT, TT>(g0, t);
    }
    for (; t < count; ++t) dot_block<GT, 1>(g0, t);
  }

  template <int GT, int TT>
  WS_INLINE void dot_block(int64_t g0, int64_t t0) {
    if constexpr (S::kBf16Dot) {
      constexpr int kPairs = S::kBf16PerRaw;
      V acc[GT * TT];
      for (int i = 0; i < GT * TT; ++i) acc[i] = S::zero();
      const int64_t vec_end = dim_qk - dim_qk % kPairs;
      for (int64_t d = 0; d < vec_end; d += kPairs) {
        typename S::Raw kv[TT];
        for (int ti = 0; ti < TT; ++ti) kv[ti] = S::load_raw(k_rows[t0 + ti] + d);
        for (int gi = 0; gi < GT; ++gi) {
          const typename S::Raw qv = S::load_raw(q_bf16 + (g0 + gi) * a.q_head_stride + d);
          for (int ti = 0; ti < TT; ++ti) acc[gi * TT + ti] = S::dot_bf16(acc[gi * TT + ti], qv, kv[ti]);
        }
      }
      float sums[GT * TT];
      reduce_scores<GT * TT>(acc, sums);
      for (int gi = 0; gi < GT; ++gi) {
        const uint16_t* q_row = q_bf16 + (g0 + gi) * a.q_head_stride;
        for (int ti = 0; ti < TT; ++ti) {
          float s = sums[gi * TT + ti];
          for (int64_t d = vec_end; d < dim_qk; ++d) s += bf16_bits_to_float(q_row[d]) * Kv::one(k_rows[t0 + ti] + d);
          scores[(g0 + gi) * kTileTokens + t0 + ti] = s * a.scale;
        }
      }
    }
  }

  // ------------------------------------------------------------------ scores with heads in lanes
  // The dot path with a group of whole W-head chunks (MLA: 16 or 128 query heads on one latent):
  // the score vectors hold heads, not tokens. For each 4 dims, a token's two K pairs are one 64-bit
  // broadcast, and two q vectors hold W / 2 heads each, a head's two q pairs in neighbouring
  // lanes: two dots take a token's 4 dims for W heads, and the dims sum inside the dots (one add of
  // neighbouring lanes per token at the end) where dot_block reduces a vector per (head, token).
  // Per step: 2 q loads and kLaneTokens broadcasts for 2 kLaneTokens dots, the paired kernel's
  // ratio. The vectors go to the [head, token] scores through a small transpose buffer.
  static constexpr int kLaneTokens = 8;  // 16 accumulators: enough dots in flight for the latency
  // The next tile's lines are asked for a few at a time, every kLaneStepQuads steps of the scores.
  static constexpr int64_t kLaneStepQuads = 16;

  // The score blocks of a tile (one prefetch step each) on the vector paths.
  int64_t vector_steps(int64_t count) const {
    const int64_t chunks = (group + kScoreHeadTile - 1) / kScoreHeadTile;
    return chunks * (count / (kScoreAccumulators / kScoreHeadTile) + 1);
  }

  int64_t lane_steps(int64_t count) const {
    return (count + kLaneTokens - 1) / kLaneTokens * (group / W) * (dim_qk / 4 / kLaneStepQuads);
  }

  // q as [group / W, dim_qk / 4, 2, W] 32-bit words: for dims [4 P, 4 P + 4) and heads c W + h W / 2
  // + j (j < W / 2), word 2 j holds the bf16 pair (4 P, 4 P + 1) and word 2 j + 1 the pair (4 P + 2,
  // 4 P + 3). In q32's memory, unused on the dot path (its group * dim_qk floats hold the words).
  void load_lane_queries() {
    q_lanes = reinterpret_cast<uint32_t*>(q32);
    const int64_t quads = dim_qk / 4;
    for (int64_t c = 0; c < group / W; ++c)
      for (int64_t h = 0; h < 2; ++h)
        for (int64_t j = 0; j < W / 2; ++j) {  // words 2 j, 2 j + 1: the row's 4 dims as stored, one 8-byte copy
          const uint16_t* row = q_bf16 + (c * W + h * (W / 2) + j) * a.q_head_stride;
          uint32_t* words = q_lanes + (c * quads * 2 + h) * W + 2 * j;
          for (int64_t quad = 0; quad < quads; ++quad) std::memcpy(words + quad * 2 * W, row + 4 * quad, 8);
        }
  }

  void lane_scores(int64_t count) {
    for (int64_t t = 0; t < count; t += kLaneTokens) {
      const int64_t n = count - t < kLaneTokens ? count - t : kLaneTokens;
      for (int64_t c = 0; c < group / W; ++c) lane_score_block(c, t, n);
    }
  }

  // Head chunk c's scores of tokens [t0, t0 + n), n <= kLaneTokens.
  WS_INLINE void lane_score_block(int64_t c, int64_t t0, int64_t n) {
    if constexpr (S::kBf16Dot && std::is_same_v<Kv, Bf16Kv>) {
      const uint16_t* rows[kLaneTokens];
      for (int ti = 0; ti < kLaneTokens; ++ti) rows[ti] = k_rows[t0 + (ti < n ? ti : n - 1)];  // past n: not stored
      V acc[kLaneTokens][2];
      for (int ti = 0; ti < kLaneTokens; ++ti) acc[ti][0] = acc[ti][1] = S::zero();
      const int64_t quads = dim_qk / 4;
      const uint32_t* q = q_lanes + c * quads * 2 * W;
      for (int64_t quad = 0; quad < quads; ++quad) {
        if (quad % kLaneStepQuads == kLaneStepQuads - 1) prefetch.step();
        const typename S::Raw q_low = S::load_raw(reinterpret_cast<const uint16_t*>(q + quad * 2 * W));
        const typename S::Raw q_high = S::load_raw(reinterpret_cast<const uint16_t*>(q + quad * 2 * W + W));
        for (int ti = 0; ti < kLaneTokens; ++ti) {
          const typename S::Raw k = S::raw_set1_64(quad_at(rows[ti] + 4 * quad));
          acc[ti][0] = S::dot_bf16(acc[ti][0], q_low, k);
          acc[ti][1] = S::dot_bf16(acc[ti][1], q_high, k);
        }
      }
      const V scale = S::set1(a.scale);
      float* to = lane_scores_at(c, t0);
      for (int ti = 0; ti < kLaneTokens; ++ti)
        if (ti < n) S::store(to + ti * W, S::mul(scale, S::add_lane_pairs(acc[ti][0], acc[ti][1])));
    }
  }

  // The lane path's scores (then probabilities): [group / W, kTileTokens, W], head chunk c's W heads
  // of one token a vector.
  float* lane_scores_at(int64_t c, int64_t t) const { return scores + (c * kTileTokens + t) * W; }

  // The online softmax with heads in lanes: max, exp and sum run down the tile's token vectors, no
  // horizontal step. A head's running max moves only when the tile passes it by kRescaleSlack (the
  // first tile, or rarely after), and then its output row is rescaled; in the other tiles the exps
  // take the running max as it was, and only a predicted branch, not their operand, waits on the
  // tile's max. Measured on a 2-vCPU Zen 4, one thread, MLA 4K in L3, items of 512 tokens: with the
  // max moved whenever it grew, 17% of the inlined softmax's samples rescaled output rows (16 heads,
  // each a new max in about one tile in k at tile k); with the slack (and the tile's max in four
  // chains, not one), 1.02x there and 1.04x at 8K from DRAM, two threads. Then the probabilities of
  // each token pair as bf16 pairs, one 32-bit word per head (lane_pair_words), the dot's broadcast
  // operand in lane_values.
  void lane_softmax(int64_t count, float* acc) {
    for (int64_t c = 0; c < group / W; ++c) {
      float* row = lane_scores_at(c, 0);
      // four chains in registers (an array indexed t % 4 stayed on the stack)
      V m0 = S::set1(kNegInf), m1 = m0, m2 = m0, m3 = m0;
      int64_t t = 0;
      for (; t + 4 <= count; t += 4) {
        m0 = S::max(m0, S::load(row + t * W));
        m1 = S::max(m1, S::load(row + (t + 1) * W));
        m2 = S::max(m2, S::load(row + (t + 2) * W));
        m3 = S::max(m3, S::load(row + (t + 3) * W));
      }
      for (; t < count; ++t) m0 = S::max(m0, S::load(row + t * W));
      const V tile_max = S::max(S::max(m0, m1), S::max(m2, m3));
      const V old_max = S::load(row_max + c * W);
      // -inf + slack stays -inf: the first tile with a finite score moves the max
      const auto moved = S::greater_lanes(tile_max, S::add(old_max, S::set1(kRescaleSlack)));
      const V new_max = moved ? S::take_lanes(moved, tile_max, old_max) : old_max;
      V sum = S::zero();
      for (int64_t t = 0; t < count; ++t) {
        const V p = S::exp(S::sub(S::load(row + t * W), new_max));
        S::store(row + t * W, p);
        sum = S::add(sum, p);
      }
      if (moved) rescale_lanes(moved, old_max, new_max, acc, c * W);
      S::store(row_sum + c * W, S::add(S::load(row_sum + c * W), sum));
      S::store(row_max + c * W, new_max);
      uint32_t* words = lane_pair_words(c, 0);
      for (int64_t t = 0; t + 2 <= count; t += 2)
        S::store_bf16_pairs(words + t / 2 * W, S::load(row + t * W), S::load(row + (t + 1) * W));
    }
  }

  // [group / W, kTileTokens / 2, W] words: head c W + lane's probabilities of tokens (t, t + 1), bf16.
  uint32_t* lane_pair_words(int64_t c, int64_t t) const {
    return reinterpret_cast<uint32_t*>(p_hi) + (c * (kTileTokens / 2) + t / 2) * W;
  }

  // PV on the lane path: kLaneValueHeads heads x 2W dims at a time, as dot_value_block.
  static constexpr int kLaneValueHeads = 8;

  void lane_values(int64_t count, float* acc, bool first_tile) {
    for (int64_t c = 0; c < group / W; ++c)
      for (int64_t h0 = 0; h0 < W; h0 += kLaneValueHeads)
        for (int64_t d0 = 0; d0 < dim_v; d0 += 2 * W) {
          if (first_tile) lane_value_block<true>(c, h0, d0, count, acc);
          else lane_value_block<false>(c, h0, d0, count, acc);
        }
  }

  template <bool kFirstTile>
  WS_INLINE void lane_value_block(int64_t c, int64_t h0, int64_t d0, int64_t count, float* acc) {
    if constexpr (S::kBf16Dot && std::is_same_v<Kv, Bf16Kv>) {
      constexpr int GT = kLaneValueHeads;
      float* out = acc + (c * W + h0) * dim_v + d0;
      V sum[GT][2];
      WS_UNROLL for (int gi = 0; gi < GT; ++gi)
        WS_UNROLL for (int h = 0; h < 2; ++h) sum[gi][h] = kFirstTile ? S::zero() : S::load(out + gi * dim_v + h * W);
      const uint32_t* p = lane_pair_words(c, 0) + h0;
      int64_t t = 0;
      for (; t + 2 <= count; t += 2) {
        typename S::Raw low, high;
        S::unpack_rows(v_rows[t] + d0, v_rows[t + 1] + d0, low, high);
        WS_UNROLL for (int gi = 0; gi < GT; ++gi) {
          const typename S::Raw probabilities = S::raw_set1(p[t / 2 * W + gi]);
          sum[gi][0] = S::dot_bf16(sum[gi][0], probabilities, low);
          sum[gi][1] = S::dot_bf16(sum[gi][1], probabilities, high);
        }
      }
      if (t < count) {  // a lone last token through FMAs of its float32 probabilities
        V low, high;
        S::unpack_row(v_rows[t] + d0, low, high);
        const float* pt = lane_scores_at(c, t) + h0;
        WS_UNROLL for (int gi = 0; gi < GT; ++gi) {
          sum[gi][0] = S::fma(S::set1(pt[gi]), low, sum[gi][0]);
          sum[gi][1] = S::fma(S::set1(pt[gi]), high, sum[gi][1]);
        }
      }
      WS_UNROLL for (int gi = 0; gi < GT; ++gi)
        WS_UNROLL for (int h = 0; h < 2; ++h) S::store(out + gi * dim_v + h * W, sum[gi][h]);
    }
  }

  static WS_INLINE uint64_t quad_at(const uint16_t* p) {
    uint64_t quad;
    std::memcpy(&quad, p, 8);
    return quad;
  }

  template <int N>
  static WS_INLINE void reduce_scores(const V* acc, float* sums) {
    if constexpr (N % 8 == 0) {
#pragma GCC unroll 4
      for (int i = 0; i < N; i += 8)
        S::reduce_add_8(acc[i], acc[i + 1], acc[i + 2], acc[i + 3], acc[i + 4], acc[i + 5], acc[i + 6], acc[i + 7],
                        sums + i);
    } else {
      for (int i = 0; i < N; ++i) sums[i] = S::reduce_add(acc[i]);
    }
  }

  void update_softmax(int64_t count, float* acc) {
    online_softmax<S>(scores, kTileTokens, group, count, row_max, row_sum, acc, dim_v, bf16_dot ? p_hi : nullptr);
  }

  template <int GT, int NV>
  WS_INLINE void value_block(int64_t g0, int64_t d0, int64_t count, float* acc) {
    V sum[GT][NV];
    for (int gi = 0; gi < GT; ++gi)
      for (int vi = 0; vi < NV; ++vi) sum[gi][vi] = S::load(acc + (g0 + gi) * dim_v + d0 + vi * W);
    for (int64_t t = 0; t < count; ++t) {
      V vv[NV];
      for (int vi = 0; vi < NV; ++vi) vv[vi] = Kv::template vec<S>(v_rows[t] + d0 + vi * W);
      for (int gi = 0; gi < GT; ++gi) {
        const V p = S::set1(scores[(g0 + gi) * kTileTokens + t]);
        for (int vi = 0; vi < NV; ++vi) sum[gi][vi] = S::fma(p, vv[vi], sum[gi][vi]);
      }
    }
    for (int gi = 0; gi < GT; ++gi)
      for (int vi = 0; vi < NV; ++vi) S::store(acc + (g0 + gi) * dim_v + d0 + vi * W, sum[gi][vi]);
  }

  // GT heads x NC chunks of 2W dims, V widened a pair at a time (the accumulators in split order).
  template <int GT, int NC>
  WS_INLINE void value_block_split(int64_t g0, int64_t d0, int64_t count, float* acc) {
    V sum[GT][NC][2];
    for (int gi = 0; gi < GT; ++gi)
      for (int c = 0; c < NC; ++c)
        for (int h = 0; h < 2; ++h) sum[gi][c][h] = S::load(acc + (g0 + gi) * dim_v + d0 + c * 2 * W + h * W);
    for (int64_t t = 0; t < count; ++t) {
      V even[NC], odd[NC];
      for (int c = 0; c < NC; ++c) S::load_pairs_bf16(v_rows[t] + d0 + c * 2 * W, W, even[c], odd[c]);
      for (int gi = 0; gi < GT; ++gi) {
        const V p = S::set1(scores[(g0 + gi) * kTileTokens + t]);
        for (int c = 0; c < NC; ++c) {
          sum[gi][c][0] = S::fma(p, even[c], sum[gi][c][0]);
          sum[gi][c][1] = S::fma(p, odd[c], sum[gi][c][1]);
        }
      }
    }
    for (int gi = 0; gi < GT; ++gi)
      for (int c = 0; c < NC; ++c)
        for (int h = 0; h < 2; ++h) S::store(acc + (g0 + gi) * dim_v + d0 + c * 2 * W + h * W, sum[gi][c][h]);
  }

  template <int GT>
  void value_heads(int64_t g0, int64_t count, float* acc) {
    constexpr int NV = kValueAccumulators / GT > 4 ? 4 : kValueAccumulators / GT;
    const int64_t vec_end = dim_v - dim_v % W;
    int64_t d = 0;
    if constexpr (kSplitPairs) {
      constexpr int NC = NV / 2 > 0 ? NV / 2 : 1;
      for (; d + NC * 2 * W <= split_v; d += NC * 2 * W) value_block_split<GT, NC>(g0, d, count, acc);
      for (; d < split_v; d += 2 * W) value_block_split<GT, 1>(g0, d, count, acc);
    }
    for (; d + NV * W <= vec_end; d += NV * W) value_block<GT, NV>(g0, d, count, acc);
    for (; d < vec_end; d += W) value_block<GT, 1>(g0, d, count, acc);
    for (; d < dim_v; ++d) {
      for (int gi = 0; gi < GT; ++gi) {
        float s = acc[(g0 + gi) * dim_v + d];
        for (int64_t t = 0; t < count; ++t)
          s += scores[(g0 + gi) * kTileTokens + t] * Kv::one(v_rows[t] + d);
        acc[(g0 + gi) * dim_v + d] = s;
      }
    }
  }

  // PV through the bf16 dot (the dot path: bf16 q and KV, the dot measured faster). As in the
  // paired kernel, P is rounded to bf16 once (relative error <= 2^-9 each, the sums stay float32);
  // two token rows' 32 dims are put in [dim][2] pairs in registers, the dot's operand, and a token
  // pair's two probabilities are one 32-bit word to broadcast: one dot per head and 16 dims of two
  // tokens, where the FMA path takes two FMAs plus the widening. Output dims stay in natural order.
  // Measured on a 2-vCPU Zen 4, MLA, interleaved with the FMA values: 1.27x at 8K, 1.30x at 32K.
  void dot_values(int64_t count, float* acc) {
    if constexpr (S::kBf16Dot && std::is_same_v<Kv, Bf16Kv>) {
      int64_t g = 0;  // the probabilities in bf16: rounded by update_softmax
      for (; g + kValueHeadTile <= group; g += kValueHeadTile) dot_value_heads<kValueHeadTile>(g, count, acc);
      for (; g + 4 <= group; g += 4) dot_value_heads<4>(g, count, acc);
      for (; g + 2 <= group; g += 2) dot_value_heads<2>(g, count, acc);
      for (; g < group; ++g) dot_value_heads<1>(g, count, acc);
    }
  }

  template <int GT>
  void dot_value_heads(int64_t g0, int64_t count, float* acc) {
    constexpr int kDims = 2 * W;  // one pair_rows
    int64_t d = 0;
    for (; d + kDims <= dim_v; d += kDims) dot_value_block<GT>(g0, d, count, acc);
    for (; d + W <= dim_v; d += W) value_block<GT, 1>(g0, d, count, acc);
    for (; d < dim_v; ++d) {
      for (int gi = 0; gi < GT; ++gi) {
        float s = acc[(g0 + gi) * dim_v + d];
        for (int64_t t = 0; t < count; ++t) s += scores[(g0 + gi) * kTileTokens + t] * Kv::one(v_rows[t] + d);
        acc[(g0 + gi) * dim_v + d] = s;
      }
    }
  }

  // GT heads x 2W dims from d0 over the tile's token pairs; a lone last token through FMAs of its
  // float32 probability.
  template <int GT>
  WS_INLINE void dot_value_block(int64_t g0, int64_t d0, int64_t count, float* acc) {
    if constexpr (S::kBf16Dot && std::is_same_v<Kv, Bf16Kv>) {
      V sum[GT][2];
      for (int gi = 0; gi < GT; ++gi)
        for (int h = 0; h < 2; ++h) sum[gi][h] = S::load(acc + (g0 + gi) * dim_v + d0 + h * W);
      // head g0 + gi's token pair (t, t + 1) at p[gi * kTileTokens / 2 + t / 2]
      const uint32_t* p = reinterpret_cast<const uint32_t*>(p_hi + g0 * kTileTokens);
      int64_t t = 0;
      for (; t + 2 <= count; t += 2) {
        typename S::Raw low, high;
        S::unpack_rows(v_rows[t] + d0, v_rows[t + 1] + d0, low, high);
        for (int gi = 0; gi < GT; ++gi) {
          const typename S::Raw probabilities = S::raw_set1(p[gi * (kTileTokens / 2) + t / 2]);
          sum[gi][0] = S::dot_bf16(sum[gi][0], probabilities, low);
          sum[gi][1] = S::dot_bf16(sum[gi][1], probabilities, high);
        }
      }
      if (t < count) {
        V low, high;
        S::unpack_row(v_rows[t] + d0, low, high);
        for (int gi = 0; gi < GT; ++gi) {
          const V pt = S::set1(scores[(g0 + gi) * kTileTokens + t]);
          sum[gi][0] = S::fma(pt, low, sum[gi][0]);
          sum[gi][1] = S::fma(pt, high, sum[gi][1]);
        }
      }
      for (int gi = 0; gi < GT; ++gi)
        for (int h = 0; h < 2; ++h) S::store(acc + (g0 + gi) * dim_v + d0 + h * W, sum[gi][h]);
    }
  }

  void accumulate_values(int64_t count, float* acc) {
    int64_t g = 0;
    for (; g + kValueHeadTile <= group; g += kValueHeadTile) value_heads<kValueHeadTile>(g, count, acc);
    for (; g + 4 <= group; g += 4) value_heads<4>(g, count, acc);
    for (; g + 2 <= group; g += 2) value_heads<2>(g, count, acc);
    for (; g < group; ++g) value_heads<1>(g, count, acc);
  }
};

}  // namespace
}  // namespace writescope

#include "writescope/paired_kernel.h"  // the paired layout's kernel and attend_item, the dispatch
