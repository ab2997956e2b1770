// The dense products of a decode step on the CPU, over bf16 weights: the few rows of a step times
// each weight matrix, the weights read once for all rows. Each entry point checks every argument,
// then releases the GIL.
#pragma once

#include <pybind11/numpy.h>

namespace writescope {
namespace py = pybind11;

// x [rows, in_features] bf16, w [out_features, in_features] bf16 -> out [rows, out_features] bf16
// (written): x w^T accumulated in float32 and rounded once, as torch's bf16 linear.
void linear_bf16(const py::array& x, const py::array& w, py::array& out);

// x [rows, dim] bf16, weight [dim] bf16 -> out [rows, dim] bf16 (written): each row over the root of
// its mean square (float32) plus eps, rounded to bf16, times the weight in bf16: the reference
// models' RMSNorm.
void rms_norm_bf16(const py::array& x, const py::array& weight, double eps, py::array& out);

// A mixture-of-experts layer's routed experts for a decode step's tokens: x [tokens, hidden] bf16,
// weights [tokens, top_k] bf16, experts [tokens, top_k] int64 (each in [0, num_experts)), gate_up
// [num_experts, 2 * intermediate, hidden] bf16 (gate rows, then up rows), down [num_experts, hidden,
// intermediate] bf16 -> out [tokens, hidden] bf16 (written): sum over slots of weight x
// down(silu(gate) * up), rounded to bf16 where torch's bf16 ops round.
void moe_experts_bf16(const py::array& x, const py::array& weights, const py::array& experts,
                      const py::array& gate_up, const py::array& down, py::array& out);

}  // namespace writescope
