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
#include <limits>

#include "writescope/kernel_args.h"
#include "writescope/simd_scalar.h"

namespace writescope {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

template <class T> struct KvLoad;
template <> struct KvLoad<float> {
  template <class S> static typename S::V vec(const float* p, bool) { return S::load(p); }
  static float one(const float* p, bool) { return *p; }
};
template <> struct KvLoad<uint16_t> {
  template <class S> static typename S::V vec(const uint16_t* p, bool is_bf16) {
    return S::load(p, is_bf16);
  }
  static float one(const uint16_t* p, bool is_bf16) {
    return is_bf16 ? bf16_bits_to_float(*p) : fp16_bits_to_float(*p);
  }
};

inline float load_q(const void* base, DType dtype, int64_t index) {
  switch (dtype) {
    case DType::kFloat32: return static_cast<const float*>(base)[index];
    case DType::kBFloat16: return bf16_bits_to_float(static_cast<const uint16_t*>(base)[index]);
    case DType::kFloat16: return fp16_bits_to_float(static_cast<const uint16_t*>(base)[index]);
  }
  return 0.0f;
}

template <class S, class T>
struct ItemKernel {
  using V = typename S::V;
  static constexpr int W = S::kWidth;
  // Register blocking: score tiles of kScoreAccumulators (heads x tokens), PV tiles of
  // kPvHeads x kPvVectors accumulators; chosen so accumulators + operands fit the register file.
  // Wider head tiles convert each loaded K/V vector once for more FMAs.
  static constexpr int kHeadTile = S::kRegisters >= 32 ? 8 : 4;
  static constexpr int kScoreAccumulators = S::kRegisters >= 32 ? 16 : 8;
  static constexpr int kValueAccumulators = S::kRegisters >= 32 ? 16 : 8;

  const PagedAttentionArgs& a;
  const bool is_bf16;
  const int64_t group, dim_qk, dim_v;
  float* q32;     // [group, dim_qk], pre-scaled
  float* scores;  // [group, kTileTokens]: scores, then probabilities
  float* row_max;  // [group]
  float* row_sum;  // [group]
  const T** k_rows;  // [kTileTokens]
  const T** v_rows;  // [kTileTokens]

