"""Calibration of the perf model on the machine it runs on, through the paths the engine runs.

One layer of the engine's own cache (an InplaceKVCache of the same format, window, ping-pong and
device, with random KV) holds `batch` sequences at each of two or more lengths, placed once all on
cpu_compute and once all on cpu_transfer. Timed there:
  CPU side     the CPU partial of a layer (LocalCPUPartial: the C++ kernel over cpu_compute, with
               its dispatch and merge), fitted to seconds = A * tokens + C_cpu;
  device side  the layer's whole device path (`split.device_side`: ping-pong copies, launches and
               the device partial over window + chunks), fitted to seconds = B * tokens + C_gpu;
  both at once the CPU side on a thread while the device side runs on the caller: whether the host
               overlaps them (a GPU beside the CPU) or they share its cores and memory (the device
               is the CPU) is decided from this, not assumed (PerfModel.concurrent).
Results are cached per machine, shape and setup in a JSON file, with the timings they came from,
and re-measured on demand (`force=True`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import platform
import statistics
import threading
import time
from dataclasses import asdict, dataclass

import torch

from writescope import env
from writescope.perf_model import PerfModel

log = logging.getLogger(__name__)

# The sides overlap when running them together hides at least this much of the shorter one.
OVERLAP_THRESHOLD = 0.5
DEFAULT_LENGTHS = (2048, 16384)  # tokens per sequence


@dataclass(frozen=True)
class CalibrationSetup:
    """What the timings depend on besides the machine: the attention's shape and the engine's cache
    (format, window, ping-pong, device, shards), and the batch measured (the engine's, at most 4)."""

    num_q_heads: int
    scale: float
    cache: object  # an inplace_kv_cache.CacheConfig: the engine's
    batch: int

    def __post_init__(self):
        if self.num_q_heads < 1 or self.batch < 1:
            raise ValueError(f"num_q_heads and batch must be >= 1, got {self.num_q_heads} and {self.batch}")

    def key(self) -> str:
        c = self.cache
        return json.dumps({"num_q_heads": self.num_q_heads, "batch": self.batch, "window_tokens": c.window_tokens,
                           "pingpong_blocks": c.pingpong_blocks, "num_shards": c.num_shards,
                           "device": str(c.device), "in_place": c.transfer_in_place, **c.format.to_dict()},
                          sort_keys=True)


def machine_fingerprint(device: str) -> str:
    """What the measurements depend on: CPU model and count, kernel variant and threads, device."""
    from writescope import _cpu

    cpu_model = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu_model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu_model)
    except OSError:
        pass
    device_name = torch.cuda.get_device_name() if device.startswith("cuda") else "cpu"
    parts = [cpu_model, str(len(os.sched_getaffinity(0))), _cpu.__cpu_variant__, str(_cpu.num_threads()), device_name]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]


def cache_path() -> str:
    root = env.CACHE_DIR.get() or os.path.join(os.path.expanduser("~"), ".cache", "writescope")
    return os.path.join(root, "calibration.json")


def calibrate(setup: CalibrationSetup, *, force: bool = False, lengths: tuple[int, ...] = DEFAULT_LENGTHS,
              repeats: int = 9) -> PerfModel:
    """The PerfModel of one layer's attention for this setup on this machine (cached)."""
    if len(lengths) < 2 or len(set(lengths)) != len(lengths) or min(lengths) <= setup.cache.window_tokens:
        raise ValueError(f"lengths must be two or more distinct token counts above the window "
                         f"({setup.cache.window_tokens}), got {lengths}")
    path = cache_path()
    key = f"{machine_fingerprint(str(setup.cache.device))}:{setup.key()}"
    cached = _load(path)
    if not force and isinstance(cached.get(key), dict) and "model" in cached[key]:
        return PerfModel(**cached[key]["model"])
    timings = measure(setup, lengths, repeats)
    a, c_cpu = _fit([t["cpu_tokens"] for t in timings], [t["cpu_s"] for t in timings])
    b, c_gpu = _fit([t["device_tokens"] for t in timings], [t["device_s"] for t in timings])
    longest = timings[-1]
    hidden = longest["cpu_s"] + longest["device_s"] - longest["together_s"]
    concurrent = hidden >= OVERLAP_THRESHOLD * min(longest["cpu_s"], longest["device_s"])
    model = PerfModel(cpu_s_per_token=a, transfer_s_per_token=b, cpu_fixed_s=c_cpu, gpu_fixed_s=c_gpu,
                      concurrent=concurrent)
    log.info("calibrated on %s, batch %d: %s (timings %s)", setup.cache.device, setup.batch, model, timings)
    cached[key] = {"model": asdict(model), "timings": timings}
    _store(path, cached)
    return model


