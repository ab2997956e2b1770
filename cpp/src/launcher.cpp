#include "launcher.h"

#include <atomic>
#include <chrono>
#include <cmath>
#include <limits>
#include <memory>

#include "checks.h"
#include "runtime.h"
#include "writescope/phase_timers.h"

namespace writescope {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// A (sequence, kv head) split into several chunks: merged by whichever thread finishes last.
struct ChunkGroup {
  float* partial_outs;  // [num_chunks, group, head_dim_v]
  float* partial_lses;  // [num_chunks, group]
  float* out;
  float* lse;
  int64_t num_chunks;
};

struct AttentionJob {
  PagedAttentionArgs args;
  const IsaKernels* kernels;
  std::vector<WorkItem> items;
  std::vector<int64_t> item_group;  // index into groups, -1 when the item writes the output
  std::vector<ChunkGroup> groups;
  std::unique_ptr<std::atomic<int64_t>[]> remaining;
  std::vector<std::vector<char>>* workspaces;
  int64_t group_size;
  int64_t threads = 1;  // threads taking this job's items
};

void run_attention_item(void* context, int64_t index, int thread) {
  auto& job = *static_cast<AttentionJob*>(context);
  auto& ws = (*job.workspaces)[thread];
  WorkItem item = job.items[index];
  const int64_t likely_next = index + job.threads;
  item.next = likely_next < static_cast<int64_t>(job.items.size()) ? &job.items[likely_next] : nullptr;
  job.kernels->attend_item(job.args, item, Workspace{ws.data(), static_cast<int64_t>(ws.size())});
  const int64_t g = job.item_group[index];
  if (g < 0 || job.remaining[g].fetch_sub(1, std::memory_order_acq_rel) != 1) return;
  const ChunkGroup& cg = job.groups[g];
  const int64_t dim_v = job.args.head_dim_v;
  phase_timers::ItemLaps laps;
  job.kernels->merge_rows(cg.num_chunks, job.group_size, dim_v, cg.partial_outs, job.group_size * dim_v,
                          cg.partial_lses, job.group_size, cg.out, cg.lse);
  laps.lap(phase_timers::kMerge);
}

void check_block_table(const PagedAttentionArgs& a, int64_t max_blocks, int64_t num_blocks) {
  const int64_t capacity = max_blocks * a.block_size;
  for (int64_t s = 0; s < a.num_seqs; ++s) {
    const int64_t len = a.seq_lens[s];
    if (len < 0 || len > capacity)
      fail("seq_lens[" + std::to_string(s) + "] = " + std::to_string(len) + " is outside [0, " +
           std::to_string(capacity) + "] (max_blocks_per_seq x block_size)");
    const int64_t used = len == 0 ? 0 : (len + a.block_size - 1) / a.block_size;
    for (int64_t j = 0; j < used; ++j) {
      const int64_t block = a.block_table[s * a.block_table_stride + j];
      if (block < 0 || block >= num_blocks)
        fail("block_table[" + std::to_string(s) + ", " + std::to_string(j) + "] = " + std::to_string(block) +
             " is outside [0, " + std::to_string(num_blocks) + ")");
    }
  }
}

// The paired layout's last three dims, a (block, head)'s K or V, must be one C-contiguous run.
void check_block_contiguous(const std::vector<int64_t>& strides, const py::array& a, const char* name) {
  if (a.size() == 0) return;
  const int64_t inner = a.shape(3) * a.shape(4);
  if (strides[4] != 1 || strides[3] != a.shape(4) || strides[2] != inner)
    fail(std::string(name) + ": its last three dims (one block of one head) must be contiguous, got strides " +
         std::to_string(strides[2]) + ", " + std::to_string(strides[3]) + ", " + std::to_string(strides[4]) +
         " elements");
}

// The block table and lengths are copied while the GIL is held, then checked and used from the
// copies: a Python thread changing the arrays after the check cannot steer the kernel out of bounds.
struct IndexCopies {
  std::vector<int32_t> table;
  std::vector<int32_t> lens;
};

KvLayout parse_layout(const std::string& name) {
  if (name == "token_major") return KvLayout::kTokenMajor;
  if (name == "paired") return KvLayout::kPaired;
  fail("layout: '" + name + "' is not supported; allowed: token_major, paired");
}

PagedAttentionArgs check_attention_args(const py::array& q, const py::array& k, const py::array& v,
                                        const py::array& table, const py::array& lens, py::array& out,
                                        py::array& lse, const std::string& q_dtype, const std::string& kv_dtype,
                                        const std::string& layout, double scale, IndexCopies& copies) {
  PagedAttentionArgs a{};
  a.layout = parse_layout(layout);
  const bool paired = a.layout == KvLayout::kPaired;
  a.q_dtype = parse_dtype(q_dtype, "q_dtype");
  a.kv_dtype = parse_dtype(kv_dtype, "kv_dtype");
  check_ndim(q, "q", 3, "[num_seqs, num_q_heads, head_dim_qk]");
  if (paired) {
    check_ndim(k, "k_cache", 5, "[num_blocks, num_kv_heads, head_dim_qk / 2, block_size, 2] (layout paired)");
    check_ndim(v, "v_cache", 5, "[num_blocks, num_kv_heads, block_size / 2, head_dim_v, 2] (layout paired)");
  } else {
    check_ndim(k, "k_cache", 4, "[num_blocks, num_kv_heads, block_size, head_dim_qk]");
    check_ndim(v, "v_cache", 4, "[num_blocks, num_kv_heads, block_size, head_dim_v]");
  }
  check_ndim(table, "block_table", 2, "[num_seqs, max_blocks_per_seq]");
  check_ndim(lens, "seq_lens", 1, "[num_seqs]");
  check_ndim(out, "out", 3, "[num_seqs, num_q_heads, head_dim_v]");
  check_ndim(lse, "lse", 2, "[num_seqs, num_q_heads]");
  check_element(q, "q", a.q_dtype);
  check_element(k, "k_cache", a.kv_dtype);
  check_element(v, "v_cache", a.kv_dtype);
  check_int32(table, "block_table");
  check_int32(lens, "seq_lens");
  check_element(out, "out", DType::kFloat32);
  check_element(lse, "lse", DType::kFloat32);

  a.num_seqs = q.shape(0);
  a.num_q_heads = q.shape(1);
  a.head_dim_qk = q.shape(2);
  a.num_kv_heads = k.shape(1);
  a.block_size = paired ? k.shape(3) : k.shape(2);
  a.head_dim_v = v.shape(3);
  const int64_t num_blocks = k.shape(0);
  if (a.num_q_heads < 1 || a.num_kv_heads < 1 || a.head_dim_qk < 1 || a.head_dim_v < 1)
    fail("num_q_heads, num_kv_heads, head_dim_qk and head_dim_v must be >= 1; got q " + shape_str(q) +
         ", k_cache " + shape_str(k) + ", v_cache " + shape_str(v));
  if (a.num_q_heads % a.num_kv_heads != 0)
    fail("num_q_heads (" + std::to_string(a.num_q_heads) + ") must be a multiple of num_kv_heads (" +
         std::to_string(a.num_kv_heads) + ")");
  if (paired) {
    if (a.head_dim_qk % 2 || a.block_size % 2 || a.block_size < 2)
      fail("layout paired needs an even head_dim_qk and an even block_size >= 2; got head_dim_qk " +
           std::to_string(a.head_dim_qk) + ", block_size " + std::to_string(a.block_size));
    check_dim(k, "k_cache", 2, a.head_dim_qk / 2, "head_dim_qk / 2, as in q");
    check_dim(k, "k_cache", 4, 2, "the pair");
    check_dim(v, "v_cache", 0, num_blocks, "num_blocks, as in k_cache");
    check_dim(v, "v_cache", 1, a.num_kv_heads, "num_kv_heads, as in k_cache");
    check_dim(v, "v_cache", 2, a.block_size / 2, "block_size / 2, as in k_cache");
    check_dim(v, "v_cache", 4, 2, "the pair");
  } else {
    check_dim(k, "k_cache", 3, a.head_dim_qk, "head_dim_qk, as in q");
    check_dim(v, "v_cache", 0, num_blocks, "num_blocks, as in k_cache");
    check_dim(v, "v_cache", 1, a.num_kv_heads, "num_kv_heads, as in k_cache");
    check_dim(v, "v_cache", 2, a.block_size, "block_size, as in k_cache");
  }
  check_dim(table, "block_table", 0, a.num_seqs, "num_seqs, as in q");
  check_dim(lens, "seq_lens", 0, a.num_seqs, "num_seqs, as in q");
  check_dim(out, "out", 0, a.num_seqs, "num_seqs");
  check_dim(out, "out", 1, a.num_q_heads, "num_q_heads");
  check_dim(out, "out", 2, a.head_dim_v, "head_dim_v");
  check_dim(lse, "lse", 0, a.num_seqs, "num_seqs");
  check_dim(lse, "lse", 1, a.num_q_heads, "num_q_heads");
  if (!std::isfinite(scale)) fail("scale must be finite, got " + std::to_string(scale));

  const auto qs = element_strides(q, "q");
  const auto ks = element_strides(k, "k_cache");
  const auto vs = element_strides(v, "v_cache");
  const auto ts = element_strides(table, "block_table");
  element_strides(lens, "seq_lens");
  check_c_contiguous(out, "out");
  check_c_contiguous(lse, "lse");
  check_writeable(out, "out");
  check_writeable(lse, "lse");

  a.q = q.data();
  a.q_seq_stride = qs[0];
  a.q_head_stride = qs[1];
  a.k = k.data();
  a.v = v.data();
  a.k_block_stride = ks[0];
  a.k_head_stride = ks[1];
  a.k_token_stride = ks[2];
  a.v_block_stride = vs[0];
  a.v_head_stride = vs[1];
  a.v_token_stride = vs[2];
  if (paired) {  // within a (block, head) the kernel walks K and V as one contiguous run each
    check_block_contiguous(ks, k, "k_cache");
    check_block_contiguous(vs, v, "v_cache");
  }
  const int64_t max_blocks = table.shape(1);
  copies.table.resize(a.num_seqs * max_blocks);
  const auto* table_in = static_cast<const int32_t*>(table.data());
  for (int64_t s = 0; s < a.num_seqs; ++s)
    for (int64_t j = 0; j < max_blocks; ++j) copies.table[s * max_blocks + j] = table_in[s * ts[0] + j];
  const auto* lens_in = static_cast<const int32_t*>(lens.data());
  copies.lens.assign(lens_in, lens_in + a.num_seqs);
  a.block_table = copies.table.data();
  a.block_table_stride = max_blocks;
  a.seq_lens = copies.lens.data();
  a.scale = static_cast<float>(scale);
  check_block_table(a, table.shape(1), num_blocks);
  return a;
}

// ceil(len / chunk_tokens) without overflow for any chunk_tokens >= 1.
int64_t chunk_count(int64_t len, int64_t chunk_tokens) { return len == 0 ? 0 : 1 + (len - 1) / chunk_tokens; }

// A (sequence, kv head)'s chunk partials, [chunks, group, dim_v] outs then [chunks, group] lses, in
// whole cache lines. Each chunk's out starts on a line when group * dim_v is a multiple of a line's
// floats (every real shape): two threads taking neighbouring chunks then never store to one line.
// Before, a 16-byte-aligned vector put the end of chunk c and the start of chunk c + 1 in one line,
// which both threads stored every tile (the paired kernel keeps the running output there).
constexpr int64_t kLineFloats = 64 / sizeof(float);
int64_t group_partial_floats(int64_t chunks, int64_t group, int64_t dim_v) {
  const int64_t floats = chunks * group * (dim_v + 1);
  return (floats + kLineFloats - 1) / kLineFloats * kLineFloats;
}

// Builds one item per (sequence, kv head, chunk); a sequence of length 0 is written directly.
void plan_items(AttentionJob& job, int64_t chunk_tokens, float* out, float* lse, std::vector<float>& partials) {
  const PagedAttentionArgs& a = job.args;
  const int64_t g = job.group_size, dim_v = a.head_dim_v;
  int64_t partial_floats = 0, num_groups = 0;
  for (int64_t s = 0; s < a.num_seqs; ++s) {
    const int64_t chunks = chunk_count(a.seq_lens[s], chunk_tokens);
    if (chunks > 1) {
      partial_floats += a.num_kv_heads * group_partial_floats(chunks, g, dim_v);
      num_groups += a.num_kv_heads;
    }
  }
  // + a line to start on a line boundary
  if (static_cast<int64_t>(partials.size()) < partial_floats + kLineFloats) partials.resize(partial_floats + kLineFloats);
  job.groups.reserve(num_groups);
  job.remaining = std::make_unique<std::atomic<int64_t>[]>(num_groups);
  float* next_partial = partials.data() + (-(reinterpret_cast<uintptr_t>(partials.data()) / sizeof(float)) & (kLineFloats - 1));
  for (int64_t s = 0; s < a.num_seqs; ++s) {
    const int64_t len = a.seq_lens[s];
    float* seq_out = out + s * a.num_q_heads * dim_v;
    float* seq_lse = lse + s * a.num_q_heads;
    if (len == 0) {
      for (int64_t i = 0; i < a.num_q_heads * dim_v; ++i) seq_out[i] = 0.0f;
      for (int64_t h = 0; h < a.num_q_heads; ++h) seq_lse[h] = kNegInf;
      continue;
    }
    const int64_t chunks = chunk_count(len, chunk_tokens);
    if (chunks == 1) {
      for (int64_t h = 0; h < a.num_kv_heads; ++h) {
        job.items.push_back(WorkItem{s, h, 0, len, seq_out + h * g * dim_v, seq_lse + h * g});
        job.item_group.push_back(-1);
      }
      continue;
    }
    const int64_t first_group = static_cast<int64_t>(job.groups.size());
    for (int64_t h = 0; h < a.num_kv_heads; ++h) {
      ChunkGroup cg{next_partial, next_partial + chunks * g * dim_v, seq_out + h * g * dim_v, seq_lse + h * g, chunks};
      next_partial += group_partial_floats(chunks, g, dim_v);
      job.remaining[job.groups.size()].store(chunks, std::memory_order_relaxed);
      job.groups.push_back(cg);
    }
    // Chunk-major: the order the threads claim items in (items, partials and merges do not depend on
    // it). A head's KV is one run of memory (head-major, a sequence's blocks in extents of
    // consecutive ids). Head-major items had the threads take alternate chunks of one head, so what
    // a core's prefetchers fetched past its item's end was the other thread's chunk; chunk-major,
    // with items taken in turns and threads that divide the kv heads, a thread's next chunk of a
    // head is the one after its last. Measured on a 2-vCPU Xeon (AMX), from DRAM, interleaved
    // against head-major: Qwen3-MoE 8K 1.02x (300 and 150 rounds; 1.01-1.04x in shorter runs),
    // Qwen3-MoE 32K and Mixtral 8K 1.01x, MHA 8K 1.00x. Lanes of one head a thread (each thread's
    // chunks of one head in turn) measured the same.
    for (int64_t c = 0; c < chunks; ++c) {
      const int64_t end = (c + 1) * chunk_tokens < len ? (c + 1) * chunk_tokens : len;
      for (int64_t h = 0; h < a.num_kv_heads; ++h) {
        const ChunkGroup& cg = job.groups[first_group + h];
        job.items.push_back(WorkItem{s, h, c * chunk_tokens, end, cg.partial_outs + c * g * dim_v,
                                     cg.partial_lses + c * g});
        job.item_group.push_back(first_group + h);
      }
    }
  }
}

// Waking the pool's workers costs tens of microseconds (a futex round trip each); a job reading
// less KV than kSerialKvBytes runs on the caller alone, which is as fast and leaves the other
// cores to whatever else runs (the GPU worker's own partial, torch). Results are the same either
// way: items and their merges do not depend on which thread runs them.
constexpr int64_t kSerialKvBytes = 256 * 1024;

bool worth_workers(const PagedAttentionArgs& a) {
  int64_t tokens = 0;
  for (int64_t s = 0; s < a.num_seqs; ++s) tokens += a.seq_lens[s];
  const int64_t element = a.kv_dtype == DType::kFloat32 ? 4 : 2;
  return tokens * a.num_kv_heads * (a.head_dim_qk + a.head_dim_v) * element >= kSerialKvBytes;
}

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

}  // namespace

