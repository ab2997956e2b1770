"""The split checked against a sweep: the median decode step under fixed CPU shares r = 0, 0.1, ... 1
and under every named policy, for each context length and batch size, in one run.

Every engine shares one model (its weights built once) and gets its own cache, placed by its own
policy. A prompt's KV is random and written where the policy places it, as a prefill would write it
(`RandomKVEngine`): the decode steps that follow are the engine's own, and what they cost does not
depend on the KV's values, while a real prefill of 4 x 64K tokens (or of the paper-shaped preset at
any length) would take longer than the sweep. The first WARMUP_STEPS steps are left out.

    python tools/bench_split.py --out bench_results/split.json --png bench_results/split.png
    python tools/bench_split.py --preset qwen3-30b-a3b-shape --contexts 32768 131072 --device cuda \\
        --device-kv-gb 2

Writes JSON (every point, the calibrated model, the host) and prints the README table; --png plots
step time against r per (context, batch), with writescope's r* and step time marked.
"""

from __future__ import annotations

import argparse
import logging
import math
import statistics

import torch
from tqdm import tqdm

from writescope.engine import Engine
from writescope.models.moe_model import MoEModel
from writescope.models.presets import PRESETS, byte_level_tokenizer, preset_config, preset_weights
from writescope.policies import POLICY_NAMES
from writescope.sampling import Sampled
from writescope.tools.results import host_info, write_json

log = logging.getLogger("bench_split")
WARMUP_STEPS = 2
def shares(step: float) -> tuple[float, ...]:
    """The fixed shares swept: 0, step, 2 step, ... 1."""
    count = round(1 / step)
    return tuple(round(i / count, 4) for i in range(count + 1))


SHARES = shares(0.1)  # the default sweep
BASELINES = ("all_transfer", "all_cpu", "fixed_half", "monolithic")


class RandomKVEngine(Engine):
    """An Engine whose prefill writes random KV of the prompt's length, placed by the policy, in
    place of running the model over the prompt; its decode steps are Engine's."""

    _random_kv = None  # [num_kv_heads, tokens, dim] per stored array, the longest prompt's so far

    def _prefill_chunk(self, request) -> Sampled:
        """The whole prompt at once, random KV (the prefill's cost is not what this tool measures;
        the engines are made without prefix caching: every prompt is written)."""
        fmt = self.cache.config.format
        length = len(request.prompt)
        if self._random_kv is None or self._random_kv[0].shape[1] < length:
            generator = torch.Generator().manual_seed(0)
            self._random_kv = [torch.randn(fmt.num_kv_heads, length, dim, generator=generator).to(fmt.torch_dtype)
                               for dim in fmt.stored_dims]
        arrays = [a[:, :length] for a in self._random_kv]  # the same values in every layer: the cost is the same
        for layer in range(self.config.num_layers):
            self.cache.write_prefill(request.seq_id, layer, *arrays)
        request.prefilled = length
        return Sampled([request.prompt[-1]], [None])


