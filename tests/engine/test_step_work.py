"""The decode step's Python-level work does not grow with the context: the same number of tensor
constructions, kernel calls and copies per step at 2K and at 8K tokens (4x the sealed blocks), and
one device partial per layer. Counted with cProfile over real decode steps (tools/profile_step.py)."""

import pytest
import torch

from writescope.engine import placement
from writescope.tools.profile_step import calls_per_step, decoding_engine, profile_steps

STEPS = 6


def work_per_step(policy: str, context: int) -> tuple[dict[str, float], int]:
    """(calls per step, how many of cpu_compute and cpu_transfer hold KV)."""
    engine, steps = decoding_engine("tiny-qwen3-moe", policy, batch=2, context=context, block_size=4,
                                    window_tokens=16, max_new_tokens=STEPS + 4)
    try:
        next(steps)  # prefilled
        next(steps)  # one warm-up step
        stats = profile_steps(steps, STEPS)
        placed = placement(engine)["placed_tokens"]
    finally:
        engine.shutdown()
    counts = calls_per_step(stats, STEPS)
    for (file, _, function), (_, calls, *_rest) in stats.stats.items():
        if (file.endswith("engine.py") and function == "_device_partial") or \
                (file.endswith(("ops.py", "executor.py")) and function == "attend"):  # each side's attend
            counts[function] = counts.get(function, 0) + calls / STEPS
    return counts, int(placed["cpu_compute"] > 0) + int(placed["cpu_transfer"] > 0)


# Each policy at both lengths, and one pair of fixed shares that puts the KV in cpu_compute at 2K and
# in cpu_transfer at 8K: what writescope's calibrated share may do on a given host, made certain.
POLICY_PAIRS = [(policy, policy) for policy in ("all_cpu", "writescope", "fixed_half", "all_transfer", "monolithic")]
POLICY_PAIRS.append(("share:1", "share:0"))


@pytest.mark.parametrize(("short_policy", "long_policy"), POLICY_PAIRS,
                         ids=[short if short == long else f"{short}-then-{long}" for short, long in POLICY_PAIRS])
def test_a_step_does_the_same_work_at_any_context(short_policy, long_policy):
    policy = long_policy
    short, short_regions = work_per_step(short_policy, 2048)
    long, long_regions = work_per_step(long_policy, 8192)
    layers = 4  # tiny-qwen3-moe
    # A host region costs one kernel call per layer when it holds tokens and none when it is empty (a
    # CPU-only host attends cpu_transfer in place). writescope's share is the r* calibrated on this host,
    # so one length may use a region the other does not. Nothing else may differ.
    extra_region_calls = layers * (long_regions - short_regions)
    if short_policy == "share:1":  # all in cpu_compute, then all in cpu_transfer: one region each
        assert (short_regions, long_regions) == (1, 1)
    elif policy != "writescope":
        assert extra_region_calls == 0
    assert {**short, "cpu kernel": short["cpu kernel"] + extra_region_calls} == long, \
        f"{policy}: per step at 2K {short} (host regions in use: {short_regions}), " \
        f"at 8K {long} ({long_regions})"
    # the window's call, and one per host region in use (monolithic ships cpu_compute to the device side)
    assert long["cpu kernel"] == layers * (1 + long_regions)
    assert long["_device_partial"] == layers  # one device partial per layer
    cpu_side = 0 if policy == "monolithic" else 1  # monolithic ships cpu_compute to the device side
    shipped = 1 if policy == "monolithic" else 0
    assert long["attend"] == layers * (1 + cpu_side + shipped)
    assert long["torch.tensor"] <= 6  # the step's few small tensors (tokens, positions, slots), not per block


def test_the_whole_decode_step_runs_at_the_decode_threads():
    """The step's rope and sampling run at the engine's decode_threads as its layers do: an op at more
    torch threads leaves them spinning into the layers' CPU kernel (measured: the kernel 1.28x slower
    at 4 x 8K on a 2-vCPU host). Between steps torch is back at the threads it had."""
    threads_before = torch.get_num_threads()
    torch.set_num_threads(2)
    engine, steps = decoding_engine("tiny-qwen3-moe", "all_cpu", batch=1, context=256, block_size=4,
                                    window_tokens=16, max_new_tokens=4)
    seen = []

    def recorded(name, fn):
        def wrapper(*args, **kwargs):
            seen.append((name, torch.get_num_threads()))
            return fn(*args, **kwargs)
        return wrapper

    try:
        assert engine.decode_threads == 1  # a CPU-only engine's
        engine.model.rope = recorded("rope", engine.model.rope)
        engine._sample = recorded("sample", engine._sample)
        next(steps)  # prefilled
        seen.clear()
        next(steps)  # one decode step
        assert torch.get_num_threads() == 2
    finally:
        engine.shutdown()
        torch.set_num_threads(threads_before)
    assert sorted({name for name, _ in seen}) == ["rope", "sample"], seen
    assert {threads for _, threads in seen} == {1}, seen
