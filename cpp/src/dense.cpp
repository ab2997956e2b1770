#include "dense.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <mutex>
#include <optional>
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

// Stacked experts' weights, gate_up [num_experts, 2 * intermediate, hidden] and down [num_experts,
// hidden, intermediate] bf16, against the caller's num_experts and hidden (experts_from and hidden_from
// say where those come from, for the messages) -> intermediate, checked even with hidden.
int64_t check_stacked_experts(const py::array& gate_up, const py::array& down, int64_t num_experts, int64_t hidden,
                              const char* experts_from, const char* hidden_from) {
  check_bf16_matrix(gate_up, "gate_up", 3, "[num_experts, 2 * intermediate, hidden]");
  check_bf16_matrix(down, "down", 3, "[num_experts, hidden, intermediate]");
  const int64_t intermediate = down.shape(2);
  check_dim(gate_up, "gate_up", 0, num_experts, experts_from);
  check_dim(gate_up, "gate_up", 1, 2 * intermediate, "2 * intermediate, intermediate as in down");
  check_dim(gate_up, "gate_up", 2, hidden, hidden_from);
  check_dim(down, "down", 0, num_experts, experts_from);
  check_dim(down, "down", 1, hidden, hidden_from);
  if (hidden % 2 != 0 || intermediate % 2 != 0)
    fail("hidden and intermediate must be even (weights are read in dim pairs), got " + std::to_string(hidden) +
         " and " + std::to_string(intermediate));
  return intermediate;
}

float silu(float x) { return x / (1.0f + std::exp(-x)); }

// rows x weights: x [rows, in_features] bf16, w [outputs, in_features] bf16 -> sums [rows, outputs]
// float32, unrounded. Called with the GIL released.
void linear_rows(const uint16_t* x_bits, int64_t rows, int64_t in_features, const uint16_t* w_bits, int64_t outputs,
                 float* sums) {
  const int64_t pairs = in_features / 2, padded = padded_pairs_of(pairs);
  std::vector<float> x_split(rows * 2 * padded);
  for (int64_t r = 0; r < rows; ++r)
    split_row([&](int64_t i) { return bf16_bits_to_float(x_bits[r * in_features + i]); }, pairs, padded,
              x_split.data() + r * 2 * padded);
  DotJob job{runtime().kernels, x_split.data(), rows, padded, pairs, outputs, w_bits, in_features, sums};
  run_dot(job);
}

// x [rows, dim] bf16 -> out [rows, dim] bf16 (may be x): the reference models' RMSNorm in torch's
// order of rounding: the normalised row in float32, rounded to bf16, then times the weight in bf16
// arithmetic (float32 product, rounded). Called with the GIL released.
void rms_norm_rows(const uint16_t* x_bits, int64_t rows, int64_t dim, const uint16_t* w_bits, float epsilon,
                   uint16_t* out_bits) {
  for (int64_t r = 0; r < rows; ++r) {
    const uint16_t* row = x_bits + r * dim;
    double squares = 0.0;  // exact for bf16 squares of any row torch's float32 mean handles
    for (int64_t d = 0; d < dim; ++d) {
      const double v = bf16_bits_to_float(row[d]);
      squares += v * v;
    }
    const float mean_square = static_cast<float>(squares / static_cast<double>(dim));
    const float inv = 1.0f / std::sqrt(mean_square + epsilon);
    for (int64_t d = 0; d < dim; ++d) {
      const float normalised = bf16_bits_to_float(bf16_round(bf16_bits_to_float(row[d]) * inv));
      out_bits[r * dim + d] = bf16_round(bf16_bits_to_float(w_bits[d]) * normalised);
    }
  }
}

float bf16_product(uint16_t a, uint16_t b) {  // a * b in bf16 arithmetic, as a float
  return bf16_bits_to_float(bf16_round(bf16_bits_to_float(a) * bf16_bits_to_float(b)));
}