void set_phase_timers(bool enabled) {
  phase_timers::reset();
  phase_timers::enabled.store(enabled, std::memory_order_relaxed);
}

double phase_ticks_per_second() {
#if defined(__x86_64__)
  // The time-stamp counter against steady_clock over 20 ms, once (invariant TSC: one rate for the run).
  static const double rate = [] {
    const auto start = std::chrono::steady_clock::now();
    const uint64_t first = phase_timers::now_ticks();
    while (seconds_since(start) < 0.02) {
    }
    return static_cast<double>(phase_timers::now_ticks() - first) / seconds_since(start);
  }();
  return rate;
#else
  return 1e9;  // steady_clock nanoseconds
#endif
}

std::vector<PhaseTotal> phase_totals() {
  std::vector<PhaseTotal> totals;
  const double rate = phase_ticks_per_second();
  for (int p = 0; p < phase_timers::kNumPhases; ++p)
    totals.push_back(PhaseTotal{phase_timers::kPhaseNames[p],
                                static_cast<int64_t>(phase_timers::counts[p].load(std::memory_order_relaxed)),
                                static_cast<double>(phase_timers::ticks[p].load(std::memory_order_relaxed)) / rate});
  return totals;
}

int64_t default_chunk_tokens(const int32_t* seq_lens, int64_t num_seqs, int64_t num_kv_heads,
                             int64_t output_bytes, int64_t kv_token_bytes) {
  int64_t token_heads = 0;
  for (int64_t s = 0; s < num_seqs; ++s) token_heads += static_cast<int64_t>(seq_lens[s]) * num_kv_heads;
  int64_t floor = kMinChunkTokens;
  const int64_t output_tokens = (kOutputShare * output_bytes + kv_token_bytes - 1) / kv_token_bytes;
  while (floor < output_tokens && floor < kMaxChunkTokens) floor *= 2;
  const int64_t chunk = (token_heads + kTargetItems - 1) / kTargetItems;
  return chunk < floor ? floor : chunk > kMaxChunkTokens ? kMaxChunkTokens : chunk;
}

