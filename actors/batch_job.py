"""A long-context batch as a Ray job: JSONL prompts in, JSONL results out, resumable.

    ray job submit --address http://127.0.0.1:8265 --working-dir . -- \\
        python -m writescope.actors.batch_job --model PATH_OR_PRESET --input prompts.jsonl --output results.jsonl

Each input line is an object: {"id": "a1", "prompt": "text" or [token ids], "max_new_tokens": 64}
with optional "temperature", "top_p", "seed", "stop". Requests run with continuous batching; each
result is appended to the output as soon as its request finishes (flushed and fsynced), so a job
that is stopped or killed loses only the requests in flight. A rerun skips every id already in the
output, so after any number of interruptions each id appears exactly once. Sampling is seeded per
request ("seed", else derived from the id), so a resumed request gets the tokens it would have got.

Records: {"id", "token_ids", "text", "finish_reason", "completion_tokens"} for a finished request;
{"id", "error"} for a request that cannot run (a bad field, too long, a prompt that is not valid
Unicode: the id is readable, and the error is that id's result); {"id": null, "line", "error"}
for a line with no usable id (not UTF-8, not JSON, no id, or an id an earlier line already has),
keyed by its line number so it can never stand for a real id.

Integrity. One job writes an output at a time: a second job on the same output is refused (an
exclusive lock on OUTPUT.lock, released when the job ends or dies). A resume repairs the output
first: a last line cut short by a kill is removed, and a corrupted line elsewhere is moved to
OUTPUT.corrupt (the output is rewritten atomically without it) and reported; its request runs
again. A request lost to the GPU worker's death is retried (up to --max-retries times, after Ray
has restarted the worker, or on another engine), never written as an error: if it still cannot
finish, the job exits non-zero and a resubmit retries it.

More than one engine (--engines N, or auto: one per node that can hold an engine group). Each is an
engine group placed by Ray on a node (writescope.actors.engine_group); the lines wait in one queue
and each engine takes the next whenever it has a free slot (work stealing: a faster or emptier
engine takes more). The output, its lock and its repair are the driver's, so every id is written
once whichever engine ran it, and sampling seeded per request gives the tokens one engine would.
An engine whose node is lost gives its in-flight lines back to the queue and leaves the batch to
the others; with no engine left, the rest is unfinished (exit 1; a resubmit runs it).

Progress (requests done, tok/s, the current CPU share r*) goes to the log every --progress-every-s
seconds; a summary at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import fcntl
import json
import logging
import os
import sys
import time
import zlib
from dataclasses import dataclass, field

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr, ValidationError, model_validator
from tqdm import tqdm

from writescope.actors.gpu_worker import EngineService, QueueFullError
from writescope.config import EngineConfig
from writescope.prompts import check_unicode
from writescope.sampling import SEED_MAX, SEED_MIN, SamplingParams

log = logging.getLogger("writescope.batch_job")
MAX_ID_CHARS = 512


class PromptLine(BaseModel):
    """One input line."""

    model_config = ConfigDict(extra="forbid")

    id: StrictStr | StrictInt
    prompt: str | list[int] = Field(min_length=1)
    max_new_tokens: int = Field(default=64, ge=1)
    temperature: float = Field(default=0.0, ge=0, allow_inf_nan=False)
    top_p: float = Field(default=1.0, gt=0, le=1, allow_inf_nan=False)
    seed: int | None = Field(default=None, ge=SEED_MIN, le=SEED_MAX)
    stop: list[str | int] | str | None = None

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data):
        return check_unicode(data)

    def params(self) -> SamplingParams:
        seed = self.seed if self.seed is not None else zlib.crc32(str(self.id).encode())
        return SamplingParams(self.max_new_tokens, self.temperature, self.top_p, seed, self.stop or ())


@dataclass
class Done:
    """What the output already holds: finished ids, and the line numbers of bad lines reported."""

    ids: set = field(default_factory=set)
    lines: set = field(default_factory=set)
    corrupt_lines: int = 0


def usable_id(value):
    """The line's id if it can key a result (a non-empty valid-Unicode string, or an integer), else None."""
    if isinstance(value, bool) or not isinstance(value, str | int):
        return None
    if isinstance(value, str):
        try:
            check_unicode(value)
        except ValueError:
            return None
        if not value or len(value) > MAX_ID_CHARS:
            return None
    return value


