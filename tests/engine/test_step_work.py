"""The decode step's Python-level work does not grow with the context: the same number of tensor
constructions, kernel calls and copies per step at 2K and at 8K tokens (4x the sealed blocks), and
one device partial per layer. Counted with cProfile over real decode steps (tools/profile_step.py)."""

import pytest

from writescope.tools.profile_step import calls_per_step, decoding_engine, profile_steps

STEPS = 6


def work_per_step(policy: str, context: int) -> dict[str, float]:
    engine, steps = decoding_engine("tiny-qwen3-moe", policy, batch=2, context=context, block_size=4,
                                    window_tokens=16, max_new_tokens=STEPS + 4)
    try:
        next(steps)  # prefilled
        next(steps)  # one warm-up step
        stats = profile_steps(steps, STEPS)
    finally:
        engine.shutdown()
    counts = calls_per_step(stats, STEPS)
    for (file, _, function), (_, calls, *_rest) in stats.stats.items():
        if (file.endswith("engine.py") and function == "_device_partial") or \
                (file.endswith(("ops.py", "cpu_partial.py")) and function == "attend"):  # each side's attend
            counts[function] = counts.get(function, 0) + calls / STEPS
    return counts


@pytest.mark.parametrize("policy", ["all_cpu", "writescope", "fixed_half", "all_transfer", "monolithic"])
def test_a_step_does_the_same_work_at_any_context(policy):
    short, long = work_per_step(policy, 2048), work_per_step(policy, 8192)
    assert short == long, f"{policy}: per step at 2K {short}, at 8K {long}"
    layers = 4  # tiny-qwen3-moe
    assert long["_device_partial"] == layers  # one device partial per layer
    cpu_side = 0 if policy == "monolithic" else 1  # monolithic ships cpu_compute to the device side
    shipped = 1 if policy == "monolithic" else 0
    assert long["attend"] == layers * (1 + cpu_side + shipped)
    assert long["torch.tensor"] <= 6  # the step's few small tensors (tokens, positions, slots), not per block
