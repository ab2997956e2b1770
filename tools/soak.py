"""A bounded fault soak of the Serve app: many concurrent clients while CPU workers and the GPU
worker are SIGKILLed at random every few seconds. Every request ends in one of five ways:

    answered            200 with exactly the tokens the prompt gets alone (greedy)
    failed with error   an error the client can see: a 4xx/5xx with an OpenAI error body, or a
                        stream that ends with an error event and `data: [DONE]`
    wrong               200 with other tokens than the prompt gets alone
    hung                no answer (or no stream progress) within --hung-after-s
    lost                the connection ended without an answer or an error (a cut stream, a reset)

The aim: wrong = hung = lost = 0. The app runs on an embedded local Ray started here (its actors
are this process's descendants, so the killer finds them by name among them).

    python tools/soak.py --duration-s 300 --clients 64 --kill-every-s 20 --out bench_results/soak.json
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import signal
import statistics
import threading
import time
from collections import Counter

import requests

from writescope.tools.local_serve import sse_payloads
from writescope.tools.results import write_json

log = logging.getLogger("soak")
MODEL = "tiny-qwen3-moe"
OUTCOMES = ("answered", "failed with error", "wrong", "hung", "lost")


def soak_app(max_seq_len: int) -> dict:
    return {"model": MODEL, "policy": "fixed_half", "max_batch_size": 16, "max_seq_len": max_seq_len,
            "max_queue": 256}


def make_prompts(count: int) -> list[str]:
    return [f"soak {i}: " + "a long context line " * (3 + (7 * i) % 40) for i in range(count)]


def reference_tokens(prompts: list[str], new_tokens: int, max_seq_len: int) -> list[list[int]]:
    """Each prompt's greedy tokens, alone, on an in-process engine with the same weights."""
    from writescope.engine import Engine

    engine = Engine.from_pretrained(MODEL, policy="fixed_half", max_batch_size=1, max_seq_len=max_seq_len)
    try:
        return [engine.generate(p, max_new_tokens=new_tokens)[0].token_ids for p in prompts]
    finally:
        engine.shutdown()


class Client(threading.Thread):
    """Sends requests until the deadline, half of them streamed, and classifies each."""

    def __init__(self, base_url: str, prompts, expected, new_tokens: int, deadline: float, hung_after_s: float,
                 rng: random.Random, record):
        super().__init__(daemon=True)
        self.base_url, self.prompts, self.expected = base_url, prompts, expected
        self.new_tokens, self.deadline, self.hung_after_s, self.rng, self.record = \
            new_tokens, deadline, hung_after_s, rng, record
        self.session = requests.Session()

    def run(self):
        while time.monotonic() < self.deadline:
            index = self.rng.randrange(len(self.prompts))
            stream = self.rng.random() < 0.5
            began = time.monotonic()
            outcome, wait_s = self._one(index, stream)
            self.record(outcome, time.monotonic() - began, stream)
            if wait_s:
                time.sleep(min(wait_s, max(0.0, self.deadline - time.monotonic())))

    def _one(self, index: int, stream: bool) -> tuple[str, float]:
        body = {"model": MODEL, "prompt": self.prompts[index], "max_tokens": self.new_tokens, "temperature": 0,
                "stream": stream}
        try:
            response = self.session.post(f"{self.base_url}/v1/completions", json=body, stream=stream,
                                         timeout=(10, self.hung_after_s))
            if response.status_code != 200:
                return self._error_answer(response)
            tokens = self._stream_tokens(response) if stream else response.json()["choices"][0]["token_ids"]
        except requests.Timeout:
            return "hung", 0.0
        except _StreamError:
            return "failed with error", 0.5
        except (requests.RequestException, ValueError, KeyError):
            return "lost", 0.5
        return ("answered" if tokens == self.expected[index] else "wrong"), 0.0

    @staticmethod
    def _error_answer(response) -> tuple[str, float]:
        try:
            error = response.json()["error"]
            visible = bool(error["message"]) and error["code"] == response.status_code
        except (ValueError, KeyError, TypeError):
            visible = False
        retry_after = float(response.headers.get("Retry-After", 0.5) or 0.5)
        return ("failed with error" if visible else "lost"), min(retry_after, 2.0)

    @staticmethod
    def _stream_tokens(response) -> list[int]:
        tokens, error, done = [], None, False
        for chunk in sse_payloads(response):
            if chunk == "[DONE]":
                done = True
                break
            if "error" in chunk:
                error = chunk["error"]
                continue
            tokens += chunk["choices"][0]["token_ids"]
        if not done:
            raise requests.ConnectionError("the stream ended without [DONE]")
        if error is not None:
            raise _StreamError(error)
        return tokens


class _StreamError(Exception):
    """A stream that ended with an error event (and [DONE])."""


def descendants_named(name: str) -> list[int]:
    """PIDs of this process's descendants whose command line starts with name (e.g. "ray::GPUWorker")."""
    parents = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                parents[int(pid)] = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
    mine, found = {os.getpid()}, []
    changed = True
    while changed:
        changed = False
        for pid, parent in parents.items():
            if parent in mine and pid not in mine:
                mine.add(pid)
                changed = True
    for pid in mine - {os.getpid()}:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if f.read().split(b"\0")[0].decode(errors="replace").startswith(name):
                    found.append(pid)
        except OSError:
            continue
    return found


