"""The CPU side of a decode step's split: the partial attention over the batch's cpu_compute tokens.

One seam, `attend(layer, q, view, scale) -> PendingPartial` (and `attend_selected` for a sparse
attention's chosen tokens), so the engine's step does not know where the CPU partial is computed:
`LocalCPUPartial` runs the C++ kernel over the cache's shards in this process (at once: the result
is ready); the Ray runtime's channel-backed one (writescope.actors.channel_executor) sends the
request to a CPU worker per NUMA node and returns, so the device partial runs while they compute,
and `result()` collects their answers. Either reports the kernel's own seconds, never a wait for a
queue or a lock, as the perf model's A wants.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from writescope import ops
from writescope.inplace_kv_cache import selected_source


class PendingPartial:
    """A CPU partial under way; result() waits for it (the first time) and returns it."""

    def __init__(self, collect):
        self._collect = collect  # () -> ops.Partial
        self._partial: ops.Partial | None = None

    @classmethod
    def done(cls, partial: ops.Partial) -> PendingPartial:
        pending = cls(None)
        pending._partial = partial
        return pending

    def result(self) -> ops.Partial:
        if self._partial is None:
            self._partial = self._collect()
        return self._partial


class CPUPartial(ABC):
    # True where attend() only sends the request (another process computes it): a caller then sends
    # it before its device work. False where attend() computes in the calling thread.
    runs_elsewhere = False

    @abstractmethod
    def attend(self, layer: int, q: torch.Tensor, view, scale: float) -> PendingPartial:
        """q [num_seqs, num_q_heads, head_dim_qk] on the host; view: the step's StepView -> the partial
        over the view's cpu_compute tokens of `layer`, on the host, once its result() is asked for."""

    @abstractmethod
    def attend_selected(self, layer: int, q: torch.Tensor, selection: list, tokens: int,
                        scale: float) -> PendingPartial:
        """q [num_seqs, num_q_heads, head_dim] on the host; selection: per cpu_compute shard, (token table
        [num_seqs, width] int32, lens [num_seqs] int32): each row's chosen tokens of the shard (a
        sparse attention's selection; a region of one KV head, see inplace_kv_cache.selected_source);
        tokens: how many they are in all -> the partial over them, once its result() is asked for."""

    def close(self) -> None:  # noqa: B027 - most partials hold nothing of their own
        """Releases what the partial holds (sockets, say); the cache's regions are not its own."""


class LocalCPUPartial(CPUPartial):
    """Every shard with the C++ kernel in this process, one call per shard, merged."""

    def __init__(self, cache):
        self.cache = cache

    def attend(self, layer: int, q: torch.Tensor, view, scale: float) -> PendingPartial:
        parts = [ops.cpu_paged_attention_timed(q, source, scale) for source in self.cache.compute_sources(layer, view)]
        out, lse = ops.merge([(out, lse) for out, lse, _ in parts])
        return PendingPartial.done(ops.Partial(out, lse, view.compute_tokens, sum(s for _, _, s in parts)))

    def attend_selected(self, layer: int, q: torch.Tensor, selection: list, tokens: int,
                        scale: float) -> PendingPartial:
        parts = [ops.cpu_paged_attention_timed(q, selected_source(region, layer, table, lens), scale)
                 for region, (table, lens) in zip(self.cache.compute, selection, strict=True)]
        out, lse = ops.merge([(out, lse) for out, lse, _ in parts])
        return PendingPartial.done(ops.Partial(out, lse, tokens, sum(s for _, _, s in parts)))
