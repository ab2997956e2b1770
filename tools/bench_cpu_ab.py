"""Two (or more) builds of the CPU kernel against each other, interleaved in one process.

On a shared host the machine's speed drifts by tens of percent within a minute, so two benchmark
runs minutes apart cannot tell a 10% change from the drift. This loads every given build of the
extension side by side (each a `_cpu*.so` file: this checkout's, and one built from another commit)
and times them in turns on the same inputs: each round runs every build on the next cold copies of
the KV (as `bench_cpu_attention.py` lays them out: at least --cold-mib between two reads of the same
bytes), so a drift falls on all builds alike. Every build's result is checked against the float32
torch reference first. Reports each build's median and 10th percentile, and each median over the
first build's.

    git worktree add /tmp/before HEAD~1 && (cd /tmp/before && python setup.py build_ext --inplace)
    python tools/bench_cpu_ab.py --builds /tmp/before/core/_cpu*.so core/_cpu*.so --shape mixtral

With --variants, each build runs once per ISA variant (its file copied for each, so each copy keeps
its own selected variant): one build's variants against each other, in turns.

    python tools/bench_cpu_ab.py --builds core/_cpu*.so --variants avx2 avx512 avx512bf16
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch

from writescope import ops, reference
from writescope.tools.bench_cpu_attention import SHAPES, cache_source, copies_for, kv_bytes, make_inputs
from writescope.tools.results import check_positive, write_json

log = logging.getLogger("bench_cpu_ab")


def load_build(path: str, index: int):
    """The extension module in `path`, under a package name of its own (the init symbol is the
    module's last name, `_cpu`, so every build loads beside the others)."""
    if not os.path.isfile(path):
        raise ValueError(f"--builds: {path!r} is not a file (give built _cpu*.so extension files)")
    spec = importlib.util.spec_from_file_location(f"writescope_build_{index}._cpu", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_variant(path: str, index: int, variant: str, workdir: str):
    """The build in `path` with ISA variant `variant` selected, from a copy of its own (a file loaded
    twice is one library, whose selected variant the two would share)."""
    if not os.path.isfile(path):
        raise ValueError(f"--builds: {path!r} is not a file (give built _cpu*.so extension files)")
    copy = os.path.join(workdir, f"{index}_{os.path.basename(path)}")
    shutil.copy(path, copy)
    module = load_build(copy, index)
    if variant not in module.available_variants():
        raise ValueError(f"--variants: {variant!r} does not run on this CPU with {path!r}; it runs "
                         f"{', '.join(module.available_variants())}")
    module.set_variant(variant)
    return module


def call(module, q, source: ops.KVSource, scale: float, out, lse) -> None:
    # q [1, num_q_heads, head_dim_qk]; out [1, num_q_heads, head_dim_v]; lse [1, num_q_heads]
    module.paged_attention(ops._as_numpy(q), ops._as_numpy(source.k_cache), ops._as_numpy(source.v_cache),
                           ops._as_numpy(source.block_table), ops._as_numpy(source.seq_lens), out.numpy(),
                           lse.numpy(), q_dtype="bfloat16", kv_dtype="bfloat16", layout=source.layout, scale=scale)


def measure(builds, shape, seq_len: int, cold_bytes: int, rounds: int) -> list[list[float]]:
    """Seconds of every call, per build, the builds taking turns round by round."""
    q, k, v = make_inputs(shape, seq_len)
    scale = shape.head_dim_qk**-0.5
    num_copies = copies_for(shape, seq_len, cold_bytes)
    sources = [cache_source(shape, k, v, torch.Generator().manual_seed(i), 16) for i in range(num_copies)]
    out = torch.empty((1, shape.num_q_heads, shape.head_dim_v))
    lse = torch.empty((1, shape.num_q_heads))
    ref_out, ref_lse = ops.partial_attention(q, k, v, scale=scale, backend="torch")
    for module in builds:
        call(module, q[None], sources[0], scale, out, lse)
        # a build on its bf16-dot path rounds the probabilities to bf16 (see ops.cpu_rounds_probabilities)
        rounds_probabilities = getattr(module, "uses_bf16_dot", lambda: False)()
        rounding = reference.probability_rounding_atol(v) if rounds_probabilities else 0.0
        torch.testing.assert_close(out[0], ref_out, atol=2e-5 + rounding, rtol=1e-4)
        torch.testing.assert_close(lse[0], ref_lse, atol=2e-5, rtol=1e-5)
    calls_per_turn = max(3, num_copies)
    times = [[] for _ in builds]
    turn = 0
    for _ in range(rounds):
        for module, seconds in zip(builds, times, strict=True):
            for _ in range(calls_per_turn):
                source = sources[turn % num_copies]
                turn += 1
                began = time.perf_counter()
                call(module, q[None], source, scale, out, lse)
                seconds.append(time.perf_counter() - began)
    return times


def summarize(paths: list[str], builds, times: list[list[float]], shape, seq_len: int) -> list[dict]:
    first = statistics.median(times[0])
    rows = []
    for path, build, seconds in zip(paths, builds, times, strict=True):
        median = statistics.median(seconds)
        rows.append({"build": path, "variant": getattr(build, "__cpu_variant__", "?"), "shape": shape.name,
                     "seq_len": seq_len, "calls": len(seconds),
                     "median_ms": median * 1e3, "p10_ms": sorted(seconds)[len(seconds) // 10] * 1e3,
                     "kv_gbps": kv_bytes(shape, seq_len) / median / 1e9, "speedup_vs_first": first / median})
    return rows


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--builds", nargs="+", required=True, help="_cpu*.so files; the first is the baseline")
    parser.add_argument("--shape", default="mixtral", choices=[s.name for s in SHAPES])
    parser.add_argument("--seq-len", type=int, default=32768, help="tokens (a multiple of 16)")
    parser.add_argument("--cold-mib", type=int, default=1024, help="MiB read between two reads of the same KV")
    parser.add_argument("--rounds", type=int, default=6, help="turns of every build")
    parser.add_argument("--variants", nargs="+", default=None,
                        help="ISA variants to run each build with (default: each build's own best)")
    parser.add_argument("--out", default=None, help="JSON output path")
    args = parser.parse_args(argv)
    check_positive(parser, args, ("seq_len", "rounds"))
    if args.seq_len % 16:
        parser.error(f"--seq-len must be a multiple of the block size 16, got {args.seq_len}")
    if args.cold_mib < 0:
        parser.error(f"--cold-mib must be >= 0, got {args.cold_mib}")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    with tempfile.TemporaryDirectory() as workdir:
        try:
            if args.variants:
                pairs = [(path, variant) for path in args.builds for variant in args.variants]
                builds = [load_variant(path, i, variant, workdir) for i, (path, variant) in enumerate(pairs)]
                paths = [path for path, _ in pairs]
            else:
                builds = [load_build(path, i) for i, path in enumerate(args.builds)]
                paths = args.builds
        except ValueError as error:
            parser.error(str(error))
        shape = {s.name: s for s in SHAPES}[args.shape]
        torch.manual_seed(0)
        times = measure(builds, shape, args.seq_len, args.cold_mib << 20, args.rounds)
    rows = summarize(paths, builds, times, shape, args.seq_len)
    for row in rows:
        log.info("%s L=%d %s (variant %s): median %.3f ms, p10 %.3f ms, %.1f GB/s, %.2fx the first", row["shape"],
                 row["seq_len"], row["build"], row["variant"], row["median_ms"], row["p10_ms"], row["kv_gbps"],
                 row["speedup_vs_first"])
    if args.out:
        write_json(args.out, {"rows": rows, "rounds": args.rounds, "cold_mib": args.cold_mib})
    return rows


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
