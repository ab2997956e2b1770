"""MLA's absorbed attention on a CPU, timed through the engine's own model code: one layer's
attention inputs (the query projected, then absorbed into the latent: q_nope x W_UK) and its output
(the latent back through W_UV, then o_proj). Two ways take turns on the same inputs: W_UK and W_UV in
float32, which the model keeps on a CPU, and in the checkpoint's bf16, as it kept them before (torch's
bf16 batched matmul on a CPU without bf16 dot products runs a plain loop).

The layer has the attention shape of a paper model (core/data/paper_models.json; the default is
DeepSeek-V2-Lite: 16 heads, 128 + 64 query dims, a 512-dim latent) and random weights; its hidden
size is the model's, its feed-forward and vocabulary are cut down (they are not timed). Reports each
way's median per batch size and their ratio, and the largest difference between their outputs
against the size of the outputs (bf16 rounding: both sum in float32 and round once).

    python tools/bench_absorb.py --batches 1 4 --rounds 20 --out bench_results/absorb.json
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time

import torch

from writescope.hardware_profiles import known_models, load_model_shape
from writescope.models.checkpoint import expected_shapes
from writescope.models.config import ModelConfig
from writescope.models.moe_model import MoEModel
from writescope.tools.results import check_positive, host_info, write_json

log = logging.getLogger("bench_absorb")
WAYS = ("float32", "bf16")


def one_layer_model(name: str) -> MoEModel:
    """One MLA layer of the named model's attention shape, random bf16 weights, on the CPU."""
    shape = load_model_shape(name)
    if shape.get("kv_lora_rank") is None:
        mla = [m for m in known_models() if load_model_shape(m).get("kv_lora_rank")]
        raise ValueError(f"--model {name!r} has no MLA latent; MLA models: {', '.join(mla)}")
    data = {**shape, "num_hidden_layers": 1, "first_k_dense_replace": 1, "intermediate_size": 64,
            "vocab_size": 256}
    config = ModelConfig.from_hf(data)
    generator = torch.Generator().manual_seed(0)
    weights = {name: (torch.randn(size, generator=generator) * 0.02).to(torch.bfloat16)
               for name, size in expected_shapes(config).items()}
    return MoEModel(config, weights, device="cpu")


def use_absorbed(model: MoEModel, dtype: torch.dtype) -> None:
    for name in ("absorbed.0.w_uk", "absorbed.0.w_uv"):
        model.w[name] = model.w[name].to(dtype)


def layer_call(model: MoEModel, batch: int):
    """A function running layer 0's attention inputs and output for `batch` tokens -> (q, out)."""
    cfg = model.config
    generator = torch.Generator().manual_seed(batch)
    hidden = torch.randn(batch, cfg.hidden_size, generator=generator).to(torch.bfloat16)
    attention = torch.randn(batch, cfg.num_q_heads, cfg.decode_head_dim_v, generator=generator)
    rope = model.rope(torch.arange(batch))

    def call():
        q, _ = model.attention_inputs(0, hidden, rope)
        return q, model.attention_output(0, attention, hidden)
    return call


def measure(model: MoEModel, batch: int, rounds: int) -> dict:
    """Each way's median seconds over `rounds` turns (after one untimed call each), and how far apart
    their outputs are."""
    call = layer_call(model, batch)
    float32_weights = {n: model.w[n] for n in ("absorbed.0.w_uk", "absorbed.0.w_uv")}
    seconds = {way: [] for way in WAYS}
    outputs = {}
    try:
        for turn in range(rounds + 1):
            for way in WAYS:
                if way == "bf16":
                    use_absorbed(model, torch.bfloat16)
                else:
                    model.w.update(float32_weights)
                start = time.perf_counter()
                outputs[way] = call()
                if turn:
                    seconds[way].append(time.perf_counter() - start)
    finally:
        model.w.update(float32_weights)
    (q32, out32), (q16, out16) = outputs["float32"], outputs["bf16"]
    medians = {way: statistics.median(times) for way, times in seconds.items()}
    return {"batch": batch, **{f"{way}_ms": medians[way] * 1e3 for way in WAYS},
            "speedup": medians["bf16"] / medians["float32"],
            "q_max_diff": (q32.float() - q16.float()).abs().max().item(), "q_max": q16.float().abs().max().item(),
            "out_max_diff": (out32.float() - out16.float()).abs().max().item(),
            "out_max": out16.float().abs().max().item()}


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="deepseek-v2-lite", help="an MLA model of paper_models.json")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4], help="decode tokens a call")
    parser.add_argument("--rounds", type=int, default=20, help="timed turns of each way")
    parser.add_argument("--out", default="bench_results/absorb.json", help="JSON output path")
    args = parser.parse_args(argv)
    check_positive(parser, args, ["rounds"])
    if min(args.batches) < 1:
        parser.error(f"--batches must be >= 1, got {args.batches}")
    if args.model not in known_models():
        parser.error(f"--model {args.model!r} is unknown; known: {', '.join(known_models())}")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        model = one_layer_model(args.model)
    except ValueError as error:
        parser.error(str(error))
    rows = [measure(model, batch, args.rounds) for batch in args.batches]
    write_json(args.out, {"host": host_info(), "model": args.model, "rows": rows})
    print(f"{args.model}, one layer's attention inputs and output on the CPU")
    print("| batch | W_UK, W_UV float32 ms | bf16 ms | bf16 / float32 | max diff q (of max) | max diff out (of max) |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['batch']} | {r['float32_ms']:.3f} | {r['bf16_ms']:.3f} | {r['speedup']:.1f}x "
              f"| {r['q_max_diff']:.2g} ({r['q_max']:.2g}) | {r['out_max_diff']:.2g} ({r['out_max']:.2g}) |")
    return rows


if __name__ == "__main__":
    main()
