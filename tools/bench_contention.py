"""Contention started mid-run, measured for real: does the online estimate follow, and does
placement stay right?

The engine decodes under the writescope policy (calibrated on this host) while, at a given step,
a second process starts loading the machine: `--hog memory` streams memory on the CPU (the
CPU-only host's case: the side attending the spilled KV slows; r* should stay at the end
calibration chose, since the other side is the same CPU and is slowed just as much); `--hog h2d`
copies host to device in a loop (a GPU host: the link slows, r* should rise). Every step's
per-layer measurements (what the policy is fed), the model's estimate and r*, and where new blocks
landed are recorded. The hog is started and paused before the run, so that it loads the machine
from the chosen step, not after its start-up.

    python tools/bench_contention.py --out bench_results/contention_cpu.json
    python tools/bench_contention.py --device cuda --hog h2d --out "$OUT/contention_h2d.json"
"""

from __future__ import annotations

import argparse
import logging
import statistics
import subprocess
import sys

import torch
from tqdm import tqdm

from writescope.engine import PROVISIONAL_MODEL, placement
from writescope.models.moe_model import MoEModel
from writescope.models.presets import PRESETS, byte_level_tokenizer, preset_config, preset_weights
from writescope.policies import WriteScopePolicy
from writescope.tools.bench_split import RandomKVEngine, whole_batch_chunk
from writescope.tools.results import host_info, write_json

log = logging.getLogger("bench_contention")

# The hog: waits for a line on stdin, then loads the machine until killed.
HOG_SOURCE = {
    "memory": """
import sys, numpy as np
a = np.ones(64 * 2**20, dtype=np.float64); b = np.empty_like(a)  # 512 MiB each: far beyond any cache
sys.stdout.write("ready\\n"); sys.stdout.flush(); sys.stdin.readline()
while True:
    np.copyto(b, a); np.copyto(a, b)
""",
    "h2d": """
import sys, torch
host = torch.empty(256 * 2**20, dtype=torch.uint8).pin_memory(); dev = torch.empty_like(host, device="cuda")
sys.stdout.write("ready\\n"); sys.stdout.flush(); sys.stdin.readline()
while True:
    dev.copy_(host, non_blocking=True); torch.cuda.synchronize()
""",
}


class Hog:
    """A second process that loads the machine from start() until stop()."""

    def __init__(self, kind: str):
        self.process = subprocess.Popen([sys.executable, "-c", HOG_SOURCE[kind]], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, text=True)
        if self.process.stdout.readline().strip() != "ready":
            self.stop()
            raise RuntimeError(f"the {kind} hog did not start")

    def start(self) -> None:
        self.process.stdin.write("go\n")
        self.process.stdin.flush()

    def stop(self) -> None:
        self.process.kill()
        self.process.wait()


class RecordingPolicy(WriteScopePolicy):
    """The writescope policy, keeping what each step fed it and what it then believed."""

    def __init__(self, model):
        super().__init__(model)
        self.steps: list[dict] = []
        self._layers: list[tuple] = []

    def observe_step(self, cpu_tokens, cpu_s, transfer_tokens, transfer_s):
        self._layers.append((cpu_tokens, cpu_s, transfer_tokens, transfer_s))
        super().observe_step(cpu_tokens, cpu_s, transfer_tokens, transfer_s)

    def end_step(self):
        # the predictions the step was made with, before its update
        cpu_predicted = [self.model.cpu_time_s(1.0, c) for c, *_ in self._layers if c]
        device_predicted = [self.model.gpu_time_s(0.0, t) for *_, t, _ in self._layers if t]
        super().end_step()
        cpu = [(c, s) for c, s, *_ in self._layers if c]
        device = [(t, s) for *_, t, s in self._layers if t]
        self.steps.append({
            "cpu_layer_s": statistics.mean(s for _, s in cpu) if cpu else None,
            "cpu_predicted_s": statistics.mean(cpu_predicted) if cpu_predicted else None,
            "device_layer_s": statistics.mean(s for _, s in device) if device else None,
            "device_predicted_s": statistics.mean(device_predicted) if device_predicted else None,
            "cpu_s_per_token": self.model.cpu_s_per_token, "transfer_s_per_token": self.model.transfer_s_per_token})
        self._layers = []


