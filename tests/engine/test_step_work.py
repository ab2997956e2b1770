"""The decode step's Python-level work does not grow with the context: the same number of tensor
constructions, kernel calls and copies per step at 2K and at 8K tokens (4x the sealed blocks), and
one device partial per layer. Counted with cProfile over real decode steps (tools/profile_step.py)."""

import pytest
import torch

from writescope.engine import placement
from writescope.tools.profile_step import calls_per_step, decoding_engine, profile_steps

STEPS = 6


def work_per_step(policy: str, context: int) -> tuple[dict[str, float], int]:
    """(calls per step, host regions holding KV)."""
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
    return counts, sum(placed[region] > 0 for region in ("cpu_compute", "cpu_transfer"))


@pytest.mark.parametrize("policy", ["all_cpu", "writescope", "fixed_half", "all_transfer", "monolithic"])
def test_a_step_does_the_same_work_at_any_context(policy):
    (short, short_regions), (long, long_regions) = work_per_step(policy, 2048), work_per_step(policy, 8192)
    layers = 4  # tiny-qwen3-moe
    # writescope's share is the r* calibrated on this host: at one length its KV may all go to one host
    # region and at the other to both, and a region in use costs one kernel call per layer (a CPU-only
    # host attends cpu_transfer in place). Nothing else may differ.
    extra_region_calls = layers * (long_regions - short_regions)
    assert policy == "writescope" or extra_region_calls == 0
    assert {**short, "cpu kernel": short["cpu kernel"] + extra_region_calls} == long, \
        f"{policy}: per step at 2K {short} ({short_regions} host regions), at 8K {long} ({long_regions})"
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
