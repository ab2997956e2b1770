"""DeepSeek-V4 on Ray against a real local Ray cluster: the checkpoint of
tests/deepseek_v4_checkpoint.py served by a Ray engine (a region owner holding one set of regions
per entry cache, CPU workers attending their shard of each over their channels, the CSA selection
as token tables) gives transformers' greedy tokens under every policy; a killed CPU worker changes
none, a killed GPU worker names the lost requests and its successor decodes them again; its state
and host memory name each entry cache; shutdown leaves nothing behind; the batch job and the Serve
app give the same tokens."""

import os
import signal
import time

import pytest
import ray

from tests import deepseek_v4_checkpoint as checkpoint_tools
from tests.deepseek_v4_checkpoint import ENGINE_OPTIONS, NEW_TOKENS
from tests.processes import abstract_sockets, processes_mapping
from writescope.engine import Engine
from writescope.models.deepseek_v4 import CSA, HCA
from writescope.policies import POLICY_NAMES

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return checkpoint_tools.make_checkpoint(transformers, tmp_path_factory.mktemp("deepseek_v4_ray"))


def ray_engine(path, policy, num_nodes):
    return Engine.from_pretrained(path, executor="ray", policy=policy, emulated_nodes=num_nodes, **ENGINE_OPTIONS)


@pytest.mark.parametrize("num_nodes", [1, 2])
@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_ray_gives_transformers_tokens_under_every_policy(ray_cluster, checkpoint, policy, num_nodes):
    path, prompts, expected = checkpoint
    engine = ray_engine(path, policy, num_nodes)
    try:
        outputs = engine.generate(prompts, max_new_tokens=NEW_TOKENS)
        attended = engine.state()["entries_attended"]
    finally:
        engine.shutdown()
    assert [o.token_ids for o in outputs] == [tokens for tokens, _ in expected]
    if policy == "fixed_half":  # the CPU workers attended entries of both caches, the selection among them
        assert attended[CSA]["cpu"] > 0 and attended[CSA]["device"] > 0
        assert attended[HCA]["cpu"] > 0 and attended[HCA]["device"] > 0
    if policy == "all_transfer":
        assert attended[CSA]["cpu"] == attended[HCA]["cpu"] == 0


def test_a_killed_cpu_worker_is_restarted_and_the_tokens_do_not_change(ray_cluster, checkpoint):
    path, prompts, expected = checkpoint
    engine = ray_engine(path, "all_cpu", 2)
    try:
        victim = engine.cpu_workers[1]
        old_pid = ray.get(victim.pid.remote())
        tokens = {0: [], 1: []}
        for count, event in enumerate(engine.generate_stream(prompts, max_new_tokens=NEW_TOKENS)):
            tokens[event.index].append(event.token_id)
            if count == 6:  # mid-generation: both sequences are decoding, their entries on the CPU workers
                os.kill(old_pid, signal.SIGKILL)
        assert [tokens[0], tokens[1]] == [t for t, _ in expected]
        assert ray.get(victim.pid.remote()) != old_pid  # restarted, both of its shards attached again
        engine.check_integrity()
    finally:
        engine.shutdown()


def test_a_killed_gpu_worker_names_the_lost_requests_and_the_engine_then_works(ray_cluster, checkpoint):
    """The restarted GPU worker attaches both entry caches' regions again (their segments released:
    nothing in them is live) and decodes the same prompts to the same tokens."""
    from writescope.actors.ray_engine import WorkerLostError

    path, prompts, expected = checkpoint
    engine = ray_engine(path, "fixed_half", 2)
    try:
        old_pid = ray.get(engine.gpu_worker.pid.remote())
        with pytest.raises(WorkerLostError) as lost:
            for count, _ in enumerate(engine.generate_stream(prompts, max_new_tokens=NEW_TOKENS)):
                if count == 4:
                    os.kill(old_pid, signal.SIGKILL)
        assert lost.value.lost_requests == [0, 1]
        assert [o.token_ids for o in engine.generate(prompts, max_new_tokens=NEW_TOKENS)] == [t for t, _ in expected]
        assert ray.get(engine.gpu_worker.pid.remote()) != old_pid
        engine.check_integrity()
    finally:
        engine.shutdown()


