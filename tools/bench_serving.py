"""The Serve app under load, measured by an existing serving benchmark: GuideLLM (vLLM's project)
sends long synthetic prompts at fixed request rates through the OpenAI completions route, streamed,
and reports time to first token, inter-token latency, time per output token and throughput.

    python3 -m venv .venv-guidellm && .venv-guidellm/bin/pip install torch==2.13.0 guidellm==0.8.1
    python tools/bench_serving.py --guidellm .venv-guidellm/bin/guidellm --rates 0.05 0.1 0.2

GuideLLM runs in its own environment (it pins its own dependencies) as a separate process; this
tool starts the app (an embedded local Ray), exports the served preset's tokenizer where GuideLLM
can load it (so its prompts have exactly --prompt-tokens tokens), runs one GuideLLM benchmark per
rate, and writes GuideLLM's reports, a JSON summary and a markdown table. Prefix caching is off:
each synthetic prompt is new, and what is measured is the prefill and decode of every prompt.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import tempfile
import time

from writescope.tools.results import host_info, write_json

log = logging.getLogger("bench_serving")
# GuideLLM's report names -> ours, in milliseconds (its latencies) or per second (its rates)
METRICS = {"time_to_first_token_ms": "ttft_ms", "inter_token_latency_ms": "itl_ms",
           "time_per_output_token_ms": "tpot_ms", "request_latency": "e2e_s"}


def export_tokenizer(preset: str, directory: str) -> str:
    """The preset's tokenizer as a Hugging Face tokenizer directory (tokenizer.json + its config)."""
    from writescope.models.presets import byte_level_tokenizer

    os.makedirs(directory, exist_ok=True)
    byte_level_tokenizer().save(os.path.join(directory, "tokenizer.json"))
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<eos>", "model_max_length": 10**7}, f)
    return directory


def guidellm_command(args, url: str, rate: float, tokenizer_dir: str, report: str) -> list[str]:
    return [args.guidellm, "run",
            "--backend", f"kind=openai_http,target={url},model={args.preset},request_format=/v1/completions",
            "--profile", f"kind=constant,rate={rate}",
            "--data", f"kind=synthetic_text,prompt_tokens={args.prompt_tokens},output_tokens={args.output_tokens}",
            "--tokenizer", f"kind=huggingface_auto,model={tokenizer_dir}",
            "--constraint", f"kind=max_requests,count={args.requests}",
            "--output", f"kind=json,path={report}",
            "--disable-console-interactive"]


def summarize(report_path: str) -> dict:
    """The successful requests' medians and p99 of each latency, and the rates, from GuideLLM's JSON."""
    with open(report_path) as f:
        report = json.load(f)
    benchmark = report["benchmarks"][0]
    metrics = benchmark["metrics"]
    summary = {}
    for theirs, ours in METRICS.items():
        successful = metrics[theirs]["successful"]
        summary[f"{ours}_p50"] = successful["median"]
        summary[f"{ours}_p99"] = successful["percentiles"]["p99"]
    summary["requests_ok"] = metrics["request_totals"]["successful"]
    summary["requests_errored"] = metrics["request_totals"]["errored"]
    summary["prompt_tokens_p50"] = metrics["prompt_token_count"]["successful"]["median"]
    # over the benchmark's whole run: what the server delivered, not a per-request rate
    summary["duration_s"] = benchmark["duration"]
    summary["output_tok_s"] = metrics["output_token_count"]["successful"]["total_sum"] / benchmark["duration"]
    summary["requests_s"] = summary["requests_ok"] / benchmark["duration"]
    return summary


