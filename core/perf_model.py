"""The roofline model of one layer's attention per decode step, and the CPU share that balances it.

For L tokens of KV outside the GPU window and a CPU share r, as the engine pays them:
    CPU side    c(r) = r * L * A + C_cpu       A: the CPU partial of a layer (the kernel over
                                               cpu_compute), per token; C_cpu: its fixed cost (with
                                               the dispatch, C_dispatch, which only calibration sees)
    device side d(r) = (1 - r) * L * B + C_gpu B: the layer's whole device path (ping-pong copies,
                                               launches, the device partial over window + chunks),
                                               per token; C_gpu: its fixed cost (the window among it)
How much of the two sides runs at once is a fact of the host, measured at calibration (`overlap`,
the share of the shorter side hidden behind the longer when both run as the engine runs them):
    layer(r) = c(r) + d(r) - overlap * min(c(r), d(r))
    overlap 1 (a GPU beside the CPU)   the max of the two: r* equalises them,
                                       r_b = (B L + C_gpu - C_cpu) / ((A + B) L), clipped to [0, 1]
    overlap 0 (the device is the CPU)  their sum, linear in r: r* is the cheaper side (calibration
                                       takes it as 0 there, whatever it measures: see calibration.fit)
    in between (a device beside a loaded CPU) a kink at r_b: r* is 0, 1 or r_b.
Where the sides mostly share the host (overlap < SHARED_BELOW), the end is the CPU side (r* = 1)
unless the device side is cheaper by more than TIE_TOLERANCE of its per-token work (with no
overlap: unless B < A / (1 + TIE_TOLERANCE), whatever the fixed costs): there the device path attends
cpu_transfer in place with the same kernel (A / B measured 0.62-1.06 across the presets on a Xeon
host: layout and noise), and r = 1 keeps the KV on one path; the balance point replaces that end
only when the overlap makes it cheaper by MIN_BALANCE_GAIN (at overlap 0.13 the balance of equal
sides is ~8% cheaper than an end).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

TIE_TOLERANCE = 0.15
SHARED_BELOW = 0.5  # overlap under which the sides count as sharing the host
MIN_BALANCE_GAIN = 0.03  # on a shared host, what the balance point must save over the chosen end


@dataclass(frozen=True)
class PerfModel:
    cpu_s_per_token: float  # A
    transfer_s_per_token: float  # B: the device path per token (its name from when it was the copy alone)
    cpu_fixed_s: float = 0.0  # C_cpu (C_dispatch included)
    gpu_fixed_s: float = 0.0  # C_gpu
    overlap: float = 1.0  # share of the shorter side hidden behind the longer: 1 overlapped, 0 one after the other
    cpu_dispatch_s: float = 0.0  # C_dispatch: the part of C_cpu outside the kernel's own seconds (a channel's
    #                              round trip), which the online observations do not contain

    def __post_init__(self):
        for name in ("cpu_s_per_token", "transfer_s_per_token", "cpu_fixed_s", "gpu_fixed_s", "cpu_dispatch_s"):
            value = getattr(self, name)
            if not value >= 0:
                raise ValueError(f"{name} must be >= 0, got {value}")
        if self.cpu_s_per_token + self.transfer_s_per_token <= 0:
            raise ValueError("cpu_s_per_token + transfer_s_per_token must be > 0")
        if not 0 <= self.overlap <= 1:
            raise ValueError(f"overlap must be in [0, 1], got {self.overlap}")
        if self.cpu_dispatch_s > self.cpu_fixed_s:
            raise ValueError(f"cpu_dispatch_s ({self.cpu_dispatch_s}) is part of cpu_fixed_s ({self.cpu_fixed_s})")

    @property
    def shares_host(self) -> bool:
        """The two sides mostly run one after the other (the device is the CPU itself)."""
        return self.overlap < SHARED_BELOW

    def cpu_time_s(self, share: float, num_tokens: int) -> float:
        return share * num_tokens * self.cpu_s_per_token + self.cpu_fixed_s

    def gpu_time_s(self, share: float, num_tokens: int) -> float:
        return (1 - share) * num_tokens * self.transfer_s_per_token + self.gpu_fixed_s

    def step_time_s(self, share: float, num_tokens: int) -> float:
        """One layer's attention: both sides, less the part of the shorter one that overlaps."""
        cpu, device = self.cpu_time_s(share, num_tokens), self.gpu_time_s(share, num_tokens)
        return cpu + device - self.overlap * min(cpu, device)

    def optimal_share(self, num_tokens: int) -> float:
        """r* for num_tokens of KV outside the window (0 when there is none). step_time_s is piecewise
        linear in r with one kink where the sides balance, so its minimum is there or at an end."""
        if num_tokens <= 0:
            return 0.0
        shares = self.candidate_shares(num_tokens)
        return shares[self.choice(num_tokens)]

    def candidate_shares(self, num_tokens: int) -> dict[str, float]:
        """The shares r* can be: the device end, the CPU end, the balance point (clipped to [0, 1])."""
        a, b = self.cpu_s_per_token, self.transfer_s_per_token
        balance = (b * num_tokens + self.gpu_fixed_s - self.cpu_fixed_s) / ((a + b) * num_tokens)
        return {"device": 0.0, "cpu": 1.0, "balance": min(1.0, max(0.0, balance))}

    def choice(self, num_tokens: int) -> str:
        """Which of candidate_shares is r* (num_tokens > 0)."""
        shares = self.candidate_shares(num_tokens)
        time_at = {name: self.step_time_s(r, num_tokens) for name, r in shares.items()}
        if not self.shares_host:
            return min(time_at, key=time_at.get)
        # the tie is a share of the device end's per-token work, not of the layer: a share of the layer
        # grows with the fixed costs, so a load that slows both rates alike (the estimator's
        # cross-scaling) but not the fixed costs would shrink it and move r* with the load
        tie_s = TIE_TOLERANCE * num_tokens * self.transfer_s_per_token
        end = "cpu" if time_at["cpu"] <= time_at["device"] + tie_s else "device"
        # the balance point is a minimum inside (0, 1) only where the overlap makes one: with none,
        # the layer is linear in r and the balance is never cheaper than both ends
        inside = time_at["balance"] < min(time_at["device"], time_at["cpu"])
        return "balance" if inside and time_at["balance"] < time_at[end] * (1 - MIN_BALANCE_GAIN) else end

    def with_cpu_rate(self, cpu_s_per_token: float) -> PerfModel:
        return replace(self, cpu_s_per_token=cpu_s_per_token)

    def with_transfer_rate(self, transfer_s_per_token: float) -> PerfModel:
        return replace(self, transfer_s_per_token=transfer_s_per_token)