// x [dim] bf16 -> out [dim] bf16: x * cos + rotate_half(x) * sin in bf16 arithmetic, each product and
// the sum rounded as torch's bf16 ops round (rotate_half(x) = (-x2, x1) over the two halves).
void rope_rotate_half_row(const uint16_t* x, const uint16_t* cos, const uint16_t* sin, int64_t dim, uint16_t* out) {
  const int64_t half = dim / 2;
  for (int64_t d = 0; d < dim; ++d) {
    const uint16_t rotated = d < half ? static_cast<uint16_t>(x[d + half] ^ 0x8000u) : x[d - half];
    out[d] = bf16_round(bf16_product(x[d], cos[d]) + bf16_product(rotated, sin[d]));
  }
}

void check_eps(double eps) {
  if (!(eps >= 0.0) || !std::isfinite(eps)) fail("eps must be finite and >= 0, got " + std::to_string(eps));
}


// Routed experts of a few tokens: x [tokens, hidden] bf16, weights [tokens, top_k] (values), chosen
// [tokens, top_k] (each valid), gate_up [E, 2 * intermediate, hidden], down [E, hidden, intermediate]
// -> out [tokens, hidden] bf16. Called with the GIL released.
void experts_rows(const uint16_t* x_bits, int64_t tokens, int64_t hidden, const float* weights,
                  const int64_t* chosen, int64_t top_k, const uint16_t* gate_up_bits, const uint16_t* down_bits,
                  int64_t intermediate, uint16_t* out_bits) {
  const IsaKernels* kernels = runtime().kernels;
  const int64_t hidden_pairs = hidden / 2, hidden_padded = padded_pairs_of(hidden_pairs);
  const int64_t inter_pairs = intermediate / 2, inter_padded = padded_pairs_of(inter_pairs);
  std::vector<float> x_split(hidden_padded * 2), gate_up_out(2 * intermediate), act_split(inter_padded * 2);
  std::vector<float> down_out(hidden);
  std::vector<double> token_sum(hidden);
  // Each (token, expert) pair in slot order, rounded to bf16 where torch's bf16 ops round: the
  // expert's gate/up product, silu(gate), its product with up, the down product, and its product
  // with the routing weight; the top_k products (bf16 values) summed in double, exactly, so the
  // slots' order does not matter, and rounded once.
  for (int64_t t = 0; t < tokens; ++t) {
    split_row([&](int64_t i) { return bf16_bits_to_float(x_bits[t * hidden + i]); }, hidden_pairs, hidden_padded,
              x_split.data());
    for (int64_t h = 0; h < hidden; ++h) token_sum[h] = 0.0;
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
      const float weight = weights[t * top_k + s];
      for (int64_t h = 0; h < hidden; ++h)
        token_sum[h] += bf16_bits_to_float(bf16_round(bf16_bits_to_float(bf16_round(down_out[h])) * weight));
    }
    for (int64_t h = 0; h < hidden; ++h) out_bits[t * hidden + h] = bf16_round(static_cast<float>(token_sum[h]));
  }
}


