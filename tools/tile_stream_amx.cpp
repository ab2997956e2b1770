// MLA's tile loop on the AMX tiles, bare, reading a latent region from DRAM tile by tile while it
// asks for the next tile's lines; or a plain read of the same region. Built and run by
// tools/bench_tile_stream.py, which checks one tile's scores and values against numpy before it
// trusts a rate.
//
// The loop is the kernel's (cpp/include/writescope/attention_kernel.h, amx_latent_groups and
// amx_value_products) for DeepSeek-V2-Lite's shape: 16 heads on one latent of 576 dims, V its first
// 512. A tile is 64 tokens, 64 x 1152 bytes in a row of memory:
//   scores  the dims from the last 32 down, each 32-dim chunk's q^T [16 dim pairs, 16 heads, 2] in
//           tile 4 or 5 serving the 4 groups of 16 tokens: K tile (16 rows 1152 bytes apart) in 6
//           or 7, one product into accumulator 0..3 per group; 72 products, then the 4 stores.
//   values  out [16 heads, 512 dims] (each 32-dim chunk as its 16 even dims then its 16 odd) +=
//           P x V: per pair of chunks the 4 accumulators loaded, per group P's even and odd words
//           (tiles 4, 5) and each chunk's V tile (6, 7), 4 products; the 4 accumulators stored.
//           128 products. P is a fixed input here (no softmax, which reads no memory).
//   asking  the next tile's lines, a step at every score product and every V tile load (136 steps
//           a tile; 72 for the scores alone) as the kernel steps its prefetcher (PREFETCH, below),
//           and one line a page of the tile after it (the kernel's page touches), once the scores'
//           products are issued.
// PREFETCH: rows (the kernel's way: the tile's 128 row slots, K and V alternately, V none for MLA,
// spread evenly over the steps: a K row's 18 lines every other step), loads (the same lines, each
// read by a load whose value goes unused), lines (the tile's lines spread evenly over the steps),
// every2 / every4 (every second / fourth of them), heads2 (the first two lines of each 4 KB page),
// none.
//
// Usage: tile_stream_amx MODE PREFETCH PV REGION_MIB
//   MODE read | loop; PV 1 | 0 (0: the scores only).
// One pass over the region to warm up, then one timed pass. Output: one JSON object on stdout with
// the timed pass's GB/s and microseconds a tile; for the loop also tile 0's scores [64 tokens, 16
// heads] and values [16 heads, 512 dims in split-pair order] computed afterwards on their own.
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

namespace {

constexpr int kHeads = 16, kLatent = 576, kValueDims = 512, kTileTokens = 64;
constexpr int64_t kRowBytes = kLatent * 2, kTileBytes = kTileTokens * kRowBytes;
constexpr int64_t kTileLines = kTileBytes / 64;
static_assert(kTileBytes % 4096 == 0, "tiles are whole pages of a page-aligned region");

// Exactly representable inputs, so the products and their float32 sums are exact: K and V k / 16
// for k in [-8, 8], q k / 8 for k in [-4, 4], P k / 8 for k in [1, 8]. bench_tile_stream.py
// generates the same from the same hash.
uint32_t mix(uint64_t i) { return static_cast<uint32_t>((i * 2654435761ull) & 0xFFFFFFFFull); }
uint16_t bf16_of(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, 4);
  return static_cast<uint16_t>(bits >> 16);  // exact for these values
}
float latent_value(uint64_t i) { return static_cast<float>(static_cast<int>((mix(i) >> 16) % 17) - 8) / 16.0f; }
float query_value(uint64_t i) { return static_cast<float>(static_cast<int>((mix(i + 7) >> 16) % 9) - 4) / 8.0f; }
float probability_value(uint64_t i) { return static_cast<float>(static_cast<int>((mix(i + 13) >> 16) % 8) + 1) / 8.0f; }

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

double now_s() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

enum class Ask { kRows, kLoads, kLines, kEvery2, kEvery4, kHeads2, kNone };