def test_state_and_host_memory_name_each_entry_cache_and_shutdown_leaves_nothing(ray_cluster, checkpoint):
    path, prompts, _ = checkpoint
    engine = ray_engine(path, "fixed_half", 2)
    events = engine.generate_stream(prompts, max_new_tokens=NEW_TOKENS)
    for _ in range(6):  # into the decode: both prompts' entries placed
        next(events)
    state, memory = engine.state(), engine.host_memory()
    for _ in events:
        pass
    names = engine.segment_names()
    owner_pid = ray.get(engine.owner.pid.remote())
    assert all(owner_pid in processes_mapping(name) for name in names)
    prefix = f"writescope-{engine.engine_id}-"
    assert set(abstract_sockets(prefix)) == {f"@{prefix}cpu0", f"@{prefix}cpu1"}
    engine.shutdown()

    regions = {f"{kind}.{region}" for kind in (CSA, HCA) for region in ("cpu_compute_0", "cpu_compute_1",
                                                                         "cpu_transfer")}
    assert set(memory) == regions
    assert all(memory[f"{kind}.cpu_compute_{s}"]["resident_bytes"] > 0 for kind in (CSA, HCA) for s in (0, 1))
    assert set(state["occupancy"]) == {f"{kind}.{r}" for kind in (CSA, HCA) for r in ("cpu_compute", "cpu_transfer")}
    assert state["running_seqs"] == 2
    for kind in (CSA, HCA):
        placed = state["placed_entries"][kind]
        assert placed["cpu_compute"] > 0 and placed["cpu_transfer"] > 0
    assert len(names) == 2 * (2 + 1) + 2  # per entry cache two shards and cpu_transfer; two channels
    deadline = time.monotonic() + 60
    while any(processes_mapping(name) for name in names) or abstract_sockets(prefix):  # ray.kill is asynchronous
        assert time.monotonic() < deadline, "the engine's memory or sockets outlived it"
        time.sleep(0.2)


def test_a_batch_job_on_ray_writes_transformers_tokens(ray_cluster, checkpoint, tmp_path):
    """The batch entry (`python -m writescope.actors.batch_job`, as `ray job submit` runs it) over the
    checkpoint: every id once, with transformers' greedy tokens."""
    import json

    from writescope.actors.batch_job import main as batch_main

    path, prompts, expected = checkpoint
    lines = tmp_path / "prompts.jsonl"
    lines.write_text("".join(json.dumps({"id": f"p{i}", "prompt": p, "max_new_tokens": NEW_TOKENS}) + "\n"
                             for i, p in enumerate(prompts)))
    flags = [f"--{name.replace('_', '-')}={value}" for name, value in ENGINE_OPTIONS.items()]
    assert batch_main(["--model", path, "--policy", "fixed_half", "--emulated-nodes", "2", *flags,
                       "--input", str(lines), "--output", str(tmp_path / "out.jsonl")]) == 0
    records = {r["id"]: r for r in map(json.loads, (tmp_path / "out.jsonl").read_text().splitlines())}
    assert {i: r["token_ids"] for i, r in records.items()} == {f"p{i}": t for i, (t, _) in enumerate(expected)}


def test_serve_answers_over_http_with_transformers_tokens(ray_cluster, checkpoint):
    """The OpenAI-compatible app (build_app, as serve.yaml deploys it) over the checkpoint: a
    completion and a streamed completion of token-id prompts, over real HTTP."""
    requests = pytest.importorskip("requests")
    from ray import serve

    from tests.actors.http import sse_chunks
    from writescope.actors.serve_app import build_app
    from writescope.tools.local_serve import free_port, wait_healthy

    path, prompts, expected = checkpoint
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        serve.run(build_app({"model": path, "policy": "fixed_half", "emulated_nodes": 2, **ENGINE_OPTIONS}),
                  name="deepseek_v4", route_prefix="/v4", blocking=False)
        base = f"http://127.0.0.1:{port}/v4"
        wait_healthy(base)
        body = {"model": os.path.basename(path), "prompt": prompts[0], "max_tokens": NEW_TOKENS, "temperature": 0}
        answer = requests.post(f"{base}/v1/completions", json=body, timeout=300)
        assert answer.status_code == 200, answer.text
        assert answer.json()["choices"][0]["token_ids"] == expected[0][0]
        streamed = requests.post(f"{base}/v1/completions", json={**body, "prompt": prompts[1], "stream": True},
                                 timeout=300, stream=True)
        chunks = sse_chunks(streamed)
        assert chunks[-1] == "[DONE]"
        assert [t for c in chunks[:-1] for t in c["choices"][0]["token_ids"]] == expected[1][0]
    finally:
        serve.shutdown()
