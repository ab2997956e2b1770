"""Builds the C++ extension writescope._cpu; everything else is declared in pyproject.toml."""

import glob
import platform

from pybind11.setup_helpers import ParallelCompile, Pybind11Extension, build_ext
from setuptools import setup

CPP_SOURCES = [
    "cpp/src/bindings.cpp",
    "cpp/src/dense.cpp",
    "cpp/src/launcher.cpp",
    "cpp/src/runtime.cpp",
    "cpp/src/thread_pool.cpp",
    "cpp/src/kernels_scalar.cpp",
]
if platform.machine().lower() in ("x86_64", "amd64"):
    # Compiled at the baseline target: their SIMD code carries its own target pragma and is
    # only called after runtime CPU detection.
    CPP_SOURCES += ["cpp/src/kernels_avx2.cpp", "cpp/src/kernels_avx512.cpp", "cpp/src/kernels_avx512bf16.cpp",
                    "cpp/src/kernels_amx.cpp"]

# Compiles the sources in parallel (one job per core, or WRITESCOPE_BUILD_JOBS).
ParallelCompile("WRITESCOPE_BUILD_JOBS").install()

extension = Pybind11Extension(
    "writescope._cpu",
    sorted(CPP_SOURCES),
    include_dirs=["cpp/include"],
    # The kernels live in headers: an edited header alone must rebuild the extension too.
    depends=sorted(glob.glob("cpp/include/writescope/*.h") + glob.glob("cpp/src/*.h")),
    cxx_std=17,
    extra_compile_args=["-O3", "-fno-math-errno", "-Wall", "-Wextra"],
    extra_link_args=["-pthread"],
)

setup(ext_modules=[extension], cmdclass={"build_ext": build_ext})
