"""The WriteScope scheduler actor and the GPU worker's view of it.

`WriteScopeScheduler` is authoritative for the placement policy: the perf model, r* and the EWMA
correction fed by the times the workers measure. The GPU worker routes each sealed block with a
`RemotePolicy`: a snapshot of the scheduler's policy, refreshed once per decode step without
waiting (the step's measurements go out with one call, the updated policy comes back by the next
step), so no layer waits on the scheduler.
"""

from __future__ import annotations

import logging
import os

import ray

from writescope.policies import Policy, make_policy

log = logging.getLogger(__name__)


@ray.remote(num_cpus=0, max_restarts=-1, max_task_retries=-1)
class WriteScopeScheduler:
    """Authoritative: the policy object (model, EWMA, steps seen). Lost on a restart of this actor;
    the GPU worker then restores it from its last snapshot (`restore`)."""

    def __init__(self):
        self.policy: Policy | None = None
        self.steps = 0

    def configure(self, policy_name: str, model=None) -> Policy:
        """The policy, made on the first call; a restarted GPU worker gets the one already running."""
        if self.policy is None or self.policy.name != policy_name:
            self.policy, self.steps = make_policy(policy_name, model), 0
        return self.policy

    def restore(self, snapshot: Policy) -> Policy:
        if self.policy is None:
            self.policy = snapshot
        return self.policy

    def observe(self, samples: list[tuple[int, float, int, float]]) -> Policy:
        """One decode step's (cpu_tokens, cpu_s, transfer_tokens, transfer_s) per layer -> the updated policy."""
        for sample in samples:
            self.policy.observe_step(*sample)
        self.policy.end_step()
        self.steps += 1
        return self.policy

    def state(self) -> dict:
        model = getattr(self.policy, "model", None)
        return {"policy": self.policy.name if self.policy else None, "steps": self.steps,
                "share_at_32k": self.policy.share(32768) if self.policy else None,
                "model": vars(model) if model is not None else None}

    def pid(self) -> int:
        return os.getpid()

    def check_health(self) -> bool:
        return True


class RemotePolicy(Policy):
    """The GPU worker's policy: decisions from a local snapshot of the scheduler's policy."""

    def __init__(self, scheduler, snapshot: Policy):
        self.name = snapshot.name
        self.ships_cpu_compute = snapshot.ships_cpu_compute
        self._scheduler = scheduler
        self._snapshot = snapshot
        self._learns = type(snapshot).observe_step is not Policy.observe_step  # fixed shares ignore samples
        self._samples: list[tuple[int, float, int, float]] = []
        self._pending = None

    def share(self, batch_tokens: int) -> float:
        return self._snapshot.share(batch_tokens)

    def observe_step(self, cpu_tokens: int, cpu_s: float, transfer_tokens: int, transfer_s: float) -> None:
        if self._learns:
            self._samples.append((cpu_tokens, cpu_s, transfer_tokens, transfer_s))

    def end_step(self) -> None:
        # a concurrent.futures view of the reply: polled without blocking (and without ray.get,
        # which Ray warns about inside the GPU worker's async actor)
        if self._pending is not None and self._pending.done():
            try:
                self._snapshot = self._pending.result()
            except ray.exceptions.RayError as error:  # the scheduler restarted: give it our state back
                log.warning("scheduler call failed (%s): restoring it from this worker's snapshot", error)
                self._scheduler.restore.remote(self._snapshot)
            self._pending = None
        if self._samples and self._pending is None:
            self._pending = self._scheduler.observe.remote(self._samples).future()
            self._samples = []
