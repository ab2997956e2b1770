"""WriteScope: long-context MoE decoding with the KV cache split between a GPU and CPU memory.

The package imports without Ray, a GPU or the compiled extension: `writescope.ops` loads the
C++ kernels (`writescope._cpu`) on first use of the "cpu" backend.
"""

__version__ = "0.1.0"
