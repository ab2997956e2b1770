"""Placement policies behind one interface: where new KV blocks go, and who attends what.

Residency is fixed at write time, so a policy acts only on future writes (prefill routing and
window flushes); placed KV never moves. Baselines are policies on the same engine:

    writescope    follow r* of the (online-corrected) perf model
    all_transfer  r = 0: everything spilled is shipped to the GPU (SolidAttention / FlexGen style)
    all_cpu       r = 1: everything spilled is attended on the CPU (FastDecode / KTransformers style)
    fixed_half    r = 0.5
    share:R       r = R, any R in [0, 1] (the sweep of tools/bench_split.py)
    monolithic    one cache in one physical state (unpinned host memory), shipped whole to the GPU
                  every step with pageable copies, as transformers' offloaded cache does
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod

from writescope.kv_format import Region
from writescope.perf_model import OnlineEstimator, PerfModel

SWITCH_GAIN = 0.10  # what a new choice of r* must save over the current one, on a shared host


class Policy(ABC):
    name: str
    # True: the KV in cpu_compute is shipped to the device each step and attended there (pageable copies)
    ships_cpu_compute: bool = False

    @abstractmethod
    def share(self, batch_tokens: int) -> float:
        """The CPU share r wanted for a batch holding batch_tokens of KV outside the GPU window."""

    def preview_share(self, batch_tokens: int) -> float:
        """What share() would answer now, without taking it as a choice: for reports and metrics,
        which must not steer where the next blocks go."""
        return self.share(batch_tokens)

    def observe_step(self, cpu_tokens: int, cpu_s: float, transfer_tokens: int, transfer_s: float) -> None:
        """Measured times of one layer's step; fixed policies ignore them."""
        return None

    def end_step(self) -> None:
        """Called once after every decode step (a policy kept elsewhere syncs here)."""
        return None

    def route_blocks(self, cpu_tokens: int, total_tokens: int, new_block_tokens: list[int],
                     batch_tokens: int) -> list[Region]:
        """Regions of a sequence's next sealed blocks, in order.

        cpu_tokens of the sequence's total_tokens already placed are in cpu_compute; each new block
        goes where the sequence's CPU token count lands closest to r * (tokens placed), so the
        placed share stays within half a block of r while r is steady.
        """
        share = self.share(batch_tokens)
        regions = []
        for block_tokens in new_block_tokens:
            total_tokens += block_tokens
            to_cpu = cpu_tokens + block_tokens / 2 < share * total_tokens
            regions.append(Region.CPU_COMPUTE if to_cpu else Region.CPU_TRANSFER)
            cpu_tokens += block_tokens if to_cpu else 0
        return regions


class FixedSharePolicy(Policy):
    def __init__(self, name: str, share: float):
        if not 0 <= share <= 1:
            raise ValueError(f"share must be in [0, 1], got {share}")
        self.name = name
        self._share = share

    def share(self, batch_tokens: int) -> float:
        return self._share


class MonolithicPolicy(Policy):
    name = "monolithic"
    ships_cpu_compute = True

    def share(self, batch_tokens: int) -> float:
        return 1.0  # every block lands in the one unpinned cache; the GPU attends it after shipping


class WriteScopePolicy(Policy):
    name = "writescope"

    def __init__(self, model: PerfModel, *, alpha: float = 0.3):
        self.estimator = OnlineEstimator(model, alpha=alpha)
        self._choice: str | None = None  # the candidate of the last share() (see share)

    @property
    def model(self) -> PerfModel:
        return self.estimator.model

    def share(self, batch_tokens: int) -> float:
        """r* of the corrected model. Where the sides share the host r* is one of three candidates
        (an end or the balance point), chosen by margins; a new choice is taken only when the model
        says it saves SWITCH_GAIN over the current one, so noise in the online estimates does not
        flip new blocks between the sides step after step."""
        if batch_tokens <= 0:
            return 0.0
        choice, share = self._choose(batch_tokens)
        self._choice = choice
        return share

    def preview_share(self, batch_tokens: int) -> float:
        return self._choose(batch_tokens)[1] if batch_tokens > 0 else 0.0

    def _choose(self, batch_tokens: int) -> tuple[str, float]:
        """(candidate, r) that share() takes for batch_tokens > 0 given the current choice."""
        model = self.model
        shares = model.candidate_shares(batch_tokens)
        choice = model.choice(batch_tokens)
        if model.shares_host and self._choice is not None and choice != self._choice:
            kept_s = model.step_time_s(shares[self._choice], batch_tokens)
            if kept_s <= model.step_time_s(shares[choice], batch_tokens) * (1 + SWITCH_GAIN):
                choice = self._choice
        return choice, shares[choice]

    def observe_step(self, cpu_tokens: int, cpu_s: float, transfer_tokens: int, transfer_s: float) -> None:
        """One layer of the step: the CPU partial's own seconds, the device path's wall seconds."""
        self.estimator.observe_layer(cpu_tokens, cpu_s, transfer_tokens, transfer_s)

    def end_step(self) -> None:
        self.estimator.end_step()


POLICY_NAMES = ("writescope", "all_transfer", "all_cpu", "fixed_half", "monolithic")
SHARE_PREFIX = "share:"


def unknown_policy(name) -> str:
    """What a bad policy name is told: the names allowed."""
    return f"unknown policy {name!r}; known: {', '.join(POLICY_NAMES)}, or share:R with R in [0, 1]"


def check_policy(policy) -> None:
    """A Policy object, a named policy or share:R; else ValueError naming what is allowed."""
    if not isinstance(policy, Policy) and not is_policy_name(policy):
        raise ValueError(unknown_policy(policy))


def is_policy_name(name) -> bool:
    """A named policy, or share:R with R in [0, 1]."""
    if name in POLICY_NAMES:
        return True
    try:
        _parse_share(name)
        return True
    except ValueError:
        return False


def policy_argument(text: str) -> str:
    """argparse type of a --policy flag: a named policy or share:R, else a message of what is allowed."""
    import argparse

    if not is_policy_name(text):
        raise argparse.ArgumentTypeError(unknown_policy(text))
    return text


def _parse_share(name) -> float:
    if not isinstance(name, str) or not name.startswith(SHARE_PREFIX):
        raise ValueError(unknown_policy(name))
    try:
        share = float(name[len(SHARE_PREFIX):])
    except ValueError:
        share = math.nan
    if not 0 <= share <= 1:
        raise ValueError(f"policy {name!r}: R must be a number in [0, 1]")
    return share


def make_policy(name: str, model: PerfModel | None = None) -> Policy:
    """A policy by name; `writescope` needs the calibrated model."""
    if name == "writescope":
        if model is None:
            raise ValueError("the writescope policy needs a PerfModel (calibrate first)")
        return WriteScopePolicy(model)
    fixed = {"all_transfer": 0.0, "all_cpu": 1.0, "fixed_half": 0.5}
    if name in fixed:
        return FixedSharePolicy(name, fixed[name])
    if isinstance(name, str) and name.startswith(SHARE_PREFIX):
        return FixedSharePolicy(name, _parse_share(name))
    if name == "monolithic":
        return MonolithicPolicy()
    raise ValueError(unknown_policy(name))
