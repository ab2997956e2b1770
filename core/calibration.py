"""Calibration of the perf model on the machine it runs on, through the paths the engine runs.

On the engine's own cache, its CPU partial and its executor's way of running the two sides:
`batch` sequences of random KV at each of two or more lengths are placed half on cpu_compute and
half on cpu_transfer (a share:0.5 placement), and layer 0 of them is timed:
  CPU side     the engine's CPU partial (`attend` ... `result()`: in this process the C++ kernel
               over the shards, under Ray a request to every CPU worker and their answers), fitted
               to seconds = A * tokens + C_cpu; the part of it outside the kernel's own seconds is
               C_dispatch (a channel's round trip), which the online observations do not contain;
  device side  the layer's whole device path (`executor.device_side`: ping-pong copies, launches and
               the device partial over window + chunks), fitted to seconds = B * tokens + C_gpu;
  both         as a decode step runs them (the CPU partial sent, or on a worker thread where the
               executor has one, then the device path, then the CPU partial's result): the overlap
               is the share of the shorter side this hides, measured, not assumed (PerfModel.overlap).
Results are cached per machine and setup in a JSON file, with the timings they came from, and
re-measured on demand (`force=True`). A cached fit is checked before it is used: the two sides are
timed again at the longest length, and where the ratio of their times (what r* depends on) moved
by more than RECHECK_TOLERANCE from the fit's, the whole calibration is measured again. A fit
cached in a spell when something else held the host's cores would otherwise place every later
engine's KV by it (placement is fixed at write: the online correction cannot move a prompt's KV
that a prefill already placed). The cache must be empty: calibration runs before any request.
"""

from __future__ import annotations

import contextlib
import functools
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

MAX_BATCH = 4  # the per-token costs hardly change beyond it
LONGEST = 16384  # tokens per sequence at the longer length (the engine's max_seq_len if lower)
# Hidden shares under this are the timing noise of a shared host: the local executor, which runs
# the sides one after the other, measured 0.00-0.09 here. (Ray's CPU workers beside a device path
# on the same CPU read 0.13-0.62, and are taken as 0 all the same: see fit.)
OVERLAP_NOISE = 0.1
# A cached fit is used while the host shows its CPU/device time ratio within this factor. On a
# 2-vCPU Zen 3, 40 rechecks of a fresh fit (tiny-qwen3-moe, 4 x 16K; 2 x 2K) drifted 0.83-1.06x
# (0.88-1.24x); a fit cached the night before, in a spell when something else held the cores (its
# CPU side 2.3x what it is, its device side 1.15x), 1.75x: it put r* at 0.52, where 1 is faster.
RECHECK_TOLERANCE = 1.5
RECHECK_REPEATS = 5
# Bytes read between timed calls, at least: twice the last-level cache where the host says, this
# where it does not.
EVICT_BYTES_MIN = 64 << 20
EVICT_BYTES_MAX = 1 << 30


@dataclass(frozen=True)
class CalibrationSetup:
    """What the timings depend on besides the machine: the attention's shape, the engine's cache
    (format, window, ping-pong, device, shards), how its CPU partial runs, and the batch measured."""

    num_q_heads: int
    scale: float
    batch: int
    cpu_partial: str  # the CPU partial's kind (local kernel, CPU workers' channels)
    cpu_in_thread: bool  # the executor runs the CPU partial on a worker thread beside the device path

    def key(self, cache_config) -> str:
        c = cache_config
        return json.dumps({"num_q_heads": self.num_q_heads, "batch": self.batch, "cpu_partial": self.cpu_partial,
                           "cpu_in_thread": self.cpu_in_thread, "window_tokens": c.window_tokens,
                           "pingpong_blocks": c.pingpong_blocks, "num_shards": c.num_shards,
                           "device": str(c.device), "in_place": c.transfer_in_place, **c.format.to_dict()},
                          sort_keys=True)