// The next tile's lines, a step at a time (one step a tile product).
struct Asker {
  Ask mode = Ask::kNone;
  int64_t steps = 1;  // a tile's steps: each asks for its share of the tile
  const char* tile = nullptr;  // null: nothing to ask for
  int64_t step = 0;
  static int64_t share(int64_t total, int64_t steps) { return (total + steps - 1) / steps; }
  void start(const char* next) { tile = next, step = 0; }
  static void line(const char* p) { _mm_prefetch(p, _MM_HINT_T1); }
  // A load whose value nothing uses: it holds a fill buffer as a prefetch does, but it is a demand
  // access, which trains the L2's streamer the way a plain read does.
  static void touch(const char* p) { asm volatile("" : : "r"(*static_cast<const volatile char*>(p))); }
  inline void next_step() {
    if (tile == nullptr) return;
    const int64_t s = step++;
    switch (mode) {
      case Ask::kRows:    // the kernel's row slots, K and V alternately (V none: it is K's prefix)
      case Ask::kLoads: {  // the same lines, loaded
        const int64_t slots = share(2 * kTileTokens, steps);
        for (int64_t slot = s * slots; slot < (s + 1) * slots && slot < 2 * kTileTokens; ++slot)
          if (slot % 2 == 0)
            for (int64_t l = 0; l < kRowBytes / 64; ++l) {
              const char* p = tile + (slot / 2) * kRowBytes + l * 64;
              if (mode == Ask::kRows) line(p);
              else touch(p);
            }
        break;
      }
      case Ask::kLines:
      case Ask::kEvery2:
      case Ask::kEvery4: {
        const int64_t span = share(kTileLines, steps);
        const int64_t every = mode == Ask::kLines ? 1 : mode == Ask::kEvery2 ? 2 : 4;
        for (int64_t l = s * span; l < (s + 1) * span && l < kTileLines; ++l)
          if (l % every == 0) line(tile + l * 64);
        break;
      }
      case Ask::kHeads2: {  // lines 0 and 1 of each of the tile's pages (tiles are whole pages)
        const int64_t pages = share(kTileBytes / 4096, steps);
        for (int64_t page = s * pages; page < (s + 1) * pages && page * 4096 < kTileBytes; ++page)
          line(tile + page * 4096), line(tile + page * 4096 + 64);
        break;
      }
      case Ask::kNone:
        break;
    }
  }
};

struct Loop {
  const uint16_t* q_pairs;  // [288 dim pairs, 16 heads, 2]
  const uint32_t* p_even;   // [16 heads, 64 tokens]: bf16 P in the low half of each word
  const uint32_t* p_odd;    // and in the high half
  float* scores;            // [64 tokens, 16 heads]
  float* out;               // [16 heads, 512 dims]
  bool values = true;
  Asker asker;

// The tile intrinsics take their tile numbers as literals (GCC spells them into the instruction).
#define WS_SCORE_PRODUCT(C, K, B, k)   \
  asker.next_step();                   \
  _tile_loadd(K, (k), kRowBytes);      \
  _tile_dpbf16ps(C, K, B)
#define WS_SCORE_CHUNK(B, tile, c)                                                         \
  do {                                                                                     \
    const char* first = (tile) + (c) * 2;                                                  \
    WS_SCORE_PRODUCT(0, 6, B, first);                                                      \
    WS_SCORE_PRODUCT(1, 7, B, first + 16 * kRowBytes);                                     \
    WS_SCORE_PRODUCT(2, 6, B, first + 32 * kRowBytes);                                     \
    WS_SCORE_PRODUCT(3, 7, B, first + 48 * kRowBytes);                                     \
  } while (0)