double paged_attention(const py::array& q, const py::array& k_cache, const py::array& v_cache,
                       const py::array& block_table, const py::array& seq_lens, py::array& out, py::array& lse,
                       const std::string& q_dtype, const std::string& kv_dtype, const std::string& layout,
                       double scale, std::optional<int64_t> requested_chunk_tokens) {
  if (requested_chunk_tokens && *requested_chunk_tokens < 1)
    fail("chunk_tokens must be >= 1 (or None: sized from the job), got " + std::to_string(*requested_chunk_tokens));
  AttentionJob job;
  IndexCopies copies;
  job.args = check_attention_args(q, k_cache, v_cache, block_table, seq_lens, out, lse, q_dtype, kv_dtype, layout,
                                  scale, copies);
  const PagedAttentionArgs& a = job.args;
  const int64_t element_bytes = a.kv_dtype == DType::kFloat32 ? 4 : 2;
  const bool v_in_k = value_inside_key(a);
  const int64_t kv_token_bytes = (a.head_dim_qk + (v_in_k ? 0 : a.head_dim_v)) * element_bytes;
  const int64_t output_bytes = a.num_q_heads / a.num_kv_heads * a.head_dim_v * 4;
  int64_t chunk_tokens = requested_chunk_tokens
                             ? *requested_chunk_tokens
                             : default_chunk_tokens(a.seq_lens, a.num_seqs, a.num_kv_heads, output_bytes, kv_token_bytes);
  // The paired kernel's items start on block boundaries: chunks are whole blocks.
  if (job.args.layout == KvLayout::kPaired) {
    const int64_t bs = job.args.block_size;
    chunk_tokens = chunk_tokens > std::numeric_limits<int64_t>::max() - bs ? chunk_tokens / bs * bs : (chunk_tokens + bs - 1) / bs * bs;
  }
  job.group_size = job.args.num_q_heads / job.args.num_kv_heads;
  float* out_ptr = static_cast<float*>(out.mutable_data());
  float* lse_ptr = static_cast<float*>(lse.mutable_data());
  py::gil_scoped_release release;
  Runtime& rt = runtime();
  std::lock_guard<std::mutex> lock(rt.mutex);
  const auto started = std::chrono::steady_clock::now();  // the pool is ours from here
  job.kernels = rt.kernels;
  job.args.use_bf16_dot = rt.bf16_dot_faster;
  job.args.round_probabilities = rounds_probabilities(rt);
  job.args.pace_loops = rt.pace_loops;
  job.workspaces = &rt.workspaces;
  const int64_t ws_bytes = kernel_workspace_bytes(job.group_size, job.args.head_dim_qk, job.args.head_dim_v,
                                                  scratch_block_size(job.args.layout, job.args.block_size));
  for (auto& ws : rt.workspaces)
    if (static_cast<int64_t>(ws.size()) < ws_bytes) ws.resize(ws_bytes);
  plan_items(job, chunk_tokens, out_ptr, lse_ptr, rt.chunk_partials);
  const bool parallel = worth_workers(job.args);
  job.threads = parallel ? rt.pool->num_threads() : 1;
  rt.pool->run(static_cast<int64_t>(job.items.size()), &run_attention_item, &job, parallel);
  return seconds_since(started);
}

