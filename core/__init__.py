"""WriteScope: long-context MoE decoding with the KV cache split between a GPU and CPU memory.

The package imports without Ray, a GPU or the compiled extension: `writescope.ops` loads the
C++ kernels (`writescope._cpu`) on first use of the "cpu" backend.
"""

__version__ = "0.1.0"

_LAZY = {"Engine": "writescope.engine", "EngineConfig": "writescope.config", "SamplingParams": "writescope.sampling"}


def __getattr__(name: str):
    """`from writescope import Engine` imports the engine (and torch) on first use, not with the package."""
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'writescope' has no attribute {name!r}")


__all__ = ["Engine", "EngineConfig", "SamplingParams", "__version__"]