// One token's routing, as the reference models route: softmax of the bf16 logits in float32, the
// top_k by probability, divided by their sum where normalize, rounded to bf16. Writes chosen and
// weight_bits [top_k] (largest first) and returns true; returns false where a NaN, or the k-th and
// the (k+1)-th largest being equal, leave the choice to torch.topk's tie rule, which is not a stable
// one.
bool route_row(const uint16_t* logit_bits, int64_t num_experts, int64_t top_k, bool normalize, int64_t* chosen,
               uint16_t* weight_bits) {
  std::vector<float> probs(num_experts);
  float largest = -INFINITY;
  for (int64_t e = 0; e < num_experts; ++e) {
    probs[e] = bf16_bits_to_float(logit_bits[e]);
    if (std::isnan(probs[e])) return false;
    largest = std::max(largest, probs[e]);
  }
  float sum = 0.0f;
  for (int64_t e = 0; e < num_experts; ++e) sum += (probs[e] = std::exp(probs[e] - largest));
  for (int64_t e = 0; e < num_experts; ++e) probs[e] /= sum;
  const int64_t ranked = std::min(top_k + 1, num_experts);
  std::vector<int64_t> order(num_experts);
  for (int64_t e = 0; e < num_experts; ++e) order[e] = e;
  std::partial_sort(order.begin(), order.begin() + ranked, order.end(),
                    [&](int64_t a, int64_t b) { return probs[a] > probs[b]; });
  // The logits decide ties: two different bf16 logits never give equal probabilities. Only a tie at
  // the boundary decides anything: inside the choice it orders the slots, and experts_rows sums them
  // in any order alike.
  if (top_k < num_experts && logit_bits[order[top_k - 1]] == logit_bits[order[top_k]]) return false;
  float chosen_sum = 0.0f;
  for (int64_t i = 0; i < top_k; ++i) chosen_sum += probs[order[i]];
  for (int64_t i = 0; i < top_k; ++i) {
    chosen[i] = order[i];
    weight_bits[i] = bf16_round(normalize ? probs[order[i]] / chosen_sum : probs[order[i]]);
  }
  return true;
}

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
  std::vector<float> sums(rows * outputs);
  linear_rows(x_bits, rows, in_features, w_bits, outputs, sums.data());
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
  check_eps(eps);
  const auto* x_bits = static_cast<const uint16_t*>(x.data());
  const auto* w_bits = static_cast<const uint16_t*>(weight.data());
  auto* out_bits = static_cast<uint16_t*>(out.mutable_data());
  py::gil_scoped_release release;
  rms_norm_rows(x_bits, rows, dim, w_bits, static_cast<float>(eps), out_bits);
}

