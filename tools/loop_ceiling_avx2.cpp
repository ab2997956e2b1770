// The paired kernel's AVX2 score loop, bare: what its shape can reach on this core, and what each of
// its costs takes from that. Built and run by tools/bench_loop_ceiling.py, which checks every loop's
// scores against a reference before it trusts a rate.
//
// One call = one score step of the kernel (cpp/include/writescope/paired_kernel.h, score_step): 64
// dim pairs (128 dims) of bf16 K in the paired block layout [pair][16 tokens][2], times q
// [pair][head][2] of 4 heads, over 2 or 3 vectors of 8 tokens. The loops:
//   kernel          4 heads x 2 token vectors as the kernel runs them: per dim pair 2 K loads,
//                   widened by a shift and a mask, 8 q broadcasts, 16 FMAs in 8 chains of two
//   k_once          the same with each K vector loaded once (GCC otherwise loads it again as the
//                   mask's memory operand)
//   phased_4x3      4 heads x 3 token vectors, the even dims of the pair first and then the odd
//                   ones: 12 accumulators of one FMA per phase, 6 K loads and 8 broadcasts per 24 FMAs
// and, between them in every round, fma_peak: 12 independent register-only FMA chains, as the
// extension's fma_peak probe runs them (the core's peak).
// Output: one JSON object on stdout (rates, one call's scores per loop, and the inputs they came from).
#include <immintrin.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

namespace {

constexpr int kPairs = 64;
constexpr int kBlockTokens = 16;                      // the engine's block: 2 token vectors a pair
constexpr int kPairElements = kBlockTokens * 2;       // bf16 values in one pair's row of a block
constexpr int kBlockElements = kPairs * kPairElements;  // one block's K, 4 KiB
constexpr int kRegionElements = 2 * kBlockElements;   // the blocks a call reads (the 4 x 3 loop's third
                                                      // token vector is the next block's first)
constexpr int kHeads = 4;

alignas(64) float g_q[kPairs * kHeads * 2];  // [pair][head][even, odd]
alignas(64) float g_out[kHeads * 3 * 8];     // the last call's scores [head][token], 24 tokens a head

inline __m256 even_of(__m256i w) { return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16)); }
inline __m256 odd_of(__m256i w) {
  return _mm256_castsi256_ps(_mm256_and_si256(w, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
}
inline __m256i load_words(const uint16_t* p) { return _mm256_load_si256(reinterpret_cast<const __m256i*>(p)); }

// Accumulators a (token vector 0) and b (token vector 1) of one head, each a chain of two FMAs a pair.
#define HEAD_STEP(a, b, qe, qo)                                          \
  {                                                                        \
    a = _mm256_fmadd_ps(qo, o0, _mm256_fmadd_ps(qe, e0, a));               \
    b = _mm256_fmadd_ps(qo, o1, _mm256_fmadd_ps(qe, e1, b));               \
  }
#define STORE_4X2()                                                          \
  {                                                                          \
    const __m256 acc[8] = {a0, a1, a2, a3, a4, a5, a6, a7};                  \
    for (int h = 0; h < kHeads; ++h)                                         \
      for (int t = 0; t < 2; ++t) _mm256_storeu_ps(g_out + h * 24 + t * 8, acc[h * 2 + t]); \
  }

template <bool kLoadOnce>
__attribute__((noinline)) void kernel_loop(const uint16_t* k) {
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
  const float* q = g_q;
  for (int p = 0; p < kPairs; ++p, q += kHeads * 2, k += kPairElements) {
    __m256i w0 = load_words(k), w1 = load_words(k + 16);
    if constexpr (kLoadOnce) asm("" : "+x"(w0), "+x"(w1));
    const __m256 e0 = even_of(w0), o0 = odd_of(w0), e1 = even_of(w1), o1 = odd_of(w1);
    HEAD_STEP(a0, a1, _mm256_broadcast_ss(q + 0), _mm256_broadcast_ss(q + 1))
    HEAD_STEP(a2, a3, _mm256_broadcast_ss(q + 2), _mm256_broadcast_ss(q + 3))
    HEAD_STEP(a4, a5, _mm256_broadcast_ss(q + 4), _mm256_broadcast_ss(q + 5))
    HEAD_STEP(a6, a7, _mm256_broadcast_ss(q + 6), _mm256_broadcast_ss(q + 7))
  }
  STORE_4X2()
}

// The odd half by two shifts, not a mask: no register holds a constant, so 12 accumulators, 3
// widened vectors and a broadcast fit the 16 registers without a spill.
inline __m256 odd_by_shifts(const uint16_t* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_srli_epi32(load_words(p), 16), 16));
}

