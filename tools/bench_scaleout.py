"""Batch throughput against the number of engines, each engine group on a Ray node of its own.

For each count N in --engines: a Ray cluster on this machine (`ray.cluster_utils.Cluster`: a head
with 1 CPU and N worker nodes, each its own raylet with --node-cpus CPUs, token auth on), then the
batch job (`python -m writescope.actors.batch_job --engines auto --engine-cpus NODE_CPUS`, one engine
per worker node) over the same JSONL of --requests prompts of --context tokens. Reports the job's
own summary: seconds from its first request to its last, generated tok/s, requests per engine.

On one machine every "node" shares the same cores, so more engines cannot be faster here: this shows
that the batch spreads and stays correct, not a speed-up. On real nodes each engine brings its own GPU
and CPUs.

    python tools/bench_scaleout.py --engines 1 2 --out bench_results/scaleout.json
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import secrets
import subprocess
import sys
import tempfile

from writescope.tools.results import check_positive, host_info, write_json

log = logging.getLogger("bench_scaleout")


def write_prompts(path: str, requests: int, context: int, new_tokens: int) -> None:
    generator = random.Random(3)
    with open(path, "w") as f:
        for i in range(requests):
            prompt = [generator.randrange(1, 256) for _ in range(context)]
            f.write(json.dumps({"id": f"r{i}", "prompt": prompt, "max_new_tokens": new_tokens}) + "\n")


def run_batch_on_cluster(engines: int, args, workdir: str) -> dict:
    """The batch job's summary on a cluster of `engines` worker nodes."""
    os.environ.setdefault("RAY_AUTH_MODE", "token")
    os.environ.setdefault("RAY_AUTH_TOKEN", secrets.token_hex(32))
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    try:
        for _ in range(engines):
            cluster.add_node(num_cpus=args.node_cpus)
        cluster.wait_for_nodes()
        output = os.path.join(workdir, f"results-{engines}.jsonl")
        command = [sys.executable, "-m", "writescope.actors.batch_job", "--model", args.model, "--dtype", "bfloat16",
                   "--policy", args.policy, "--max-seq-len", str(args.context + args.new_tokens),
                   "--max-batch-size", str(args.max_batch_size), "--engines", "auto",
                   "--engine-cpus", str(args.node_cpus), "--no-enable-prefix-caching",
                   "--input", os.path.join(workdir, "prompts.jsonl"), "--output", output]
        done = subprocess.run(command, env={**os.environ, "RAY_ADDRESS": cluster.address}, capture_output=True,
                              text=True, timeout=3600)
        lines = (done.stdout + done.stderr).splitlines()
        summaries = [json.loads(line.split("summary: ", 1)[1]) for line in lines if "summary: " in line]
        if done.returncode != 0 or not summaries:
            raise RuntimeError(f"the batch job failed ({done.returncode}): {done.stderr[-3000:]}")
        with open(output) as f:
            tokens = {r["id"]: r["token_ids"] for r in map(json.loads, f)}
        return {**summaries[0], "tokens": tokens}
    finally:
        cluster.shutdown()


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engines", type=int, nargs="+", default=[1, 2], help="engine counts to run, in turn")
    parser.add_argument("--requests", type=int, default=32, help="prompts in the batch")
    parser.add_argument("--context", type=int, default=1024, help="prompt tokens each")
    parser.add_argument("--new-tokens", type=int, default=32, help="tokens generated each")
    parser.add_argument("--node-cpus", type=int, default=2, help="logical CPUs of each worker node (= engine_cpus)")
    parser.add_argument("--max-batch-size", type=int, default=8, help="sequences each engine decodes together")
    parser.add_argument("--model", default="tiny-qwen3-moe")
    parser.add_argument("--policy", default="all_cpu")
    parser.add_argument("--out", default="bench_results/scaleout.json")
    args = parser.parse_args(argv)
    check_positive(parser, args, ("requests", "context", "new_tokens", "node_cpus", "max_batch_size"))
    if not args.engines or min(args.engines) < 1:
        parser.error(f"--engines must be counts >= 1, got {args.engines}")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    rows = []
    with tempfile.TemporaryDirectory() as workdir:
        write_prompts(os.path.join(workdir, "prompts.jsonl"), args.requests, args.context, args.new_tokens)
        reference = None
        for engines in args.engines:
            summary = run_batch_on_cluster(engines, args, workdir)
            tokens = summary.pop("tokens")
            reference = reference or tokens
            rows.append({**summary, "engines_asked": engines, "same_tokens_as_first": tokens == reference})
            log.info("%d engine(s): %.1f s, %.1f tok/s, requests per engine %s, same tokens as the first run: %s",
                     engines, summary["seconds"], summary["tok_s"], summary["requests_per_engine"],
                     rows[-1]["same_tokens_as_first"])
    result = {"host": host_info(), "args": vars(args), "rows": rows}
    write_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