void gqa_inputs_bf16(const py::array& hidden, const py::array& norm_weight, double eps, const py::array& qkv_weight,
                     const std::optional<py::array>& q_norm, const std::optional<py::array>& k_norm,
                     const py::array& cos, const py::array& sin, py::array& q, py::array& k, py::array& v) {
  check_bf16_matrix(hidden, "hidden", 2, "[tokens, hidden_size]");
  check_bf16_matrix(norm_weight, "norm_weight", 1, "[hidden_size]");
  check_bf16_matrix(qkv_weight, "qkv_weight", 2, "[(num_q_heads + 2 * num_kv_heads) * head_dim, hidden_size]");
  check_bf16_matrix(cos, "cos", 2, "[tokens, head_dim]");
  check_bf16_matrix(sin, "sin", 2, "[tokens, head_dim]");
  check_bf16_matrix(q, "q", 3, "[tokens, num_q_heads, head_dim]");
  check_bf16_matrix(k, "k", 3, "[tokens, num_kv_heads, head_dim]");
  check_bf16_matrix(v, "v", 3, "[tokens, num_kv_heads, head_dim]");
  check_writeable(q, "q");
  check_writeable(k, "k");
  check_writeable(v, "v");
  const int64_t tokens = hidden.shape(0), hidden_size = hidden.shape(1);
  const int64_t num_q_heads = q.shape(1), num_kv_heads = k.shape(1), head_dim = q.shape(2);
  const int64_t outputs = (num_q_heads + 2 * num_kv_heads) * head_dim;
  check_dim(norm_weight, "norm_weight", 0, hidden_size, "hidden_size, as in hidden");
  check_dim(qkv_weight, "qkv_weight", 0, outputs, "(num_q_heads + 2 * num_kv_heads) * head_dim, from q and k");
  check_dim(qkv_weight, "qkv_weight", 1, hidden_size, "hidden_size, as in hidden");
  for (const py::array* a : {&cos, &sin}) {
    const char* name = a == &cos ? "cos" : "sin";
    check_dim(*a, name, 0, tokens, "tokens, as in hidden");
    check_dim(*a, name, 1, head_dim, "head_dim, as in q");
  }
  check_dim(q, "q", 0, tokens, "tokens, as in hidden");
  check_dim(k, "k", 0, tokens, "tokens, as in hidden");
  check_dim(k, "k", 2, head_dim, "head_dim, as in q");
  for (int axis = 0; axis < 3; ++axis) check_dim(v, "v", axis, k.shape(axis), "as in k");
  for (const auto* norm : {&q_norm, &k_norm}) {
    if (!norm->has_value()) continue;
    const char* name = norm == &q_norm ? "q_norm" : "k_norm";
    check_bf16_matrix(**norm, name, 1, "[head_dim]");
    check_dim(**norm, name, 0, head_dim, "head_dim, as in q");
  }
  if (hidden_size % 2 != 0 || head_dim % 2 != 0)
    fail("hidden_size and head_dim must be even (weights are read in dim pairs, rope turns halves), got " +
         std::to_string(hidden_size) + " and " + std::to_string(head_dim));
  check_eps(eps);
  const auto* hidden_bits = static_cast<const uint16_t*>(hidden.data());
  const auto* norm_bits = static_cast<const uint16_t*>(norm_weight.data());
  const auto* qkv_bits = static_cast<const uint16_t*>(qkv_weight.data());
  const auto* q_norm_bits = q_norm ? static_cast<const uint16_t*>(q_norm->data()) : nullptr;
  const auto* k_norm_bits = k_norm ? static_cast<const uint16_t*>(k_norm->data()) : nullptr;
  const auto* cos_bits = static_cast<const uint16_t*>(cos.data());
  const auto* sin_bits = static_cast<const uint16_t*>(sin.data());
  auto* q_bits = static_cast<uint16_t*>(q.mutable_data());
  auto* k_bits = static_cast<uint16_t*>(k.mutable_data());
  auto* v_bits = static_cast<uint16_t*>(v.mutable_data());
  py::gil_scoped_release release;
  const float epsilon = static_cast<float>(eps);
  std::vector<uint16_t> normed(tokens * hidden_size), head(head_dim);
  rms_norm_rows(hidden_bits, tokens, hidden_size, norm_bits, epsilon, normed.data());
  std::vector<float> sums(tokens * outputs);
  linear_rows(normed.data(), tokens, hidden_size, qkv_bits, outputs, sums.data());
  // Each head of q and k: its projection rounded to bf16, its RMSNorm (Qwen3), then rope at the
  // token's position; v's heads rounded only.
  auto rotated_head = [&](const float* projected, const uint16_t* norm, int64_t t, uint16_t* out) {
    for (int64_t d = 0; d < head_dim; ++d) head[d] = bf16_round(projected[d]);
    if (norm != nullptr) rms_norm_rows(head.data(), 1, head_dim, norm, epsilon, head.data());
    rope_rotate_half_row(head.data(), cos_bits + t * head_dim, sin_bits + t * head_dim, head_dim, out);
  };
  for (int64_t t = 0; t < tokens; ++t) {
    const float* row = sums.data() + t * outputs;
    for (int64_t h = 0; h < num_q_heads; ++h)
      rotated_head(row + h * head_dim, q_norm_bits, t, q_bits + (t * num_q_heads + h) * head_dim);
    const float* k_row = row + num_q_heads * head_dim;
    for (int64_t h = 0; h < num_kv_heads; ++h)
      rotated_head(k_row + h * head_dim, k_norm_bits, t, k_bits + (t * num_kv_heads + h) * head_dim);
    const float* v_row = k_row + num_kv_heads * head_dim;
    for (int64_t i = 0; i < num_kv_heads * head_dim; ++i)
      v_bits[t * num_kv_heads * head_dim + i] = bf16_round(v_row[i]);
  }
}