  ItemKernel(const PagedAttentionArgs& args, Workspace ws)
      : a(args),
        is_bf16(args.kv_dtype == DType::kBFloat16),
        group(args.num_q_heads / args.num_kv_heads),
        dim_qk(args.head_dim_qk),
        dim_v(args.head_dim_v) {
    char* p = static_cast<char*>(ws.data);
    q32 = reinterpret_cast<float*>(p);
    p += group * dim_qk * 4;
    scores = reinterpret_cast<float*>(p);
    p += group * kTileTokens * 4;
    row_max = reinterpret_cast<float*>(p);
    p += group * 4;
    row_sum = reinterpret_cast<float*>(p);
    p += group * 4;
    p = reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(p) + 63) & ~uintptr_t(63));
    k_rows = reinterpret_cast<const T**>(p);
    v_rows = k_rows + kTileTokens;
  }

  void run(const WorkItem& item) {
    load_queries(item);
    for (int64_t i = 0; i < group * dim_v; ++i) item.out[i] = 0.0f;
    for (int64_t g = 0; g < group; ++g) {
      row_max[g] = kNegInf;
      row_sum[g] = 0.0f;
    }
    for (int64_t begin = item.token_begin; begin < item.token_end; begin += kTileTokens) {
      const int64_t count = item.token_end - begin < kTileTokens ? item.token_end - begin : kTileTokens;
      gather_rows(item, begin, count);
      compute_scores(count);
      update_softmax(count, item.out);
      accumulate_values(count, item.out);
    }
    for (int64_t g = 0; g < group; ++g) {
      const float inv = 1.0f / row_sum[g];
      for (int64_t d = 0; d < dim_v; ++d) item.out[g * dim_v + d] *= inv;
      item.lse[g] = row_max[g] + std::log(row_sum[g]);
    }
  }

  void load_queries(const WorkItem& item) {
    const int64_t first_head = item.kv_head * group;
    for (int64_t g = 0; g < group; ++g) {
      const int64_t base = item.seq * a.q_seq_stride + (first_head + g) * a.q_head_stride;
      for (int64_t d = 0; d < dim_qk; ++d) q32[g * dim_qk + d] = load_q(a.q, a.q_dtype, base + d) * a.scale;
    }
  }

  // Asking for a whole tile's lines at once keeps many misses in flight, where the hardware
  // prefetcher alone leaves the kernel waiting on memory latency.
  static void prefetch_row(const T* row, int64_t dim) {
    const char* bytes = reinterpret_cast<const char*>(row);
    for (int64_t offset = 0; offset < dim * static_cast<int64_t>(sizeof(T)); offset += 64)
      __builtin_prefetch(bytes + offset, 0, 3);
  }

  // Row pointers of the tile's tokens, walking the block table without a division per token.
  // Prefetching the whole tile here measured faster than prefetching the next tile ahead.
  void gather_rows(const WorkItem& item, int64_t begin, int64_t count) {
    const int32_t* table = a.block_table + item.seq * a.block_table_stride;
    int64_t block = begin / a.block_size;
    int64_t offset = begin % a.block_size;
    const T* k_base = static_cast<const T*>(a.k) + item.kv_head * a.k_head_stride;
    const T* v_base = static_cast<const T*>(a.v) + item.kv_head * a.v_head_stride;
    for (int64_t t = 0; t < count; ++t) {
      const int64_t physical = table[block];
      k_rows[t] = k_base + physical * a.k_block_stride + offset * a.k_token_stride;
      v_rows[t] = v_base + physical * a.v_block_stride + offset * a.v_token_stride;
      prefetch_row(k_rows[t], dim_qk);
      prefetch_row(v_rows[t], dim_v);
      if (++offset == a.block_size) {
        offset = 0;
        ++block;
      }
    }
  }

  template <int GT, int TT>
  void score_block(int64_t g0, int64_t t0) {
    V acc[GT * TT];
    for (int i = 0; i < GT * TT; ++i) acc[i] = S::zero();
    const int64_t vec_end = dim_qk - dim_qk % W;
    for (int64_t d = 0; d < vec_end; d += W) {
      V kv[TT];
      for (int ti = 0; ti < TT; ++ti) kv[ti] = KvLoad<T>::template vec<S>(k_rows[t0 + ti] + d, is_bf16);
      for (int gi = 0; gi < GT; ++gi) {
        const V qv = S::load(q32 + (g0 + gi) * dim_qk + d);
        for (int ti = 0; ti < TT; ++ti) acc[gi * TT + ti] = S::fma(qv, kv[ti], acc[gi * TT + ti]);
      }
    }
    float sums[GT * TT];
    int done = 0;
    for (; done + 8 <= GT * TT; done += 8) S::reduce_add_8(acc + done, sums + done);
    for (; done < GT * TT; ++done) sums[done] = S::reduce_add(acc[done]);
    for (int gi = 0; gi < GT; ++gi) {
      for (int ti = 0; ti < TT; ++ti) {
        float s = sums[gi * TT + ti];
        for (int64_t d = vec_end; d < dim_qk; ++d)
          s += q32[(g0 + gi) * dim_qk + d] * KvLoad<T>::one(k_rows[t0 + ti] + d, is_bf16);
        scores[(g0 + gi) * kTileTokens + t0 + ti] = s;
      }
    }
  }

  // GT heads x kScoreAccumulators / GT tokens per block: whole groups of eight horizontal sums.
  template <int GT>
  void score_heads(int64_t g0, int64_t count) {
    constexpr int TT = kScoreAccumulators / GT;
    int64_t t = 0;
    for (; t + TT <= count; t += TT) score_block<GT, TT>(g0, t);
    for (; t < count; ++t) score_block<GT, 1>(g0, t);
  }

  void compute_scores(int64_t count) {
    int64_t g = 0;
    for (; g + kHeadTile <= group; g += kHeadTile) score_heads<kHeadTile>(g, count);
    for (; g + 4 <= group; g += 4) score_heads<4>(g, count);
    for (; g + 2 <= group; g += 2) score_heads<2>(g, count);
    for (; g < group; ++g) score_heads<1>(g, count);
  }

  // Online softmax: new running max, rescale the running sum and accumulator, probabilities.
  void update_softmax(int64_t count, float* acc) {
    const int64_t padded = (count + W - 1) / W * W;
    for (int64_t g = 0; g < group; ++g) {
      float* row = scores + g * kTileTokens;
      for (int64_t t = count; t < padded; ++t) row[t] = kNegInf;  // exp -> 0 in the padding
      V vmax = S::set1(kNegInf);
      for (int64_t t = 0; t < padded; t += W) vmax = S::max(vmax, S::load(row + t));
      const float tile_max = S::reduce_max(vmax);
      const float new_max = tile_max > row_max[g] ? tile_max : row_max[g];
      const V shift = S::set1(new_max);
      V vsum = S::zero();
      for (int64_t t = 0; t < padded; t += W) {
        const V p = S::exp(S::sub(S::load(row + t), shift));
        S::store(row + t, p);
        vsum = S::add(vsum, p);
      }
      if (new_max != row_max[g]) {
        const float alpha = row_max[g] == kNegInf ? 0.0f : std::exp(row_max[g] - new_max);
        row_sum[g] *= alpha;
        float* out = acc + g * dim_v;
        for (int64_t d = 0; d < dim_v; ++d) out[d] *= alpha;
        row_max[g] = new_max;
      }
      row_sum[g] += S::reduce_add(vsum);
    }
  }

  template <int GT, int NV>
  void value_block(int64_t g0, int64_t d0, int64_t count, float* acc) {
    V sum[GT][NV];
    for (int gi = 0; gi < GT; ++gi)
      for (int vi = 0; vi < NV; ++vi) sum[gi][vi] = S::load(acc + (g0 + gi) * dim_v + d0 + vi * W);
    for (int64_t t = 0; t < count; ++t) {
      V vv[NV];
      for (int vi = 0; vi < NV; ++vi) vv[vi] = KvLoad<T>::template vec<S>(v_rows[t] + d0 + vi * W, is_bf16);
      for (int gi = 0; gi < GT; ++gi) {
        const V p = S::set1(scores[(g0 + gi) * kTileTokens + t]);
        for (int vi = 0; vi < NV; ++vi) sum[gi][vi] = S::fma(p, vv[vi], sum[gi][vi]);
      }
    }
    for (int gi = 0; gi < GT; ++gi)
      for (int vi = 0; vi < NV; ++vi) S::store(acc + (g0 + gi) * dim_v + d0 + vi * W, sum[gi][vi]);
  }

  template <int GT>
  void value_heads(int64_t g0, int64_t count, float* acc) {
    constexpr int NV = kValueAccumulators / GT > 4 ? 4 : kValueAccumulators / GT;
    const int64_t vec_end = dim_v - dim_v % W;
    int64_t d = 0;
    for (; d + NV * W <= vec_end; d += NV * W) value_block<GT, NV>(g0, d, count, acc);
    for (; d < vec_end; d += W) value_block<GT, 1>(g0, d, count, acc);
    for (; d < dim_v; ++d) {
      for (int gi = 0; gi < GT; ++gi) {
        float s = acc[(g0 + gi) * dim_v + d];
        for (int64_t t = 0; t < count; ++t)
          s += scores[(g0 + gi) * kTileTokens + t] * KvLoad<T>::one(v_rows[t] + d, is_bf16);
        acc[(g0 + gi) * dim_v + d] = s;
      }
    }
  }

  void accumulate_values(int64_t count, float* acc) {
    int64_t g = 0;
    for (; g + kHeadTile <= group; g += kHeadTile) value_heads<kHeadTile>(g, count, acc);
    for (; g + 4 <= group; g += 4) value_heads<4>(g, count, acc);
    for (; g + 2 <= group; g += 2) value_heads<2>(g, count, acc);
    for (; g < group; ++g) value_heads<1>(g, count, acc);
  }
};

template <class S>
void attend_item(const PagedAttentionArgs& args, const WorkItem& item, Workspace ws) {
  if (args.kv_dtype == DType::kFloat32) {
    ItemKernel<S, float>(args, ws).run(item);
  } else {
    ItemKernel<S, uint16_t>(args, ws).run(item);
  }
}

}  // namespace
}  // namespace writescope
