"""A bounded fuzz run of the HTTP API from its own OpenAPI schema (schemathesis): every operation,
with bodies that follow the schema (positive) and bodies that break it (negative); the aim is no
5xx at all. Prints and writes the counts by operation and status class, and every 5xx case.

    python tools/fuzz_http.py --examples 100 --out bench_results/fuzz_http.json     # starts the app here
    python tools/fuzz_http.py --url http://127.0.0.1:8000 --examples 500            # a running server

Started here, the app serves tiny-qwen3-moe with max_seq_len 64, so a valid request decodes at
most 63 tokens and the run stays bounded in time.
"""

from __future__ import annotations

import argparse
import json
import logging
from collections import Counter

import requests
from hypothesis import HealthCheck, given, seed, settings
from hypothesis.errors import Unsatisfiable
from tqdm import tqdm

from writescope.tools.results import write_json

log = logging.getLogger("fuzz_http")
TARGET_APP = {"model": "tiny-qwen3-moe", "policy": "all_cpu", "max_batch_size": 4, "max_seq_len": 64, "max_queue": 64}
MODES = ("positive", "negative")


def fuzz(base_url: str, examples: int, random_seed: int = 0, modes=MODES, headers: dict | None = None,
         timeout_s: float = 60.0) -> dict:
    """{"operations": {"METHOD /path mode": {status class: count}}, "server_errors": [...], "cases": n}."""
    import schemathesis

    schema = schemathesis.openapi.from_url(base_url + "/openapi.json", headers=headers or {})
    report = {"operations": {}, "server_errors": [], "cases": 0}
    operations = [result.ok() for result in schema.get_all_operations()]
    bar = tqdm(total=len(operations) * len(modes) * examples, desc="fuzz", unit="case")
    session = requests.Session()
    models = session.get(base_url + "/v1/models", headers=headers, timeout=timeout_s).json()["data"]
    served_model = models[0]["id"] if models else None
    for operation in operations:
        for mode in modes:
            counts = _fuzz_operation(operation, mode, base_url, examples, random_seed, session, headers, timeout_s,
                                     report, bar, served_model)
            report["operations"][f"{operation.label} {mode}"] = dict(counts)
    bar.close()
    return report


def _fuzz_operation(operation, mode: str, base_url: str, examples: int, random_seed: int, session, headers,
                    timeout_s: float, report: dict, bar, served_model: str | None) -> Counter:
    from schemathesis import GenerationMode

    counts: Counter = Counter()

    @seed(random_seed)
    @settings(max_examples=examples, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(case=operation.as_strategy(generation_mode=GenerationMode(mode)))
    def run(case):
        if mode == "positive" and isinstance(case.body, dict) and served_model is not None:
            case.body["model"] = served_model  # else nearly every valid body is a 404 for its random model
        report["cases"] += 1
        bar.update(1)
        try:
            response = case.call(base_url=base_url, session=session, headers=headers, timeout=timeout_s)
        except requests.RequestException as error:
            counts["no answer"] += 1
            report["server_errors"].append({"operation": case.operation.label, "mode": mode,
                                            "error": f"{type(error).__name__}: {error}"[:300],
                                            "body": repr(case.body)[:300]})
            return
        counts[f"{response.status_code // 100}xx"] += 1
        if response.status_code >= 500:
            report["server_errors"].append({"operation": case.operation.label, "mode": mode,
                                            "status": response.status_code, "body": repr(case.body)[:300],
                                            "answer": response.text[:300]})

    try:
        run()
    except Unsatisfiable:  # nothing to break: an operation without parameters or body has no negative case
        counts["no case"] += 1
    return counts


def table(report: dict) -> str:
    lines = ["| operation | mode | 2xx | 4xx | 5xx | no answer |", "|---|---|---|---|---|---|"]
    for name, counts in report["operations"].items():
        operation, mode = name.rsplit(" ", 1)
        lines.append(f"| {operation} | {mode} | {counts.get('2xx', 0)} | {counts.get('4xx', 0)} | "
                     f"{counts.get('5xx', 0)} | {counts.get('no answer', 0)} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default=None, help="a running server (default: start the app here)")
    parser.add_argument("--examples", type=int, default=100, help="cases per operation and mode")
    parser.add_argument("--seed", type=int, default=0, help="hypothesis seed")
    parser.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    parser.add_argument("--out", default="bench_results/fuzz_http.json", help="JSON report")
    args = parser.parse_args(argv)
    if args.examples < 1:
        parser.error(f"--examples must be >= 1, got {args.examples}")
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else None
    if args.url:
        report = fuzz(args.url.rstrip("/"), args.examples, args.seed, headers=headers)
    else:
        from writescope.tools.local_serve import local_serve_app

        with local_serve_app(TARGET_APP, name="fuzz") as base_url:
            report = fuzz(base_url, args.examples, args.seed, headers=headers)
    report["target"] = args.url or TARGET_APP
    write_json(args.out, report)
    print(table(report))  # noqa: T201 - the tool's output
    print(f"{report['cases']} cases, {len(report['server_errors'])} server errors")  # noqa: T201
    for failure in report["server_errors"][:20]:
        print(json.dumps(failure))  # noqa: T201
    return 1 if report["server_errors"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