  void run_scores(const char* tile) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int c = kLatent - 64; c >= 0; c -= 64) {  // 576 = 9 x 64: the last 32 dims first
      _tile_loadd(5, q_pairs + (c + 32) * kHeads, kHeads * 4);
      WS_SCORE_CHUNK(5, tile, c + 32);
      _tile_loadd(4, q_pairs + c * kHeads, kHeads * 4);
      WS_SCORE_CHUNK(4, tile, c);
    }
  }

  void store_scores() {
    _tile_stored(0, scores, kHeads * 4);
    _tile_stored(1, scores + 16 * kHeads, kHeads * 4);
    _tile_stored(2, scores + 32 * kHeads, kHeads * 4);
    _tile_stored(3, scores + 48 * kHeads, kHeads * 4);
  }

  void run_values(const char* tile) {
    const int64_t out_stride = kValueDims * 4, p_stride = kTileTokens * 4;
    for (int a = 0; a < kValueDims / 32; a += 2) {
      _tile_loadd(0, out + 32 * a, out_stride);
      _tile_loadd(1, out + 32 * a + 16, out_stride);
      _tile_loadd(2, out + 32 * (a + 1), out_stride);
      _tile_loadd(3, out + 32 * (a + 1) + 16, out_stride);
      for (int g = 0; g < 4; ++g) {
        const char* v = tile + g * 16 * kRowBytes;
        _tile_loadd(4, p_even + 16 * g, p_stride);
        _tile_loadd(5, p_odd + 16 * g, p_stride);
        asker.next_step();
        _tile_loadd(6, v + a * 64, kRowBytes);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 5, 6);
        asker.next_step();
        _tile_loadd(7, v + (a + 1) * 64, kRowBytes);
        _tile_dpbf16ps(2, 4, 7);
        _tile_dpbf16ps(3, 5, 7);
      }
      _tile_stored(0, out + 32 * a, out_stride);
      _tile_stored(1, out + 32 * a + 16, out_stride);
      _tile_stored(2, out + 32 * (a + 1), out_stride);
      _tile_stored(3, out + 32 * (a + 1) + 16, out_stride);
    }
  }

  // One pass over `tiles` tiles from `region`.
  void pass(const char* region, int64_t tiles) {
    for (int64_t j = 0; j < tiles; ++j) {
      const char* tile = region + j * kTileBytes;
      while (asker.tile != nullptr && asker.step < asker.steps) asker.next_step();  // any left, at once
      asker.start(j + 1 < tiles ? tile + kTileBytes : nullptr);
      run_scores(tile);
      if (j + 2 < tiles)  // the pages of the tile after next, in the shadow of the score stores
        for (int64_t offset = 0; offset < kTileBytes; offset += 4096) _mm_prefetch(tile + 2 * kTileBytes + offset, _MM_HINT_T1);
      store_scores();
      if (values) run_values(tile);
    }
  }
};

// Integer adds: the latent's bf16 pairs read as float32 would include denormals, whose assists
// would time the adds, not the memory.
int64_t read_pass(const char* region, int64_t bytes) {
  __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0;
  for (int64_t i = 0; i + 256 <= bytes; i += 256) {
    a0 = _mm512_add_epi32(a0, _mm512_load_si512(region + i));
    a1 = _mm512_add_epi32(a1, _mm512_load_si512(region + i + 64));
    a2 = _mm512_add_epi32(a2, _mm512_load_si512(region + i + 128));
    a3 = _mm512_add_epi32(a3, _mm512_load_si512(region + i + 192));
  }
  alignas(64) int32_t lanes[16];
  _mm512_store_si512(lanes, _mm512_add_epi32(_mm512_add_epi32(a0, a1), _mm512_add_epi32(a2, a3)));
  int64_t sum = 0;
  for (int32_t lane : lanes) sum += lane;
  return sum;
}

bool parse_ask(const std::string& name, Ask* ask) {
  const struct { const char* name; Ask ask; } names[] = {{"rows", Ask::kRows}, {"loads", Ask::kLoads}, {"lines", Ask::kLines},
                                                          {"every2", Ask::kEvery2}, {"every4", Ask::kEvery4},
                                                          {"heads2", Ask::kHeads2}, {"none", Ask::kNone}};
  for (const auto& n : names)
    if (name == n.name) return *ask = n.ask, true;
  return false;
}

}  // namespace