def table(rows: list[dict], args, host: dict) -> str:
    lines = [f"GuideLLM {rows[0]['guidellm_version']} against the Serve app: {args.preset}, {args.dtype}, policy "
             f"{args.policy}, max_batch_size {args.max_batch_size}; {args.requests} requests a rate of "
             f"{args.prompt_tokens} prompt + {args.output_tokens} output tokens, streamed. Host: {host['cpu_model']}, "
             f"{host['cpus']} CPUs, kernel variant {host['cpu_variant']}.", "",
             "| rate (req/s) | ok | TTFT p50 / p99 (ms) | ITL p50 / p99 (ms) | TPOT p50 / p99 (ms) | "
             "e2e p50 (s) | output tok/s | req/s done |", "|---|---|---|---|---|---|---|---|"]
    for row in rows:
        lines.append(f"| {row['rate']} | {row['requests_ok']} | {row['ttft_ms_p50']:.0f} / {row['ttft_ms_p99']:.0f} | "
                     f"{row['itl_ms_p50']:.1f} / {row['itl_ms_p99']:.1f} | {row['tpot_ms_p50']:.1f} / "
                     f"{row['tpot_ms_p99']:.1f} | {row['e2e_s_p50']:.2f} | {row['output_tok_s']:.1f} | "
                     f"{row['requests_s']:.3f} |")
    return "\n".join(lines)


def warm_up(base_url: str, args) -> None:
    """Two requests of the benchmark's shape before any is timed, so that none of GuideLLM's pays
    for a first call (allocating the regions' first segments, torch's first kernels)."""
    import requests

    for seed in range(2):
        body = {"model": args.preset, "prompt": [(seed * 7 + i) % 250 + 1 for i in range(args.prompt_tokens)],
                "max_tokens": args.output_tokens, "ignore_eos": True}
        requests.post(f"{base_url}/v1/completions", json=body, timeout=600).raise_for_status()


def run(args) -> list[dict]:
    from writescope.tools.local_serve import local_serve_app

    version = subprocess.run([args.guidellm, "--version"], capture_output=True, text=True, check=True)
    app_args = {"model": args.preset, "dtype": args.dtype, "policy": args.policy,
                "max_batch_size": args.max_batch_size, "max_seq_len": args.prompt_tokens + args.output_tokens + 64,
                "enable_prefix_caching": False}
    rows = []
    with tempfile.TemporaryDirectory() as scratch, local_serve_app(app_args) as base_url:
        tokenizer_dir = export_tokenizer(args.preset, os.path.join(scratch, "tokenizer"))
        warm_up(base_url, args)
        for rate in args.rates:
            report = os.path.join(args.reports, f"guidellm_rate_{rate}.json")
            os.makedirs(args.reports, exist_ok=True)
            command = guidellm_command(args, base_url, rate, tokenizer_dir, report)
            log.info("rate %s: %s", rate, " ".join(command))
            began = time.monotonic()
            done = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout_s)
            if done.returncode != 0:
                raise RuntimeError(f"guidellm failed at rate {rate}: {done.stderr[-3000:] or done.stdout[-3000:]}")
            rows.append({"rate": rate, "wall_s": round(time.monotonic() - began, 1),
                         "guidellm_version": version.stdout.strip().split()[-1], **summarize(report)})
            log.info("rate %s: %s", rate, rows[-1])
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--guidellm", default="guidellm", help="the guidellm executable (its own environment)")
    parser.add_argument("--preset", default="tiny-qwen3-moe", help="the served preset")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--policy", default="writescope")
    parser.add_argument("--max-batch-size", type=int, default=4)
    parser.add_argument("--rates", type=float, nargs="+", default=[0.05, 0.1, 0.2], help="requests per second")
    parser.add_argument("--prompt-tokens", type=int, default=8192)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--requests", type=int, default=10, help="requests per rate")
    parser.add_argument("--timeout-s", type=float, default=1800, help="the longest one rate may take")
    parser.add_argument("--reports", default="bench_results/serving", help="where GuideLLM's reports go")
    parser.add_argument("--out", default="bench_results/serving.json")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    host = host_info()
    rows = run(args)
    write_json(args.out, {"host": host, "args": vars(args), "rows": rows})
    text = table(rows, args, host)
    with open(os.path.splitext(args.out)[0] + ".md", "w") as f:
        f.write(text + "\n")
    sys.stdout.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
