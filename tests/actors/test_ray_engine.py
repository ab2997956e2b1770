"""The engine on Ray against a real local Ray cluster (one per test session): the same tokens as
the local executor, CPU workers pinned to their (emulated) NUMA nodes, a killed CPU worker that is
restarted mid-generation without changing a token, a killed GPU worker that names the lost
requests and is then usable again, the policy store fed by the workers' times, and nothing left
behind by shutdown."""

import os
import signal
import subprocess
import sys
import time

import pytest
import ray

from tests.processes import abstract_sockets, processes_mapping  # noqa: E402
from writescope.actors.local_ray import start_local_ray  # noqa: E402
from writescope.actors.policy_store import SYNC_STEPS  # noqa: E402
from writescope.actors.ray_engine import RayEngine, WorkerLostError  # noqa: E402
from writescope.engine import Engine  # noqa: E402
from writescope.models.presets import TINY_PRESETS  # noqa: E402
from writescope.policies import POLICY_NAMES  # noqa: E402
from writescope.topology import emulated_topology, read_topology  # noqa: E402

pytestmark = pytest.mark.ray
PROMPTS = [[5, 6, 7] * 50, list(range(1, 110))]
OPTIONS = {"window_tokens": 8, "block_size": 4, "max_batch_size": 2, "max_seq_len": 200}


def local_tokens(preset, policy):
    engine = Engine.from_pretrained(preset, policy=policy, **OPTIONS)
    try:
        return [o.token_ids for o in engine.generate(PROMPTS, max_new_tokens=10)]
    finally:
        engine.shutdown()


def ray_engine(preset, policy, num_nodes):
    return RayEngine.from_pretrained(preset, policy=policy, emulated_nodes=num_nodes, **OPTIONS)


@pytest.mark.parametrize("num_nodes", [1, 2])
@pytest.mark.parametrize("policy", POLICY_NAMES)
@pytest.mark.parametrize("preset", list(TINY_PRESETS))
def test_ray_gives_the_local_tokens(ray_cluster, preset, policy, num_nodes):
    engine = ray_engine(preset, policy, num_nodes)
    try:
        tokens = [o.token_ids for o in engine.generate(PROMPTS, max_new_tokens=10)]
    finally:
        engine.shutdown()
    assert tokens == local_tokens(preset, policy)


def test_cpu_workers_are_pinned_to_their_nodes_and_no_worker_polls_for_jobs(ray_cluster):
    nodes = emulated_topology(2)
    engine = ray_engine("tiny-qwen3-moe", "all_cpu", 2)
    try:
        # the workers share the node's cores: a pool polling between jobs would take another's core
        assert ray.get(engine.gpu_worker.pool_spin.remote()) == 0
        assert ray.get([w.pool_spin.remote() for w in engine.cpu_workers]) == [0, 0]
        for node, worker in zip(nodes, engine.cpu_workers, strict=True):
            affinities = ray.get(worker.thread_affinities.remote())
            assert len(affinities) > 1
            for tid, cpus in affinities.items():
                assert set(cpus) <= set(node.cpus), f"thread {tid} of node {node.index}'s worker runs on {cpus}"
    finally:
        engine.shutdown()


def test_on_real_nodes_each_shard_lives_in_its_nodes_memory(ray_cluster):
    nodes = read_topology()
    engine = Engine.from_pretrained("tiny-qwen3-moe", policy="all_cpu", executor="ray",
                                    executor_options={"nodes": nodes}, **OPTIONS)
    try:
        events = engine.generate_stream(PROMPTS, max_new_tokens=8)
        for _ in range(7):  # into the decode: the shards hold the prompts' KV, read by their workers
            next(events)
        for node, worker in zip(nodes, engine.cpu_workers, strict=True):
            pages = set(ray.get(worker.shard_page_nodes.remote()))
            assert node.index in pages and pages <= {node.index, -2}  # on the node, or not allocated (yet)
    finally:
        engine.shutdown()


def test_a_killed_cpu_worker_is_restarted_and_the_tokens_do_not_change(ray_cluster):
    expected = local_tokens("tiny-mixtral", "all_cpu")
    engine = ray_engine("tiny-mixtral", "all_cpu", 2)
    try:
        victim = engine.cpu_workers[1]
        old_pid = ray.get(victim.pid.remote())
        tokens = {0: [], 1: []}
        for count, event in enumerate(engine.generate_stream(PROMPTS, max_new_tokens=10)):
            tokens[event.index].append(event.token_id)
            if count == 6:  # mid-generation: both sequences are decoding
                os.kill(old_pid, signal.SIGKILL)
        assert [tokens[0], tokens[1]] == expected
        assert ray.get(victim.pid.remote()) != old_pid  # it was restarted and re-attached its shard
        engine.check_integrity()
    finally:
        engine.shutdown()


