"""Scale-out on a real multi-node Ray cluster on this machine (tests/actors/multinode.py: a head and
two worker nodes, each its own raylet, token auth on; each scenario in a child process, so this
session's own local Ray is untouched):
- Serve with 2 replicas lands them on the 2 worker nodes and both answer (the x-writescope-node
  header says which); removing one node ends the streams in flight there, the other replica keeps
  answering at once, and Serve places a new replica when a node comes back;
- a batch of 50 requests over `--engines auto` (two engine groups, one per worker node): every id
  once, the tokens of a one-engine run, both engines did work;
- removing one engine's node mid-batch: the batch completes, nothing lost or duplicated."""

import json
import os
import random
import subprocess
import sys

import pytest

from tests.actors.multinode import STREAM_TOKENS
from writescope.actors.batch_job import main as batch_main

pytestmark = pytest.mark.ray
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NUM_PROMPTS = 50


def run_scenario(name: str, workdir) -> dict:
    done = subprocess.run([sys.executable, "-m", "tests.actors.multinode", name, str(workdir)], cwd=ROOT,
                          capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    with open(workdir / "result.json") as f:
        return json.load(f)


def write_prompts(path) -> None:
    generator = random.Random(11)
    with open(path, "w") as f:
        for i in range(NUM_PROMPTS):
            prompt = [generator.randrange(1, 256) for _ in range(20 + 3 * (i % 13))]
            line = {"id": f"q{i}", "prompt": prompt, "max_new_tokens": 8 + i % 5}
            if i % 3 == 0:  # sampled, seeded per request: the same tokens whichever engine runs it
                line |= {"temperature": 0.8, "top_p": 0.9}
            f.write(json.dumps(line) + "\n")


def read_results(path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The prompts and a one-engine, one-process run's tokens by id."""
    workdir = tmp_path_factory.mktemp("reference")
    write_prompts(workdir / "prompts.jsonl")
    from tests.actors.multinode import MODEL_ARGS

    flags = [f"--{k.replace('_', '-')}={v}" for k, v in MODEL_ARGS.items()]
    assert batch_main([*flags, "--executor", "local", "--input", str(workdir / "prompts.jsonl"),
                       "--output", str(workdir / "reference.jsonl")]) == 0
    return workdir / "prompts.jsonl", {r["id"]: r["token_ids"] for r in read_results(workdir / "reference.jsonl")}


def batch_workdir(tmp_path, reference):
    prompts, _ = reference
    (tmp_path / "prompts.jsonl").write_bytes(prompts.read_bytes())
    return tmp_path


def assert_every_id_once_with_the_reference_tokens(output, expected: dict) -> None:
    records = read_results(output)
    ids = [r["id"] for r in records]
    assert sorted(ids) == sorted(expected), "every id exactly once"
    assert all("error" not in r for r in records), [r for r in records if "error" in r][:3]
    assert {r["id"]: r["token_ids"] for r in records} == expected


def test_a_batch_over_two_engines_on_two_nodes(tmp_path, reference):
    result = run_scenario("batch", batch_workdir(tmp_path, reference))
    assert result["returncode"] == 0, result["log_tail"]
    summary = result["summary"]
    assert summary["engines"] == 2 and summary["engines_lost"] == 0
    assert sorted(result["engine_nodes"]) == sorted(result["worker_nodes"]), "one engine group per worker node"
    assert min(summary["requests_per_engine"]) > 0, f"both engines did work: {summary['requests_per_engine']}"
    assert sum(summary["requests_per_engine"]) == NUM_PROMPTS
    assert_every_id_once_with_the_reference_tokens(tmp_path / "results.jsonl", reference[1])


def test_a_node_lost_mid_batch_loses_nothing(tmp_path, reference):
    result = run_scenario("batch_node_loss", batch_workdir(tmp_path, reference))
    assert result["removed"] in result["worker_nodes"]
    assert result["returncode"] == 0, result["log_tail"]
    summary = result["summary"]
    assert summary["engines"] == 2 and summary["engines_lost"] == 1, result["log_tail"]
    assert summary["unfinished"] == 0 and summary["ok"] == NUM_PROMPTS
    assert_every_id_once_with_the_reference_tokens(tmp_path / "results.jsonl", reference[1])


def test_serve_replicas_on_two_nodes_survive_the_loss_of_one(tmp_path):
    result = run_scenario("serve", tmp_path)
    workers = set(result["worker_nodes"])
    before = result["before"]
    assert all(a["status"] == 200 for a in before), before
    assert {a["node"] for a in before} == workers, "both replicas, one per worker node, answered"

    lost, kept = result["removed"], (workers - {result["removed"]}).pop()
    streams = result["streams"]
    assert all(s["ended"] for s in streams), "no stream hangs when its node goes"
    assert any(s["node"] == lost and s["in_flight_at_loss"] for s in streams)
    for stream in streams:  # in flight on the lost node: cut off (no [DONE]); on the other: complete
        if stream["node"] == lost:
            assert stream["outcome"] != "done" or not stream["in_flight_at_loss"], stream
        else:
            assert stream["outcome"] == "done" and stream["tokens"] == STREAM_TOKENS, stream

    after = result["after"]
    assert [a["status"] for a in after[-10:]] == [200] * 10 and {a["node"] for a in after[-10:]} == {kept}
    assert after[-10]["seconds_after_loss"] < 60, "the other replica answers within a minute of the loss"

    replaced = result["replaced"]
    assert {a["node"] for a in replaced} >= {kept, result["returned"]}, "a new replica on the node that came back"