void merge_partials(const py::array& outs, const py::array& lses, py::array& out, py::array& lse) {
  check_ndim(outs, "outs", 3, "[num_parts, rows, dim]");
  check_ndim(lses, "lses", 2, "[num_parts, rows]");
  check_ndim(out, "out", 2, "[rows, dim]");
  check_ndim(lse, "lse", 1, "[rows]");
  check_element(outs, "outs", DType::kFloat32);
  check_element(lses, "lses", DType::kFloat32);
  check_element(out, "out", DType::kFloat32);
  check_element(lse, "lse", DType::kFloat32);
  const int64_t parts = outs.shape(0), rows = outs.shape(1), dim = outs.shape(2);
  check_dim(lses, "lses", 0, parts, "num_parts, as in outs");
  check_dim(lses, "lses", 1, rows, "rows, as in outs");
  check_dim(out, "out", 0, rows, "rows, as in outs");
  check_dim(out, "out", 1, dim, "dim, as in outs");
  check_dim(lse, "lse", 0, rows, "rows, as in outs");
  check_c_contiguous(outs, "outs");
  check_c_contiguous(lses, "lses");
  check_c_contiguous(out, "out");
  check_c_contiguous(lse, "lse");
  check_writeable(out, "out");
  check_writeable(lse, "lse");
  const float* lse_in = static_cast<const float*>(lses.data());
  for (int64_t i = 0; i < parts * rows; ++i)
    if (std::isnan(lse_in[i]) || lse_in[i] == std::numeric_limits<float>::infinity())
      fail("lses: entry " + std::to_string(i) + " is NaN or +inf; allowed: finite values or -inf (empty part)");
  const float* outs_in = static_cast<const float*>(outs.data());
  float* out_ptr = static_cast<float*>(out.mutable_data());
  float* lse_ptr = static_cast<float*>(lse.mutable_data());
  const IsaKernels* kernels = runtime().kernels;  // not the pool's lock: a merge runs beside a kernel call
  py::gil_scoped_release release;
  kernels->merge_rows(parts, rows, dim, outs_in, rows * dim, lse_in, rows, out_ptr, lse_ptr);
}