void output_projection_bf16(const py::array& attention, const py::array& weight, const py::array& residual,
                            py::array& out) {
  check_ndim(attention, "attention", 2, "[tokens, num_q_heads * head_dim_v]");
  check_element(attention, "attention", DType::kFloat32);
  check_c_contiguous(attention, "attention");
  check_bf16_matrix(weight, "weight", 2, "[hidden_size, num_q_heads * head_dim_v]");
  check_bf16_matrix(residual, "residual", 2, "[tokens, hidden_size]");
  check_bf16_matrix(out, "out", 2, "[tokens, hidden_size]");
  check_writeable(out, "out");
  const int64_t tokens = attention.shape(0), width = attention.shape(1), hidden_size = weight.shape(0);
  check_dim(weight, "weight", 1, width, "num_q_heads * head_dim_v, as in attention");
  check_dim(residual, "residual", 0, tokens, "tokens, as in attention");
  check_dim(residual, "residual", 1, hidden_size, "hidden_size, as in weight");
  check_dim(out, "out", 0, tokens, "tokens, as in attention");
  check_dim(out, "out", 1, hidden_size, "hidden_size, as in weight");
  if (width % 2 != 0)
    fail("attention: its width must be even (weights are read in dim pairs), got " + std::to_string(width));
  const auto* attention_values = static_cast<const float*>(attention.data());
  const auto* w_bits = static_cast<const uint16_t*>(weight.data());
  const auto* residual_bits = static_cast<const uint16_t*>(residual.data());
  auto* out_bits = static_cast<uint16_t*>(out.mutable_data());
  py::gil_scoped_release release;
  std::vector<uint16_t> attention_bits(tokens * width);
  for (int64_t i = 0; i < tokens * width; ++i) attention_bits[i] = bf16_round(attention_values[i]);
  std::vector<float> sums(tokens * hidden_size);
  linear_rows(attention_bits.data(), tokens, width, w_bits, hidden_size, sums.data());
  for (int64_t i = 0; i < tokens * hidden_size; ++i)
    out_bits[i] = bf16_round(bf16_bits_to_float(residual_bits[i]) + bf16_bits_to_float(bf16_round(sums[i])));
}

void moe_experts_bf16(const py::array& x, const py::array& weights, const py::array& experts,
                      const py::array& gate_up, const py::array& down, py::array& out) {
  check_bf16_matrix(x, "x", 2, "[tokens, hidden]");
  check_ndim(weights, "weights", 2, "[tokens, top_k]");
  check_c_contiguous(weights, "weights");
  const bool float_weights = weights.dtype().kind() == 'f' && weights.itemsize() == 4;
  if (!float_weights && !((weights.dtype().kind() == 'i' || weights.dtype().kind() == 'u') && weights.itemsize() == 2))
    fail("weights: element type '" + std::string(py::str(weights.dtype())) +
         "'; allowed: bf16 (as 16-bit integers) or float32");
  check_ndim(experts, "experts", 2, "[tokens, top_k]");
  if (experts.dtype().kind() != 'i' || experts.itemsize() != 8)
    fail("experts: expected int64, got " + std::string(py::str(experts.dtype())));
  check_c_contiguous(experts, "experts");
  check_bf16_matrix(out, "out", 2, "[tokens, hidden]");
  check_writeable(out, "out");
  const int64_t tokens = x.shape(0), hidden = x.shape(1), top_k = weights.shape(1);
  check_ndim(gate_up, "gate_up", 3, "[num_experts, 2 * intermediate, hidden]");
  const int64_t num_experts = gate_up.shape(0);
  const int64_t intermediate =
      check_stacked_experts(gate_up, down, num_experts, hidden, "num_experts, as in gate_up", "hidden, as in x");
  check_dim(weights, "weights", 0, tokens, "tokens, as in x");
  check_dim(experts, "experts", 0, tokens, "tokens, as in x");
  check_dim(experts, "experts", 1, top_k, "top_k, as in weights");
  check_dim(out, "out", 0, tokens, "tokens, as in x");
  check_dim(out, "out", 1, hidden, "hidden, as in x");
  const auto* chosen = static_cast<const int64_t*>(experts.data());
  for (int64_t i = 0; i < tokens * top_k; ++i)
    if (chosen[i] < 0 || chosen[i] >= num_experts)
      fail("experts: entry " + std::to_string(i) + " is " + std::to_string(chosen[i]) + "; allowed: 0 to " +
           std::to_string(num_experts - 1));
  const auto* x_bits = static_cast<const uint16_t*>(x.data());
  std::vector<float> weight_values(tokens * top_k);
  for (int64_t i = 0; i < tokens * top_k; ++i)
    weight_values[i] = float_weights ? static_cast<const float*>(weights.data())[i]
                                     : bf16_bits_to_float(static_cast<const uint16_t*>(weights.data())[i]);
  const auto* gate_up_bits = static_cast<const uint16_t*>(gate_up.data());
  const auto* down_bits = static_cast<const uint16_t*>(down.data());
  auto* out_bits = static_cast<uint16_t*>(out.mutable_data());
  py::gil_scoped_release release;
  experts_rows(x_bits, tokens, hidden, weight_values.data(), chosen, top_k, gate_up_bits, down_bits, intermediate,
               out_bits);
}

