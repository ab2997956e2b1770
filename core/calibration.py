"""Calibration of the perf model on the machine it runs on.

A and C_cpu: our CPU kernel (`ops.paged_partial_attention`, backend "cpu") over a cpu_compute-shaped
pool at two lengths, fitted to time = A * L + C_cpu. B and C_gpu: the copy of cpu_transfer-shaped
blocks into a ping-pong buffer on the device (on a CPU-only host: into a CPU buffer, which is what
this host's "device" path does), fitted the same way. Results are cached per machine and shape in
a JSON file and re-measured on demand (`force=True`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import statistics
import time
from dataclasses import asdict, dataclass

import torch

from writescope import env, ops
from writescope.kv_format import KVFormat
from writescope.perf_model import PerfModel

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class AttentionShape:
    num_q_heads: int
    format: KVFormat

    def key(self) -> str:
        return json.dumps({"num_q_heads": self.num_q_heads, **self.format.to_dict()}, sort_keys=True)


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


def calibrate(shape: AttentionShape, *, device: str = "cpu", force: bool = False,
              lengths: tuple[int, int] = (2048, 16384), repeats: int = 7) -> PerfModel:
    """The PerfModel of one layer's attention for this shape on this machine (cached)."""
    path = cache_path()
    key = f"{machine_fingerprint(device)}:{shape.key()}"
    cached = _load(path)
    if not force and key in cached:
        return PerfModel(**cached[key])
    a, c_cpu = _fit(lengths, [_cpu_attention_s(shape, n, repeats) for n in lengths])
    b, c_gpu = _fit(lengths, [_transfer_s(shape.format, n, device, repeats) for n in lengths])
    model = PerfModel(cpu_s_per_token=a, transfer_s_per_token=b, cpu_fixed_s=c_cpu, gpu_fixed_s=c_gpu)
    log.info("calibrated %s on %s: %s", shape, device, model)
    cached[key] = asdict(model)
    _store(path, cached)
    return model


def _fit(lengths, seconds) -> tuple[float, float]:
    """Slope and intercept through two points, both clipped at 0 (noise can invert a tiny intercept)."""
    (l1, l2), (t1, t2) = lengths, seconds
    slope = max((t2 - t1) / (l2 - l1), 1e-12)
    return slope, max(t1 - slope * l1, 0.0)


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


def _cpu_attention_s(shape: AttentionShape, num_tokens: int, repeats: int) -> float:
    fmt = shape.format
    num_blocks = -(-num_tokens // fmt.block_size)
    pool_k = torch.randn(fmt.shape("cpu_compute", num_blocks, fmt.head_dim_k)[1:]).to(fmt.torch_dtype)
    k = pool_k.permute(1, 0, 2, 3)  # [num_blocks, num_kv_heads, block_size, head_dim_k], head-major storage
    if fmt.v_in_k:
        v = k[..., : fmt.head_dim_v]
    else:
        pool_v = torch.randn(fmt.shape("cpu_compute", num_blocks, fmt.head_dim_v)[1:]).to(fmt.torch_dtype)
        v = pool_v.permute(1, 0, 2, 3)
    q = torch.randn(1, shape.num_q_heads, fmt.head_dim_k).to(fmt.torch_dtype)
    table = torch.arange(num_blocks, dtype=torch.int32)[None]
    lens = torch.tensor([num_tokens], dtype=torch.int32)
    return median_time_s(lambda: ops.paged_partial_attention(q, k, v, table, lens, backend="cpu"), repeats)


def _transfer_s(fmt: KVFormat, num_tokens: int, device: str, repeats: int) -> float:
    num_blocks = -(-num_tokens // fmt.block_size)
    pin = device.startswith("cuda")
    sources = [torch.randn(fmt.shape("cpu_transfer", num_blocks, d)[1:]).to(fmt.torch_dtype) for d in fmt.stored_dims]
    if pin:
        sources = [s.pin_memory() for s in sources]
    targets = [torch.empty_like(s, device=device) for s in sources]

    def copy():
        for target, source in zip(targets, sources, strict=True):
            target.copy_(source, non_blocking=pin)
        if pin:
            torch.cuda.current_stream().synchronize()

    return median_time_s(copy, repeats)


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