namespace {
// Adds to a shared sum (the probes' results, kept so no read or burst is optimised away).
void add_to(std::atomic<double>* sink, double value) {
  double current = sink->load();
  while (!sink->compare_exchange_weak(current, current + value)) {
  }
}
struct ReadJob {
  const IsaKernels* kernels;
  const float* data;
  int64_t count, slices;
  std::atomic<double>* sink;
};
void read_slice(void* context, int64_t slice, int) {
  auto& job = *static_cast<ReadJob*>(context);
  const int64_t per = (job.count + job.slices - 1) / job.slices;
  const int64_t begin = slice * per;
  const int64_t end = begin + per < job.count ? begin + per : job.count;
  if (begin >= end) return;
  add_to(job.sink, job.kernels->read_sum(job.data + begin, end - begin));
}
// Ranges read in list order: slice i of `slices` takes the i-th contiguous share of the list, as a
// kernel thread takes consecutive blocks of one work item.
struct RangesJob {
  const IsaKernels* kernels;
  std::vector<const float*> starts;
  std::vector<int64_t> counts;  // float32 words
  int64_t slices;
  std::atomic<double>* sink;
};
void read_ranges_slice(void* context, int64_t slice, int) {
  auto& job = *static_cast<RangesJob*>(context);
  const int64_t n = static_cast<int64_t>(job.starts.size());
  const int64_t begin = n * slice / job.slices, end = n * (slice + 1) / job.slices;
  double sum = 0.0;
  for (int64_t i = begin; i < end; ++i) sum += job.kernels->read_sum(job.starts[i], job.counts[i]);
  add_to(job.sink, sum);
}
struct FillJob {
  float* data;
  int64_t count, slices;
};
void fill_slice(void* context, int64_t slice, int) {
  auto& job = *static_cast<FillJob*>(context);
  const int64_t per = (job.count + job.slices - 1) / job.slices;
  for (int64_t i = slice * per; i < (slice + 1) * per && i < job.count; ++i) job.data[i] = 1.0f;
}
struct FmaJob {
  const IsaKernels* kernels;
  int64_t iterations;
  std::atomic<double>* sink;
  MacKind kind;  // which instruction's burst
};
void fma_item(void* context, int64_t, int) {
  auto& job = *static_cast<FmaJob*>(context);
  const double value = job.kind == MacKind::kDot    ? job.kernels->dot_burst(job.iterations)
                       : job.kind == MacKind::kTile ? job.kernels->tile_burst(job.iterations)
                                                    : job.kernels->fma_burst(job.iterations);
  add_to(job.sink, value);
}
}  // namespace