__attribute__((noinline)) void phased_4x3_loop(const uint16_t* k) {
  __m256 acc[12];
  for (auto& a : acc) a = _mm256_setzero_ps();
  const float* q = g_q;
  for (int p = 0; p < kPairs; ++p, q += kHeads * 2, k += kPairElements) {
    {
      const __m256 e0 = even_of(load_words(k)), e1 = even_of(load_words(k + 16));
      const __m256 e2 = even_of(load_words(k + kBlockElements));
      for (int h = 0; h < kHeads; ++h) {
        const __m256 qe = _mm256_broadcast_ss(q + 2 * h);
        acc[3 * h] = _mm256_fmadd_ps(qe, e0, acc[3 * h]);
        acc[3 * h + 1] = _mm256_fmadd_ps(qe, e1, acc[3 * h + 1]);
        acc[3 * h + 2] = _mm256_fmadd_ps(qe, e2, acc[3 * h + 2]);
      }
    }
    const __m256 o0 = odd_by_shifts(k), o1 = odd_by_shifts(k + 16), o2 = odd_by_shifts(k + kBlockElements);
    for (int h = 0; h < kHeads; ++h) {
      const __m256 qo = _mm256_broadcast_ss(q + 2 * h + 1);
      acc[3 * h] = _mm256_fmadd_ps(qo, o0, acc[3 * h]);
      acc[3 * h + 1] = _mm256_fmadd_ps(qo, o1, acc[3 * h + 1]);
      acc[3 * h + 2] = _mm256_fmadd_ps(qo, o2, acc[3 * h + 2]);
    }
  }
  for (int h = 0; h < kHeads; ++h)
    for (int t = 0; t < 3; ++t) _mm256_storeu_ps(g_out + h * 24 + t * 8, acc[3 * h + t]);
}

constexpr int kPeakChains = 12, kPeakSteps = 512;  // long enough that the final sum costs < 1%
__attribute__((noinline)) void fma_peak_loop(const uint16_t*) {
  __m256 acc[kPeakChains];
  for (int i = 0; i < kPeakChains; ++i) acc[i] = _mm256_set1_ps(static_cast<float>(i));
  const __m256 x = _mm256_set1_ps(0.999f), y = _mm256_set1_ps(1e-3f);
  for (int step = 0; step < kPeakSteps; ++step)
    for (auto& a : acc) a = _mm256_fmadd_ps(a, x, y);
  __m256 sum = acc[0];
  for (int i = 1; i < kPeakChains; ++i) sum = _mm256_add_ps(sum, acc[i]);
  _mm256_storeu_ps(g_out, sum);
}

struct Loop {
  const char* name;
  void (*fn)(const uint16_t*);
  double flops_per_call;
  int token_vectors;  // scores written to g_out (0: not a score)
};

uint32_t g_state = 12345;
uint32_t next_random() {
  g_state ^= g_state << 13;
  g_state ^= g_state >> 17;
  g_state ^= g_state << 5;
  return g_state;
}
// A bf16 value in [-2, 2), exactly representable (7 bits of mantissa, a small exponent range).
uint16_t random_bf16() {
  const float x = (static_cast<float>(next_random() % 4096) - 2048.0f) / 1024.0f;
  uint32_t bits;
  std::memcpy(&bits, &x, 4);
  return static_cast<uint16_t>(bits >> 16);
}

double rate_gflops(const Loop& loop, const uint16_t* k, int regions, long calls) {
  const auto begin = std::chrono::steady_clock::now();
  for (long i = 0, region = 0; i < calls; ++i, region = region + 1 == regions ? 0 : region + 1)
    loop.fn(k + region * kRegionElements);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - begin).count();
  return loop.flops_per_call * calls / seconds / 1e9;
}

double median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  return values[values.size() / 2];
}

}  // namespace