class Killer(threading.Thread):
    """Every kill_every_s (jittered), SIGKILLs a CPU worker or the GPU worker, at random."""

    def __init__(self, kill_every_s: float, deadline: float, rng: random.Random, kinds=("CPUWorker", "GPUWorker")):
        super().__init__(daemon=True)
        self.kill_every_s, self.deadline, self.rng, self.kinds = kill_every_s, deadline, rng, kinds
        self.kills: list[dict] = []
        self._began = time.monotonic()

    def run(self):
        while True:
            time.sleep(self.kill_every_s * self.rng.uniform(0.7, 1.3))
            if time.monotonic() >= self.deadline - self.kill_every_s / 2:
                return
            kind = self.rng.choice(self.kinds)
            pids = descendants_named(f"ray::{kind}")
            if not pids:
                log.warning("no %s to kill (restarting?)", kind)
                continue
            pid = self.rng.choice(pids)
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                continue
            self.kills.append({"at_s": round(time.monotonic() - self._began, 1), "kind": kind, "pid": pid})
            log.info("killed %s (pid %d)", kind, pid)


def soak(base_url: str, prompts, expected, *, duration_s: float, clients: int, kill_every_s: float,
         new_tokens: int, hung_after_s: float, seed: int = 0) -> dict:
    counts, latencies, lock = Counter(), {o: [] for o in OUTCOMES}, threading.Lock()
    by_kind = Counter()

    def record(outcome, seconds, stream):
        with lock:
            counts[outcome] += 1
            by_kind[(outcome, "stream" if stream else "plain")] += 1
            latencies[outcome].append(seconds)

    deadline = time.monotonic() + duration_s
    rng = random.Random(seed)
    threads = [Client(base_url, prompts, expected, new_tokens, deadline, hung_after_s, random.Random(rng.random()),
                      record) for _ in range(clients)]
    killer = Killer(kill_every_s, deadline, random.Random(rng.random())) if kill_every_s > 0 else None
    for thread in threads:
        thread.start()
    if killer:
        killer.start()
    last = 0.0
    while any(t.is_alive() for t in threads):
        time.sleep(1)
        if time.monotonic() - last > 30:
            last = time.monotonic()
            with lock:
                log.info("%.0f s left: %s", max(0.0, deadline - time.monotonic()), dict(counts))
    return {"duration_s": duration_s, "clients": clients, "kill_every_s": kill_every_s, "new_tokens": new_tokens,
            "counts": {o: counts[o] for o in OUTCOMES},
            "by_kind": {f"{o} ({k})": n for (o, k), n in sorted(by_kind.items())},
            "answered_latency_s": _quantiles(latencies["answered"]),
            "error_latency_s": _quantiles(latencies["failed with error"]),
            "kills": killer.kills if killer else []}


def _quantiles(values: list[float]) -> dict:
    if not values:
        return {}
    values = sorted(values)
    return {"p50": round(statistics.median(values), 3), "p99": round(values[int(0.99 * (len(values) - 1))], 3),
            "max": round(values[-1], 3)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration-s", type=float, default=300.0, help="how long clients send requests")
    parser.add_argument("--clients", type=int, default=64, help="concurrent clients")
    parser.add_argument("--kill-every-s", type=float, default=20.0, help="mean seconds between kills (0: none)")
    parser.add_argument("--new-tokens", type=int, default=16, help="max_tokens of every request")
    parser.add_argument("--prompts", type=int, default=32, help="distinct prompts")
    parser.add_argument("--hung-after-s", type=float, default=120.0, help="no answer or progress for this long: hung")
    parser.add_argument("--max-seq-len", type=int, default=1024, help="the app's max_seq_len")
    parser.add_argument("--seed", type=int, default=0, help="clients' and killer's random seed")
    parser.add_argument("--out", default="bench_results/soak.json", help="JSON report")
    args = parser.parse_args(argv)
    for name in ("duration_s", "clients", "new_tokens", "prompts", "hung_after_s"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be > 0")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    from writescope.tools.local_serve import local_serve_app

    prompts = make_prompts(args.prompts)
    expected = reference_tokens(prompts, args.new_tokens, args.max_seq_len)
    with local_serve_app(soak_app(args.max_seq_len), name="soak") as base_url:
        report = soak(base_url, prompts, expected, duration_s=args.duration_s, clients=args.clients,
                      kill_every_s=args.kill_every_s, new_tokens=args.new_tokens, hung_after_s=args.hung_after_s,
                      seed=args.seed)
    write_json(args.out, report)
    counts = report["counts"]
    print("| " + " | ".join(OUTCOMES) + " | kills (CPU / GPU worker) |")  # noqa: T201 - the tool's output
    print("|" + "---|" * (len(OUTCOMES) + 1))  # noqa: T201
    kinds = Counter(k["kind"] for k in report["kills"])
    print("| " + " | ".join(str(counts[o]) for o in OUTCOMES) +  # noqa: T201
          f" | {kinds['CPUWorker']} / {kinds['GPUWorker']} |")
    print(json.dumps({"answered_latency_s": report["answered_latency_s"], "by_kind": report["by_kind"]}))  # noqa: T201
    return 0 if counts["wrong"] == counts["hung"] == counts["lost"] == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