def default_lengths(max_seq_len: int, block_size: int) -> tuple[int, int]:
    """Two lengths of whole blocks that an engine of max_seq_len admits: the longer up to LONGEST."""
    longest = min(LONGEST, (max_seq_len - 1) // block_size * block_size)
    shortest = max(2 * block_size, longest // 8 // block_size * block_size)
    if longest <= shortest:
        raise ValueError(f"max_seq_len {max_seq_len} leaves no two lengths of whole blocks of {block_size} "
                         f"tokens to calibrate at: give the engine at least {3 * block_size + 1} tokens")
    return shortest, longest


def cpu_model() -> str:
    """This CPU's model name (/proc/cpuinfo), else what the platform says."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")),
                        platform.processor())
    except OSError:
        return platform.processor()


@functools.cache
def kernel_build() -> str:
    """The CPU kernel's build: a digest of the extension file. A rebuilt kernel may cost a token
    differently (2026-12-05, an Emerald Rapids Xeon: the AMX loops became 1.2x faster, and a fit cached
    an hour before, whose sides' ratio the recheck still passed at 0.67x, put r* at 0 where r = 1 was
    1.4-1.7x faster), so its fit is not reused."""
    from writescope import _cpu

    with open(_cpu.__file__, "rb") as extension:
        return hashlib.sha256(extension.read()).hexdigest()[:16]


def machine_fingerprint(device: str) -> str:
    """What the measurements depend on: CPU model and count, kernel build, variant and threads, device."""
    from writescope import _cpu

    device_name = torch.cuda.get_device_name() if device.startswith("cuda") else "cpu"
    parts = [cpu_model(), str(len(os.sched_getaffinity(0))), kernel_build(), _cpu.__cpu_variant__,
             str(_cpu.num_threads()), device_name]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]


def cache_path() -> str:
    root = env.CACHE_DIR.get() or os.path.join(os.path.expanduser("~"), ".cache", "writescope")
    return os.path.join(root, "calibration.json")


def calibrate(cache, cpu_partial, setup: CalibrationSetup, *, force: bool = False,
              lengths: tuple[int, ...] | None = None, repeats: int = 9) -> PerfModel:
    """The PerfModel of one layer's attention through this (empty) cache and CPU partial (cached)."""
    if cache.seqs:
        raise ValueError("calibration needs an empty cache: it runs before the engine takes requests")
    block_size = cache.config.format.block_size
    lengths = tuple(lengths or default_lengths(cache.config.max_blocks_per_seq * block_size, block_size))
    if len(lengths) < 2 or len(set(lengths)) != len(lengths) or min(lengths) < 2 * block_size:
        raise ValueError(f"lengths must be two or more distinct token counts of at least two blocks "
                         f"({2 * block_size} tokens), got {lengths}")
    path = cache_path()
    key = f"{machine_fingerprint(str(cache.config.device))}:{setup.key(cache.config)}:{sorted(lengths)}"
    cached = _load(path)
    on_the_cpu = torch.device(cache.config.device).type == "cpu"
    model = None if force else _cached_model(cached.get(key), on_the_cpu)
    if model is not None:
        drift = ratio_drift(model, recheck(cache, cpu_partial, setup, max(lengths)))
        if 1 / RECHECK_TOLERANCE <= drift <= RECHECK_TOLERANCE:
            log.info("the cached calibration holds on this host (its CPU/device time ratio %.2fx what it was)", drift)
            return model
        log.warning("the cached calibration no longer holds on this host (its CPU/device time ratio is %.2fx "
                    "what it was, more than %.2fx): measuring again", drift, RECHECK_TOLERANCE)
    timings = measure(cache, cpu_partial, setup, sorted(lengths), repeats)
    for _ in range(FLAT_FIT_RETRIES):
        flat = flat_side(timings)
        if flat is None:
            break
        # Both sides read more bytes for more tokens: a side whose seconds did not grow with its tokens
        # met a slower stretch of a shared host at the shorter lengths (a 2-vCPU Zen 4 guest's memory
        # moved 31-65 GB/s within minutes). Its fit would make it free per token; measure again and fit
        # every measurement, so a stretch falls on both lengths.
        log.info("a side's time did not grow with its tokens (%s): measuring again", flat)
        timings += measure(cache, cpu_partial, setup, sorted(lengths), repeats)
    model = fit(timings, sides_share_cores=on_the_cpu)
    log.info("calibrated on %s, batch %d: %s (timings %s)", cache.config.device, setup.batch, model, timings)
    cached[key] = {"model": asdict(model), "timings": timings}
    _store(path, cached)
    return model


FLAT_FIT_RETRIES = 2


def flat_side(timings: list[dict]) -> str | None:
    """'cpu' or 'device' when that side's least-squares slope over the timings is not positive (its
    time did not grow with its tokens), else None."""
    for side, tokens in (("cpu", "cpu_tokens"), ("device", "device_tokens")):
        xs, ys = [t[tokens] for t in timings], [t[f"{side}_s"] for t in timings]
        mean_x, mean_y = sum(xs) / len(xs), sum(ys) / len(ys)
        if len(set(xs)) > 1 and sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True)) <= 0:
            return side
    return None


