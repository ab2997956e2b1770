// Pacing of the paired kernel's tile loops: how much each compute step is held back so the loops
// consume KV no faster than memory delivers it, chosen online per thread and shape.
//
// Why: measured on a 2-vCPU Zen 4 guest (Mixtral and MHA shapes at 32K, KV from DRAM, 2 threads),
// the kernel's loops compute a tile faster than one thread's share of memory bandwidth brings the
// next one. They then catch up with their own software prefetches every tile, stall on demand
// misses, and the stream collapses to 0.6 of the host's read rate. Held back by a chain of dependent
// multiplies in every step (a few cycles; no memory, no change to any result) to just under the
// memory rate, the same loops read at 0.75-0.8 of it: Mixtral 38 -> 44 GB/s with 8 multiplies a
// step, MHA 41 -> 48 with 12, where the host's whole-array read gave 62-65. Too much holds the
// loops below the memory rate (MHA 46 with 14, 41 with 16); and where the KV is in cache, or the
// shape is compute-bound, any delay is a loss. The best delay moves with the shape and with the
// host's bandwidth (which drifts 30-65 GB/s on a shared host), so it is searched for, not fixed.
//
// The search: per (thread, shape), a level is a delay of level * kPaceStep multiplies a step. Three
// items in four run at the best level so far; the fourth tries a neighbour (one above, then one
// below, alternating), and the neighbour becomes the best when its recent cost per token is lower
// by kPaceMargin. Each level's cost is an average of its recent items, so a slower hour of the host
// raises every level alike and moves nothing. A compute-bound shape finds level 1 costlier and stays
// at 0, paying one item in eight at level 1.
#pragma once

#include <cstdint>

namespace writescope {

constexpr int kPaceLevels = 16;      // delays 0, 2, ..., 30 multiplies a step
constexpr int kPaceStep = 2;         // multiplies between two neighbouring levels
constexpr int kPaceExploreEvery = 4;  // one item in four tries a neighbour of the best level
constexpr double kPaceMargin = 0.02;  // a neighbour must be this much cheaper to become the best
constexpr double kPaceWeight = 0.5;   // weight of the newest item in a level's cost

class PaceController {
 public:
  // The level to run the next item at.
  int choose() {
    ++items_;
    if (items_ % kPaceExploreEvery != 0) return best_;
    const int level = best_ + (explore_up_ ? 1 : -1);
    explore_up_ = !explore_up_;
    return level < 0 || level >= kPaceLevels ? best_ : level;  // no side there: this turn stays
  }

  // An item run at `level` cost `seconds_per_token`.
  void record(int level, double seconds_per_token) {
    if (level < 0 || level >= kPaceLevels || !(seconds_per_token > 0)) return;
    double& cost = cost_[level];
    cost = cost == 0 ? seconds_per_token : (1 - kPaceWeight) * cost + kPaceWeight * seconds_per_token;
    if (level != best_ && (cost_[best_] == 0 || cost < cost_[best_] * (1 - kPaceMargin))) best_ = level;
  }

 private:
  double cost_[kPaceLevels] = {};  // recent seconds per token at each level; 0: not tried
  int best_ = 0;
  uint32_t items_ = 0;
  bool explore_up_ = true;
};

// The multiplies a step at `level`.
constexpr int64_t pace_delay(int level) { return static_cast<int64_t>(level) * kPaceStep; }

}  // namespace writescope
