// The entry points the binding exposes. Each checks every argument, then releases the GIL.
#pragma once

#include <pybind11/numpy.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace writescope {
namespace py = pybind11;

// q [num_seqs, num_q_heads, head_dim_qk]; layout "token_major": k_cache [num_blocks, num_kv_heads,
// block_size, head_dim_qk], v_cache [num_blocks, num_kv_heads, block_size, head_dim_v]; layout "paired":
// k_cache [num_blocks, num_kv_heads, head_dim_qk / 2, block_size, 2], v_cache [num_blocks, num_kv_heads,
// block_size / 2, head_dim_v, 2] (KvLayout in kernel_args.h); block_table [num_seqs, max_blocks] int32;
// seq_lens [num_seqs] int32; out [num_seqs, num_q_heads, head_dim_v] float32 (written);
// lse [num_seqs, num_q_heads] float32 natural log (written), -inf for an empty sequence.
// chunk_tokens: the tokens of one work item (one kv head of one sequence); empty: sized from the
// job alone (default_chunk_tokens), so the result never depends on the thread count.
// Returns the seconds the kernel ran, from taking the pool to its end: a wait for another caller
// holding the pool (the other side of the split, say) is not in it.
double paged_attention(const py::array& q, const py::array& k_cache, const py::array& v_cache,
                       const py::array& block_table, const py::array& seq_lens, py::array& out, py::array& lse,
                       const std::string& q_dtype, const std::string& kv_dtype, const std::string& layout,
                       double scale, std::optional<int64_t> chunk_tokens);

// The default work item: ceil(tokens x kv heads of the job / kTargetItems), kept within
// [kMinChunkTokens, kMaxChunkTokens]. An item restarts the tile pipeline (its first tiles are read
// with no compute to hide them behind), so items of 512 tokens cost 1.1-1.3x items of 2K-8K
// (measured on a 2-vCPU Zen 3, 4 x 32K and 1 x 32K, Mixtral, Qwen3-MoE and tiny shapes); 64 items
// leave a pool of up to 16 threads at least 4 each to balance.
// Where an item's output is large against its KV (MLA: 16 heads x 512 float32 outputs, 32 KB, on a
// 1152-byte latent a token), the item also holds at least kOutputShare times the tokens whose KV
// bytes match its output, rounded up to a power of two: its first tile (74 KB at MLA) and its
// output, zeroed, normalised, written as a partial and merged, are then a small part of it.
// Measured on a 2-vCPU Xeon (AMX), MLA from DRAM: items of 2048 tokens 1.09x items of 512 at 8K
// and 1.10x at 32K (1024: 1.06x); 1.08x with the KV in L3. GQA and MHA shapes keep the 512 floor.
constexpr int64_t kMinChunkTokens = 512;
constexpr int64_t kMaxChunkTokens = 4096;
constexpr int64_t kTargetItems = 64;
constexpr int64_t kOutputShare = 64;
// output_bytes: one item's output (group x head_dim_v float32); kv_token_bytes: the KV an item
// reads per token (MLA's latent once).
int64_t default_chunk_tokens(const int32_t* seq_lens, int64_t num_seqs, int64_t num_kv_heads,
                             int64_t output_bytes, int64_t kv_token_bytes);

// The kernel's phase timers (writescope/phase_timers.h): switched on or off, and zeroed, by
// set_phase_timers; phase_totals gives each phase's count and summed seconds over every thread.
void set_phase_timers(bool enabled);
struct PhaseTotal {
  std::string name;
  int64_t count;
  double seconds;
};
std::vector<PhaseTotal> phase_totals();

// outs [num_parts, rows, dim], lses [num_parts, rows] float32 -> out [rows, dim], lse [rows].
void merge_partials(const py::array& outs, const py::array& lses, py::array& out, py::array& lse);

// Streaming-read bandwidth in GB/s, one figure per repeat, over a buffer of num_bytes.
std::vector<double> read_bandwidth(int64_t num_bytes, int repeats);
// Seconds to read `buffers` (C-contiguous arrays) whole, once, with the pool's threads and the
// variant's streaming read: the memory roofline of a call that reads exactly those bytes, measured
// next to it (a host's bandwidth drifts within a run; a probe minutes away measures another moment).
double stream_read_seconds(const std::vector<py::object>& buffers);

// Seconds to read byte ranges of C-contiguous arrays once, in list order, with the current variant
// and pool (threads take consecutive shares of the list): ranges int64 [n, 3] rows of (index into
// buffers, byte offset, bytes), each a whole number of 4-byte words inside its buffer.
double ranges_read_seconds(const std::vector<py::object>& buffers, const py::array& ranges);
// Float32 FMA throughput in GFLOP/s, one figure per repeat, each lasting `iterations` FMA rounds.
std::vector<double> fma_peak(int64_t iterations, int repeats);
// The same for the bf16 dot product (2 multiply-adds per lane per instruction), where the variant has one.
std::vector<double> dot_peak(int64_t iterations, int repeats);
// The same for AMX bf16 tile products, where the variant has them.
std::vector<double> tile_peak(int64_t iterations, int repeats);
enum class MacKind { kFma, kDot, kTile };
std::vector<double> mac_peak(int64_t iterations, int repeats, MacKind kind);

}  // namespace writescope
