// Argument checks at the Python boundary. Every failure is a ValueError that names the argument,
// what it was and what is allowed; nothing is ever copied or converted silently.
#pragma once

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <cstdint>
#include <string>
#include <vector>

#include "writescope/kernel_args.h"

namespace writescope {
namespace py = pybind11;

[[noreturn]] inline void fail(const std::string& message) { throw py::value_error(message); }

inline std::string shape_str(const py::array& a) {
  std::string s = "[";
  for (py::ssize_t i = 0; i < a.ndim(); ++i) s += (i ? ", " : "") + std::to_string(a.shape(i));
  return s + "]";
}

inline DType parse_dtype(const std::string& name, const char* arg) {
  if (name == "float32") return DType::kFloat32;
  if (name == "bfloat16") return DType::kBFloat16;
  if (name == "float16") return DType::kFloat16;
  fail(std::string(arg) + ": dtype '" + name + "' is not supported; allowed: float32, bfloat16, float16");
}

inline void check_ndim(const py::array& a, const char* name, int ndim, const char* layout) {
  if (a.ndim() != ndim)
    fail(std::string(name) + ": expected a " + std::to_string(ndim) + "-d array " + layout + ", got shape " +
         shape_str(a));
}

// float32 is numpy float32; float16 is numpy float16; bfloat16 travels as its 16-bit pattern
// (numpy has no bfloat16), so it arrives as int16 or uint16.
inline void check_element(const py::array& a, const char* name, DType dtype) {
  const char kind = a.dtype().kind();
  const auto size = a.itemsize();
  bool ok = false;
  switch (dtype) {
    case DType::kFloat32: ok = kind == 'f' && size == 4; break;
    case DType::kFloat16: ok = kind == 'f' && size == 2; break;
    case DType::kBFloat16: ok = (kind == 'i' || kind == 'u') && size == 2; break;
  }
  if (!ok)
    fail(std::string(name) + ": element type '" + std::string(py::str(a.dtype())) +
         "' does not match the declared dtype");
}

inline void check_int32(const py::array& a, const char* name) {
  if (a.dtype().kind() != 'i' || a.itemsize() != 4)
    fail(std::string(name) + ": expected int32, got " + std::string(py::str(a.dtype())));
}

// Strides in elements; they must be non-negative multiples of the item size, and the last
// dimension must be contiguous.
inline std::vector<int64_t> element_strides(const py::array& a, const char* name) {
  std::vector<int64_t> strides(a.ndim(), 0);
  if (a.size() == 0) return strides;  // nothing is read through an empty array
  for (py::ssize_t i = 0; i < a.ndim(); ++i) {
    const int64_t bytes = a.strides(i);
    if (bytes < 0 || bytes % a.itemsize() != 0)
      fail(std::string(name) + ": stride " + std::to_string(bytes) + " bytes of dimension " + std::to_string(i) +
           " is negative or not a multiple of the element size");
    strides[i] = bytes / a.itemsize();
  }
  if (a.ndim() > 0 && a.shape(a.ndim() - 1) > 1 && strides.back() != 1)
    fail(std::string(name) + ": the last dimension must be contiguous (stride 1), got stride " +
         std::to_string(strides.back()));
  return strides;
}

inline void check_c_contiguous(const py::array& a, const char* name) {
  if (!(a.flags() & py::array::c_style)) fail(std::string(name) + ": must be C-contiguous");
}

inline void check_writeable(const py::array& a, const char* name) {
  if (!a.writeable()) fail(std::string(name) + ": must be writeable");
}

inline void check_dim(const py::array& a, const char* name, int dim, int64_t expected, const char* what) {
  if (a.shape(dim) != expected)
    fail(std::string(name) + ": dimension " + std::to_string(dim) + " (" + what + ") must be " +
         std::to_string(expected) + ", got shape " + shape_str(a));
}

}  // namespace writescope
