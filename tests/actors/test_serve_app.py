"""The OpenAI-compatible Serve app over real HTTP on 127.0.0.1: 32 concurrent requests (streaming
and not) each answered with its own prompt's tokens; malformed bodies get 4xx with a message; a
full queue gets 429 with Retry-After while the admitted requests finish; the API key is enforced."""

import json
import os
import signal
import threading
import time

import pytest
import ray

requests = pytest.importorskip("requests")

from ray import serve  # noqa: E402

from tests.actors.http import sse_chunks  # noqa: E402
from writescope.actors.serve_app import OpenAIIngress, build_app  # noqa: E402
from writescope.engine import Engine  # noqa: E402
from writescope.tools.local_serve import free_port, wait_healthy  # noqa: E402

pytestmark = pytest.mark.ray
MODEL = "tiny-qwen3-moe"
PROMPTS = [f"request {i}: " + "long context " * (5 + 3 * i) for i in range(32)]
NEW_TOKENS = 6


@pytest.fixture(scope="module")
def server(ray_cluster):
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(build_app({"model": MODEL, "policy": "fixed_half", "max_batch_size": 8, "max_seq_len": 2048,
                         "max_queue": 64}), name="main", route_prefix="/", blocking=False)
    tight = OpenAIIngress.options(name="TightIngress", ray_actor_options={"runtime_env": {
        "env_vars": {"WS_TEST_KEY": "sesame"}}})
    serve.run(tight.bind(model=MODEL, policy="all_cpu", max_batch_size=1, max_seq_len=1024, max_queue=2,
                         api_key_env="WS_TEST_KEY"), name="tight", route_prefix="/tight", blocking=False)
    base = f"http://127.0.0.1:{port}"
    for prefix in ("", "/tight"):
        wait_healthy(base + prefix)
    yield base
    serve.shutdown()


@pytest.fixture(scope="module")
def expected():
    engine = Engine.from_pretrained(MODEL, policy="fixed_half", max_batch_size=1, max_seq_len=2048)
    try:
        return [engine.generate(p, max_new_tokens=NEW_TOKENS)[0] for p in PROMPTS]
    finally:
        engine.shutdown()


def call(base, index):
    """One completion; every other request streams (server-sent events)."""
    body = {"model": MODEL, "prompt": PROMPTS[index], "max_tokens": NEW_TOKENS, "temperature": 0,
            "stream": index % 2 == 1}
    response = requests.post(f"{base}/v1/completions", json=body, timeout=300, stream=body["stream"])
    assert response.status_code == 200, response.text
    if not body["stream"]:
        choice = response.json()["choices"][0]
        return choice["token_ids"], choice["text"], choice["finish_reason"]
    chunks = sse_chunks(response)
    assert chunks[-1] == "[DONE]"
    tokens = [t for c in chunks[:-1] for t in c["choices"][0]["token_ids"]]
    text = "".join(c["choices"][0]["text"] for c in chunks[:-1])
    return tokens, text, chunks[-2]["choices"][0]["finish_reason"]


def test_32_concurrent_requests_each_get_their_own_answer(server, expected):
    results = {}

    def worker(index):
        results[index] = call(server, index)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(PROMPTS))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=600)
    assert sorted(results) == list(range(len(PROMPTS)))
    for index, (tokens, text, finish) in results.items():
        assert tokens == expected[index].token_ids, f"request {index} got another request's tokens"
        assert text == expected[index].text
        assert finish == "length"


