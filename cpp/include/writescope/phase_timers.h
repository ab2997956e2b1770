// The attention kernel's own phase timers: where a call's thread time goes, item by item and tile by
// tile, counted in the time-stamp counter (x86) or steady_clock nanoseconds, off unless switched on
// (writescope._cpu.set_phase_timers). Off, a lap is one predicted branch; on, an rdtsc (~10 ns) and
// an add, and each item hands its sums to the shared counters once, at its end.
//
// Why: the kernel's figures from DRAM are set by what overlaps what inside an item (an item's first
// tile waits for its own lines, its last asks for none), which neither a profiler's samples nor the
// call's wall time separate. Throwaway rdtsc builds measured these phases in sessions 62 and 63; this
// keeps them in the build.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>

#if defined(__x86_64__)
#include <x86intrin.h>
#endif

namespace writescope {
namespace phase_timers {

// An item: start (queries, zeroed output) | first tile | middle tiles, each as gather (row pointers,
// page touches), scores, softmax, values | last tile | end (normalise, lse). A one-tile item's tile
// is its first. The merge of a (sequence, kv head)'s chunk partials is its own phase.
enum Phase : int {
  kItemStart,
  kFirstTile,
  kGather,
  kScores,
  kSoftmax,
  kValues,
  kLastTile,
  kItemEnd,
  kMerge,
  kNumPhases,
};
inline constexpr const char* kPhaseNames[kNumPhases] = {"item_start", "first_tile", "gather", "scores", "softmax",
                                                         "values",     "last_tile",  "item_end", "merge"};

// C++17 inline variables: one instance shared by every ISA translation unit.
inline std::atomic<bool> enabled{false};
inline std::atomic<uint64_t> ticks[kNumPhases];
inline std::atomic<uint64_t> counts[kNumPhases];

inline uint64_t now_ticks() {
#if defined(__x86_64__)
  return __rdtsc();
#else
  return static_cast<uint64_t>(
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
          .count());
#endif
}

inline void reset() {
  for (int p = 0; p < kNumPhases; ++p) {
    ticks[p].store(0, std::memory_order_relaxed);
    counts[p].store(0, std::memory_order_relaxed);
  }
}

// One item's laps (or one merge's), summed locally and handed over once (flush), so two threads
// do not share a counter's line tile by tile.
struct ItemLaps {
  bool on = enabled.load(std::memory_order_relaxed);
  uint64_t mark = on ? now_ticks() : 0;
  uint64_t local_ticks[kNumPhases] = {};
  uint64_t local_counts[kNumPhases] = {};

  // The time since the last lap (or the item's start) goes to `phase`.
  inline void lap(Phase phase) {
    if (!on) return;
    const uint64_t t = now_ticks();
    local_ticks[phase] += t - mark;
    local_counts[phase] += 1;
    mark = t;
  }
  // A tile's laps by its place in the item: a first or last tile counts whole; a middle tile by part.
  inline void part(Phase phase, bool first, bool last) {
    if (!on) return;
    if (first) return lap_uncounted(kFirstTile);
    if (last) return lap_uncounted(kLastTile);
    lap(phase);
  }
  // Closes a tile: a first or last tile counts once, whole.
  inline void end_tile(bool first, bool last) {
    if (!on || !(first || last)) return;
    lap(first ? kFirstTile : kLastTile);
  }
  void flush() {
    if (!on) return;
    for (int p = 0; p < kNumPhases; ++p) {
      if (local_counts[p] == 0 && local_ticks[p] == 0) continue;
      ticks[p].fetch_add(local_ticks[p], std::memory_order_relaxed);
      counts[p].fetch_add(local_counts[p], std::memory_order_relaxed);
    }
    on = false;
  }
  ~ItemLaps() { flush(); }

 private:
  inline void lap_uncounted(Phase phase) {
    const uint64_t t = now_ticks();
    local_ticks[phase] += t - mark;
    mark = t;
  }
};

}  // namespace phase_timers
}  // namespace writescope