def read_requests(path: str, done: Done) -> tuple[list[PromptLine], list[dict]]:
    """(the lines to run, error records of bad lines not reported before). The first line with an
    id claims it; a later line with the same id is a bad line, keyed by its line number."""
    todo, errors, claimed = [], [], set()
    with open(path, "rb") as f:  # lines decoded one by one: a bad byte spoils its line, not the batch
        for number, raw_bytes in enumerate(f, start=1):
            if not raw_bytes.strip():
                continue
            data, line_id, problem = _parse_line(raw_bytes)
            if line_id is None or line_id in claimed:
                problem = problem or f"duplicate id {line_id!r} (an earlier line has it)"
                if number not in done.lines:
                    errors.append({"id": None, "line": number, "error": f"line {number}: {problem}"})
                continue
            claimed.add(line_id)
            if line_id in done.ids:
                continue
            try:
                line = PromptLine.model_validate(data)
                line.params()
            except ValidationError as error:
                errors.append({"id": line_id, "error": f"line {number}: {_problems(error)}"})
                continue
            except ValueError as error:
                errors.append({"id": line_id, "error": f"line {number}: {error}"})
                continue
            todo.append(line)
    return todo, errors


def _parse_line(raw_bytes: bytes):
    """(the parsed object, its usable id, None) or (None, None, what is wrong)."""
    try:
        data = json.loads(raw_bytes.decode("utf-8"))
    except UnicodeDecodeError as error:
        return None, None, f"not UTF-8 ({error.reason} at byte {error.start})"
    except (json.JSONDecodeError, RecursionError) as error:
        return None, None, f"not JSON ({error})"
    if not isinstance(data, dict):
        return None, None, f"not a JSON object (a {type(data).__name__})"
    line_id = usable_id(data.get("id"))
    if line_id is None:
        return None, None, f"id must be a non-empty string (at most {MAX_ID_CHARS} characters) or an " \
                           f"integer, got {json.dumps(data.get('id'))[:40]}"
    return data, line_id, None


def _problems(error: ValidationError) -> str:
    return "; ".join(f"{'.'.join(map(str, e['loc'])) or 'line'}: {e['msg']}" for e in error.errors())


# ---------------------------------------------------------------------------------------- output
class OutputLockedError(RuntimeError):
    """Another batch job writes this output."""


class ResultOutput:
    """The output JSONL under an exclusive lock (OUTPUT.lock, held until close or death): read and
    repaired once, then appended one record at a time, each flushed and fsynced."""

    def __init__(self, path: str):
        self.path = path
        self._lock = _lock(path)
        try:
            self.done = _repair(path)
            self._file = open(path, "a")  # noqa: SIM115 - kept open for the whole batch
        except BaseException:
            self._lock.close()
            raise

    def write(self, record: dict) -> None:
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        os.fsync(self._file.fileno())

    def close(self) -> None:
        self._file.close()
        self._lock.close()  # releases the lock


def _lock(path: str):
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    lock = open(f"{path}.lock", "a+")  # noqa: SIM115 - held for the job's life
    try:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.seek(0)
        holder = lock.read().strip() or "unknown"
        lock.close()
        raise OutputLockedError(f"{path} is being written by another batch job ({holder}): wait for it to end, "
                                f"or give another --output") from None
    lock.truncate(0)
    lock.write(f"pid {os.getpid()} on {os.uname().nodename}\n")
    lock.flush()
    return lock


