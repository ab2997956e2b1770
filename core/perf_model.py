"""The roofline model of one layer's attention per decode step, and the CPU share that balances it.

For L tokens of KV outside the GPU window and a CPU share r:
    CPU time ~ r * L * A + C_cpu        (A: s/token of our CPU kernel, C_cpu: fixed cost)
    GPU time ~ (1 - r) * L * B + C_gpu  (B: s/token of the copy into the ping-pong buffer; the GPU's
                                         own attention overlaps the copy, C_gpu: fixed cost)
    r* = (B * L + C_gpu - C_cpu) / ((A + B) * L), clipped to [0, 1], equalises the two.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace


@dataclass(frozen=True)
class PerfModel:
    cpu_s_per_token: float  # A
    transfer_s_per_token: float  # B
    cpu_fixed_s: float = 0.0  # C_cpu
    gpu_fixed_s: float = 0.0  # C_gpu

    def __post_init__(self):
        for name in ("cpu_s_per_token", "transfer_s_per_token", "cpu_fixed_s", "gpu_fixed_s"):
            value = getattr(self, name)
            if not value >= 0:
                raise ValueError(f"{name} must be >= 0, got {value}")
        if self.cpu_s_per_token + self.transfer_s_per_token <= 0:
            raise ValueError("cpu_s_per_token + transfer_s_per_token must be > 0")

    def cpu_time_s(self, share: float, num_tokens: int) -> float:
        return share * num_tokens * self.cpu_s_per_token + self.cpu_fixed_s

    def gpu_time_s(self, share: float, num_tokens: int) -> float:
        return (1 - share) * num_tokens * self.transfer_s_per_token + self.gpu_fixed_s

    def step_time_s(self, share: float, num_tokens: int) -> float:
        """Both sides run concurrently: the layer waits for the slower."""
        return max(self.cpu_time_s(share, num_tokens), self.gpu_time_s(share, num_tokens))

    def optimal_share(self, num_tokens: int) -> float:
        """r* for num_tokens of KV outside the window (0 when there is none)."""
        if num_tokens <= 0:
            return 0.0
        a, b = self.cpu_s_per_token, self.transfer_s_per_token
        share = (b * num_tokens + self.gpu_fixed_s - self.cpu_fixed_s) / ((a + b) * num_tokens)
        return min(1.0, max(0.0, share))

    def with_cpu_rate(self, cpu_s_per_token: float) -> PerfModel:
        return replace(self, cpu_s_per_token=cpu_s_per_token)

    def with_transfer_rate(self, transfer_s_per_token: float) -> PerfModel:
        return replace(self, transfer_s_per_token=transfer_s_per_token)


@dataclass
class OnlineEstimator:
    """Corrects a PerfModel from measured step times.

    A follows an EWMA of the measured CPU seconds per token. B is left alone while transfers run
    as modelled (noise within `slowdown_threshold`); once they run slower or faster than that
    (contention, e.g. expert weights on the same PCIe link, or its end), B follows the EWMA until
    it agrees with the measurements within `settled_tolerance` again.
    With weight alpha, after n observations the remaining error of a step change is (1 - alpha)^n
    of it: alpha = 0.3 leaves under 5% after 9 observations.
    """

    model: PerfModel
    alpha: float = 0.3
    slowdown_threshold: float = 0.15
    settled_tolerance: float = 0.02
    tracking_transfer: bool = False

    def __post_init__(self):
        if not 0 < self.alpha <= 1:
            raise ValueError(f"alpha must be in (0, 1], got {self.alpha}")

    def observe_cpu(self, num_tokens: int, seconds: float) -> None:
        per_token = self._per_token(num_tokens, seconds - self.model.cpu_fixed_s)
        if per_token is not None:
            a = self.model.cpu_s_per_token
            self.model = self.model.with_cpu_rate((1 - self.alpha) * a + self.alpha * per_token)

    def observe_transfer(self, num_tokens: int, seconds: float) -> None:
        per_token = self._per_token(num_tokens, seconds - self.model.gpu_fixed_s)
        if per_token is None:
            return
        b = self.model.transfer_s_per_token
        deviation = abs(per_token / b - 1) if b > 0 else math.inf
        if deviation > self.slowdown_threshold:
            self.tracking_transfer = True
        if self.tracking_transfer:
            self.model = self.model.with_transfer_rate((1 - self.alpha) * b + self.alpha * per_token)
            self.tracking_transfer = abs(per_token / self.model.transfer_s_per_token - 1) > self.settled_tolerance

    @staticmethod
    def _per_token(num_tokens: int, seconds: float) -> float | None:
        if num_tokens <= 0 or seconds <= 0:
            return None
        return seconds / num_tokens
