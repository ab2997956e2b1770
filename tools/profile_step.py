"""Where a decode step's time goes: cProfile over the engine's decode steps (the prefill is left
out), the top functions by own time, and per step the calls that must not grow with the context
(torch.tensor, the attention kernels, copies).

    python tools/profile_step.py --policy all_cpu --batch 4 --context 16384 --steps 16
    python tools/profile_step.py --policy writescope --batch 4 --context 16384 --steps 16 --top 30
"""

from __future__ import annotations

import argparse
import cProfile
import io
import logging
import pstats

import torch

from writescope.engine import Engine
from writescope.policies import policy_argument
from writescope.tools.bench_split import whole_batch_chunk

log = logging.getLogger("profile_step")
# What a step's count of calls is checked on (tests/engine/test_step_work.py): name -> profiler key.
COUNTED = {"torch.tensor": "<built-in method torch.tensor>",
           "cpu kernel": "<built-in method writescope._cpu.paged_attention>",
           "copy_": "<method 'copy_' of 'torch._C.TensorBase' objects>"}


def decoding_engine(preset: str, policy: str, batch: int, context: int, *, block_size: int = 16,
                    window_tokens: int = 256, dtype: str = "bfloat16", max_new_tokens: int = 64):
    """An engine and a generator whose first next() has prefilled `batch` prompts of `context` tokens;
    each further next() is one decode step of the batch. The batch is prefilled in one turn: with
    smaller chunks the first sequences would decode (and could finish) before the last is placed."""
    engine = Engine.from_pretrained(preset, policy=policy, dtype=dtype, max_batch_size=batch,
                                    max_seq_len=context + max_new_tokens, block_size=block_size,
                                    window_tokens=window_tokens, enable_prefix_caching=False,
                                    prefill_chunk_tokens=whole_batch_chunk(batch, context, block_size))
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 256, (context,), generator=generator).tolist() for _ in range(batch)]
    events = engine.generate_stream(prompts, max_new_tokens=max_new_tokens)
    return engine, _steps(engine, events, batch)


def _steps(engine, events, batch: int):
    """Yields once the whole batch is prefilled (with chunked prefill the first sequences may decode
    before the last is prefilled: those steps are not yielded), then after each decode step."""
    steps = None
    for _ in events:
        if steps is None:
            if len(engine.cache.seqs) == batch and all(
                    len(s.prefilled_layers) == engine.config.num_layers for s in engine.cache.seqs.values()):
                steps = engine.stats["steps"]
                yield 0
        elif engine.stats["steps"] != steps:
            steps = engine.stats["steps"]
            yield steps


def profile_steps(steps, count: int) -> pstats.Stats:
    """cProfile over the next `count` decode steps of a _steps generator."""
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(count):
        next(steps)
    profiler.disable()
    return pstats.Stats(profiler)


def calls_per_step(stats: pstats.Stats, steps: int) -> dict[str, float]:
    counts = {name: 0 for name in COUNTED}
    for (file, _line, function), (_, calls, *_rest) in stats.stats.items():
        for name, wanted in COUNTED.items():
            if file == "~" and function == wanted:
                counts[name] += calls
    return {name: calls / steps for name, calls in counts.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="tiny-qwen3-moe")
    parser.add_argument("--policy", default="all_cpu", type=policy_argument, help="a named policy or share:R")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--context", type=int, default=16384)
    parser.add_argument("--steps", type=int, default=16, help="decode steps profiled (after 2 warm-up steps)")
    parser.add_argument("--top", type=int, default=25, help="functions shown, by own time")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    engine, steps = decoding_engine(args.preset, args.policy, args.batch, args.context,
                                    max_new_tokens=args.steps + 8)
    try:
        next(steps)  # prefilled
        for _ in range(2):  # warm-up
            next(steps)
        decode_s = engine.stats["decode_s"]
        stats = profile_steps(steps, args.steps)
        step_ms = (engine.stats["decode_s"] - decode_s) / args.steps * 1e3
    finally:
        engine.shutdown()
    text = io.StringIO()
    stats.stream = text
    stats.sort_stats("tottime").print_stats(args.top)
    print(text.getvalue())  # noqa: T201 - the tool's output
    print(f"{args.policy}, batch {args.batch} x {args.context}: {step_ms:.2f} ms a step under the profiler; "  # noqa: T201
          f"per step: {calls_per_step(stats, args.steps)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