def _repair(path: str) -> Done:
    """Done ids and lines of the output; a torn last line is cut off, corrupted lines are moved to
    PATH.corrupt and the output is rewritten without them (atomically: a kill leaves one or the other)."""
    if not os.path.exists(path):
        return Done()
    with open(path, "rb") as f:
        data = f.read()
    complete = data[: data.rfind(b"\n") + 1]
    if len(complete) != len(data):
        log.warning("%s ends with a partial line (an interrupted write): removing it", path)
        with open(path, "r+b") as f:
            f.truncate(len(complete))
    done, good, corrupt = Done(), [], []
    for number, raw in enumerate(complete.splitlines(keepends=True), start=1):
        if not raw.strip():
            continue
        key = _record_key(raw)
        if key is None:
            corrupt.append((number, raw))
            continue
        (done.lines if key[0] == "line" else done.ids).add(key[1])
        good.append(raw)
    if corrupt:
        _quarantine(path, good, corrupt)
    done.corrupt_lines = len(corrupt)
    return done


def _record_key(raw: bytes):
    """("id", id) or ("line", number) of a well-formed record, else None."""
    try:
        record = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        return None
    if not isinstance(record, dict) or not ("error" in record or "token_ids" in record):
        return None
    if record.get("id") is None:
        return ("line", record["line"]) if isinstance(record.get("line"), int) else None
    line_id = usable_id(record["id"])
    return None if line_id is None else ("id", line_id)


def _quarantine(path: str, good: list[bytes], corrupt: list[tuple[int, bytes]]) -> None:
    with open(f"{path}.corrupt", "ab") as f:
        for number, raw in corrupt:
            f.write(f"# {path} line {number}, removed {time.strftime('%Y-%m-%dT%H:%M:%S')}\n".encode() + raw)
        f.flush()
        os.fsync(f.fileno())
    temporary = f"{path}.rewrite"
    with open(temporary, "wb") as f:
        f.writelines(good)
        f.flush()
        os.fsync(f.fileno())
    os.replace(temporary, path)
    directory = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)
    log.warning("%s had %d corrupted lines (%s): moved to %s; their requests run again", path, len(corrupt),
                ", ".join(str(n) for n, _ in corrupt[:10]), f"{path}.corrupt")


# ---------------------------------------------------------------------------------------- running
class _EngineLostError(Exception):
    """The request was lost with the GPU worker (or the engine failed): it may be retried."""


class LineQueue:
    """The lines not yet written, shared by every engine: an engine takes the next whenever it has a
    free slot (work stealing), and gives back a line its engine lost, which any engine may take.
    `take` waits while the queue is empty but lines are in flight (one may come back), and returns
    None once every line is written or given up, or no engine is left to run the rest."""

    def __init__(self, lines: list[PromptLine], max_retries: int, engines: int):
        self._lines = collections.deque(lines)
        self._open = len(lines)  # not yet written nor given up
        self._losses: dict = collections.Counter()
        self._max_retries = max_retries
        self._engines = engines  # still taking lines
        self._changed = asyncio.Condition()
        self.unfinished: list = []  # ids lost more than max_retries times

    async def take(self) -> PromptLine | None:
        async with self._changed:
            await self._changed.wait_for(lambda: self._lines or self._open == 0 or self._engines == 0)
            return self._lines.popleft() if self._lines and self._engines else None

    async def done(self) -> None:
        async with self._changed:
            self._open -= 1
            self._changed.notify_all()

    async def put_back(self, line: PromptLine) -> None:
        """A line taken and not started: first in the queue again."""
        async with self._changed:
            self._lines.appendleft(line)
            self._changed.notify_all()

    async def give_back(self, line: PromptLine) -> bool:
        """The line's engine lost it: back in the queue (True), or given up after max_retries losses."""
        async with self._changed:
            self._losses[line.id] += 1
            if self._losses[line.id] > self._max_retries:
                self.unfinished.append(line.id)
                self._open -= 1
                self._changed.notify_all()
                return False
            self._lines.appendleft(line)  # first in line again: it was taken first
            self._changed.notify_all()
            return True

    async def engine_gone(self) -> None:
        """An engine lost for good stops taking lines; with none left, what remains is unfinished."""
        async with self._changed:
            self._engines -= 1
            if self._engines == 0:
                self.unfinished.extend(line.id for line in self._lines)
                self._open -= len(self._lines)
                self._lines.clear()
            self._changed.notify_all()


