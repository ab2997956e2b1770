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
// items in four, drawn at random, run at the best level so far; the others try a neighbour (one
// above, then one below, alternating). A neighbour above becomes the best when its recent cost per
// token is lower by kPaceMargin; one below, unless it is higher by kPaceSlack: holding back must pay
// for itself. Each level's cost is an average of its recent items, so a slower hour of the host
// raises every level alike and moves nothing. A compute-bound shape finds level 1 costlier and stays
// at 0, paying one item in eight at level 1.
//
// Why the clip, the draw and the slack: on a 2-vCPU Xeon with AMX (Qwen3-MoE at 8K from DRAM, the
// tile products) an item cost 61 ns a token on average, with a standard deviation of 45-80 from
// rare items many times the rest, and the levels differed by about 0.5% a step. An average of raw
// costs moved with its outliers, every fourth item explored (so the first item of each call, which
// starts cold, always ran at the best level), and the search wandered over all 16 levels about
// evenly. Now each item counts at most kPaceClip from its level's cost, the exploring items are
// drawn, and a tie goes to the lower level: 89% of the items ran at levels 0-3, against 32%.
#pragma once

#include <algorithm>
#include <cstdint>

namespace writescope {

constexpr int kPaceLevels = 16;      // delays 0, 2, ..., 30 multiplies a step
constexpr int kPaceStep = 2;         // multiplies between two neighbouring levels
constexpr int kPaceExploreEvery = 4;  // one item in four tries a neighbour of the best level
constexpr double kPaceMargin = 0.02;  // a neighbour above must be this much cheaper to become the best
constexpr double kPaceSlack = 0.01;   // a neighbour below becomes the best unless this much costlier
constexpr double kPaceWeight = 0.25;  // weight of the newest item in a level's cost
constexpr double kPaceClip = 1.25;    // an item counts at most this factor from its level's cost

class PaceController {
 public:
  // The level to run the next item at.
  int choose() {
    if (next_random() % kPaceExploreEvery != 0) return best_;
    const int level = best_ + (explore_up_ ? 1 : -1);
    explore_up_ = !explore_up_;
    return level < 0 || level >= kPaceLevels ? best_ : level;  // no side there: this turn stays
  }

  // An item run at `level` cost `seconds_per_token`.
  void record(int level, double seconds_per_token) {
    if (level < 0 || level >= kPaceLevels || !(seconds_per_token > 0)) return;
    double& cost = cost_[level];
    const double counted = cost == 0 ? seconds_per_token
                                     : std::min(std::max(seconds_per_token, cost / kPaceClip), cost * kPaceClip);
    cost = cost == 0 ? counted : (1 - kPaceWeight) * cost + kPaceWeight * counted;
    const double bar = level < best_ ? 1 + kPaceSlack : 1 - kPaceMargin;
    if (level != best_ && (cost_[best_] == 0 || cost < cost_[best_] * bar)) best_ = level;
  }

 private:
  // xorshift32: which items explore, drawn so no place in a call (its first item, which starts cold,
  // or its last, which may run alone) is always the best level's or always a neighbour's.
  uint32_t next_random() {
    random_ ^= random_ << 13;
    random_ ^= random_ >> 17;
    random_ ^= random_ << 5;
    return random_ >> 8;
  }

  double cost_[kPaceLevels] = {};  // recent seconds per token at each level; 0: not tried
  int best_ = 0;
  uint32_t random_ = 0x9E3779B9u;
  bool explore_up_ = true;
};

// The multiplies a step at `level`.
constexpr int64_t pace_delay(int level) { return static_cast<int64_t>(level) * kPaceStep; }

}  // namespace writescope