@dataclass
class LinearTracker:
    """seconds ~ slope * tokens + intercept, refitted from (tokens, seconds) pairs with exponential
    forgetting: each pair's weight shrinks by (1 - alpha) per later pair, so a step change in the
    truth is followed to within (1 - alpha)^n of it after n pairs (alpha = 0.3: 5% after 9).

    The prior (the calibrated fit) enters as pseudo-pairs: on the slope, `prior_weight` pairs' worth
    that is forgotten like any pair; on the intercept, the same weight held for good. Pairs at one
    token count fix only slope * tokens + intercept there, so a slowdown at a steady length moves the
    slope (as contention for bandwidth does) and the fixed cost stays as calibrated; lengths that
    vary refit both."""

    slope: float
    intercept: float
    alpha: float = 0.3
    prior_weight: float = 1.0
    _sums: list[float] = field(default_factory=lambda: [0.0] * 5)  # weight, x, xx, y, xy

    def __post_init__(self):
        if not 0 < self.alpha <= 1:
            raise ValueError(f"alpha must be in (0, 1], got {self.alpha}")
        self._prior = (self.slope, self.intercept)
        self._slope_prior_weight = self.prior_weight / 10  # the rate gives way first: see above

    def observe(self, tokens: float, seconds: float) -> None:
        if tokens <= 0 or not seconds >= 0 or not math.isfinite(seconds):
            return
        keep = 1 - self.alpha
        w, sx, sxx, sy, sxy = (value * keep for value in self._sums)
        self._sums = [w + 1, sx + tokens, sxx + tokens * tokens, sy + seconds, sxy + tokens * seconds]
        self._slope_prior_weight *= keep
        self._refit(tokens)

    def scale_slope(self, factor: float) -> None:
        """The slope (and its prior) times factor: a change seen on the other side of a shared host."""
        self.slope *= factor
        self._prior = (self._prior[0] * factor, self._prior[1])
        w, sx, sxx, sy, sxy = self._sums  # pairs as if measured at the new rate: y - intercept scaled
        intercept = self.intercept
        self._sums = [w, sx, sxx, intercept * w + (sy - intercept * w) * factor,
                      intercept * sx + (sxy - intercept * sx) * factor]

    def _refit(self, scale: float) -> None:
        """Weighted least squares of the pairs plus the prior, in units where tokens ~ 1."""
        w, sx, sxx, sy, sxy = self._sums
        a0, c0 = self._prior
        x, xx, xy = sx / scale, sxx / scale**2, sxy / scale  # tokens rescaled to ~1: a conditioned solve
        lam_a, lam_c = self._slope_prior_weight, self.prior_weight
        m00, m01, m11 = xx + lam_a, x, w + lam_c
        r0, r1 = xy + lam_a * a0 * scale, sy + lam_c * c0
        det = m00 * m11 - m01 * m01
        slope_scaled = (r0 * m11 - m01 * r1) / det
        intercept = (m00 * r1 - m01 * r0) / det
        if intercept < 0:  # noise can ask for a negative fixed cost: refit the slope with none
            intercept, slope_scaled = 0.0, (xy + lam_a * a0 * scale) / m00
        self.slope = max(slope_scaled / scale, 1e-15)
        self.intercept = intercept