async def run_batch(engines, todo: list[PromptLine], writer, *, max_in_flight: int, max_retries: int = 3,
                    progress_every_s: float = 10.0) -> dict:
    """Runs every line on `engines` (each with submit / stream / wait_until_ready / lost and up to
    max_in_flight requests at once), taking lines from one LineQueue; returns the counts. A line
    whose engine is lost goes back to the queue, up to max_retries times. The engine then takes no
    line until it answers again (Ray restarted its GPU worker); one lost for good (its node gone)
    leaves the batch to the others."""
    counts = {"ok": 0, "errors": 0, "tokens": 0, "retries": 0, "unfinished": [], "engines_lost": 0,
              "per_engine": [0] * len(engines)}
    queue = LineQueue(todo, max_retries, len(engines))
    began = time.perf_counter()
    bar = tqdm(total=len(todo), desc="requests", unit="req", file=sys.stderr)

    def write(index: int, record: dict) -> None:
        writer.write(record)
        counts["errors" if "error" in record else "ok"] += 1
        counts["tokens"] += len(record.get("token_ids", []))
        counts["per_engine"][index] += 1
        bar.update(1)

    def progress():
        elapsed = time.perf_counter() - began
        shares = []
        for engine in engines:
            with contextlib.suppress(Exception):  # a lost or restarting engine has no share to show
                share = engine.current_share()
                shares.append("n/a" if share is None else f"{share:.3f}")
        log.info("progress: %d/%d requests done, %.1f tok/s, r* = %s", counts["ok"] + counts["errors"],
                 len(todo), counts["tokens"] / max(elapsed, 1e-9), ", ".join(shares) or "n/a")

    async def report():
        while True:
            await asyncio.sleep(progress_every_s)
            progress()

    reporter = asyncio.create_task(report())
    try:
        await asyncio.gather(*[_serve_lines(i, engine, queue, write, max_in_flight, counts)
                               for i, engine in enumerate(engines)])
    finally:
        reporter.cancel()
        bar.close()
    progress()
    counts["unfinished"] = queue.unfinished
    counts["seconds"] = time.perf_counter() - began
    return counts


async def _serve_lines(index: int, engine, queue: LineQueue, write, max_in_flight: int, counts: dict) -> None:
    """One engine's part of the batch: lines from the queue, up to max_in_flight at once; after a
    loss, no new line until the engine answers again or is found lost for good."""
    slots = asyncio.Semaphore(max_in_flight)
    running: set[asyncio.Task] = set()
    lost = asyncio.Event()

    async def run(line: PromptLine):
        try:
            record = await _generate(engine, line)
        except _EngineLostError as error:
            lost.set()
            counts["retries"] += 1
            if await queue.give_back(line):
                log.warning("request %r lost with engine %d (%s): retrying once it is back, or on another engine",
                            line.id, index, error)
            else:
                log.error("request %r lost too many times (%s): left for a resubmit", line.id, error)
            return
        finally:
            slots.release()
        write(index, record)
        await queue.done()

    while True:
        await slots.acquire()
        if not lost.is_set():
            line = await queue.take()
            if line is None:
                slots.release()
                await asyncio.gather(*running)
                return
            if not lost.is_set():
                task = asyncio.create_task(run(line))
                running.add(task)
                task.add_done_callback(running.discard)
                await asyncio.sleep(0)  # the other engines take their turn at the queue
                continue
            await queue.put_back(line)  # lost while this waited for a line: not this engine's to run now
        slots.release()
        await asyncio.gather(*running)  # what was in flight on it comes back to the queue
        if not await _recovered(index, engine):
            counts["engines_lost"] += 1
            await queue.engine_gone()
            return
        lost.clear()


async def _recovered(index: int, engine) -> bool:
    """After a loss: True once the engine answers again; False if it is lost for good."""
    if await engine.lost():
        log.error("engine %d is lost for good (its node or region owner is gone): the other engines take its lines",
                  index)
        with contextlib.suppress(Exception):
            await asyncio.to_thread(engine.shutdown, False)
        return False
    try:
        await engine.wait_until_ready()
    except RuntimeError as error:
        log.error("engine %d: %s; the other engines take its lines", index, error)
        return False
    return True