def _cached_model(entry, sides_share_cores: bool) -> PerfModel | None:
    try:
        model = PerfModel(**entry["model"])
    except (KeyError, TypeError, ValueError):  # none, or written by an older version: measure again
        return None
    # a fit cached before the rule of fit(sides_share_cores) may hold a hidden share: measure again
    return None if sides_share_cores and model.overlap > 0 else model


def recheck(cache, cpu_partial, setup: CalibrationSetup, length: int) -> dict:
    """One length timed as calibration times it (the sides alone and together, interleaved, so each
    side's caches are as warm as they were), median of RECHECK_REPEATS: what a cached fit is checked against."""
    with _half_on_each_side(cache):
        return _time_sides(cache, cpu_partial, setup, length, torch.Generator().manual_seed(0), RECHECK_REPEATS)


def ratio_drift(model: PerfModel, timing: dict) -> float:
    """How many times the CPU/device time ratio of `timing` is the one `model` predicts for its tokens."""
    predicted = model.cpu_time_s(1.0, timing["cpu_tokens"]) / model.gpu_time_s(0.0, timing["device_tokens"])
    return timing["cpu_s"] / timing["device_s"] / predicted


def fit(timings: list[dict], *, sides_share_cores: bool = False) -> PerfModel:
    """The PerfModel of measure()'s timings: both sides' lines, the overlap, the CPU partial's dispatch.

    sides_share_cores: the device is the CPU, so the device path's kernel runs on the cores the CPU
    partial runs on (the local pool, or, under Ray, the GPU worker's unpinned pool over every CPU
    of the machine, the CPU workers' nodes among them). Run at once, the two sides then split those
    cores: nothing of their work is hidden, and the overlap is 0 whatever the timings show. What
    calibration reads there as hidden is the CPU side's fixed costs (a worker's idle cores waking,
    the channel's round trip) falling behind the device path: 0.08-0.62 of the shorter side at 16K
    and 32K through Ray on a 2-vCPU Zen 3, while the engine at the balance r* (about 0.5) that such
    an overlap gives ran at 0.48-0.89x of the CPU end (all_cpu) in seven runs of 4 x 32K there."""
    a, c_cpu = _fit([t["cpu_tokens"] for t in timings], [t["cpu_s"] for t in timings])
    b, c_gpu = _fit([t["device_tokens"] for t in timings], [t["device_s"] for t in timings])
    overlap = min(_hidden_share(t) for t in timings)  # a real overlap shows at every length
    if overlap < OVERLAP_NOISE or sides_share_cores:
        overlap = 0.0
    dispatch = min(c_cpu, max(0.0, statistics.median(t["cpu_s"] - t["cpu_kernel_s"] for t in timings)))
    return PerfModel(cpu_s_per_token=a, transfer_s_per_token=b, cpu_fixed_s=c_cpu, gpu_fixed_s=c_gpu,
                     overlap=overlap, cpu_dispatch_s=dispatch)


def _hidden_share(timing: dict) -> float:
    """The share of the shorter side that running both hid, in [0, 1]."""
    hidden = timing["cpu_s"] + timing["device_s"] - timing["together_s"]
    return min(1.0, max(0.0, hidden / min(timing["cpu_s"], timing["device_s"])))


def measure(cache, cpu_partial, setup: CalibrationSetup, lengths, repeats: int) -> list[dict]:
    """Per length: the tokens on each side, and the median seconds of the CPU side alone (wall, and
    the kernel's own as the partial reports them), the device side alone, and both as a step runs them."""
    generator = torch.Generator().manual_seed(0)
    with _half_on_each_side(cache):
        return [_time_sides(cache, cpu_partial, setup, length, generator, repeats) for length in lengths]


@contextlib.contextmanager
def _half_on_each_side(cache):
    """The cache places half of every sequence on each side meanwhile (its policy put back after)."""
    from writescope.policies import FixedSharePolicy

    placing = cache.policy
    cache.policy = FixedSharePolicy("calibration", 0.5)
    try:
        yield
    finally:
        cache.policy = placing


