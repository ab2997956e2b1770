"""The policy store actor and the GPU worker's view of it.

`PolicyStore` holds the placement policy (the perf model, r* and the online correction) so
that it outlives the GPU worker: a restarted worker takes the running policy back. The GPU worker
routes each sealed block with a `RemotePolicy`: its own copy of that policy, corrected at every
decode step from the times the step measured (r* follows a contention change at once, no call in
the step's path), and published to the policy store every SYNC_STEPS steps with one call that
nothing waits for.
"""

from __future__ import annotations

import os

import ray

from writescope.policies import Policy, make_policy


@ray.remote(num_cpus=0, max_restarts=-1, max_task_retries=-1)
class PolicyStore:
    """The policy object (model, online correction, steps seen) as the GPU worker last published it.
    Lost on a restart of this actor; the GPU worker's next publication restores it."""

    def __init__(self):
        self.policy: Policy | None = None
        self.steps = 0

    def configure(self, policy_name: str, model=None) -> Policy:
        """The policy, made on the first call; a restarted GPU worker gets the one already running."""
        if self.policy is None or self.policy.name != policy_name:
            self.policy, self.steps = make_policy(policy_name, model), 0
        return self.policy

    def calibrated(self, model) -> Policy:
        """The GPU worker's calibration: the policy's model, unless it has learned from steps already
        (a restarted GPU worker then keeps what the running policy knows)."""
        if self.steps == 0 and hasattr(self.policy, "estimator"):
            self.policy.estimator.reset_to(model)
        return self.policy

    def publish(self, policy: Policy, steps: int) -> None:
        """The GPU worker's policy after `steps` more decode steps."""
        self.policy = policy
        self.steps += steps

    def state(self) -> dict:
        model = getattr(self.policy, "model", None)
        return {"policy": self.policy.name if self.policy else None, "steps": self.steps,
                "share_at_32k": self.policy.preview_share(32768) if self.policy else None,
                "model": vars(model) if model is not None else None}

    def pid(self) -> int:
        return os.getpid()

    def check_health(self) -> bool:
        """A policy is held: the GPU worker configures one as it starts (False before, or after a
        restart of this actor that no GPU worker has configured again)."""
        return self.policy is not None


# Decode steps between two publications of the GPU worker's policy to the policy store: a call per
# step cost the GPU worker and the policy store a Ray call each step (on a 2-core host, measured: ~5%
# of a 4 x 16K step with a reply awaited every 4 steps); a restarted worker loses at most these.
SYNC_STEPS = 8


class RemotePolicy(Policy):
    """The GPU worker's policy: the policy store's, kept and corrected here, published back."""

    def __init__(self, policy_store, snapshot: Policy, sync_steps: int = SYNC_STEPS):
        self.name = snapshot.name
        self.ships_cpu_compute = snapshot.ships_cpu_compute
        self._policy_store = policy_store
        self._policy = snapshot
        self._learns = type(snapshot).observe_step is not Policy.observe_step  # fixed shares ignore samples
        self._sync_steps = sync_steps
        self._unpublished = 0

    def share(self, batch_tokens: int) -> float:
        return self._policy.share(batch_tokens)

    def preview_share(self, batch_tokens: int) -> float:
        return self._policy.preview_share(batch_tokens)

    def reset(self, snapshot: Policy) -> None:
        """The policy store's policy again (after calibration), at once."""
        self._policy = snapshot

    def observe_step(self, cpu_tokens: int, cpu_s: float, transfer_tokens: int, transfer_s: float) -> None:
        if self._learns:
            self._policy.observe_step(cpu_tokens, cpu_s, transfer_tokens, transfer_s)

    def end_step(self) -> None:
        if not self._learns:
            return
        self._policy.end_step()
        self._unpublished += 1
        if self._unpublished >= self._sync_steps:
            self._policy_store.publish.remote(self._policy, self._unpublished)  # nothing waits for it
            self._unpublished = 0
