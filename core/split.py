"""The device side of a layer's split as the decode step runs it, and as calibration times it.

The CPU side is the engine's CPUPartial seam (`writescope.cpu_partial`); this is the other one:
the window (with this step's token) and cpu_transfer, in place or through the ping-pong buffer,
one attention call per group of sources, plus the monolithic baseline's shipped cpu_compute, merged.
"""

from __future__ import annotations

import torch

from writescope import ops


def device_side(cache, layer: int, view, q: torch.Tensor, scale: float, backend: str, *,
                ships_compute: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """q [num_seqs, num_q_heads, head_dim_qk] on the device -> (out [num_seqs, num_q_heads, head_dim_v],
    lse [num_seqs, num_q_heads]) over the view's window and cpu_transfer tokens of `layer` (and its
    cpu_compute tokens shipped whole when ships_compute), on the device. The caller started the
    layer's first ping-pong chunk (`cache.start_transfer`)."""
    partials = [ops.attend(q, group, scale, backend) for group in cache.device_source_groups(layer, view)]
    if ships_compute:
        partials.append(ops.attend(q, cache.shipped_compute_sources(layer, view), scale, backend))
    return ops.merge(partials)