int main(int argc, char** argv) {
  Ask ask = Ask::kNone;
  const std::string mode = argc == 5 ? argv[1] : "";
  const int pv = argc == 5 ? std::atoi(argv[3]) : -1;
  const int64_t region_mib = argc == 5 ? std::atoll(argv[4]) : 0;
  if (argc != 5 || (mode != "read" && mode != "loop") || !parse_ask(argv[2], &ask) || (pv != 0 && pv != 1) ||
      region_mib < 1) {
    std::fprintf(stderr,
                 "usage: %s read|loop rows|loads|lines|every2|every4|heads2|none 1|0 REGION_MIB (REGION_MIB >= 1)\n",
                 argv[0]);
    return 2;
  }
  const int64_t tiles = (region_mib << 20) / kTileBytes;
  if (tiles < 3) {
    std::fprintf(stderr, "REGION_MIB must hold at least 3 tiles of %lld bytes\n", static_cast<long long>(kTileBytes));
    return 2;
  }
  const int64_t bytes = tiles * kTileBytes;
  char* region = static_cast<char*>(std::aligned_alloc(4096, (bytes + 4095) / 4096 * 4096));
  if (region == nullptr) {
    std::fprintf(stderr, "cannot allocate %lld MiB\n", static_cast<long long>(region_mib));
    return 3;
  }
  // Tile 0 from the hash, every other tile a copy of it (what the values are does not change what
  // the memory does, and a hash per element of a GiB takes seconds).
  auto* latent = reinterpret_cast<uint16_t*>(region);
  for (int64_t i = 0; i < kTileBytes / 2; ++i) latent[i] = bf16_of(latent_value(static_cast<uint64_t>(i)));
  for (int64_t j = 1; j < tiles; ++j) std::memcpy(region + j * kTileBytes, region, kTileBytes);

  if (mode == "read") {
    read_pass(region, bytes);
    const double start = now_s();
    const int64_t sum = read_pass(region, bytes);
    const double seconds = now_s() - start;
    std::printf("{\"gbps\": %.4f, \"tile_us\": %.4f, \"sum\": %lld}\n", bytes / seconds / 1e9, seconds / tiles * 1e6,
                static_cast<long long>(sum));
    return 0;
  }

  if (syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) != 0) {
    std::fprintf(stderr, "the kernel refused the AMX tile state (arch_prctl ARCH_REQ_XCOMP_PERM)\n");
    return 3;
  }
  TileConfig config;
  for (int t = 0; t < 8; ++t) config.rows[t] = 16, config.colsb[t] = 64;
  _tile_loadconfig(&config);

  alignas(64) static uint16_t q_pairs[kLatent / 2 * kHeads * 2];
  alignas(64) static uint32_t p_even[kHeads * kTileTokens], p_odd[kHeads * kTileTokens];
  alignas(64) static float scores[kTileTokens * kHeads], out[kHeads * kValueDims];
  for (int h = 0; h < kHeads; ++h)
    for (int d = 0; d < kLatent; ++d)
      q_pairs[(d / 2) * kHeads * 2 + h * 2 + d % 2] = bf16_of(query_value(static_cast<uint64_t>(h * kLatent + d)));
  for (int h = 0; h < kHeads; ++h)
    for (int t = 0; t < kTileTokens; ++t) {
      const uint32_t p = bf16_of(probability_value(static_cast<uint64_t>(h * kTileTokens + t)));
      p_even[h * kTileTokens + t] = p;
      p_odd[h * kTileTokens + t] = p << 16;
    }
  Loop loop{q_pairs, p_even, p_odd, scores, out, pv == 1, Asker{ask, 72 + (pv == 1 ? 64 : 0)}};

  loop.pass(region, tiles);
  const double start = now_s();
  loop.pass(region, tiles);
  const double seconds = now_s() - start;

  std::memset(out, 0, sizeof(out));  // tile 0 alone, for the reference check
  loop.asker.start(nullptr);
  loop.run_scores(region);
  loop.store_scores();
  loop.run_values(region);
  _tile_release();

  std::printf("{\"gbps\": %.4f, \"tile_us\": %.4f, \"scores\": [", bytes / seconds / 1e9, seconds / tiles * 1e6);
  for (int i = 0; i < kTileTokens * kHeads; ++i) std::printf("%s%.9g", i ? ", " : "", scores[i]);
  std::printf("], \"values\": [");
  for (int i = 0; i < kHeads * kValueDims; ++i) std::printf("%s%.9g", i ? ", " : "", out[i]);
  std::printf("]}\n");
  std::free(region);
  return 0;
}
