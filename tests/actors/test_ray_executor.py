"""The `ray` executor against a real local Ray cluster (one per test session): the same tokens as
the local executor, CPU workers pinned to their (emulated) NUMA nodes, and a killed CPU worker that
is restarted mid-generation without changing a token."""

import os
import signal
import subprocess
import sys

import pytest

ray = pytest.importorskip("ray")

from writescope.engine import Engine  # noqa: E402
from writescope.models.presets import PRESETS  # noqa: E402
from writescope.policies import POLICY_NAMES  # noqa: E402
from writescope.topology import emulated_topology  # noqa: E402

pytestmark = pytest.mark.ray
PROMPTS = [[5, 6, 7] * 50, list(range(1, 110))]
OPTIONS = {"window_tokens": 8, "block_size": 4, "max_batch_size": 2, "max_seq_len": 200}


@pytest.fixture(scope="session")
def ray_cluster(tmp_path_factory):
    os.environ.setdefault("WRITESCOPE_CACHE_DIR", str(tmp_path_factory.mktemp("calibration")))
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def local_tokens(preset, policy):
    engine = Engine.from_pretrained(preset, policy=policy, **OPTIONS)
    try:
        return [o.token_ids for o in engine.generate(PROMPTS, max_new_tokens=10)]
    finally:
        engine.shutdown()


def ray_engine(preset, policy, num_nodes):
    return Engine.from_pretrained(preset, policy=policy, executor="ray",
                                  executor_options={"nodes": emulated_topology(num_nodes)}, **OPTIONS)


@pytest.mark.parametrize("num_nodes", [1, 2])
@pytest.mark.parametrize("policy", POLICY_NAMES)
@pytest.mark.parametrize("preset", list(PRESETS))
def test_ray_gives_the_local_tokens(ray_cluster, preset, policy, num_nodes):
    engine = ray_engine(preset, policy, num_nodes)
    try:
        tokens = [o.token_ids for o in engine.generate(PROMPTS, max_new_tokens=10)]
    finally:
        engine.shutdown()
    assert tokens == local_tokens(preset, policy)


def test_cpu_workers_are_pinned_to_their_nodes(ray_cluster):
    nodes = emulated_topology(2)
    engine = ray_engine("tiny-qwen3-moe", "all_cpu", 2)
    try:
        for node, worker in zip(nodes, engine.executor.workers, strict=True):
            affinities = ray.get(worker.thread_affinities.remote())
            assert len(affinities) > 1
            for tid, cpus in affinities.items():
                assert set(cpus) <= set(node.cpus), f"thread {tid} of node {node.index}'s worker runs on {cpus}"
    finally:
        engine.shutdown()


def test_a_killed_cpu_worker_is_restarted_and_the_tokens_do_not_change(ray_cluster):
    expected = local_tokens("tiny-mixtral", "all_cpu")
    engine = ray_engine("tiny-mixtral", "all_cpu", 2)
    try:
        victim = engine.executor.workers[1]
        old_pid = ray.get(victim.pid.remote())
        tokens = {0: [], 1: []}
        for count, event in enumerate(engine.generate_stream(PROMPTS, max_new_tokens=10)):
            tokens[event.index].append(event.token_id)
            if count == 6:  # mid-generation: both sequences are decoding
                os.kill(old_pid, signal.SIGKILL)
        assert [tokens[0], tokens[1]] == expected
        assert ray.get(victim.pid.remote()) != old_pid  # it was restarted and re-attached its shard
        engine.cache.check_integrity()
    finally:
        engine.shutdown()


def test_ray_executor_needs_a_running_ray():
    code = ("from writescope.engine import Engine\n"
            "try:\n    Engine.from_pretrained('tiny-mixtral', executor='ray')\n"
            "except ValueError as e:\n    print(e)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "needs a running Ray" in result.stdout, result.stderr