def _time_sides(cache, cpu_partial, setup: CalibrationSetup, length: int, generator, repeats: int) -> dict:
    from writescope.executor import device_side

    fmt, device = cache.config.format, torch.device(cache.config.device)
    backend = "triton" if device.type == "cuda" else "cpu"
    q = torch.randn(setup.batch, setup.num_q_heads, fmt.head_dim_k, generator=generator).to(fmt.torch_dtype)
    q_device = q.to(device)
    ids = _fill(cache, length, setup.batch, generator)
    try:
        view = cache.step_view(ids, pending_tokens=0)
        kernel_s = []

        def cpu_side():
            kernel_s.append(cpu_partial.attend(0, q, view, setup.scale).result().seconds)

        def device_path():
            fresh = cache.step_view(ids, pending_tokens=0)  # its own ping-pong key, as each step has
            cache.start_transfer(0, fresh)
            device_side(cache, 0, fresh, q_device, setup.scale, backend)
            if device.type == "cuda":
                torch.cuda.synchronize(device)

        def together():
            if setup.cpu_in_thread:
                thread = threading.Thread(target=cpu_side)
                thread.start()
                device_path()
                thread.join()
                return
            pending = cpu_partial.attend(0, q, view, setup.scale)  # sent (CPU workers), or done here
            device_path()
            pending.result()

        cpu_s, device_s, together_s = interleaved_median_s([cpu_side, device_path, together], repeats,
                                                           before_each=_cache_evictor())
        return {"length": length, "cpu_tokens": view.compute_tokens, "device_tokens": view.transfer_tokens,
                "cpu_s": cpu_s, "cpu_kernel_s": statistics.median(kernel_s), "device_s": device_s,
                "together_s": together_s}
    finally:
        for seq_id in ids:
            cache.finish(seq_id)


def interleaved_median_s(fns, repeats: int, warmup: int = 1, before_each=None) -> list[float]:
    """The median wall time of each of fns, timed in turn within every repeat: a slow spell of a
    shared host then falls on all of them alike instead of on whichever ran during it. before_each,
    if given, runs untimed before every timed call."""
    for _ in range(warmup):
        for fn in fns:
            fn()
    times = [[] for _ in fns]
    for _ in range(repeats):
        for fn, samples in zip(fns, times, strict=True):
            if before_each is not None:
                before_each()
            start = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - start)
    return [statistics.median(samples) for samples in times]


def cache_bytes_by_level() -> dict[int, int]:
    """CPU 0's caches as /sys lists them: level -> the largest cache of that level in bytes (the L1
    data and instruction caches share level 1); empty where /sys does not list them."""
    sizes: dict[int, int] = {}
    root = "/sys/devices/system/cpu/cpu0/cache"
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    try:
        for index in (name for name in os.listdir(root) if name.startswith("index")):
            with open(os.path.join(root, index, "level")) as f:
                level = int(f.read().strip())
            with open(os.path.join(root, index, "size")) as f:
                text = f.read().strip()
            size = int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text)
            sizes[level] = max(size, sizes.get(level, 0))
    except (OSError, ValueError):
        return {}
    return sizes


def last_level_cache_bytes() -> int | None:
    """The largest CPU cache's size in bytes as /sys lists it for CPU 0, or None where it does not."""
    return max(cache_bytes_by_level().values(), default=None)


def _cache_evictor():
    """A call that reads a buffer of twice the last-level cache, so that the KV timed after it comes
    from memory, as at the long contexts the engine is for. Without it a small model's calibration
    KV (tiny-qwen3-moe, 4 x 16K: 16 MiB a side and layer) sits in a 32 MiB L3, where the two sides'
    layouts and processes rank differently than from memory: through Ray on a 2-vCPU Zen 3 it
    read the device path at 0.6x the CPU side's cost a token, where the engine at 4 x 32K paid 2x."""
    llc = last_level_cache_bytes() or 0
    buffer = torch.ones(min(EVICT_BYTES_MAX, max(EVICT_BYTES_MIN, 2 * llc)) // 8, dtype=torch.int64)
    return lambda: int(buffer.sum())  # int64: a plain streaming sum (an int32 one widens, 25x slower)


def _fill(cache, length: int, batch: int, generator) -> list:
    """batch sequences of `length` tokens of random KV in every layer (the same values in each: the
    cost does not depend on them), placed by the cache's policy; their ids."""
    fmt = cache.config.format
    arrays = [torch.randn(fmt.num_kv_heads, length, dim, generator=generator).to(fmt.torch_dtype)
              for dim in fmt.stored_dims]
    ids = []
    try:
        for index in range(batch):
            seq_id = f"calibration-{length}-{index}"
            cache.admit(seq_id, prompt_len=length, max_new_tokens=1)
            ids.append(seq_id)
            for layer in range(fmt.num_layers):
                cache.write_prefill(seq_id, layer, *arrays)
    except BaseException:
        for seq_id in ids:
            cache.finish(seq_id)
        raise
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