def test_chat_completions_and_models(server):
    response = requests.post(f"{server}/v1/chat/completions", timeout=120, json={
        "model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4, "temperature": 0})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["object"] == "chat.completion" and body["usage"]["completion_tokens"] == 4
    assert body["choices"][0]["message"]["role"] == "assistant"
    stream = requests.post(f"{server}/v1/chat/completions", timeout=120, stream=True, json={
        "model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4, "temperature": 0,
        "stream": True})
    chunks = sse_chunks(stream)
    assert chunks[-1] == "[DONE]"
    assert "".join(c["choices"][0]["delta"]["content"] for c in chunks[:-1]) == \
        body["choices"][0]["message"]["content"]
    parts = requests.post(f"{server}/v1/chat/completions", timeout=120, json={
        "model": MODEL, "messages": [{"role": "user", "content": [{"type": "text", "text": "hel"},
                                                                 {"type": "text", "text": "lo"}]}],
        "max_tokens": 4, "temperature": 0})
    assert parts.status_code == 200, parts.text
    assert parts.json()["choices"][0]["token_ids"] == body["choices"][0]["token_ids"]  # the same prompt
    unseeded = [requests.post(f"{server}/v1/completions", timeout=120, json={
        "model": MODEL, "prompt": "same prompt", "max_tokens": 12, "temperature": 1.0}).json() for _ in range(2)]
    assert unseeded[0]["choices"][0]["token_ids"] != unseeded[1]["choices"][0]["token_ids"]
    models = requests.get(f"{server}/v1/models", timeout=30).json()
    assert [m["id"] for m in models["data"]] == [MODEL]


@pytest.mark.parametrize("body, status, words", [
    (b"{not json", 400, "JSON"),
    ({"model": MODEL}, 400, "prompt"),
    ({"model": MODEL, "prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ({"model": MODEL, "prompt": "x", "temperature": -1}, 400, "temperature"),
    ({"model": MODEL, "prompt": [10**9]}, 400, "outside"),
    ({"model": MODEL, "prompt": "x " * 1100, "max_tokens": 8}, 400, "max_seq_len"),
    ({"model": "gpt-4", "prompt": "x"}, 404, "not served"),
])
def test_malformed_bodies_get_4xx_with_a_message(server, body, status, words):
    if isinstance(body, bytes):
        response = requests.post(f"{server}/v1/completions", data=body, timeout=60,
                                 headers={"Content-Type": "application/json"})
    else:
        response = requests.post(f"{server}/v1/completions", json=body, timeout=60)
    assert response.status_code == status, response.text
    assert words.lower() in response.json()["error"]["message"].lower()


def test_a_full_queue_gets_429_with_retry_after_and_the_admitted_finish(server):
    headers = {"Authorization": "Bearer sesame"}
    statuses, lock = [], threading.Lock()

    def worker(index):
        response = requests.post(f"{server}/tight/v1/completions", headers=headers, timeout=300, json={
            "model": MODEL, "prompt": PROMPTS[index], "max_tokens": 48, "temperature": 0})
        with lock:
            statuses.append((response.status_code, response.headers.get("Retry-After"), response.json()))

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(10)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=600)
    refused = [s for s in statuses if s[0] == 429]
    answered = [s for s in statuses if s[0] == 200]
    assert refused and answered and len(refused) + len(answered) == 10
    assert all(int(retry) >= 1 for _, retry, _ in refused)
    assert all(body["choices"][0]["finish_reason"] == "length" for _, _, body in answered)


def test_the_api_key_is_required_when_set(server):
    body = {"model": MODEL, "prompt": "x", "max_tokens": 1}
    assert requests.post(f"{server}/tight/v1/completions", json=body, timeout=60).status_code == 401
    wrong = requests.post(f"{server}/tight/v1/completions", json=body, timeout=60,
                          headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401 and "API key" in wrong.json()["error"]["message"]
    right = requests.post(f"{server}/tight/v1/completions", json=body, timeout=60,
                          headers={"Authorization": "Bearer sesame"})
    assert right.status_code == 200
    for path in ("/openapi.json", "/docs", "/v1/models", "/no/such/route"):  # every route but /health
        assert requests.get(f"{server}/tight{path}", timeout=60).status_code == 401, path
    assert requests.get(f"{server}/tight/openapi.json", timeout=60,
                        headers={"Authorization": "Bearer sesame"}).json()["paths"]
    assert requests.get(f"{server}/tight/health", timeout=60).status_code == 200  # probes send no key


def test_unknown_app_args_are_refused():
    with pytest.raises(ValueError, match="unknown app args"):
        build_app({"model": MODEL, "batch": 3})


def test_the_serve_configs_args_build_the_app():
    import os

    import yaml

    root = os.path.join(os.path.dirname(__file__), "..", "..", "cluster_configs")
    with open(os.path.join(root, "serve.yaml")) as f:
        application = yaml.safe_load(f)["applications"][0]
    assert application["import_path"] == "writescope.actors.serve_app:build_app"
    assert isinstance(build_app(application["args"]), serve.Application)


def test_a_stream_cut_by_a_gpu_worker_loss_ends_with_an_error_event_and_done(server):
    """Near the end of this file: it kills the GPU workers of this module's apps (every one this
    process's cluster runs), and waits until they are back."""
    from writescope.tools.soak import descendants_named

    response = requests.post(f"{server}/v1/completions", stream=True, timeout=300, json={
        "model": MODEL, "prompt": PROMPTS[5], "max_tokens": 1000, "temperature": 0, "stream": True})
    assert response.status_code == 200
    killed = []

    def kill_after_first_chunk():
        if not killed:
            killed.extend(descendants_named("ray::GPUWorker"))
            for pid in killed:
                os.kill(pid, signal.SIGKILL)

    chunks = sse_chunks(response, on_chunk=kill_after_first_chunk)
    assert killed
    assert chunks[-1] == "[DONE]", chunks[-3:]
    error = chunks[-2]["error"]
    assert error["code"] == 503 and "retry" in error["message"] and "Traceback" not in json.dumps(chunks[-2])
    statuses = []
    deadline = time.monotonic() + 240
    while not statuses or statuses[-1] != 200:
        assert time.monotonic() < deadline, f"/health never came back: {statuses[-5:]}"
        statuses.append(requests.get(f"{server}/health", timeout=30).status_code)
        time.sleep(0.2)
    assert set(statuses) <= {503, 200}  # 503 while Ray restarts it (past a 2 s wait), never a 500
    again = requests.post(f"{server}/v1/completions", timeout=120, json={
        "model": MODEL, "prompt": PROMPTS[0], "max_tokens": NEW_TOKENS, "temperature": 0})
    assert again.status_code == 200


def test_health_is_503_with_retry_after_when_the_engine_is_gone(server):
    """Last in this file: the GPU workers of both apps are killed for good (as when a node is lost)."""
    workers = [a for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].endswith("-gpu-worker")]
    assert len(workers) == 2  # the main app's engine and the tight one's, found by their names
    for actor in workers:
        ray.kill(ray.get_actor(actor["name"], namespace=actor["namespace"]), no_restart=True)
    for prefix in ("", "/tight"):
        deadline = time.monotonic() + 60
        while (health := requests.get(f"{server}{prefix}/health", timeout=30)).status_code == 200:
            assert time.monotonic() < deadline, "ray.kill did not take effect"
            time.sleep(0.2)
        assert health.status_code == 503 and int(health.headers["Retry-After"]) >= 1
        assert health.json()["error"]["code"] == 503
        refused = requests.post(f"{server}{prefix}/v1/completions", timeout=60, headers={"Authorization":
                                "Bearer sesame"}, json={"model": MODEL, "prompt": "x", "max_tokens": 2})
        assert refused.status_code == 503 and "Traceback" not in refused.text