async def _generate(engine, line: PromptLine) -> dict:
    """The line's record; _EngineLostError when the engine failed under it (nothing of it is kept)."""
    while True:
        try:
            request_id = await engine.submit(line.prompt, line.params())
            break
        except QueueFullError as error:  # the semaphore keeps this rare: wait for room
            await asyncio.sleep(error.retry_after_s)
        except ValueError as error:  # the request's own fault: its result is this error
            return {"id": line.id, "error": str(error).splitlines()[-1] if str(error) else type(error).__name__}
        except Exception as error:  # noqa: BLE001 - the GPU worker is gone or restarting
            raise _EngineLostError(f"{type(error).__name__} at submit") from None
    tokens, text, finish = [], [], None
    try:
        async for event in engine.stream(request_id):
            if event.finish_reason == "error":
                if event.retryable:
                    raise _EngineLostError(event.error)
                return {"id": line.id, "error": event.error}
            if event.token_id >= 0:
                tokens.append(event.token_id)
                text.append(event.text)
            finish = event.finish_reason
    except _EngineLostError:
        raise
    except Exception as error:  # noqa: BLE001 - the GPU worker died during the request
        raise _EngineLostError(f"{type(error).__name__} while streaming") from None
    return {"id": line.id, "token_ids": tokens, "text": "".join(text), "finish_reason": finish,
            "completion_tokens": len(tokens)}


class LocalEngine:
    """The batch on an in-process Engine (--executor local), through the same submit / stream API."""

    def __init__(self, engine, max_waiting: int):
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

    async def wait_until_ready(self) -> None:
        """An in-process engine whose loop failed does not come back."""
        if self.service.failure is not None:
            raise RuntimeError(f"the in-process engine failed: {self.service.failure}")

    async def lost(self) -> bool:
        return self.service.failure is not None

    def current_share(self) -> float | None:
        return self.engine.cache_state()["cpu_share_now"]

    def shutdown(self, graceful: bool = True) -> None:
        self.service.close()
        self.engine.shutdown()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m writescope.actors.batch_job",
                                     description="Run a JSONL batch of long-context prompts; resumable.")
    parser.add_argument("--input", required=True, help="JSONL: {id, prompt (text or token ids), max_new_tokens, "
                                                       "optional temperature, top_p, seed, stop} per line")
    parser.add_argument("--output", required=True, help="JSONL results, appended; ids already there are skipped")
    parser.add_argument("--executor", default="ray", choices=["ray", "local"],
                        help="ray: actors on the job's cluster (or an embedded local Ray); local: one process")
    EngineConfig.add_arguments(parser)
    parser.add_argument("--engines", type=_engines_argument, default=1,
                        help="engine groups sharing the batch (work stealing), each on a node of its own where "
                             "engine_cpus and the GPU make it so; auto: one per node that can hold one")
    parser.add_argument("--max-in-flight", type=int, default=64,
                        help="requests submitted and not yet finished, per engine (with several engines, at most "
                             "twice --max-batch-size each)")
    parser.add_argument("--max-retries", type=int, default=3,
                        help="times a request lost with the GPU worker is retried after Ray restarts it")
    parser.add_argument("--progress-every-s", type=float, default=10.0, help="seconds between progress log lines")
    return parser


def _engines_argument(text: str):
    if text == "auto":
        return text
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1 or 'auto', got {text!r}")
    return int(text)


def _check_args(parser, args) -> None:
    if args.max_in_flight < 1:
        parser.error(f"--max-in-flight must be >= 1, got {args.max_in_flight}")
    try:
        EngineConfig.from_args(args)
    except ValueError as error:
        parser.error(str(error))
    if args.max_retries < 0:
        parser.error(f"--max-retries must be >= 0, got {args.max_retries}")
    if args.emulated_nodes is not None and not 1 <= args.emulated_nodes <= len(os.sched_getaffinity(0)):
        parser.error(f"--emulated-nodes must be in [1, {len(os.sched_getaffinity(0))}] (the CPUs of this machine)")
    if not os.path.isfile(args.input):
        parser.error(f"--input {args.input!r} is not a file")


