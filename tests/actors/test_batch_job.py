"""The batch entry through `ray job submit` on a real head node: stopped halfway with `ray job
stop`, resubmitted, every id exactly once with the tokens of an uninterrupted run; bad lines
become error records. The head runs as a child of this test (own temp dir, token auth on) and is
stopped by its PID, never with `ray stop`."""

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

pytest.importorskip("ray")

from writescope.actors.batch_job import main as batch_main  # noqa: E402

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


def read_results(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


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
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)


def job_id(stdout: str) -> str:
    for word in stdout.split():
        if word.strip("'").startswith("raysubmit_"):
            return word.strip("'")
    raise AssertionError(f"no job id in: {stdout}")


def test_a_stopped_batch_resumes_and_every_id_appears_once_with_the_same_tokens(head, tmp_path):
    address, env = head
    workdir = tmp_path / "job"
    workdir.mkdir()
    write_prompts(workdir / "prompts.jsonl")
    reference = tmp_path / "reference.jsonl"
    assert batch_main([*ARGS, "--executor", "local", "--input", str(workdir / "prompts.jsonl"),
                       "--output", str(reference)]) == 0
    expected = {r["id"]: r for r in read_results(reference)}

    output = tmp_path / "results.jsonl"
    started = submit(address, env, workdir, output, wait=False)
    assert started.returncode == 0, started.stderr
    job = job_id(started.stdout)
    deadline = time.monotonic() + 300
    while not output.exists() or len(read_results(output)) < 6:  # 2 error records + some results
        assert time.monotonic() < deadline, "the job wrote no results in 300 s"
        time.sleep(0.2)
    stopped = subprocess.run([f"{BIN}/ray", "job", "stop", "--address", address, job], env=env,
                             capture_output=True, text=True, timeout=120)
    assert stopped.returncode == 0, stopped.stderr
    halfway = read_results(output)
    assert 4 <= len(halfway) < len(expected), "the stop came after the batch ended: nothing to resume"

    finished = submit(address, env, workdir, output)
    assert finished.returncode == 0, finished.stdout + finished.stderr
    assert "summary:" in finished.stdout and "progress:" in finished.stdout  # the job's logs
    results = read_results(output)
    ids = [r["id"] for r in results]
    assert sorted(ids) == sorted(expected) and len(ids) == len(set(ids))  # each id exactly once
    for record in results:
        assert record == expected[record["id"]]
    assert "too long" in expected["too-long"]["error"] or "exceeds max_seq_len" in expected["too-long"]["error"]
    assert "not JSON" in expected["line-17"]["error"]


def test_bad_arguments_are_refused_with_what_is_allowed(tmp_path, capsys):
    (tmp_path / "in.jsonl").write_text("")
    with pytest.raises(SystemExit):
        batch_main(["--model", "tiny-mixtral", "--input", str(tmp_path / "in.jsonl"), "--output", "o",
                    "--max-batch-size", "0"])
    assert "--max-batch-size must be >= 1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        batch_main(["--model", "tiny-mixtral", "--input", str(tmp_path / "missing.jsonl"), "--output", "o"])
    assert "is not a file" in capsys.readouterr().err


def test_bad_bytes_and_duplicates_are_reported_once_across_resumed_runs(tmp_path):
    from writescope.actors.batch_job import read_requests

    path = tmp_path / "in.jsonl"
    path.write_bytes(b'{"id": "a", "prompt": "x"}\n{"id": "a", "prompt": "y"}\n\xff\xfe\n{"id": "b", "prompt": "z"}\n')
    todo, errors = read_requests(str(path), set())
    assert [line.id for line in todo] == ["a", "b"]
    assert {e["id"]: e["error"] for e in errors} == {"line-2": "line 2: duplicate id 'a'",
                                                     "line-3": errors[1]["error"]}
    assert "not UTF-8" in errors[1]["error"]
    todo, errors = read_requests(str(path), {"line-2", "line-3"})  # resumed before "a" finished
    assert [line.id for line in todo] == ["a", "b"] and errors == []
    todo, errors = read_requests(str(path), {"a", "line-2", "line-3"})
    assert [line.id for line in todo] == ["b"] and errors == []
