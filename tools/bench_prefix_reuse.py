"""Prefix reuse against its peer in the same run: an engine with prefix caching and one without
answer the same questions over one long document (multi-turn over a document, the common long
context case). For each question: the prefill time, the time to the first token, the prompt
tokens reused and the blocks allocated; medians over the questions after the first (which writes
the document), and whether both engines answered the same tokens.

    python tools/bench_prefix_reuse.py --document-tokens 16384 --questions 5
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import time

from writescope.engine import Engine
from writescope.tools.results import host_info, write_json

log = logging.getLogger("bench_prefix_reuse")


def ask(engine: Engine, prompt: list[int], new_tokens: int) -> dict:
    """One request alone: its prefill time, its time to first token, its reuse and its answer."""
    before_s, before_cached = engine.stats["prefill_s"], engine.stats["cached_prompt_tokens"]
    began = time.perf_counter()
    stream = engine.generate_stream([prompt], max_new_tokens=new_tokens)
    first = next(stream)
    ttft_s = time.perf_counter() - began
    blocks = engine.cache.allocated_blocks()
    tokens = [first.token_id] + [event.token_id for event in stream if event.token_id >= 0]
    return {"prefill_s": engine.stats["prefill_s"] - before_s, "ttft_s": ttft_s, "allocated_blocks": blocks,
            "cached_tokens": engine.stats["cached_prompt_tokens"] - before_cached, "tokens": tokens}


def run(args) -> dict:
    document = [(31 * i) % 251 + 1 for i in range(args.document_tokens)]
    questions = [[300 + q % 10] + [(q * 13 + i) % 250 + 1 for i in range(args.question_tokens)]
                 for q in range(args.questions)]
    results = {}
    for reuse in (False, True):
        engine = Engine.from_pretrained(args.preset, dtype=args.dtype, policy=args.policy, max_batch_size=1,
                                        max_seq_len=args.document_tokens + args.question_tokens + args.new_tokens + 16,
                                        enable_prefix_caching=reuse)
        try:
            ask(engine, list(range(1, 65)), 2)  # warm-up: a short prompt shares no block with the document
            results[reuse] = [ask(engine, document + q, args.new_tokens) for q in questions]
        finally:
            engine.shutdown()
    return results


def summary(results: dict) -> list[dict]:
    rows = []
    for reuse, asked in results.items():
        later = asked[1:]
        rows.append({"prefix_caching": reuse, "first_prefill_s": asked[0]["prefill_s"],
                     "first_ttft_s": asked[0]["ttft_s"],
                     "later_prefill_s_median": statistics.median(a["prefill_s"] for a in later),
                     "later_ttft_s_median": statistics.median(a["ttft_s"] for a in later),
                     "later_cached_tokens": [a["cached_tokens"] for a in later],
                     "allocated_blocks": [a["allocated_blocks"] for a in asked]})
    return rows


def table(rows: list[dict], same_tokens: bool, args, host: dict) -> str:
    lines = [f"{args.preset}, {args.dtype}, policy {args.policy}: {args.questions} questions of {args.question_tokens} "
             f"tokens over one {args.document_tokens}-token document, {args.new_tokens} new tokens each, one at a "
             f"time. Host: {host['cpu_model']}, {host['cpus']} CPUs, kernel variant {host['cpu_variant']}. Same "
             f"tokens with and without reuse: {same_tokens}.", "",
             "| prefix caching | first question: prefill s / TTFT s | later ones (median): prefill s / TTFT s | "
             "prompt tokens reused (later ones) | blocks allocated after each first token |",
             "|---|---|---|---|---|"]
    for row in rows:
        lines.append(f"| {'on' if row['prefix_caching'] else 'off'} | {row['first_prefill_s']:.3f} / "
                     f"{row['first_ttft_s']:.3f} | {row['later_prefill_s_median']:.3f} / "
                     f"{row['later_ttft_s_median']:.3f} | {row['later_cached_tokens']} | {row['allocated_blocks']} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="tiny-qwen3-moe")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--policy", default="writescope")
    parser.add_argument("--document-tokens", type=int, default=16384)
    parser.add_argument("--question-tokens", type=int, default=24)
    parser.add_argument("--questions", type=int, default=5, help="at least 2: the first writes the document")
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--out", default="bench_results/prefix_reuse.json")
    args = parser.parse_args(argv)
    if args.questions < 2:
        parser.error("--questions must be >= 2: the first writes the document, the others may reuse it")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    host = host_info()
    results = run(args)
    same = [a["tokens"] for a in results[False]] == [a["tokens"] for a in results[True]]
    rows = summary(results)
    write_json(args.out, {"host": host, "args": vars(args), "rows": rows, "same_tokens": same})
    sys.stdout.write(table(rows, same, args, host) + "\n")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