def _open_output(parser, path: str) -> ResultOutput:
    try:
        return ResultOutput(path)
    except OutputLockedError as error:
        parser.exit(2, f"{parser.prog}: error: {error}\n")
    except OSError as error:
        parser.error(f"--output {path!r} cannot be written: {error.strerror or error}")


def _open_engines(args) -> list:
    """args.engines engines (all started, or none: a failure stops those already started)."""
    from writescope.engine import Engine

    config = EngineConfig.from_args(args)
    if args.executor == "local":
        count = 1 if args.engines == "auto" else args.engines
        return [LocalEngine(Engine.from_config(config), args.max_in_flight) for _ in range(count)]
    from writescope.actors.local_ray import ensure_ray

    ensure_ray()  # before Ray is imported: inside `ray job submit` the job's cluster; else an embedded local one
    from writescope.actors.ray_engine import RayEngine

    count = nodes_for_engines(config) if args.engines == "auto" else args.engines
    engines = []
    try:
        for index in range(count):
            engines.append(RayEngine.from_pretrained(config=config, max_waiting=args.max_in_flight))
            log.info("engine %d of %d on node %s", index + 1, count, engines[-1].node_id)
    except BaseException:
        for engine in engines:
            engine.shutdown()
        raise
    return engines


def in_flight_per_engine(args, engines: int) -> int:
    """--max-in-flight for one engine; with several, at most twice an engine's batch each, so the
    lines no engine can start yet stay in the shared queue for whichever engine frees a slot first
    (lines queued inside one engine would wait there while another idles)."""
    return args.max_in_flight if engines == 1 else min(args.max_in_flight, 2 * args.max_batch_size)


def nodes_for_engines(config: EngineConfig) -> int:
    """The alive nodes of the Ray cluster whose resources hold one engine group (at least one)."""
    import ray

    from writescope.actors.engine_group import engine_bundle

    bundle = engine_bundle(config)
    fits = [node for node in ray.nodes() if node["Alive"] and
            all(node["Resources"].get(name, 0) >= amount for name, amount in bundle.items())]
    return max(1, len(fits))


def main(argv: list[str] | None = None) -> int:
    """0: every line has its record; 1: some requests could not finish (resubmit to retry them)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    _check_args(parser, args)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    output = _open_output(parser, args.output)
    engines = []
    try:
        done = output.done
        todo, bad = read_requests(args.input, done)
        log.info("%d requests to run, %d already in %s, %d bad lines, %d corrupted output lines moved aside",
                 len(todo), len(done.ids), args.output, len(bad), done.corrupt_lines)
        for record in bad:
            output.write(record)
        try:
            engines = _open_engines(args)
        except ValueError as error:  # no room for the engines asked for, a bad model: nothing ran
            parser.exit(2, f"{parser.prog}: error: {error}\n")
        counts = asyncio.run(run_batch(engines, todo, output, max_in_flight=in_flight_per_engine(args, len(engines)),
                                       max_retries=args.max_retries, progress_every_s=args.progress_every_s))
    finally:
        output.close()
        for engine in engines:
            with contextlib.suppress(Exception):
                engine.shutdown()
    summary = {"ran": len(todo), "ok": counts["ok"], "errors": counts["errors"] + len(bad),
               "skipped": len(done.ids), "retries": counts["retries"], "unfinished": len(counts["unfinished"]),
               "corrupt_lines": done.corrupt_lines, "generated_tokens": counts["tokens"],
               "seconds": round(counts["seconds"], 2),
               "tok_s": round(counts["tokens"] / max(counts["seconds"], 1e-9), 1),
               "engines": len(engines), "engines_lost": counts["engines_lost"],
               "requests_per_engine": counts["per_engine"]}
    log.info("summary: %s", json.dumps(summary))
    if counts["unfinished"]:
        log.error("%d requests could not finish (%s): resubmit the job to run them", len(counts["unfinished"]),
                  ", ".join(map(repr, counts["unfinished"][:10])))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