std::vector<double> read_bandwidth(int64_t num_bytes, int repeats) {
  if (num_bytes < (1 << 20)) fail("num_bytes must be >= 1 MiB, got " + std::to_string(num_bytes));
  if (repeats < 1) fail("repeats must be >= 1, got " + std::to_string(repeats));
  py::gil_scoped_release release;
  Runtime& rt = runtime();
  std::lock_guard<std::mutex> lock(rt.mutex);
  const int64_t count = num_bytes / 4;
  std::unique_ptr<float[]> data(new float[count]);
  const int64_t slices = int64_t{8} * rt.pool->num_threads();
  FillJob fill{data.get(), count, slices};
  rt.pool->run(slices, &fill_slice, &fill);  // first touch by the threads that will read
  std::atomic<double> sink{0.0};
  ReadJob job{rt.kernels, data.get(), count, slices, &sink};
  std::vector<double> gbps;
  for (int r = 0; r < repeats; ++r) {
    const auto start = std::chrono::steady_clock::now();
    rt.pool->run(slices, &read_slice, &job);
    gbps.push_back(static_cast<double>(count) * 4 / seconds_since(start) / 1e9);
  }
  return gbps;
}

// The probes' buffers: numpy arrays as they are (converting anything else would read a copy, not
// the bytes asked about), C-contiguous.
std::vector<py::array> probe_arrays(const std::vector<py::object>& buffers) {
  if (buffers.empty()) fail("buffers: expected at least one array, got none");
  std::vector<py::array> arrays;
  for (size_t i = 0; i < buffers.size(); ++i) {
    const std::string name = "buffers[" + std::to_string(i) + "]";
    if (!py::isinstance<py::array>(buffers[i]))
      fail(name + ": expected a numpy array, got " + std::string(py::str(py::type::of(buffers[i]).attr("__name__"))));
    arrays.push_back(py::reinterpret_borrow<py::array>(buffers[i]));
    check_c_contiguous(arrays.back(), name.c_str());
  }
  return arrays;
}

