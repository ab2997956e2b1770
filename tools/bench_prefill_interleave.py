"""A running stream's inter-token gaps while another request's long prompt is prefilled, with the
prefill chunked (interleaved with decode steps) or whole: through the Engine API in one process, or
over HTTP against the Serve app (`--http`: an embedded local Ray, the OpenAI completions route,
streamed; the times are when the client reads each server-sent event).

For each chunk size: a short request decodes; once it has produced `--warm-tokens`, a request with a
`--context`-token prompt arrives (EngineService, as callers submit; or a second HTTP client).
Reported: the short stream's largest gap between two tokens while the long prompt is prefilled, its
median gap, the long prompt's time to first token and its prefill tok/s.

    python tools/bench_prefill_interleave.py --context 32768 --chunks 4096 32768
    python tools/bench_prefill_interleave.py --http --context 32768 --chunks 4096 32768
"""

from __future__ import annotations

import argparse
import logging
import statistics
import threading
import time

import requests
import torch

from writescope.actors.gpu_worker import EngineService
from writescope.config import EngineConfig
from writescope.engine import Engine
from writescope.sampling import SamplingParams
from writescope.tools.local_serve import sse_payloads
from writescope.tools.results import write_json

log = logging.getLogger("bench_prefill_interleave")


def measure(args, chunk: int) -> dict:
    config = EngineConfig(model=args.preset, dtype="bfloat16", policy="all_cpu", max_batch_size=2,
                          max_seq_len=args.context + 64, prefill_chunk_tokens=chunk, enable_prefix_caching=False)
    engine = Engine.from_config(config)
    service = EngineService(engine, max_waiting=4)
    try:
        generator = torch.Generator().manual_seed(0)
        long_prompt = torch.randint(1, 250, (args.context,), generator=generator).tolist()
        short = service.submit([5, 6, 7, 8], SamplingParams(max_new_tokens=args.short_tokens, ignore_eos=True))
        stamps, long_times = [], {}
        for event in short:
            stamps.append(time.perf_counter())
            if len(stamps) == args.warm_tokens:
                long_times["submitted"] = time.perf_counter()
                long = service.submit(long_prompt, SamplingParams(max_new_tokens=2, ignore_eos=True))
                threading.Thread(target=_first_token, args=(long, long_times), daemon=True).start()
            if event.finish_reason is not None or "first" in long_times and len(stamps) > args.warm_tokens + 8:
                break
        _wait_for_first_token(long_times)
    finally:
        service.close()
        engine.shutdown()
    return _row(args, chunk, stamps, long_times)


def _wait_for_first_token(long_times: dict) -> None:
    while "first" not in long_times:
        if "error" in long_times:
            raise RuntimeError(f"the long prompt's request failed: {long_times['error']}")
        time.sleep(0.01)


def _row(args, chunk: int, stamps: list[float], long_times: dict) -> dict:
    if stamps[-1] < long_times["first"]:
        raise RuntimeError(f"the short stream ended after {len(stamps)} tokens, before the long prompt's first "
                           f"token: its gaps would not cover the prefill; raise --short-tokens")
    during = [b - a for a, b in zip(stamps, stamps[1:], strict=False)
              if b > long_times["submitted"] and a < long_times["first"]]
    ttft_s = long_times["first"] - long_times["submitted"]
    return {"chunk_tokens": chunk, "context": args.context, "max_gap_during_prefill_s": max(during, default=None),
            "median_gap_s": statistics.median(b - a for a, b in zip(stamps, stamps[1:], strict=False)),
            "gaps_during_prefill": len(during), "long_ttft_s": ttft_s, "prefill_tok_s": args.context / ttft_s}


def measure_http(args, chunk: int) -> dict:
    from writescope.tools.local_serve import local_serve_app

    app_args = {"model": args.preset, "dtype": "bfloat16", "policy": "all_cpu", "max_batch_size": 2,
                "max_seq_len": args.context + 64, "prefill_chunk_tokens": chunk, "enable_prefix_caching": False}
    long_prompt = torch.randint(1, 250, (args.context,), generator=torch.Generator().manual_seed(0)).tolist()
    stamps, long_times = [], {}
    with local_serve_app(app_args) as base_url:
        url = base_url + "/v1/completions"
        # greedy and past EOS: a random-weight model may draw EOS at any step, which would end the
        # stream being timed before the long prompt's prefill is over
        short = {"model": args.preset, "prompt": [5, 6, 7, 8], "max_tokens": args.short_tokens, "stream": True,
                 "temperature": 0, "ignore_eos": True}
        with requests.post(url, json=short, stream=True, timeout=600) as response:
            response.raise_for_status()
            for _chunk in _sse(response):
                stamps.append(time.perf_counter())
                if len(stamps) == args.warm_tokens:
                    long_times["submitted"] = time.perf_counter()
                    long = {"model": args.preset, "prompt": long_prompt, "max_tokens": 2, "stream": True,
                            "temperature": 0, "ignore_eos": True}
                    threading.Thread(target=_first_http_token, args=(url, long, long_times), daemon=True).start()
                if "first" in long_times and len(stamps) > args.warm_tokens + 8:
                    break
        _wait_for_first_token(long_times)
    return _row(args, chunk, stamps, long_times)


def _sse(response):
    """A streamed completion's chunks as they arrive; an error event raises (it is not a token)."""
    for chunk in sse_payloads(response):
        if chunk == "[DONE]":
            return
        if "error" in chunk:
            raise RuntimeError(f"the stream ended with an error: {chunk['error']}")
        yield chunk


def _first_http_token(url: str, body: dict, times: dict) -> None:
    try:
        with requests.post(url, json=body, stream=True, timeout=3600) as response:
            response.raise_for_status()
            for _chunk in _sse(response):
                times.setdefault("first", time.perf_counter())
    except Exception as error:  # reported by _wait_for_first_token in the measuring thread
        times["error"] = repr(error)


def _first_token(stream, times: dict) -> None:
    try:
        for _event in stream:
            times.setdefault("first", time.perf_counter())
    except Exception as error:
        times["error"] = repr(error)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="tiny-qwen3-moe")
    parser.add_argument("--context", type=int, default=32768, help="the long prompt's tokens")
    parser.add_argument("--chunks", type=int, nargs="+", default=[4096, 32768],
                        help="prefill_chunk_tokens to compare (the context or more: whole)")
    parser.add_argument("--warm-tokens", type=int, default=5, help="short-stream tokens before the long prompt")
    parser.add_argument("--short-tokens", type=int, default=4000, help="the short stream's max_new_tokens")
    parser.add_argument("--http", action="store_true", help="over HTTP against the Serve app (embedded local Ray)")
    parser.add_argument("--out", default=None, help="default bench_results/prefill_interleave[_http].json")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    rows = [(measure_http if args.http else measure)(args, chunk) for chunk in args.chunks]
    out = args.out or f"bench_results/prefill_interleave{'_http' if args.http else ''}.json"
    write_json(out, {"preset": args.preset, "path": "http" if args.http else "engine", "rows": rows})
    print("| prefill chunk | context | short stream's largest gap during the prefill | its median gap "
          "| long prompt's TTFT | prefill tok/s |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['chunk_tokens']} | {r['context']} | {r['max_gap_during_prefill_s']:.2f} s | "
              f"{r['median_gap_s'] * 1e3:.0f} ms | {r['long_ttft_s']:.2f} s | {r['prefill_tok_s']:.0f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
