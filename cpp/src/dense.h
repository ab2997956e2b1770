// The dense products of a decode step on the CPU, over bf16 weights: the few rows of a step times
// each weight matrix, the weights read once for all rows. Each entry point checks every argument,
// then releases the GIL.
#pragma once

#include <pybind11/numpy.h>

#include <optional>

namespace writescope {
namespace py = pybind11;

// x [rows, in_features] bf16, w [out_features, in_features] bf16 -> out [rows, out_features] bf16
// (written): x w^T accumulated in float32 and rounded once, as torch's bf16 linear.
void linear_bf16(const py::array& x, const py::array& w, py::array& out);

// x [rows, dim] bf16, weight [dim] bf16 -> out [rows, dim] bf16 (written): each row over the root of
// its mean square (float32) plus eps, rounded to bf16, times the weight in bf16: the reference
// models' RMSNorm.
void rms_norm_bf16(const py::array& x, const py::array& weight, double eps, py::array& out);

// A GQA layer's attention inputs for a decode step's tokens, in one call: hidden [tokens,
// hidden_size] bf16 -> its RMSNorm (norm_weight [hidden_size]) -> the fused q/k/v projection
// (qkv_weight [(num_q_heads + 2 * num_kv_heads) * head_dim, hidden_size]) -> each q and k head's
// RMSNorm where q_norm / k_norm [head_dim] are given (Qwen3) -> rope (rotate-half, cos and sin
// [tokens, head_dim] bf16) on q and k; written to q [tokens, num_q_heads, head_dim], k and v
// [tokens, num_kv_heads, head_dim] bf16. Bit for bit the separate steps' results.
void gqa_inputs_bf16(const py::array& hidden, const py::array& norm_weight, double eps, const py::array& qkv_weight,
                     const std::optional<py::array>& q_norm, const std::optional<py::array>& k_norm,
                     const py::array& cos, const py::array& sin, py::array& q, py::array& k, py::array& v);

// attention [tokens, width] float32 -> out [tokens, hidden_size] bf16 (written) = residual + the
// attention rounded to bf16 times weight [hidden_size, width] bf16 transposed: the output
// projection and its residual add, rounded as torch's bf16 ops round.
void output_projection_bf16(const py::array& attention, const py::array& weight, const py::array& residual,
                            py::array& out);

// A mixture-of-experts layer's routed experts for a decode step's tokens: x [tokens, hidden] bf16,
// weights [tokens, top_k] bf16 or float32 (DeepSeek-V2 keeps its routing weights in float32),
// experts [tokens, top_k] int64 (each in [0, num_experts)), gate_up [num_experts, 2 * intermediate,
// hidden] bf16 (gate rows, then up rows), down [num_experts, hidden, intermediate] bf16 -> out [tokens,
// hidden] bf16 (written): sum over slots of weight x down(silu(gate) * up), rounded to bf16 where
// torch's bf16 ops round (a bf16 value times a float32 weight: the float32 product, rounded once).
void moe_experts_bf16(const py::array& x, const py::array& weights, const py::array& experts,
                      const py::array& gate_up, const py::array& down, py::array& out);

// A mixture-of-experts layer (no shared experts) for a decode step's tokens, with its residual:
// hidden [tokens, hidden_size] bf16 -> RMSNorm (norm_weight) -> router logits (router_weight
// [num_experts, hidden_size]) -> softmax in float32, the top_k, divided by their sum where normalize
// -> moe_experts_bf16's experts -> out [tokens, hidden_size] = hidden + experts (written). Returns
// false, leaving out unwritten, where a token's routing meets a NaN or a tie between its k-th and
// (k+1)-th largest logits: torch.topk's tie order is not a stable one, so the caller's torch path
// routes the step then.
bool moe_feed_forward_bf16(const py::array& hidden, const py::array& norm_weight, double eps,
                           const py::array& router_weight, const py::array& gate_up, const py::array& down,
                           int64_t top_k, bool normalize, py::array& out);

}  // namespace writescope