def measure(setup: CalibrationSetup, lengths, repeats: int) -> list[dict]:
    """Per length: the tokens each side attended and the median seconds of the CPU side alone, the
    device side alone (each placed wholly on its side) and both together."""
    from writescope.cpu_partial import LocalCPUPartial
    from writescope.inplace_kv_cache import InplaceKVCache
    from writescope.policies import make_policy

    config = _one_layer_config(setup.cache, setup.batch, lengths)
    fmt = config.format
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(setup.batch, setup.num_q_heads, fmt.head_dim_k, generator=generator).to(fmt.torch_dtype)
    with InplaceKVCache(config, make_policy("all_cpu")) as on_cpu, \
            InplaceKVCache(config, make_policy("all_transfer")) as on_device:
        cpu_partial = LocalCPUPartial(on_cpu)
        return [_time_sides(on_cpu, on_device, cpu_partial, q, setup.scale, length, setup.batch, generator, repeats)
                for length in lengths]


def _time_sides(on_cpu, on_device, cpu_partial, q, scale: float, length: int, batch: int, generator,
                repeats: int) -> dict:
    from writescope.split import device_side

    device = torch.device(on_device.config.device)
    backend = "triton" if device.type == "cuda" else "cpu"
    q_device = q.to(device)
    cpu_ids = _fill(on_cpu, length, batch, generator)
    device_ids = _fill(on_device, length, batch, generator)
    cpu_view = on_cpu.step_view(cpu_ids, pending_tokens=0)

    def cpu_side():
        cpu_partial.attend(0, q, cpu_view, scale).result()

    def device_path():
        view = on_device.step_view(device_ids, pending_tokens=0)  # a new view: its own ping-pong key
        on_device.start_transfer(0, view)
        device_side(on_device, 0, view, q_device, scale, backend)
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def together():
        thread = threading.Thread(target=cpu_side)
        thread.start()
        device_path()
        thread.join()

    cpu_s, device_s, together_s = interleaved_median_s([cpu_side, device_path, together], repeats)
    timing = {"length": length, "cpu_tokens": cpu_view.compute_tokens,
              "device_tokens": on_device.step_view(device_ids, pending_tokens=0).transfer_tokens,
              "cpu_s": cpu_s, "device_s": device_s, "together_s": together_s}
    for seq_id in cpu_ids:
        on_cpu.finish(seq_id)
    for seq_id in device_ids:
        on_device.finish(seq_id)
    return timing


def interleaved_median_s(fns, repeats: int, warmup: int = 1) -> list[float]:
    """The median wall time of each of fns, timed in turn within every repeat: a slow spell of a
    shared host then falls on all of them alike instead of on whichever ran during it."""
    for _ in range(warmup):
        for fn in fns:
            fn()
    times = [[] for _ in fns]
    for _ in range(repeats):
        for fn, samples in zip(fns, times, strict=True):
            start = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - start)
    return [statistics.median(samples) for samples in times]


def _one_layer_config(cache_config, batch: int, lengths):
    """The engine's cache config cut to one layer and sized for `batch` sequences of the longest length."""
    blocks_per_seq = -(-max(lengths) // cache_config.format.block_size)
    blocks = batch * blocks_per_seq
    return dataclasses.replace(
        cache_config, format=dataclasses.replace(cache_config.format, num_layers=1), max_seqs=batch,
        compute_blocks_per_shard=-(-blocks // cache_config.num_shards), transfer_blocks=blocks,
        max_blocks_per_seq=blocks_per_seq, pingpong_blocks=min(cache_config.pingpong_blocks, blocks))


def _fill(cache, length: int, batch: int, generator) -> list:
    """batch sequences of `length` random tokens of KV, placed by the cache's policy; their ids."""
    fmt = cache.config.format
    ids = []
    for index in range(batch):
        seq_id = f"calibration-{length}-{index}"
        cache.admit(seq_id, prompt_len=length, max_new_tokens=1)
        arrays = [torch.randn(fmt.num_kv_heads, length, dim, generator=generator).to(fmt.torch_dtype)
                  for dim in fmt.stored_dims]
        cache.write_prefill(seq_id, 0, *arrays)
        ids.append(seq_id)
    return ids


def _fit(tokens, seconds) -> tuple[float, float]:
    """Least-squares slope and intercept, both clipped at 0 (noise can invert a tiny intercept)."""
    n = len(tokens)
    mean_x, mean_y = sum(tokens) / n, sum(seconds) / n
    sxx = sum((x - mean_x) ** 2 for x in tokens)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(tokens, seconds, strict=True)) / sxx
    slope = max(slope, 1e-12)
    intercept = mean_y - slope * mean_x
    if intercept < 0:
        slope, intercept = max(sum(seconds) / sum(tokens), 1e-12), 0.0
    return slope, intercept


def median_time_s(fn, repeats: int, warmup: int = 1) -> float:
    """Median wall time of fn over `repeats` calls after `warmup` untimed ones."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _load(path: str) -> dict:
    try:
        with open(path) as f:
            data = json.load(f)
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _store(path: str, data: dict) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1, sort_keys=True)
    os.replace(tmp, path)