// Each round times every loop with K in L1 (one region) and from L2 (REGIONS_L2 regions in turn),
// and the FMA burst between them: a loop's share of the peak is taken within its round, so the
// host's drift between rounds falls on both alike.
int main(int argc, char** argv) {
  if (argc != 4) {
    std::fprintf(stderr, "usage: %s ROUNDS CALLS_PER_ROUND REGIONS_L2\n", argv[0]);
    return 2;
  }
  const int rounds = std::atoi(argv[1]);
  const long calls = std::atol(argv[2]);
  const int l2_regions = std::atoi(argv[3]);
  if (rounds < 1 || calls < 1 || l2_regions < 2) {
    std::fprintf(stderr, "ROUNDS and CALLS_PER_ROUND must be >= 1 and REGIONS_L2 >= 2\n");
    return 2;
  }
  std::vector<uint16_t> storage(static_cast<size_t>(l2_regions) * kRegionElements + 32);
  uint16_t* k = reinterpret_cast<uint16_t*>((reinterpret_cast<uintptr_t>(storage.data()) + 63) & ~uintptr_t(63));
  for (long i = 0; i < static_cast<long>(l2_regions) * kRegionElements; ++i) k[i] = random_bf16();
  for (auto& x : g_q) x = (static_cast<float>(next_random() % 2048) - 1024.0f) / 4096.0f;

  const double fma_flops = 2.0 * 8;  // one FMA: 8 lanes of a multiply and an add
  const Loop peak{"fma_peak", fma_peak_loop, double(kPeakChains) * kPeakSteps * fma_flops, 0};
  const Loop loops[] = {
      {"kernel", kernel_loop<false>, 16 * fma_flops * kPairs, 2},
      {"k_once", kernel_loop<true>, 16 * fma_flops * kPairs, 2},
      {"phased_4x3", phased_4x3_loop, 24 * fma_flops * kPairs, 3},
  };
  constexpr int kLoops = sizeof(loops) / sizeof(loops[0]);
  std::vector<double> peak_rates;
  std::vector<std::vector<double>> l1(kLoops), l2(kLoops), l1_share(kLoops), l2_share(kLoops);
  for (int r = 0; r < rounds; ++r) {
    const double peak_rate = rate_gflops(peak, k, 1, calls / 8 + 1);
    peak_rates.push_back(peak_rate);
    for (int l = 0; l < kLoops; ++l) {
      l1[l].push_back(rate_gflops(loops[l], k, 1, calls));
      l2[l].push_back(rate_gflops(loops[l], k, l2_regions, calls));
      l1_share[l].push_back(l1[l].back() / peak_rate);
      l2_share[l].push_back(l2[l].back() / peak_rate);
    }
  }

  std::printf("{\"fma_peak_gflops\": %.3f, \"loops\": [", median(peak_rates));
  for (int l = 0; l < kLoops; ++l) {
    loops[l].fn(k);  // the first region's scores, for the reference check
    std::printf("%s{\"name\": \"%s\", \"l1_gflops\": %.3f, \"l2_gflops\": %.3f, \"l1_of_peak\": %.4f, "
                "\"l2_of_peak\": %.4f, \"token_vectors\": %d, \"scores\": [",
                l ? ", " : "", loops[l].name, median(l1[l]), median(l2[l]), median(l1_share[l]), median(l2_share[l]),
                loops[l].token_vectors);
    for (int i = 0; i < kHeads * loops[l].token_vectors * 8; ++i) {
      const int h = i / (loops[l].token_vectors * 8), t = i % (loops[l].token_vectors * 8);
      std::printf("%s%.9g", i ? ", " : "", g_out[h * 24 + t]);
    }
    std::printf("]}");
  }
  std::printf("], \"q\": [");
  for (int i = 0; i < kPairs * kHeads * 2; ++i) std::printf("%s%.9g", i ? ", " : "", g_q[i]);
  std::printf("], \"k\": [");
  for (int i = 0; i < kRegionElements; ++i) std::printf("%s%u", i ? ", " : "", static_cast<unsigned>(k[i]));
  std::printf("], \"pairs\": %d, \"block_tokens\": %d, \"heads\": %d}\n", kPairs, kBlockTokens, kHeads);
  return 0;
}
