"""End-to-end decode speed: every policy of the engine against transformers' generate on the same
weights, in the same run.

For each context length and batch size: decode tok/s = batch / the median decode step time, for the
engine under every policy and for transformers (`generate`, greedy, its default dynamic cache). The
first WARMUP_STEPS steps of each are left out: they pay one-time costs (Triton compiling kernels for
new shapes, CUDA's first launches) that would otherwise decide the ranking by run order. The preset's weights are
saved as a Hugging Face checkpoint first, and both sides load that directory.

    python tools/bench_e2e.py --out bench_results/e2e.json
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import tempfile
import time

import torch
from safetensors.torch import save_file
from tqdm import tqdm

from writescope.engine import Engine
from writescope.models.presets import PRESETS, preset_config, preset_weights
from writescope.policies import POLICY_NAMES, policy_argument
from writescope.tools.bench_split import whole_batch_chunk
from writescope.tools.results import write_json

log = logging.getLogger("bench_e2e")
WARMUP_STEPS = 2


def median_step_tok_s(step_ends: list[float], batch: int) -> float:
    """batch / the median gap between consecutive decode-step ends, leaving the first WARMUP_STEPS out."""
    gaps = [b - a for a, b in zip(step_ends, step_ends[1:], strict=False)][WARMUP_STEPS:]
    if not gaps:
        raise ValueError(f"need more than {WARMUP_STEPS + 1} decode steps: raise --new-tokens")
    return batch / statistics.median(gaps)


def save_preset(preset: str, path: str) -> None:
    config = preset_config(preset)
    weights = preset_weights(config, torch.float32)
    save_file({k: v.contiguous() for k, v in weights.items()}, os.path.join(path, "model.safetensors"))
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({**PRESETS[preset], "dtype": "float32", "eos_token_id": None}, f)


def engine_tok_s(path, policy, prompts, new_tokens, dtype, device="cpu", executor="local") -> dict:
    # The whole batch prefilled in one turn (as transformers' generate does), so the events after the
    # first len(prompts) are whole-batch decode steps.
    engine = Engine.from_pretrained(path, policy=policy, dtype=dtype, max_batch_size=len(prompts),
                                    max_seq_len=len(prompts[0]) + new_tokens, device=device, executor=executor,
                                    prefill_chunk_tokens=whole_batch_chunk(len(prompts), len(prompts[0]), 16),
                                    enable_prefix_caching=False)
    try:
        started, step_ends = time.perf_counter(), []
        for count, _ in enumerate(engine.generate_stream(prompts, max_new_tokens=new_tokens), start=1):
            if count % len(prompts) == 0:  # the first: every sequence prefilled; then one per decode step
                step_ends.append(time.perf_counter())
        return {"prefill_s": step_ends[0] - started, "decode_tok_s": median_step_tok_s(step_ends, len(prompts)),
                "kernel_share": kernel_share(engine.step_history)}
    finally:
        engine.shutdown()


def kernel_share(history) -> float:
    """The median over decode steps (warm-up left out) of the share of the step spent in attention:
    the CPU partial and the device partial as the engine timed them inside the step."""
    shares = [times.attention_s / times.step_s for times in list(history)[WARMUP_STEPS:]]
    return statistics.median(shares) if shares else float("nan")


class _StepClock:
    """A logits processor: transformers calls it once per generated token, right after that step's
    forward pass, so its timestamps bracket the decode steps exactly (prefill excluded)."""

    def __init__(self):
        self.times = []

    def __call__(self, input_ids, scores):
        self.times.append(time.perf_counter())
        return scores


def transformers_tok_s(path, prompts, new_tokens, dtype, device="cpu") -> dict:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).eval().to(device)
    ids = torch.tensor(prompts, device=device)
    clock = _StepClock()
    with torch.no_grad():
        model.generate(ids[:, :16], max_new_tokens=2, do_sample=False, pad_token_id=0)  # warm-up
        started = time.perf_counter()
        model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0,
                       logits_processor=transformers.LogitsProcessorList([clock]))
    return {"prefill_s": clock.times[0] - started, "decode_tok_s": median_step_tok_s(clock.times, len(prompts))}


def main(argv: list[str] | None = None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="tiny-qwen3-moe", choices=list(PRESETS), help="model preset")
    parser.add_argument("--contexts", type=int, nargs="+", default=[2048, 8192, 32768], help="prompt tokens")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4], help="batch sizes")
    # 64: the medians are over the decode steps after the warm-up; with 16 (14 steps) one slow stretch
    # of a shared host moved a row's kernel share by 0.05 (Ray, 4 x 32K, Zen 4: 0.76-0.79, then 0.81
    # with 64).
    parser.add_argument("--new-tokens", type=int, default=64, help="tokens generated per sequence")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="weights and KV dtype")
    parser.add_argument("--policies", nargs="+", default=list(POLICY_NAMES), type=policy_argument,
                        help="policies: the named ones, or share:R")
    parser.add_argument("--device", default="cpu", help="device of the engine and of transformers (cuda on a GPU)")
    parser.add_argument("--executor", default="local", choices=["local", "ray"],
                        help="the engine's executor (ray: its actors on an embedded local Ray)")
    parser.add_argument("--out", default="bench_results/e2e.json", help="JSON output path")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.executor == "ray":
        from writescope.actors.local_ray import ensure_ray

        ensure_ray()
    rows = []
    with tempfile.TemporaryDirectory() as path:
        save_preset(args.preset, path)
        bar = tqdm(total=len(args.contexts) * len(args.batches) * (len(args.policies) + 1), desc="runs", unit="run")
        for context in args.contexts:
            for batch in args.batches:
                generator = torch.Generator().manual_seed(context + batch)
                prompts = torch.randint(0, 256, (batch, context), generator=generator).tolist()
                row = {"context": context, "batch": batch,
                       "transformers": transformers_tok_s(path, prompts, args.new_tokens, args.dtype, args.device)}
                bar.update(1)
                for policy in args.policies:
                    row[policy] = engine_tok_s(path, policy, prompts, args.new_tokens, args.dtype, args.device,
                                               args.executor)
                    bar.update(1)
                log.info("%s", json.dumps(row))
                rows.append(row)
    bar.close()
    write_json(args.out, {"args": vars(args), "rows": rows})
    print(table(rows, args.policies))  # noqa: T201 - the tool's output


def table(rows: list[dict], policies: list[str]) -> str:
    """Decode tok/s per policy with its kernel share in parentheses, and the best against transformers."""
    header = ["context", "batch", "transformers", *policies, "best vs transformers"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in rows:
        ours = [r[p]["decode_tok_s"] for p in policies]
        cells = [f"{r['context'] // 1024}K", str(r["batch"]), f"{r['transformers']['decode_tok_s']:.1f}",
                 *[f"{r[p]['decode_tok_s']:.1f} ({r[p]['kernel_share']:.2f})" for p in policies],
                 f"{max(ours) / r['transformers']['decode_tok_s']:.1f}x"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
