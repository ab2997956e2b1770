"""Where the tools' measurements go: one JSON file each, its folder made when missing."""

from __future__ import annotations

import json
import os


def write_json(path: str, data) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(data, f, indent=2)


def host_info() -> dict:
    """What a table's figures depend on: the CPU model and count, the C++ kernel's variant and threads,
    the GPU if any."""
    import torch

    from writescope import _cpu
    from writescope.calibration import cpu_model

    return {"cpu_model": cpu_model(), "cpus": len(os.sched_getaffinity(0)), "cpu_variant": _cpu.__cpu_variant__,
            "kernel_threads": _cpu.num_threads(),
            "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None}


def check_positive(parser, args, names) -> None:
    """parser.error naming the flag unless each of args' `names` is >= 1."""
    for name in names:
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