def test_a_killed_gpu_worker_names_the_lost_requests_and_the_engine_then_works(ray_cluster):
    expected = local_tokens("tiny-qwen3-moe", "fixed_half")
    engine = ray_engine("tiny-qwen3-moe", "fixed_half", 1)
    try:
        old_pid = ray.get(engine.gpu_worker.pid.remote())
        with pytest.raises(WorkerLostError) as lost:
            for count, _ in enumerate(engine.generate_stream(PROMPTS, max_new_tokens=10)):
                if count == 4:
                    os.kill(old_pid, signal.SIGKILL)
        assert lost.value.lost_requests == [0, 1]
        assert "lost requests (prompt indices): [0, 1]" in str(lost.value)
        tokens = [o.token_ids for o in engine.generate(PROMPTS, max_new_tokens=10)]  # after the restart
        assert tokens == expected
        assert ray.get(engine.gpu_worker.pid.remote()) != old_pid
        engine.check_integrity()
    finally:
        engine.shutdown()


def test_the_policy_store_learns_from_the_workers_times(ray_cluster):
    engine = ray_engine("tiny-mixtral", "writescope", 2)
    try:
        calibrated = engine.policy_state()["model"]  # the GPU worker's calibration, through its channels
        engine.generate(PROMPTS, max_new_tokens=2 * SYNC_STEPS + 2)
        # published every SYNC_STEPS decode steps by a call nothing waits for: it arrives soon after
        wait_until(lambda: engine.policy_state()["steps"] >= 2 * SYNC_STEPS)
        state = engine.policy_state()
    finally:
        engine.shutdown()
    assert state["policy"] == "writescope"
    assert calibrated["cpu_dispatch_s"] > 0  # a channel's round trip: outside the kernel's own seconds
    assert calibrated["overlap"] == 0.0  # the device is this CPU: its path and the CPU workers split the cores
    assert state["model"] != calibrated  # corrected from the steps' times
    assert 0 <= state["share_at_32k"] <= 1 and state["model"]["cpu_s_per_token"] > 0


def wait_until(condition, timeout_s=60.0):
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "not within the time limit"
        time.sleep(0.2)


def test_shutdown_leaves_no_segment_socket_or_actor(ray_cluster):
    engine = ray_engine("tiny-deepseek-v2", "fixed_half", 2)
    engine.generate(PROMPTS[:1], max_new_tokens=3)
    names = engine.segment_names()
    assert len(names) == 2 + 1 + 2  # two shards, cpu_transfer, two channels
    owner_pid = ray.get(engine.owner.pid.remote())
    assert all(owner_pid in processes_mapping(name) for name in names)
    prefix = f"writescope-{engine.engine_id}-"
    assert set(abstract_sockets(prefix)) == {f"@{prefix}cpu0", f"@{prefix}cpu1"}  # the channels: no file anywhere
    assert not [n for n in os.listdir("/dev/shm") if engine.engine_id in n]
    actors = [engine.owner, engine.policy_store, engine.gpu_worker, *engine.cpu_workers]
    engine.shutdown()
    wait_until(lambda: not any(processes_mapping(name) for name in names))  # ray.kill is asynchronous
    assert abstract_sockets(prefix) == []
    for actor in actors:
        with pytest.raises(ray.exceptions.RayActorError):
            wait_until(lambda a=actor: ray.get(a.check_health.remote(), timeout=30) is None, timeout_s=30)


def test_an_engine_killed_outright_leaves_no_memory_behind(ray_cluster):
    engine = ray_engine("tiny-qwen3-moe", "fixed_half", 1)
    try:
        engine.generate(PROMPTS[:1], max_new_tokens=3)
        names = engine.segment_names()
        pids = [ray.get(a.pid.remote()) for a in [engine.owner, engine.gpu_worker, *engine.cpu_workers]]
        for pid in pids:  # as a node's OOM killer or `kill -9` would
            os.kill(pid, signal.SIGKILL)
        wait_until(lambda: not any(processes_mapping(name) for name in names))
        assert not [n for n in os.listdir("/dev/shm") if engine.engine_id in n]
    finally:
        engine.shutdown()


def test_an_engine_group_holds_every_actor_of_one_engine_and_goes_at_shutdown(ray_cluster):
    engine = RayEngine.from_pretrained("tiny-qwen3-moe", policy="all_cpu", engine_cpus=3, **OPTIONS)
    group = engine.group
    try:
        table = ray.util.placement_group_table(group.placement_group)
        assert group.owned and table["strategy"] == "STRICT_PACK" and table["state"] == "CREATED"
        assert table["bundles"] == {0: {"CPU": 3.0}}  # reserved while the engine runs
        names = {f"writescope-{engine.engine_id}-{part}" for part in ("region-owner", "policy-store", "gpu-worker",
                                                                      "cpu-worker-0")}
        actors = [a for a in ray._private.state.actors().values() if a["Name"] in names and a["State"] == "ALIVE"]
        assert {a["Name"] for a in actors} == names
        assert {a["Address"]["NodeID"] for a in actors} == {engine.node_id}  # the GCS's record, no dashboard
    finally:
        engine.shutdown()
    wait_until(lambda: ray.util.placement_group_table(group.placement_group)["state"] == "REMOVED")


