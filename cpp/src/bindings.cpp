// Binds the launcher to Python as writescope._cpu. Arguments are numpy arrays taken without
// conversion (noconvert), so a wrong type is an error, never a silent copy.
#include <optional>
#include <string>
#include <vector>

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "dense.h"
#include "launcher.h"
#include "runtime.h"
#include "writescope/line_prefetcher.h"
#include "writescope/pacing.h"

namespace py = pybind11;
using namespace writescope;

PYBIND11_MODULE(_cpu, m) {
  m.doc() = "WriteScope CPU attention kernels (C++, runtime ISA dispatch, persistent thread pool).";
  init_runtime_from_env();
  m.attr("__cpu_variant__") = runtime().kernels->name;
  m.attr("MIN_CHUNK_TOKENS") = kMinChunkTokens;
  m.attr("MAX_CHUNK_TOKENS") = kMaxChunkTokens;
  m.attr("DEFAULT_POOL_SPIN_MICROSECONDS") = ThreadPool::kDefaultSpinMicroseconds;

  m.def("paged_attention", &paged_attention, py::arg("q").noconvert(), py::arg("k_cache").noconvert(),
        py::arg("v_cache").noconvert(), py::arg("block_table").noconvert(), py::arg("seq_lens").noconvert(),
        py::arg("out").noconvert(), py::arg("lse").noconvert(), py::kw_only(), py::arg("q_dtype"),
        py::arg("kv_dtype"), py::arg("layout") = "token_major", py::arg("scale"), py::arg("chunk_tokens") = py::none(),
        "Decode attention over a paged head-major KV cache (layout token_major or paired); writes out and lse "
        "in place and returns the kernel's seconds (a wait for the pool held by another caller excluded). "
        "chunk_tokens: tokens of one work item; None sizes items from the job (never from the thread count).");
  m.def("merge_partials", &merge_partials, py::arg("outs").noconvert(), py::arg("lses").noconvert(),
        py::arg("out").noconvert(), py::arg("lse").noconvert(),
        "Merges normalised partials by their natural-log LSE; writes out and lse in place.");
  m.def("linear_bf16", &linear_bf16, py::arg("x").noconvert(), py::arg("w").noconvert(), py::arg("out").noconvert(),
        "x [rows, in] bf16 times w [out, in] bf16 transposed -> out [rows, out] bf16, written in place; float32 "
        "accumulation, rounded once.");
  m.def("rms_norm_bf16", &rms_norm_bf16, py::arg("x").noconvert(), py::arg("weight").noconvert(), py::arg("eps"),
        py::arg("out").noconvert(),
        "x [rows, dim] bf16 -> out [rows, dim] bf16, written in place: RMSNorm with weight [dim] bf16, as the "
        "reference models compute it (float32 statistics, rounded to bf16, times the weight).");
  m.def("gqa_inputs_bf16", &gqa_inputs_bf16, py::arg("hidden").noconvert(), py::arg("norm_weight").noconvert(),
        py::arg("eps"), py::arg("qkv_weight").noconvert(), py::arg("q_norm").noconvert().none(true),
        py::arg("k_norm").noconvert().none(true), py::arg("cos").noconvert(), py::arg("sin").noconvert(),
        py::arg("q").noconvert(), py::arg("k").noconvert(), py::arg("v").noconvert(),
        "A GQA layer's decode inputs in one call: RMSNorm, the fused q/k/v projection, the q and k heads' RMSNorm "
        "(when given) and rope; writes q [tokens, num_q_heads, head_dim], k and v [tokens, num_kv_heads, head_dim].");
  m.def("output_projection_bf16", &output_projection_bf16, py::arg("attention").noconvert(),
        py::arg("weight").noconvert(), py::arg("residual").noconvert(), py::arg("out").noconvert(),
        "residual + bf16(attention [tokens, width] float32) times weight [hidden, width] transposed -> out "
        "[tokens, hidden] bf16, written in place.");
  m.def("moe_feed_forward_bf16", &moe_feed_forward_bf16, py::arg("hidden").noconvert(),
        py::arg("norm_weight").noconvert(), py::arg("eps"), py::arg("router_weight").noconvert(),
        py::arg("gate_up").noconvert(), py::arg("down").noconvert(), py::arg("top_k"), py::arg("normalize"),
        py::arg("out").noconvert(),
        "A MoE layer of a decode step with its residual: RMSNorm, router, softmax top_k (divided by their sum "
        "where normalize), routed experts -> out [tokens, hidden] bf16, written in place. False, out unwritten, "
        "where a routing meets a NaN or a tie between the k-th and (k+1)-th largest logits.");
  m.def("moe_experts_bf16", &moe_experts_bf16, py::arg("x").noconvert(), py::arg("weights").noconvert(),
        py::arg("experts").noconvert(), py::arg("gate_up").noconvert(), py::arg("down").noconvert(),
        py::arg("out").noconvert(),
        "Routed SwiGLU experts of a few tokens: x [tokens, hidden], weights (bf16 or float32) and experts "
        "[tokens, top_k], gate_up [E, 2 * inter, hidden], down [E, hidden, inter] -> out [tokens, hidden] bf16, "
        "written in place.");
  m.def("set_phase_timers", &set_phase_timers, py::arg("enabled"),
        "Switches the attention kernel's phase timers on or off and zeroes them (off by default; on, each "
        "tile's phases cost a time-stamp read).");
  m.def(
      "phase_timers",
      [] {
        py::dict phases;
        for (const PhaseTotal& total : phase_totals())
          phases[py::str(total.name)] = py::make_tuple(total.count, total.seconds);
        return phases;
      },
      "Since the timers were last set: {phase: (count, seconds summed over threads)}. Phases of an item: "
      "item_start, first_tile (whole), then each middle tile's gather, scores, softmax and values, last_tile "
      "(whole), item_end; and merge (a sequence's chunk partials). Counts: items, first tiles, middle tiles, "
      "last tiles, items, merges.");
  m.def("available_variants", &available_variants, "ISA variants this CPU runs, best first.");
  m.def(
      "set_variant",
      [m](const std::string& name) mutable {
        select_variant(name);
        m.attr("__cpu_variant__") = runtime().kernels->name;
      },
      py::arg("name"), "Selects an ISA variant (one of available_variants()).");
  m.def("num_threads", [] { return runtime().pool->num_threads(); }, "Threads of the pool, the caller included.");
  m.def("pinned_cpus", [] { return runtime().pool->cpus(); }, "CPUs the pool's workers are pinned to (empty: none).");
  m.def("set_num_threads", &configure_threads, py::arg("num_threads"), py::arg("cpus") = std::vector<int>{},
        "Rebuilds the pool with num_threads threads (the caller included), workers pinned to cpus if given.");
  m.def("pool_spin", &ThreadPool::spin_microseconds,
        "Microseconds an idle pool thread polls for the next job (and a caller for the workers) before it sleeps.");
  m.def("set_pool_spin", &ThreadPool::set_spin_microseconds, py::arg("microseconds"),
        "Sets pool_spin for this process, in [0, 1000000]; 0 sleeps at once (a process whose cores other busy "
        "processes share).");
  m.def("read_bandwidth", &read_bandwidth, py::arg("num_bytes"), py::arg("repeats"),
        "Streaming-read bandwidth in GB/s per repeat, with the current variant and pool.");
  m.def("stream_read_seconds", &stream_read_seconds, py::arg("buffers"),
        "Seconds to stream-read the given C-contiguous arrays whole, once, with the current variant and pool.");
  m.def("ranges_read_seconds", &ranges_read_seconds, py::arg("buffers"), py::arg("ranges").noconvert(),
        "Seconds to read byte ranges of C-contiguous arrays once, in the order given, with the current variant "
        "and pool: ranges int64 [n, 3] rows of (buffer index, byte offset, bytes).");
  m.def("fma_peak", &fma_peak, py::arg("iterations"), py::arg("repeats"),
        "Float32 FMA throughput in GFLOP/s per repeat, with the current variant and pool.");
  m.def("dot_peak", &dot_peak, py::arg("iterations"), py::arg("repeats"),
        "BF16 dot-product (vdpbf16ps) throughput in GFLOP/s per repeat, with the current variant and pool.");
  m.def("tile_peak", &tile_peak, py::arg("iterations"), py::arg("repeats"),
        "AMX bf16 tile-product throughput in GFLOP/s per repeat, with the current variant and pool.");
  m.def(
      "multiply_add_instructions",
      [](const std::string& layout, int64_t group, int64_t head_dim_qk, int64_t head_dim_v, int64_t block_size) {
        if (layout != "paired" && layout != "token_major")
          throw py::value_error("layout: '" + layout + "' is not supported; allowed: token_major, paired");
        if (group < 1 || head_dim_qk < 1 || head_dim_v < 1 || block_size < 1)
          throw py::value_error("group, head_dim_qk, head_dim_v and block_size must be >= 1");
        const bool tiles = runtime().kernels->tile_burst != nullptr &&
                           (layout == "paired" ? paired_tiles_fit(group, head_dim_qk, head_dim_v, block_size)
                                               : token_major_tiles_fit(group, head_dim_qk, head_dim_v, block_size));
        if (tiles) return std::make_pair(std::string("tile"), std::string("tile"));
        const std::string vector = runtime().bf16_dot_faster ? "dot" : "fma";
        return std::make_pair(vector, vector);
      },
      py::arg("layout"), py::arg("group"), py::arg("head_dim_qk"), py::arg("head_dim_v"), py::arg("block_size"),
      "The instructions (tile, dot or fma) of QK and of PV for bf16 q and KV of this shape, with the current "
      "variant on this CPU.");
  m.def("pacing", [] { return runtime().pace_loops; },
        "Whether the paired kernel paces its loops to the memory rate (searched online per thread and shape; "
        "WRITESCOPE_CPU_PACING=auto, the default, or off).");
  m.def(
      "set_pacing",
      [](bool on) {
        std::lock_guard<std::mutex> lock(runtime().mutex);
        runtime().pace_loops = on;
      },
      py::arg("on"), "Turns the paired kernel's pacing on or off for this process.");
  m.def(
      "simulate_pacing",
      [](const std::vector<double>& cost_per_level, int64_t items, std::optional<std::vector<double>> item_factors) {
        if (static_cast<int>(cost_per_level.size()) != kPaceLevels)
          throw py::value_error("cost_per_level must hold " + std::to_string(kPaceLevels) + " costs (one per level), got " +
                                std::to_string(cost_per_level.size()));
        if (items < 0) throw py::value_error("items must be >= 0, got " + std::to_string(items));
        if (item_factors && static_cast<int64_t>(item_factors->size()) != items)
          throw py::value_error("item_factors must hold one factor per item (" + std::to_string(items) + "), got " +
                                std::to_string(item_factors->size()));
        PaceController controller;
        std::vector<int> levels;
        for (int64_t i = 0; i < items; ++i) {
          const int level = controller.choose();
          levels.push_back(level);
          controller.record(level, cost_per_level[level] * (item_factors ? (*item_factors)[i] : 1.0));
        }
        return levels;
      },
      py::arg("cost_per_level"), py::arg("items"), py::arg("item_factors") = py::none(),
      "The levels the pacing search runs `items` items at, item i at level l costing cost_per_level[l] x "
      "item_factors[i] seconds per token (the factors: noise, or an item's place in its call; default 1): the "
      "controller the kernel uses, on a given cost curve.");
  m.def(
      "simulate_prefetch",
      [](int64_t blocks, int64_t previous_steps, int64_t steps) {
        if (blocks < 1 || blocks > 64) throw py::value_error("blocks must be in [1, 64], got " + std::to_string(blocks));
        if (previous_steps < 0) throw py::value_error("previous_steps must be >= 0, got " + std::to_string(previous_steps));
        if (steps < 0 || steps > 1000000) throw py::value_error("steps must be in [0, 1000000], got " + std::to_string(steps));
        constexpr int64_t kBlockBytes = 4096;  // a 16-token block of one head's K (or V), 128 bf16 dims
        std::vector<char> tile(static_cast<size_t>(2 * blocks * kBlockBytes));
        std::vector<const char*> ranges(static_cast<size_t>(2 * blocks));
        for (int64_t r = 0; r < 2 * blocks; ++r) ranges[r] = tile.data() + r * kBlockBytes;
        LinePrefetcher prefetcher;
        prefetcher.ranges = ranges.data();
        prefetcher.k_bytes = prefetcher.v_bytes = kBlockBytes;
        prefetcher.steps = previous_steps;
        prefetcher.reset(2 * blocks * kBlockBytes / 64, 2 * blocks);
        std::vector<int64_t> asked;  // lines asked for after each step
        for (int64_t i = 0; i < steps; ++i) {
          prefetcher.step();
          const int64_t r = prefetcher.range;
          asked.push_back(r >= prefetcher.num_ranges ? 2 * blocks * kBlockBytes / 64
                                                     : r * (kBlockBytes / 64) + (prefetcher.line - ranges[r]) / 64);
        }
        return asked;
      },
      py::arg("blocks"), py::arg("previous_steps"), py::arg("steps"),
      "The paired kernel's line prefetcher over a tile of `blocks` 4 KB K and V blocks, paced by a previous tile "
      "of `previous_steps` steps (0: none): the lines it has asked for after each of `steps` steps.");
  m.def("rounds_probabilities", [] { return rounds_probabilities(runtime()); },
        "Whether the kernels may round the probabilities of bf16 q and KV to bf16 before PV: the bf16 dot "
        "path (uses_bf16_dot) and the AMX tile products do, as the GPU kernel's tensor-core dot does.");
  m.def("uses_bf16_dot", [] { return runtime().bf16_dot_faster; },
        "Whether the kernels take bf16 q.K and PV (the probabilities rounded to bf16) through the bf16 dot "
        "product: only where the variant has one and it measured faster than float32 FMAs on this CPU.");
}
