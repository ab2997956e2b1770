#include "dense.h"

#include <cmath>
#include <cstring>
#include <mutex>
#include <vector>

#include "checks.h"
#include "runtime.h"
#include "writescope/attention_kernel.h"  // bf16_round, bf16_bits_to_float

namespace writescope {
namespace {

// Below this many multiply-adds a product runs on the caller alone: waking the pool's workers
// costs tens of microseconds, more than a decode step's small projections take.
constexpr int64_t kSerialMacs = int64_t{1} << 21;
// Outputs per pool item: enough work per item to pay for claiming it, few enough to balance.
constexpr int64_t kOutputsPerItem = 64;

int64_t padded_pairs_of(int64_t pairs) { return (pairs + 15) / 16 * 16; }

// Row [2 * pairs] (bf16 bits, or float) -> [even dims | odd dims], each padded_pairs long, zero-padded.
template <class Read>
void split_row(Read read, int64_t pairs, int64_t padded_pairs, float* out) {
  for (int64_t p = 0; p < padded_pairs; ++p) {
    out[p] = p < pairs ? read(2 * p) : 0.0f;
    out[padded_pairs + p] = p < pairs ? read(2 * p + 1) : 0.0f;
  }
}

struct DotJob {
  const IsaKernels* kernels;
  const float* x_split;
  int64_t rows, padded_pairs, pairs, outputs;
  const uint16_t* w;
  int64_t w_stride;
  float* out;  // [rows, outputs]
};

void run_dot_item(void* context, int64_t item, int) {
  const auto& job = *static_cast<DotJob*>(context);
  const int64_t begin = item * kOutputsPerItem;
  const int64_t end = begin + kOutputsPerItem < job.outputs ? begin + kOutputsPerItem : job.outputs;
  job.kernels->dot_rows(job.x_split, job.rows, job.padded_pairs, job.w, job.w_stride, job.pairs, begin, end, job.out,
                        job.outputs);
}

// job.out = the job's rows x weights; on the pool when the product is large enough to pay for it.
void run_dot(DotJob& job) {
  if (job.rows * job.outputs * job.pairs * 2 < kSerialMacs) {
    job.kernels->dot_rows(job.x_split, job.rows, job.padded_pairs, job.w, job.w_stride, job.pairs, 0, job.outputs,
                          job.out, job.outputs);
    return;
  }
  Runtime& rt = runtime();
  std::lock_guard<std::mutex> lock(rt.mutex);
  rt.pool->run((job.outputs + kOutputsPerItem - 1) / kOutputsPerItem, &run_dot_item, &job);
}

void check_bf16_matrix(const py::array& a, const char* name, int ndim, const char* layout) {
  check_ndim(a, name, ndim, layout);
  check_element(a, name, DType::kBFloat16);
  check_c_contiguous(a, name);
}

float silu(float x) { return x / (1.0f + std::exp(-x)); }

}  // namespace

void linear_bf16(const py::array& x, const py::array& w, py::array& out) {
  check_bf16_matrix(x, "x", 2, "[rows, in_features]");
  check_bf16_matrix(w, "w", 2, "[out_features, in_features]");
  check_bf16_matrix(out, "out", 2, "[rows, out_features]");
  check_writeable(out, "out");
  const int64_t rows = x.shape(0), in_features = x.shape(1), outputs = w.shape(0);
  check_dim(w, "w", 1, in_features, "in_features, as in x");
  check_dim(out, "out", 0, rows, "rows, as in x");
  check_dim(out, "out", 1, outputs, "out_features, as in w");
  if (in_features % 2 != 0)
    fail("x: in_features must be even (weights are read in dim pairs), got " + std::to_string(in_features));
  const auto* x_bits = static_cast<const uint16_t*>(x.data());
  const auto* w_bits = static_cast<const uint16_t*>(w.data());
  auto* out_bits = static_cast<uint16_t*>(out.mutable_data());
  py::gil_scoped_release release;
  const int64_t pairs = in_features / 2, padded = padded_pairs_of(pairs);
  std::vector<float> x_split(rows * 2 * padded);
  for (int64_t r = 0; r < rows; ++r)
    split_row([&](int64_t i) { return bf16_bits_to_float(x_bits[r * in_features + i]); }, pairs, padded,
              x_split.data() + r * 2 * padded);
  std::vector<float> sums(rows * outputs);
  DotJob job{runtime().kernels, x_split.data(), rows, padded, pairs, outputs, w_bits, in_features, sums.data()};
  run_dot(job);
  for (int64_t i = 0; i < rows * outputs; ++i) out_bits[i] = bf16_round(sums[i]);
}

void rms_norm_bf16(const py::array& x, const py::array& weight, double eps, py::array& out) {
  check_bf16_matrix(x, "x", 2, "[rows, dim]");
  check_bf16_matrix(weight, "weight", 1, "[dim]");
  check_bf16_matrix(out, "out", 2, "[rows, dim]");
  check_writeable(out, "out");
  const int64_t rows = x.shape(0), dim = x.shape(1);
  check_dim(weight, "weight", 0, dim, "dim, as in x");
  check_dim(out, "out", 0, rows, "rows, as in x");
  check_dim(out, "out", 1, dim, "dim, as in x");
  if (!(eps >= 0.0) || !std::isfinite(eps)) fail("eps must be finite and >= 0, got " + std::to_string(eps));
  const auto* x_bits = static_cast<const uint16_t*>(x.data());
  const auto* w_bits = static_cast<const uint16_t*>(weight.data());
  auto* out_bits = static_cast<uint16_t*>(out.mutable_data());
  py::gil_scoped_release release;
  const float epsilon = static_cast<float>(eps);
  for (int64_t r = 0; r < rows; ++r) {
    const uint16_t* row = x_bits + r * dim;
    double squares = 0.0;  // exact for bf16 squares of any row torch's float32 mean handles
    for (int64_t d = 0; d < dim; ++d) {
      const double v = bf16_bits_to_float(row[d]);
      squares += v * v;
    }
    // torch's order of rounding: the normalised row in float32, rounded to bf16, then times the
    // weight in bf16 arithmetic (float32 product, rounded)
    const float mean_square = static_cast<float>(squares / static_cast<double>(dim));
    const float inv = 1.0f / std::sqrt(mean_square + epsilon);
    for (int64_t d = 0; d < dim; ++d) {
      const float normalised = bf16_bits_to_float(bf16_round(bf16_bits_to_float(row[d]) * inv));
      out_bits[r * dim + d] = bf16_round(bf16_bits_to_float(w_bits[d]) * normalised);
    }
  }
}

void moe_experts_bf16(const py::array& x, const py::array& weights, const py::array& experts,
                      const py::array& gate_up, const py::array& down, py::array& out) {
  check_bf16_matrix(x, "x", 2, "[tokens, hidden]");
  check_bf16_matrix(weights, "weights", 2, "[tokens, top_k]");
  check_ndim(experts, "experts", 2, "[tokens, top_k]");
  if (experts.dtype().kind() != 'i' || experts.itemsize() != 8)
    fail("experts: expected int64, got " + std::string(py::str(experts.dtype())));
  check_c_contiguous(experts, "experts");
  check_bf16_matrix(gate_up, "gate_up", 3, "[num_experts, 2 * intermediate, hidden]");
  check_bf16_matrix(down, "down", 3, "[num_experts, hidden, intermediate]");
  check_bf16_matrix(out, "out", 2, "[tokens, hidden]");
  check_writeable(out, "out");
  const int64_t tokens = x.shape(0), hidden = x.shape(1), top_k = weights.shape(1);
  const int64_t num_experts = gate_up.shape(0), intermediate = down.shape(2);
  check_dim(weights, "weights", 0, tokens, "tokens, as in x");
  check_dim(experts, "experts", 0, tokens, "tokens, as in x");
  check_dim(experts, "experts", 1, top_k, "top_k, as in weights");
  check_dim(gate_up, "gate_up", 1, 2 * intermediate, "2 * intermediate, intermediate as in down");
  check_dim(gate_up, "gate_up", 2, hidden, "hidden, as in x");
  check_dim(down, "down", 0, num_experts, "num_experts, as in gate_up");
  check_dim(down, "down", 1, hidden, "hidden, as in x");
  check_dim(out, "out", 0, tokens, "tokens, as in x");
  check_dim(out, "out", 1, hidden, "hidden, as in x");
  if (hidden % 2 != 0 || intermediate % 2 != 0)
    fail("hidden and intermediate must be even (weights are read in dim pairs), got " + std::to_string(hidden) +
         " and " + std::to_string(intermediate));
  const auto* chosen = static_cast<const int64_t*>(experts.data());
  for (int64_t i = 0; i < tokens * top_k; ++i)
    if (chosen[i] < 0 || chosen[i] >= num_experts)
      fail("experts: entry " + std::to_string(i) + " is " + std::to_string(chosen[i]) + "; allowed: 0 to " +
           std::to_string(num_experts - 1));
  const auto* x_bits = static_cast<const uint16_t*>(x.data());
  const auto* weight_bits = static_cast<const uint16_t*>(weights.data());
  const auto* gate_up_bits = static_cast<const uint16_t*>(gate_up.data());
  const auto* down_bits = static_cast<const uint16_t*>(down.data());
  auto* out_bits = static_cast<uint16_t*>(out.mutable_data());
  py::gil_scoped_release release;
  const IsaKernels* kernels = runtime().kernels;
  const int64_t hidden_pairs = hidden / 2, hidden_padded = padded_pairs_of(hidden_pairs);
  const int64_t inter_pairs = intermediate / 2, inter_padded = padded_pairs_of(inter_pairs);
  std::vector<float> x_split(hidden_padded * 2), gate_up_out(2 * intermediate), act_split(inter_padded * 2);
  std::vector<float> down_out(hidden), token_sum(hidden);
  // Each (token, expert) pair in slot order, rounded to bf16 where torch's bf16 ops round: the
  // expert's gate/up product, silu(gate), its product with up, the down product, and its product
  // with the routing weight; the top_k products summed in float32 and rounded once.
  for (int64_t t = 0; t < tokens; ++t) {
    split_row([&](int64_t i) { return bf16_bits_to_float(x_bits[t * hidden + i]); }, hidden_pairs, hidden_padded,
              x_split.data());
    for (int64_t h = 0; h < hidden; ++h) token_sum[h] = 0.0f;
    for (int64_t s = 0; s < top_k; ++s) {
      const int64_t e = chosen[t * top_k + s];
      DotJob up_job{kernels, x_split.data(), 1, hidden_padded, hidden_pairs, 2 * intermediate,
                    gate_up_bits + e * 2 * intermediate * hidden, hidden, gate_up_out.data()};
      run_dot(up_job);
      auto act = [&](int64_t i) {
        const float gate = bf16_bits_to_float(bf16_round(gate_up_out[i]));
        const float up = bf16_bits_to_float(bf16_round(gate_up_out[intermediate + i]));
        return bf16_bits_to_float(bf16_round(bf16_bits_to_float(bf16_round(silu(gate))) * up));
      };
      split_row(act, inter_pairs, inter_padded, act_split.data());
      DotJob down_job{kernels, act_split.data(), 1, inter_padded, inter_pairs, hidden,
                      down_bits + e * hidden * intermediate, intermediate, down_out.data()};
      run_dot(down_job);
      const float weight = bf16_bits_to_float(weight_bits[t * top_k + s]);
      for (int64_t h = 0; h < hidden; ++h)
        token_sum[h] += bf16_bits_to_float(bf16_round(bf16_bits_to_float(bf16_round(down_out[h])) * weight));
    }
    for (int64_t h = 0; h < hidden; ++h) out_bits[t * hidden + h] = bf16_round(token_sum[h]);
  }
}

}  // namespace writescope