double stream_read_seconds(const std::vector<py::object>& buffers) {
  const std::vector<py::array> arrays = probe_arrays(buffers);
  std::vector<ReadJob> jobs;
  std::atomic<double> sink{0.0};
  Runtime& rt = runtime();
  for (size_t i = 0; i < arrays.size(); ++i) {
    const int64_t count = static_cast<int64_t>(arrays[i].nbytes()) / 4;  // read as float32 words
    if (count < 1)
      fail("buffers[" + std::to_string(i) + "]: must hold at least 4 bytes, got " + std::to_string(arrays[i].nbytes()));
    jobs.push_back(ReadJob{rt.kernels, static_cast<const float*>(arrays[i].data()), count, 0, &sink});
  }
  py::gil_scoped_release release;
  std::lock_guard<std::mutex> lock(rt.mutex);
  for (ReadJob& job : jobs) job.slices = int64_t{8} * rt.pool->num_threads();
  const auto start = std::chrono::steady_clock::now();
  for (ReadJob& job : jobs) rt.pool->run(job.slices, &read_slice, &job);
  return seconds_since(start);
}

double ranges_read_seconds(const std::vector<py::object>& buffers, const py::array& ranges) {
  const std::vector<py::array> arrays = probe_arrays(buffers);
  check_ndim(ranges, "ranges", 2, "[num_ranges, 3] (buffer index, byte offset, bytes)");
  if (ranges.dtype().kind() != 'i' || ranges.itemsize() != 8)
    fail("ranges: expected int64, got " + std::string(py::str(ranges.dtype())));
  check_dim(ranges, "ranges", 1, 3, "buffer index, byte offset, bytes");
  check_c_contiguous(ranges, "ranges");
  if (ranges.shape(0) < 1) fail("ranges: expected at least one range, got none");
  Runtime& rt = runtime();
  std::atomic<double> sink{0.0};
  RangesJob job{rt.kernels, {}, {}, 0, &sink};
  const auto* rows = static_cast<const int64_t*>(ranges.data());
  for (int64_t r = 0; r < ranges.shape(0); ++r) {
    const int64_t index = rows[3 * r], offset = rows[3 * r + 1], bytes = rows[3 * r + 2];
    const std::string name = "ranges[" + std::to_string(r) + "]";
    if (index < 0 || index >= static_cast<int64_t>(arrays.size()))
      fail(name + ": buffer index " + std::to_string(index) + " is outside [0, " + std::to_string(arrays.size()) + ")");
    const int64_t size = static_cast<int64_t>(arrays[index].nbytes());
    if (offset < 0 || offset % 4 || bytes < 4 || bytes % 4 || offset > size || bytes > size - offset)
      fail(name + ": bytes [" + std::to_string(offset) + ", +" + std::to_string(bytes) + ") must be a non-empty " +
           "range of 4-byte words inside buffers[" + std::to_string(index) + "] (" + std::to_string(size) + " bytes)");
    job.starts.push_back(reinterpret_cast<const float*>(static_cast<const char*>(arrays[index].data()) + offset));
    job.counts.push_back(bytes / 4);
  }
  py::gil_scoped_release release;
  std::lock_guard<std::mutex> lock(rt.mutex);
  job.slices = int64_t{8} * rt.pool->num_threads();
  const auto start = std::chrono::steady_clock::now();
  rt.pool->run(job.slices, &read_ranges_slice, &job);
  return seconds_since(start);
}

