"""A long-context batch as a Ray job: JSONL prompts in, JSONL results out, resumable.

    ray job submit --address http://127.0.0.1:8265 --working-dir . -- \\
        python -m writescope.actors.batch_job --model PATH_OR_PRESET --input prompts.jsonl --output results.jsonl

Each input line is an object: {"id": "a1", "prompt": "text" or [token ids], "max_new_tokens": 64}
with optional "temperature", "top_p", "seed", "stop". Requests run with continuous batching; each
result is appended to the output as soon as its request finishes (flushed and fsynced), so a job
that is stopped or killed loses only the requests in flight. A rerun skips every id already in the
output, so after any number of interruptions each id appears exactly once. Sampling is seeded per
request ("seed", else derived from the id), so a resumed request gets the tokens it would have got.

A bad line (not JSON, a missing or wrong field, a duplicate id, too long for max_seq_len) becomes an
error record {"id": ..., "error": "..."} in the output and does not stop the batch. Progress
(requests done, tok/s, the current CPU share r*) goes to the log every --progress-every-s seconds;
a summary at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
import time
import zlib

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from tqdm import tqdm

from writescope.engine import SamplingParams
from writescope.policies import POLICY_NAMES
from writescope.service import QueueFullError

log = logging.getLogger("writescope.batch_job")


class PromptLine(BaseModel):
    """One input line."""

    model_config = ConfigDict(extra="forbid")

    id: str | int
    prompt: str | list[int] = Field(min_length=1)
    max_new_tokens: int = Field(default=64, ge=1)
    temperature: float = Field(default=0.0, ge=0)
    top_p: float = Field(default=1.0, gt=0, le=1)
    seed: int | None = None
    stop: list[str | int] | str | None = None

    @field_validator("id")
    @classmethod
    def _id_not_empty(cls, value):
        if isinstance(value, str) and not value:
            raise ValueError("id is empty")
        return value

    def params(self) -> SamplingParams:
        seed = self.seed if self.seed is not None else zlib.crc32(str(self.id).encode())
        return SamplingParams(self.max_new_tokens, self.temperature, self.top_p, seed, self.stop or ())


def read_done_ids(path: str) -> set:
    """Ids already in the output. A last line cut short by a kill is removed, so appends stay valid JSONL."""
    if not os.path.exists(path):
        return set()
    with open(path, "rb") as f:
        data = f.read()
    complete = data[: data.rfind(b"\n") + 1]
    if len(complete) != len(data):
        log.warning("%s ends with a partial line (an interrupted write): removing it", path)
        with open(path, "r+b") as f:
            f.truncate(len(complete))
    done = set()
    for line in complete.decode().splitlines():
        if line.strip():
            done.add(json.loads(line)["id"])
    return done


def read_requests(path: str, done: set) -> tuple[list[PromptLine], list[dict]]:
    """(the lines to run, error records of the bad lines), skipping ids already done."""
    todo, errors, seen, in_file = [], [], set(done), set()
    with open(path, "rb") as f:  # lines decoded one by one: a bad byte spoils its line, not the batch
        for number, raw_bytes in enumerate(f, start=1):
            if not raw_bytes.strip():
                continue
            try:
                raw = raw_bytes.decode()
                line = PromptLine.model_validate(json.loads(raw))
            except UnicodeDecodeError as error:
                record_id = f"line-{number}"
                if record_id not in seen:
                    errors.append({"id": record_id, "error": f"line {number} is not UTF-8: {error}"})
                    seen.add(record_id)
                continue
            except json.JSONDecodeError as error:
                record_id = f"line-{number}"
                if record_id not in seen:
                    errors.append({"id": record_id, "error": f"line {number} is not JSON: {error}"})
                    seen.add(record_id)
                continue
            except ValidationError as error:
                record_id = _line_id(raw, number)
                if record_id not in seen:
                    problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'line'}: {e['msg']}"
                                         for e in error.errors())
                    errors.append({"id": record_id, "error": f"line {number}: {problems}"})
                    seen.add(record_id)
                continue
            if line.id in in_file:  # a second line with this id
                record_id = f"line-{number}"
                if record_id not in seen:  # reported once, also across resumed runs
                    errors.append({"id": record_id, "error": f"line {number}: duplicate id {line.id!r}"})
                    seen.add(record_id)
                continue
            in_file.add(line.id)
            if line.id not in seen:  # not done by an earlier run
                seen.add(line.id)
                todo.append(line)
    return todo, errors


def _line_id(raw: str, number: int):
    try:
        value = json.loads(raw).get("id")
    except (ValueError, AttributeError):
        return f"line-{number}"
    return value if isinstance(value, str | int) and value != "" else f"line-{number}"


class ResultWriter:
    """Appends one JSON object per line, each flushed and fsynced before the next request is counted."""

    def __init__(self, path: str):
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self._file = open(path, "a")  # noqa: SIM115 - kept open for the whole batch

    def write(self, record: dict) -> None:
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        os.fsync(self._file.fileno())

    def close(self) -> None:
        self._file.close()


async def run_batch(engine, todo: list[PromptLine], writer: ResultWriter, *, max_in_flight: int,
                    progress_every_s: float = 10.0, state=None) -> dict:
    """Runs every line through engine.submit / engine.stream; returns the counts."""
    counts = {"ok": 0, "errors": 0, "tokens": 0}
    slots = asyncio.Semaphore(max_in_flight)
    began = time.perf_counter()
    bar = tqdm(total=len(todo), desc="requests", unit="req", file=sys.stderr)

    async def one(line: PromptLine):
        async with slots:
            record = await _generate(engine, line)
        writer.write(record)
        counts["errors" if "error" in record else "ok"] += 1
        counts["tokens"] += len(record.get("token_ids", []))
        bar.update(1)

    def progress():
        elapsed = time.perf_counter() - began
        share = state() if state else None
        log.info("progress: %d/%d requests done, %.1f tok/s, r* = %s", counts["ok"] + counts["errors"],
                 len(todo), counts["tokens"] / max(elapsed, 1e-9), "n/a" if share is None else f"{share:.3f}")

    async def report():
        while True:
            await asyncio.sleep(progress_every_s)
            progress()

    reporter = asyncio.create_task(report())
    try:
        await asyncio.gather(*[one(line) for line in todo])
    finally:
        reporter.cancel()
        bar.close()
    progress()
    counts["seconds"] = time.perf_counter() - began
    return counts


async def _generate(engine, line: PromptLine) -> dict:
    while True:
        try:
            request_id = await engine.submit(line.prompt, line.params())
            break
        except QueueFullError as error:  # the semaphore keeps this rare: wait for room
            await asyncio.sleep(error.retry_after_s)
        except ValueError as error:
            return {"id": line.id, "error": str(error).splitlines()[-1] if str(error) else type(error).__name__}
    tokens, text, finish = [], [], None
    async for event in engine.stream(request_id):
        if event.token_id >= 0:
            tokens.append(event.token_id)
            text.append(event.text)
        finish = event.finish_reason
        if finish == "error":
            return {"id": line.id, "error": event.error}
    return {"id": line.id, "token_ids": tokens, "text": "".join(text), "finish_reason": finish,
            "completion_tokens": len(tokens)}


class LocalEngine:
    """The batch on an in-process Engine (--executor local), through the same submit / stream API."""

    def __init__(self, engine, max_waiting: int):
        from writescope.service import EngineService

        self.engine = engine
        self.service = EngineService(engine, max_waiting=max_waiting)
        self._streams = {}

    async def submit(self, prompt, params) -> int:
        stream = self.service.submit(prompt, params, loop=asyncio.get_running_loop())
        self._streams[stream.request_id] = stream
        return stream.request_id

    async def stream(self, request_id):
        async for event in self._streams.pop(request_id):
            yield event

    def current_share(self) -> float | None:
        tokens = sum(s.num_tokens for s in self.engine.cache.seqs.values())
        return self.engine.policy.share(tokens) if tokens else None

    def shutdown(self) -> None:
        self.service.close()
        self.engine.shutdown()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m writescope.actors.batch_job",
                                     description="Run a JSONL batch of long-context prompts; resumable.")
    parser.add_argument("--model", required=True, help="a checkpoint directory or a preset name (tiny-qwen3-moe, ...)")
    parser.add_argument("--input", required=True, help="JSONL: {id, prompt (text or token ids), max_new_tokens, "
                                                       "optional temperature, top_p, seed, stop} per line")
    parser.add_argument("--output", required=True, help="JSONL results, appended; ids already there are skipped")
    parser.add_argument("--policy", default="writescope", choices=POLICY_NAMES, help="KV placement policy")
    parser.add_argument("--executor", default="ray", choices=["ray", "local"],
                        help="ray: actors on the job's cluster (or an embedded local Ray); local: one process")
    parser.add_argument("--max-batch-size", type=int, default=8, help="sequences decoded together")
    parser.add_argument("--max-seq-len", type=int, default=32768, help="prompt + new tokens, at most")
    parser.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                        help="weights and KV dtype (default: the checkpoint's)")
    parser.add_argument("--device", default="cpu", help="cpu, or cuda on a GPU node")
    parser.add_argument("--emulated-nodes", type=int, default=None,
                        help="split this machine's CPUs into N emulated NUMA nodes (one CPU worker each)")
    parser.add_argument("--max-in-flight", type=int, default=64, help="requests submitted and not yet finished")
    parser.add_argument("--progress-every-s", type=float, default=10.0, help="seconds between progress log lines")
    return parser


def _positive(parser, args) -> None:
    for name in ("max_batch_size", "max_seq_len", "max_in_flight"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.emulated_nodes is not None and not 1 <= args.emulated_nodes <= len(os.sched_getaffinity(0)):
        parser.error(f"--emulated-nodes must be in [1, {len(os.sched_getaffinity(0))}] (the CPUs of this machine)")
    if not os.path.isfile(args.input):
        parser.error(f"--input {args.input!r} is not a file")


def _open_engine(args):
    from writescope.engine import Engine

    options = dict(policy=args.policy, dtype=args.dtype, max_batch_size=args.max_batch_size,
                   max_seq_len=args.max_seq_len, device=args.device)
    if args.executor == "local":
        return LocalEngine(Engine.from_pretrained(args.model, **options), args.max_in_flight)
    import ray

    from writescope.actors.local_ray import start_local_ray
    from writescope.topology import emulated_topology, topology

    if not ray.is_initialized():
        if os.environ.get("RAY_ADDRESS"):  # inside `ray job submit`: the job's cluster
            ray.init(log_to_driver=False)
        else:
            start_local_ray()
    nodes = emulated_topology(args.emulated_nodes) if args.emulated_nodes else topology()
    return Engine.from_pretrained(args.model, executor="ray", **options,
                                  executor_options={"nodes": nodes, "max_waiting": args.max_in_flight})


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    _positive(parser, args)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    done = read_done_ids(args.output)
    todo, bad = read_requests(args.input, done)
    log.info("%d requests to run, %d already in %s, %d bad lines", len(todo), len(done), args.output, len(bad))
    writer = ResultWriter(args.output)
    engine = None
    try:
        for record in bad:
            writer.write(record)
        engine = _open_engine(args)
        counts = asyncio.run(run_batch(engine, todo, writer, max_in_flight=args.max_in_flight,
                                       progress_every_s=args.progress_every_s, state=engine.current_share))
    finally:
        writer.close()
        if engine is not None:
            engine.shutdown()
    summary = {"ran": len(todo), "ok": counts["ok"], "errors": counts["errors"] + len(bad), "skipped": len(done),
               "generated_tokens": counts["tokens"], "seconds": round(counts["seconds"], 2),
               "tok_s": round(counts["tokens"] / max(counts["seconds"], 1e-9), 1)}
    log.info("summary: %s", json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