class OnlineEstimator:
    """Corrects a PerfModel from what each decode step measured: per layer, the CPU partial's own
    seconds (the kernel's, never a wait for a lock or a queue) and the device path's wall time,
    each with the tokens it attended. A step's layers are averaged into one (tokens, seconds) pair
    per side (`end_step`), so the forgetting counts steps, whatever the number of layers."""

    def __init__(self, model: PerfModel, alpha: float = 0.3):
        self.model = model
        # the CPU side's observations are the kernel's own seconds: its tracker's fixed cost leaves
        # out the dispatch, added back to the model's
        self.cpu = LinearTracker(model.cpu_s_per_token, model.cpu_fixed_s - model.cpu_dispatch_s, alpha)
        self.device = LinearTracker(model.transfer_s_per_token, model.gpu_fixed_s, alpha)
        self._step: list[list[float]] = [[0.0, 0.0, 0], [0.0, 0.0, 0]]  # per side: tokens, seconds, layers

    @property
    def alpha(self) -> float:
        return self.cpu.alpha

    def observe_cpu(self, num_tokens: int, seconds: float) -> None:
        """A layer's CPU partial (commits at once: for callers outside a step)."""
        self._add(0, num_tokens, seconds)
        self.end_step()

    def observe_transfer(self, num_tokens: int, seconds: float) -> None:
        """A layer's device path (commits at once: for callers outside a step)."""
        self._add(1, num_tokens, seconds)
        self.end_step()

    def observe_layer(self, cpu_tokens: int, cpu_s: float, device_tokens: int, device_s: float) -> None:
        self._add(0, cpu_tokens, cpu_s)
        self._add(1, device_tokens, device_s)

    def end_step(self) -> None:
        """Commits the step's pairs. Where the two sides share the host (model.shares_host), a side seen
        alone moves the other by the same factor: the same cores and memory serve both, so a load on
        the host slows both, and their ratio (which alone decides r* there) is the code paths', not
        the load's. Without this, r* = 1 would leave B as calibrated while contention raised A, and
        the next blocks would go to a device side that is just as slowed."""
        seen = []
        for side, tracker in ((0, self.cpu), (1, self.device)):
            tokens, seconds, layers = self._step[side]
            if layers:
                before = tracker.slope
                tracker.observe(tokens / layers, seconds / layers)
                seen.append((tracker, tracker.slope / before))
        if len(seen) == 1 and self.model.shares_host:
            (tracker, factor), = seen
            other = self.device if tracker is self.cpu else self.cpu
            other.scale_slope(factor)
        self._step = [[0.0, 0.0, 0], [0.0, 0.0, 0]]
        self.model = replace(self.model, cpu_s_per_token=self.cpu.slope,
                             cpu_fixed_s=self.cpu.intercept + self.model.cpu_dispatch_s,
                             transfer_s_per_token=self.device.slope, gpu_fixed_s=self.device.intercept)

    def _add(self, side: int, tokens: int, seconds: float) -> None:
        if tokens > 0 and seconds > 0:
            entry = self._step[side]
            entry[0] += tokens
            entry[1] += seconds
            entry[2] += 1

    def reset_to(self, model: PerfModel) -> None:
        """A new prior (a re-calibration, or a test's change of the truth)."""
        self.__init__(model, self.alpha)