std::vector<double> fma_peak(int64_t iterations, int repeats) { return mac_peak(iterations, repeats, MacKind::kFma); }

std::vector<double> tile_peak(int64_t iterations, int repeats) {
  if (runtime().kernels->tile_burst == nullptr)
    fail(std::string("variant ") + runtime().kernels->name + " has no AMX tiles; amx has");
  return mac_peak(iterations, repeats, MacKind::kTile);
}

std::vector<double> dot_peak(int64_t iterations, int repeats) {
  if (runtime().kernels->dot_burst == nullptr)
    fail(std::string("variant ") + runtime().kernels->name + " has no bf16 dot product; avx512bf16 has");
  return mac_peak(iterations, repeats, MacKind::kDot);
}

std::vector<double> mac_peak(int64_t iterations, int repeats, MacKind kind) {
  if (iterations < 1) fail("iterations must be >= 1, got " + std::to_string(iterations));
  if (repeats < 1) fail("repeats must be >= 1, got " + std::to_string(repeats));
  py::gil_scoped_release release;
  Runtime& rt = runtime();
  std::lock_guard<std::mutex> lock(rt.mutex);
  std::atomic<double> sink{0.0};
  FmaJob job{rt.kernels, iterations, &sink, kind};
  const int threads = rt.pool->num_threads();
  std::vector<double> gflops;
  for (int r = 0; r < repeats; ++r) {
    const auto start = std::chrono::steady_clock::now();
    rt.pool->run(threads, &fma_item, &job);
    const int64_t per_iteration = kind == MacKind::kDot    ? rt.kernels->dot_flops_per_iteration
                                  : kind == MacKind::kTile ? rt.kernels->tile_flops_per_iteration
                                                           : rt.kernels->fma_flops_per_iteration;
    const double flops = static_cast<double>(threads) * iterations * per_iteration;
    gflops.push_back(flops / seconds_since(start) / 1e9);
  }
  return gflops;
}

}  // namespace writescope