def test_no_node_with_room_for_an_engine_group_is_a_clear_error(ray_cluster):
    from writescope.actors.engine_group import EngineGroup
    from writescope.config import EngineConfig

    groups_before = set(ray.util.placement_group_table())
    with pytest.raises(ValueError, match=r"no node of the Ray cluster had \{'CPU': 64.0\} free for an engine group "
                                         r"within 2 s .*lower engine_cpus or add a node"):
        EngineGroup.place(EngineConfig(engine_cpus=64), timeout_s=2)
    new_groups = set(ray.util.placement_group_table()) - groups_before
    assert new_groups and all(ray.util.placement_group_table()[g]["state"] == "REMOVED" for g in new_groups)


def test_token_authentication_is_on(ray_cluster):
    assert os.environ["RAY_AUTH_MODE"] == "token"


def test_a_local_ray_without_token_authentication_is_refused(monkeypatch):
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    with pytest.raises(ValueError, match="keeps Ray's token authentication on"):
        start_local_ray(num_cpus=1)


def test_without_a_running_ray_an_embedded_one_is_started(tmp_path):
    """As vLLM does it: no ray.init(), no RAY_ADDRESS, so `from writescope import Engine` with
    executor="ray" starts a local cluster, with token authentication on and its node on loopback,
    and decodes on it."""
    code = ("import os, sys\n"
            "from writescope import Engine\n"
            "engine = Engine.from_pretrained('tiny-mixtral', executor='ray', policy='all_cpu', window_tokens=16,\n"
            "                                block_size=4, max_batch_size=1, max_seq_len=128)\n"
            "import ray\n"
            "out = engine.generate('hello', max_new_tokens=3)[0]\n"
            "print(len(out.token_ids), os.environ['RAY_AUTH_MODE'], ray.util.get_node_ip_address())\n"
            "engine.shutdown()\n")
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_AUTH_MODE")}
    env["WRITESCOPE_CACHE_DIR"] = str(tmp_path)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    tokens, auth_mode, node_ip = result.stdout.split()[-3:]
    assert (tokens, auth_mode) == ("3", "token") and node_ip.startswith("127."), result.stdout


def test_a_caller_that_stops_early_frees_its_requests(ray_cluster):
    import asyncio

    from writescope.engine import SamplingParams

    engine = ray_engine("tiny-qwen3-moe", "fixed_half", 1)
    try:
        for count, _ in enumerate(engine.generate_stream(PROMPTS, max_new_tokens=40)):
            if count == 3:
                break  # the generator is closed here: the call's requests must stop

        async def submit_then_leave():
            request_id = await engine.submit(PROMPTS[0], SamplingParams(max_new_tokens=40))
            events = engine.stream(request_id)
            await events.__anext__()
            await events.aclose()

        asyncio.run(submit_then_leave())
        deadline = time.monotonic() + 30
        while engine.state()["running_seqs"] and time.monotonic() < deadline:
            time.sleep(0.2)
        assert engine.state()["running_seqs"] == 0  # their batch slots and KV are free again
        assert [o.finish_reason for o in engine.generate(PROMPTS, max_new_tokens=3)] == ["length", "length"]
    finally:
        engine.shutdown()


def test_generate_takes_more_prompts_than_the_queue_limit(ray_cluster):
    engine = Engine.from_pretrained("tiny-mixtral", policy="all_cpu", executor="ray",
                                    executor_options={"nodes": emulated_topology(1), "max_waiting": 2}, **OPTIONS)
    try:
        outputs = engine.generate([[7, 8, 9, i] for i in range(5)], max_new_tokens=2)
    finally:
        engine.shutdown()
    assert [len(o.token_ids) for o in outputs] == [2] * 5


def test_host_memory_follows_the_kv_written(ray_cluster, tmp_path):
    """tools/bench_capacity.py on a small batch: the regions' pages in memory are the KV placed (the
    segments committed as blocks are placed), though each region is sized for every sequence."""
    import json

    from writescope.tools import bench_capacity

    out = tmp_path / "capacity.json"
    assert bench_capacity.main(["--batch", "2", "--context", "1024", "--new-tokens", "4", "--window-tokens", "64",
                                "--prefill-chunk-tokens", "256", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    placed = result["placed_tokens"]
    assert placed["cpu_compute"] == 2 * 1024 and placed["cpu_transfer"] == 0  # all_cpu: every full block
    assert result["raw_kv_bytes"] == placed["cpu_compute"] * bench_capacity.kv_bytes_per_token("tiny-qwen3-moe")
    assert result["host_size_bytes"] >= 2 * result["raw_kv_bytes"]  # sized for any policy
    assert 0.95 <= result["resident_over_raw"] <= 1.3, result["host_regions"]
    assert result["decode_tok_s"] > 0 and result["prefill_tok_s"] > 0