def whole_batch_chunk(batch: int, context: int, block_size: int) -> int:
    """A prefill budget that takes the whole batch's prompts in one turn: every sequence is placed
    before the first decode step, as the steps this tool times assume."""
    return -(-batch * context // block_size) * block_size


def device_budget(preset: str, device_kv_gb: float | None, block_size: int, batch: int) -> tuple[int, int | None]:
    """(window tokens per sequence, ping-pong blocks): a 256-token window and the default ping-pong,
    or, with a device KV budget (the paper's ~2 GB), half of it to the batch's windows and half to
    the two ping-pong buffers."""
    if device_kv_gb is None:
        return 256, None
    fmt = preset_config(preset).kv_format("bfloat16", block_size)
    half_bytes = device_kv_gb * 2**30 / 2
    window = int(half_bytes / fmt.token_bytes / batch) // block_size * block_size
    pingpong = int(half_bytes / fmt.nbytes("gpu_pingpong", 1))  # nbytes of one block in both buffers
    return max(block_size, window), max(1, pingpong)


def step_s(engine: Engine, prompts, new_tokens: int) -> float:
    """The median decode step time after WARMUP_STEPS, from the engine's own step record."""
    engine.step_history.clear()
    for _ in engine.generate_stream(prompts, max_new_tokens=new_tokens):
        pass
    steps = [times.step_s for times in list(engine.step_history)[WARMUP_STEPS:]]
    if not steps:
        raise ValueError(f"need more than {WARMUP_STEPS} decode steps: raise --new-tokens")
    return statistics.median(steps)


def run_point(model, tokenizer, policy: str, context: int, batch: int, args) -> dict:
    window, pingpong = device_budget(args.preset, args.device_kv_gb, args.block_size, batch)
    engine = RandomKVEngine.from_model(model, tokenizer, torch.bfloat16, policy=policy, max_batch_size=batch,
                                       max_seq_len=context + args.new_tokens, block_size=args.block_size,
                                       window_tokens=window, pingpong_blocks=pingpong,
                                       prefill_chunk_tokens=whole_batch_chunk(batch, context, args.block_size),
                                       enable_prefix_caching=False)
    try:
        generator = torch.Generator().manual_seed(batch)
        prompts = [torch.randint(0, 256, (context,), generator=generator).tolist() for _ in range(batch)]
        seconds = step_s(engine, prompts, args.new_tokens)
        spilled = batch * (context - context % args.block_size)
        point = {"policy": policy, "context": context, "batch": batch, "step_s": seconds,
                 "share": engine.policy.share(spilled)}
        if policy == "writescope":
            model_fit = engine.policy.model
            point["model"] = {**vars(model_fit)}
        return point
    finally:
        engine.shutdown()


def sweep(args) -> list[dict]:
    config = preset_config(args.preset)
    weights = {k: v.to(args.device) for k, v in preset_weights(config, torch.bfloat16).items()}
    model = MoEModel(config, weights, device=args.device)
    tokenizer = byte_level_tokenizer()
    policies = [f"share:{r}" for r in shares(args.share_step)] + list(POLICY_NAMES)
    points = []
    grid = [(c, b) for c in args.contexts for b in args.batches]
    with tqdm(total=len(grid) * len(policies) * args.rounds, desc="bench split") as bar:
        for context, batch in grid:
            rounds: dict[str, list[dict]] = {name: [] for name in policies}
            for round_index in range(args.rounds):  # alternate the order: a drift of the host cancels out
                for policy in policies if round_index % 2 == 0 else policies[::-1]:
                    rounds[policy].append(run_point(model, tokenizer, policy, context, batch, args))
                    bar.update()
            for policy in policies:
                point = rounds[policy][-1]
                point["round_step_s"] = [p["step_s"] for p in rounds[policy]]
                point["step_s"] = statistics.median(point["round_step_s"])
                points.append(point)
    return points


def summarise(points: list[dict]) -> list[dict]:
    """Per (context, batch): the best fixed r, writescope's r* and step, and the baselines'."""
    rows = []
    for key in sorted({(p["context"], p["batch"]) for p in points}):
        here = {p["policy"]: p for p in points if (p["context"], p["batch"]) == key}
        fixed = [p for name, p in here.items() if name.startswith("share:")]
        best = min(fixed, key=lambda p: p["step_s"])
        ws = here["writescope"]
        best_baseline = min(BASELINES, key=lambda name: here[name]["step_s"])
        rows.append({"context": key[0], "batch": key[1], "best_share": best["share"], "best_step_s": best["step_s"],
                     "writescope_share": ws["share"], "writescope_step_s": ws["step_s"],
                     "writescope_vs_best_fixed": ws["step_s"] / best["step_s"],
                     "baselines_step_s": {name: here[name]["step_s"] for name in BASELINES},
                     "best_baseline": best_baseline,
                     "speedup_vs_best_baseline": here[best_baseline]["step_s"] / ws["step_s"],
                     "speedup_vs_baselines_geomean": math.exp(statistics.mean(
                         math.log(here[name]["step_s"] / ws["step_s"]) for name in BASELINES))})
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| context | batch | best fixed r (ms) | writescope r* (ms) | ws / best fixed | all_transfer | all_cpu "
             "| fixed_half | monolithic | best baseline / ws | geomean baselines / ws |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        b = r["baselines_step_s"]
        lines.append(f"| {r['context'] // 1024}K | {r['batch']} | {r['best_share']:.1f} ({r['best_step_s'] * 1e3:.2f})"
                     f" | {r['writescope_share']:.2f} ({r['writescope_step_s'] * 1e3:.2f})"
                     f" | {r['writescope_vs_best_fixed']:.3f} | "
                     + " | ".join(f"{b[name] * 1e3:.2f}" for name in BASELINES)
                     + f" | {r['speedup_vs_best_baseline']:.2f}x | {r['speedup_vs_baselines_geomean']:.2f}x |")
    return "\n".join(lines)


def plot(points: list[dict], rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = min(3, len(rows))
    lines = -(-len(rows) // cols)
    fig, axes = plt.subplots(lines, cols, figsize=(4.2 * cols, 3.3 * lines), squeeze=False)
    for ax in axes.ravel()[len(rows):]:
        ax.set_visible(False)
    for ax, row in zip(axes.ravel(), rows, strict=False):
        here = [p for p in points if (p["context"], p["batch"]) == (row["context"], row["batch"])]
        fixed = sorted((p["share"], p["step_s"] * 1e3) for p in here if p["policy"].startswith("share:"))
        ax.plot([r for r, _ in fixed], [t for _, t in fixed], "o-", label="fixed r")
        ax.plot([row["writescope_share"]], [row["writescope_step_s"] * 1e3], "r*", ms=14, label="writescope r*")
        for name, style in (("monolithic", ":"), ("fixed_half", "--")):
            ax.axhline(row["baselines_step_s"][name] * 1e3, ls=style, lw=0.8, color="gray", label=name)
        ax.set_title(f"{row['context'] // 1024}K x {row['batch']}")
        ax.set_xlabel("CPU share r")
        ax.set_ylabel("decode step (ms)")
    axes[0][0].legend(fontsize=7)
    fig.suptitle(f"decode step vs CPU share ({host_info()['cpu_model']}, kernel {host_info()['cpu_variant']})",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="tiny-qwen3-moe", choices=list(PRESETS), help="model preset")
    parser.add_argument("--contexts", type=int, nargs="+", default=[4096, 16384, 65536], help="tokens per sequence")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4], help="sequences per step")
    parser.add_argument("--new-tokens", type=int, default=16, help=f"decode steps per point ({WARMUP_STEPS} warm-up)")
    parser.add_argument("--rounds", type=int, default=3, help="runs of every policy per point (median of medians)")
    parser.add_argument("--share-step", type=float, default=0.1,
                        help="step of the fixed shares swept (0.1: r = 0, 0.1, ... 1); 1 / step a whole number")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--device-kv-gb", type=float, default=None,
                        help="device KV budget (window + ping-pong), as the paper's ~2 GB; default: a 256-token "
                             "window and the default ping-pong")
    parser.add_argument("--out", default=None, help="JSON path")
    parser.add_argument("--png", default=None, help="plot path")
    args = parser.parse_args(argv)
    for name in ("contexts", "batches", "rounds"):
        if min(getattr(args, name) if name != "rounds" else [args.rounds]) < 1:
            parser.error(f"--{name} must be >= 1")
    if any(c % args.block_size for c in args.contexts):
        parser.error(f"--contexts must be multiples of --block-size ({args.block_size})")
    if not 0 < args.share_step <= 1 or abs(1 / args.share_step - round(1 / args.share_step)) > 1e-6:
        parser.error("--share-step must be in (0, 1] and divide 1 (0.1, 0.125, 0.25, 0.5, 1)")
    if args.new_tokens <= WARMUP_STEPS + 1:
        parser.error(f"--new-tokens must be > {WARMUP_STEPS + 1}")
    return args


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    args = parse_args(argv)
    points = sweep(args)
    rows = summarise(points)
    print(table(rows))
    if args.out:
        write_json(args.out, {"host": host_info(), "args": vars(args), "points": points, "rows": rows})
    if args.png:
        plot(points, rows, args.png)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