def run(args) -> dict:
    config = preset_config(args.preset)
    weights = {k: v.to(args.device) for k, v in preset_weights(config, torch.bfloat16).items()}
    model = MoEModel(config, weights, device=args.device)
    max_seq_len = args.context + args.steps + 1
    policy = RecordingPolicy(PROVISIONAL_MODEL)
    engine = RandomKVEngine.from_model(model, byte_level_tokenizer(), torch.bfloat16, policy=policy,
                                       max_batch_size=args.batch, max_seq_len=max_seq_len,
                                       window_tokens=args.window_tokens,
                                       prefill_chunk_tokens=whole_batch_chunk(args.batch, args.context, 16),
                                       enable_prefix_caching=False)
    calibrated = engine.calibrate()
    policy.estimator.reset_to(calibrated)
    hog = Hog(args.hog)
    shares, placed, step_s = [], [], []
    try:
        prompts = [[7] * args.context for _ in range(args.batch)]
        events = engine.generate_stream(prompts, max_new_tokens=args.steps + 1)
        for _ in range(args.batch):
            next(events)  # every sequence prefilled (its first token)
        for step in tqdm(range(args.steps), desc=f"decode, {args.hog} hog from step {args.hog_step}"):
            if step == args.hog_step:
                hog.start()
            for _ in range(args.batch):
                next(events)
            where = placement(engine)
            shares.append(where["cpu_share_spilled"])
            placed.append(where["placed_tokens"])
            step_s.append(engine.step_history[-1].step_s)
        list(events)
    finally:
        hog.stop()
        engine.shutdown()
    return summarise(policy.steps[: args.steps], shares, placed, step_s, calibrated, args)


def measured_side(steps) -> str:
    """The side whose per-layer times the summary follows: the CPU partial where it attends KV
    (r* > 0 on a GPU host, or the CPU end of a CPU-only one), else the device path (the device end)."""
    return "cpu" if any(s["cpu_layer_s"] for s in steps) else "device"


def summarise(steps, shares, placed, step_s, calibrated, args) -> dict:
    """The measured slowdown of the side that attends the spilled KV, and how many steps after the
    hog's start the estimate followed it."""
    at = args.hog_step
    side = measured_side(steps)
    layer, predicted, rate = (f"{side}_layer_s", f"{side}_predicted_s",
                              "cpu_s_per_token" if side == "cpu" else "transfer_s_per_token")
    measured_before = statistics.median(s[layer] for s in steps[2:at] if s[layer])
    measured_during = statistics.median(s[layer] for s in steps[at + 10:] if s[layer])
    follows = None
    for index, s in enumerate(steps[at:], start=1):  # the prediction the step was made with vs the truth since
        if s[predicted] and abs(s[predicted] - measured_during) <= 0.1 * measured_during:
            follows = index
            break
    spilled_end = placed[-1]["cpu_compute"] + placed[-1]["cpu_transfer"]
    return {
        "host": host_info(), "args": vars(args), "calibrated": vars(calibrated), "measured_side": side,
        "layer_ms_before": measured_before * 1e3, "layer_ms_during": measured_during * 1e3,
        "measured_slowdown": measured_during / measured_before,
        "estimate_slowdown": steps[-1][rate] / steps[at - 1][rate],
        "steps_until_the_estimate_follows": follows,
        "share_before": shares[at - 1], "share_min_during": min(shares[at:]), "share_max_during": max(shares[at:]),
        "placed_before": placed[at - 1], "placed_end": placed[-1],
        "placed_cpu_share_end": placed[-1]["cpu_compute"] / spilled_end if spilled_end else None,
        "step_ms_before": statistics.median(step_s[2:at]) * 1e3, "step_ms_during": statistics.median(step_s[at:]) * 1e3,
        "steps": steps, "shares": shares,
    }


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="tiny-qwen3-moe", choices=list(PRESETS), help="model preset")
    parser.add_argument("--context", type=int, default=32768, help="tokens per sequence (random KV)")
    parser.add_argument("--batch", type=int, default=4, help="sequences")
    parser.add_argument("--steps", type=int, default=120, help="decode steps")
    parser.add_argument("--hog-step", type=int, default=40, help="the step at which the hog starts")
    parser.add_argument("--hog", default="memory", choices=list(HOG_SOURCE), help="what the second process loads")
    parser.add_argument("--window-tokens", type=int, default=32,
                        help="GPU window: small, so new blocks are placed while the hog runs")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--out", default=None, help="JSON path")
    args = parser.parse_args(argv)
    if not 12 <= args.hog_step <= args.steps - 20:
        parser.error("--hog-step must leave 12 steps before and 20 after it (--steps)")
    if args.hog == "h2d" and not args.device.startswith("cuda"):
        parser.error("--hog h2d needs --device cuda")
    if args.context % 16 or args.context < 16 or args.batch < 1:
        parser.error("--context must be a positive multiple of 16 and --batch >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    args = parse_args(argv)
    result = run(args)
    keys = ("measured_side", "layer_ms_before", "layer_ms_during", "measured_slowdown", "estimate_slowdown",
            "steps_until_the_estimate_follows", "share_before", "share_min_during", "share_max_during",
            "placed_before", "placed_end", "step_ms_before", "step_ms_during")
    for key in keys:
        log.info("%s: %s", key, result[key])
    if args.out:
        write_json(args.out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
