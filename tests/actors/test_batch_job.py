"""The batch entry through `ray job submit` on a real head node: stopped halfway through Ray's job
API (what `ray job stop` calls), resubmitted, every id exactly once with the tokens of an
uninterrupted run; a GPU worker killed mid-batch costs nothing (its requests are retried); bad and
poison lines become error records keyed so they cannot collide with a real id; a second job on the
same output is refused; a corrupted output line is moved aside on resume. The head runs as a child
of this test (own temp dir, token auth on) and is stopped by its PID, never with `ray stop`."""

import json
import os
import random
import secrets
import signal
import socket
import subprocess
import sys
import time

import pytest

from writescope.actors.batch_job import main as batch_main

pytestmark = pytest.mark.ray
BIN = os.path.dirname(sys.executable)
ARGS = ["--model", "tiny-qwen3-moe", "--max-seq-len", "1024", "--max-batch-size", "2", "--policy", "fixed_half"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_prompts(path, count=16):
    generator = random.Random(7)
    with open(path, "w") as f:
        for i in range(count):
            prompt = [generator.randrange(256) for _ in range(300 + 40 * i)]
            f.write(json.dumps({"id": f"req-{i}", "prompt": prompt, "max_new_tokens": 24}) + "\n")
        f.write("{broken\n")
        f.write(json.dumps({"id": "too-long", "prompt": list(range(1, 200)) * 6, "max_new_tokens": 8}) + "\n")
        f.write(json.dumps({"id": "line-17", "prompt": [1, 2, 3], "max_new_tokens": 4}) + "\n")  # a real id
        f.write(json.dumps({"id": "tiny", "prompt": [4, 5, 6], "max_new_tokens": 6, "temperature": 1e-300,
                            "top_p": 1e-300}) + "\n")
        f.write('{"id": "surrogate", "prompt": "a\\ud800b", "max_new_tokens": 4}\n')


def read_results(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def key(record):
    """What a record answers: its id, or the line number of a line that had no usable id."""
    return ("line", record["line"]) if record["id"] is None else ("id", record["id"])


@pytest.fixture(scope="module")
def head(tmp_path_factory):
    temp_dir = f"/tmp/wsr{secrets.token_hex(3)}"  # own session dir: no other ray.init() finds this head
    dashboard = free_port()
    env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32),
           "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "1"}
    env.pop("RAY_ADDRESS", None)
    log = open(tmp_path_factory.mktemp("head") / "head.log", "w")  # noqa: SIM115
    process = subprocess.Popen([f"{BIN}/ray", "start", "--head", "--block", f"--port={free_port()}",
                                "--dashboard-host=127.0.0.1", f"--dashboard-port={dashboard}", "--num-cpus=2",
                                # not the default 52365, which a local Ray of this test session may hold
                                f"--dashboard-agent-listen-port={free_port()}",
                                f"--temp-dir={temp_dir}", "--disable-usage-stats"],
                               env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    address = f"http://127.0.0.1:{dashboard}"
    deadline = time.monotonic() + 120
    while subprocess.run([f"{BIN}/ray", "job", "list", "--address", address], env=env,
                         capture_output=True).returncode != 0:
        assert process.poll() is None, "the head node exited while starting"
        assert time.monotonic() < deadline, "the head node's job server did not come up in 120 s"
        time.sleep(1)
    yield address, env
    process.send_signal(signal.SIGTERM)  # by its PID: `ray stop` would kill every Ray on the machine
    try:
        process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
    log.close()


def submit(address, env, workdir, output, wait=True):
    command = [f"{BIN}/ray", "job", "submit", "--address", address, "--working-dir", str(workdir)]
    command += [] if wait else ["--no-wait"]
    command += ["--", sys.executable, "-m", "writescope.actors.batch_job", *ARGS, "--input", "prompts.jsonl",
                "--output", str(output), "--progress-every-s", "1"]
    deadline = time.monotonic() + 60
    while True:
        submitted = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
        # A fresh head answers `ray job list` a little before its job agent takes submissions.
        if "No available agent to submit job" not in submitted.stderr or time.monotonic() > deadline:
            return submitted
        time.sleep(2)


def job_id(stdout: str) -> str:
    for word in stdout.split():
        if word.strip("'").startswith("raysubmit_"):
            return word.strip("'")
    raise AssertionError(f"no job id in: {stdout}")


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The prompts and an uninterrupted one-process run's records, by key."""
    workdir = tmp_path_factory.mktemp("job")
    write_prompts(workdir / "prompts.jsonl")
    output = workdir.parent / "reference.jsonl"
    assert batch_main([*ARGS, "--executor", "local", "--input", str(workdir / "prompts.jsonl"),
                       "--output", str(output)]) == 0
    return workdir, {key(r): r for r in read_results(output)}


def test_poison_and_bad_lines_become_their_own_records(reference):
    _, expected = reference
    assert "exceeds max_seq_len" in expected[("id", "too-long")]["error"]
    assert "not JSON" in expected[("line", 17)]["error"]
    assert expected[("id", "line-17")]["finish_reason"] == "length"  # a real id never collides with a bad line
    assert expected[("id", "tiny")]["finish_reason"] == "length"  # degenerate sampling is greedy, not a crash
    assert "lone surrogate" in expected[("id", "surrogate")]["error"]
    assert sum(1 for k in expected if k[0] == "id" and k[1].startswith("req-")) == 16


def wait_for_results(output, count, timeout_s=300):
    deadline = time.monotonic() + timeout_s
    while not output.exists() or len(read_results(output)) < count:
        assert time.monotonic() < deadline, f"the job wrote fewer than {count} results in {timeout_s} s"
        time.sleep(0.2)


def submit_and_wait_for_results(head, workdir, output, count=6) -> str:
    """Submits the batch without waiting; returns its job id once the output holds count records
    (the error records and a few results: early enough that a `ray job stop`, whose CLI takes
    seconds to start, still finds most of the batch to do)."""
    address, env = head
    started = submit(address, env, workdir, output, wait=False)
    assert started.returncode == 0, started.stderr
    wait_for_results(output, count)
    return job_id(started.stdout)


def assert_complete(output, expected):
    results = read_results(output)
    keys = [key(r) for r in results]
    assert sorted(keys, key=str) == sorted(expected, key=str) and len(keys) == len(set(keys))  # each exactly once
    for record in results:
        assert record == expected[key(record)]


# What a test does to a running batch, in a process started before the batch: a CLI started after it
# (Ray's import, seconds on a 2-core host, and more in a fresh virtualenv that compiles Ray's modules
# on first use) has let the batch finish first. Each prints "ready", then acts on a line of stdin.
# `ray job stop`'s own steps: stop_job, then wait for a final status.
STOPPER = """
import sys, time
from ray.job_submission import JobStatus, JobSubmissionClient
client = JobSubmissionClient(sys.argv[1])
print("ready", flush=True)
job = sys.stdin.readline().strip()
client.stop_job(job)
deadline = time.monotonic() + 100
while not client.get_job_status(job).is_terminal() and time.monotonic() < deadline:
    time.sleep(0.1)
print(client.get_job_status(job).value, flush=True)
"""


# `ray list actors --filter class_name=GPUWorker --filter state=ALIVE --detail`: their pids.
GPU_WORKER_PIDS = """
import json, sys
from ray.util.state import list_actors

def pids():
    alive = list_actors(address=sys.argv[1], filters=[("class_name", "=", "GPUWorker"), ("state", "=", "ALIVE")],
                        detail=True)
    return [actor.pid for actor in alive]

pids()
print("ready", flush=True)
sys.stdin.readline()
print(json.dumps(pids()), flush=True)
"""


def ready_helper(script, address, env) -> subprocess.Popen:
    """A process running `script` against the head, once it printed "ready"."""
    helper = subprocess.Popen([sys.executable, "-c", script, address], env=env, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert helper.stdout.readline().strip() == "ready", helper.stderr.read() if helper.poll() is not None else ""
    return helper


def test_a_stopped_batch_resumes_and_every_id_appears_once_with_the_same_tokens(head, reference, tmp_path):
    address, env = head
    workdir, expected = reference
    output = tmp_path / "results.jsonl"
    stopper = ready_helper(STOPPER, address, env)
    job = submit_and_wait_for_results(head, workdir, output)
    status, errors = stopper.communicate(job + "\n", timeout=120)
    assert stopper.returncode == 0 and status.strip() == "STOPPED", errors
    halfway = read_results(output)
    assert 6 <= len(halfway) < len(expected), "the stop came after the batch ended: nothing to resume"

    finished = submit(address, env, workdir, output)
    assert finished.returncode == 0, finished.stdout + finished.stderr
    assert "summary:" in finished.stdout and "progress:" in finished.stdout  # the job's logs
    assert_complete(output, expected)


def test_a_gpu_worker_killed_mid_batch_costs_nothing(head, reference, tmp_path):
    address, env = head
    workdir, expected = reference
    output = tmp_path / "results.jsonl"
    lister = ready_helper(GPU_WORKER_PIDS, address, env)
    job = submit_and_wait_for_results(head, workdir, output)
    listed, errors = lister.communicate("\n", timeout=120)
    assert lister.returncode == 0, errors
    pids = json.loads(listed)
    assert len(pids) == 1
    os.kill(pids[0], signal.SIGKILL)  # Ray restarts it; the requests in flight are retried on the new one
    waited = subprocess.run([f"{BIN}/ray", "job", "logs", "--follow", "--address", address, job], env=env,
                            capture_output=True, text=True, timeout=600)
    status = subprocess.run([f"{BIN}/ray", "job", "status", "--address", address, job], env=env,
                            capture_output=True, text=True, timeout=120)
    assert "succeeded" in status.stdout.lower(), waited.stdout[-3000:]
    assert "retrying once it is back" in waited.stdout  # some request was in flight and was retried
    assert_complete(output, expected)


def test_a_second_job_on_the_same_output_is_refused(reference, tmp_path):
    from writescope.actors.batch_job import ResultOutput

    workdir, expected = reference
    output = tmp_path / "results.jsonl"
    command = [sys.executable, "-m", "writescope.actors.batch_job", *ARGS, "--executor", "local",
               "--input", str(workdir / "prompts.jsonl"), "--output", str(output)]
    running = ResultOutput(str(output))  # a job writing this output (in this process: its lock is real)
    try:
        second = subprocess.run(command, capture_output=True, text=True, timeout=120)
        assert second.returncode == 2
        assert "is being written by another batch job" in second.stderr and f"pid {os.getpid()}" in second.stderr
        assert read_results(output) == []  # the refused job wrote nothing
    finally:
        running.close()
    assert subprocess.run(command, capture_output=True, text=True, timeout=600).returncode == 0  # once it is free
    assert_complete(output, expected)


def test_a_corrupted_output_line_is_moved_aside_and_its_request_runs_again(reference, tmp_path):
    workdir, expected = reference
    output = tmp_path / "results.jsonl"
    records = [json.dumps(r) for r in expected.values()]
    torn = records[3][: len(records[3]) // 2]  # a record half-overwritten in the middle of the file
    output.write_text("\n".join(records[:3] + [torn] + records[4:8]) + "\n" + records[8][:10])
    assert batch_main([*ARGS, "--executor", "local", "--input", str(workdir / "prompts.jsonl"),
                       "--output", str(output)]) == 0
    assert_complete(output, expected)
    quarantined = (tmp_path / "results.jsonl.corrupt").read_text()
    assert torn in quarantined and "line 4" in quarantined


def test_an_unwritable_output_is_a_clear_error(reference, tmp_path, capsys):
    workdir, _ = reference
    (tmp_path / "dir").mkdir()
    for output in ("/proc/no-such/results.jsonl", str(tmp_path / "dir")):
        with pytest.raises(SystemExit) as exited:
            batch_main([*ARGS, "--executor", "local", "--input", str(workdir / "prompts.jsonl"), "--output", output])
        assert exited.value.code == 2
        assert "cannot be written" in capsys.readouterr().err


def test_bad_arguments_are_refused_with_what_is_allowed(tmp_path, capsys):
    (tmp_path / "in.jsonl").write_text("")
    with pytest.raises(SystemExit):
        batch_main(["--model", "tiny-mixtral", "--input", str(tmp_path / "in.jsonl"), "--output", "o",
                    "--max-batch-size", "0"])
    assert "max_batch_size must be an integer >= 1, got 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        batch_main(["--model", "tiny-mixtral", "--input", str(tmp_path / "missing.jsonl"), "--output", "o"])
    assert "is not a file" in capsys.readouterr().err


def test_bad_bytes_and_duplicates_are_reported_once_across_resumed_runs(tmp_path):
    from writescope.actors.batch_job import Done, read_requests

    path = tmp_path / "in.jsonl"
    path.write_bytes(b'{"id": "a", "prompt": "x"}\n{"id": "a", "prompt": "y"}\n\xff\xfe\n{"id": "b", "prompt": "z"}\n'
                     b'{"id": true, "prompt": "t"}\n{"id": "c", "prompt": 5}\n{"id": "c", "prompt": "w"}\n')
    todo, errors = read_requests(str(path), Done())
    assert [line.id for line in todo] == ["a", "b"]
    by_key = {key(e): e["error"] for e in errors}
    assert set(by_key) == {("line", 2), ("line", 3), ("line", 5), ("id", "c"), ("line", 7)}
    assert by_key[("line", 2)] == "line 2: duplicate id 'a' (an earlier line has it)"
    assert "not UTF-8" in by_key[("line", 3)] and "id must be" in by_key[("line", 5)]
    assert "prompt" in by_key[("id", "c")]  # the first line with an id claims it, valid or not
    todo, errors = read_requests(str(path), Done(ids={"c"}, lines={2, 3, 5, 7}))  # resumed before "a" finished
    assert [line.id for line in todo] == ["a", "b"] and errors == []
    todo, errors = read_requests(str(path), Done(ids={"a", "c"}, lines={2, 3, 5, 7}))
    assert [line.id for line in todo] == ["b"] and errors == []


def test_two_engines_share_a_batch_and_a_failed_one_leaves_its_lines_to_the_other(reference, tmp_path):
    """Two in-process engines take lines from one queue; one engine's loop fails mid-batch (a fault
    injected into its decode step): its lines in flight go back to the queue and the other engine
    finishes the batch, every id once, with the tokens of the one-engine run."""
    import asyncio

    from writescope.actors.batch_job import LocalEngine, ResultOutput, build_parser, read_requests, run_batch
    from writescope.config import EngineConfig
    from writescope.engine import Engine

    workdir, expected = reference
    config = EngineConfig.from_args(build_parser().parse_args([*ARGS, "--input", "x", "--output", "y"]))
    steady, failing = (LocalEngine(Engine.from_config(config), max_waiting=4) for _ in range(2))
    steps = {"taken": 0}
    decode_step = failing.engine._decode_step

    def fails_on_step_60(running):
        steps["taken"] += 1
        if steps["taken"] == 60:  # after it finished some requests of its own
            raise RuntimeError("injected: this engine's loop fails")
        return decode_step(running)

    failing.engine._decode_step = fails_on_step_60
    output = ResultOutput(str(tmp_path / "results.jsonl"))
    try:
        todo, bad = read_requests(str(workdir / "prompts.jsonl"), output.done)
        for record in bad:
            output.write(record)
        counts = asyncio.run(run_batch([steady, failing], todo, output, max_in_flight=2, progress_every_s=60))
    finally:
        output.close()
        steady.shutdown()
        failing.shutdown()
    assert counts["engines_lost"] == 1 and counts["unfinished"] == [] and counts["retries"] >= 1
    assert counts["per_engine"][0] > 0 and counts["per_engine"][1] > 0  # both worked before the failure
    assert_complete(tmp_path / "results.jsonl", expected)


def test_the_line_queue_gives_lost_lines_back_and_ends_when_no_engine_is_left():
    import asyncio

    from writescope.actors.batch_job import LineQueue, PromptLine

    lines = [PromptLine(id=f"l{i}", prompt=[1, 2, 3]) for i in range(3)]

    async def scenario():
        queue = LineQueue(lines, max_retries=1, engines=2)
        first = await queue.take()
        assert await queue.give_back(first)  # lost once: back at the front
        assert (await queue.take()).id == first.id
        assert not await queue.give_back(first)  # lost twice, max_retries=1: given up
        second = await queue.take()
        await queue.done()
        waiting = asyncio.create_task(queue.take())  # the queue holds l2: taken at once
        assert (await waiting).id == "l2"
        blocked = asyncio.create_task(queue.take())  # empty, l2 in flight: waits, it may come back
        await asyncio.sleep(0.01)
        assert not blocked.done()
        assert await queue.give_back(lines[2])
        assert (await blocked).id == "l2"
        await queue.engine_gone()
        await queue.engine_gone()  # no engine left: what remains is unfinished and take() ends
        assert await queue.take() is None
        return second.id, queue.unfinished

    second, unfinished = asyncio.run(scenario())
    assert second == "l1" and unfinished == ["l0"]