bool moe_feed_forward_bf16(const py::array& hidden, const py::array& norm_weight, double eps,
                           const py::array& router_weight, const py::array& gate_up, const py::array& down,
                           int64_t top_k, bool normalize, py::array& out) {
  check_bf16_matrix(hidden, "hidden", 2, "[tokens, hidden_size]");
  check_bf16_matrix(norm_weight, "norm_weight", 1, "[hidden_size]");
  check_bf16_matrix(router_weight, "router_weight", 2, "[num_experts, hidden_size]");
  check_bf16_matrix(out, "out", 2, "[tokens, hidden_size]");
  check_writeable(out, "out");
  const int64_t tokens = hidden.shape(0), hidden_size = hidden.shape(1), num_experts = router_weight.shape(0);
  const int64_t intermediate = check_stacked_experts(gate_up, down, num_experts, hidden_size,
                                                     "num_experts, as in router_weight", "hidden_size, as in hidden");
  check_dim(norm_weight, "norm_weight", 0, hidden_size, "hidden_size, as in hidden");
  check_dim(router_weight, "router_weight", 1, hidden_size, "hidden_size, as in hidden");
  check_dim(out, "out", 0, tokens, "tokens, as in hidden");
  check_dim(out, "out", 1, hidden_size, "hidden_size, as in hidden");
  if (top_k < 1 || top_k > num_experts)
    fail("top_k must be 1 to num_experts (" + std::to_string(num_experts) + "), got " + std::to_string(top_k));
  check_eps(eps);
  const auto* hidden_bits = static_cast<const uint16_t*>(hidden.data());
  const auto* norm_bits = static_cast<const uint16_t*>(norm_weight.data());
  const auto* router_bits = static_cast<const uint16_t*>(router_weight.data());
  const auto* gate_up_bits = static_cast<const uint16_t*>(gate_up.data());
  const auto* down_bits = static_cast<const uint16_t*>(down.data());
  auto* out_bits = static_cast<uint16_t*>(out.mutable_data());
  py::gil_scoped_release release;
  std::vector<uint16_t> normed(tokens * hidden_size), logits(tokens * num_experts);
  rms_norm_rows(hidden_bits, tokens, hidden_size, norm_bits, static_cast<float>(eps), normed.data());
  std::vector<float> sums(tokens * num_experts);
  linear_rows(normed.data(), tokens, hidden_size, router_bits, num_experts, sums.data());
  for (int64_t i = 0; i < tokens * num_experts; ++i) logits[i] = bf16_round(sums[i]);
  std::vector<int64_t> chosen(tokens * top_k);
  std::vector<uint16_t> weight_bits(tokens * top_k);
  for (int64_t t = 0; t < tokens; ++t)
    if (!route_row(logits.data() + t * num_experts, num_experts, top_k, normalize, chosen.data() + t * top_k,
                   weight_bits.data() + t * top_k))
      return false;
  std::vector<float> weight_values(tokens * top_k);
  for (int64_t i = 0; i < tokens * top_k; ++i) weight_values[i] = bf16_bits_to_float(weight_bits[i]);
  std::vector<uint16_t> routed(tokens * hidden_size);
  experts_rows(normed.data(), tokens, hidden_size, weight_values.data(), chosen.data(), top_k, gate_up_bits, down_bits,
               intermediate, routed.data());
  for (int64_t i = 0; i < tokens * hidden_size; ++i)
    out_bits[i] = bf16_round(bf16_bits_to_float(hidden_bits[i]) + bf16_bits_to_float(routed[i]));
  return true;
}

}  // namespace writescope
