"""Poison requests against the Serve app over real HTTP on 127.0.0.1: each is sent while 8 innocent
streaming requests decode; every innocent one finishes with the tokens it gets alone, never delayed
by more than 2 s, and the poison gets a 4xx with an OpenAI-shaped error that leaks nothing (or, for
a degenerate but valid sampling setting, a normal answer: such temperatures and top_p are greedy)."""

import json
import threading
import time

import pytest

requests = pytest.importorskip("requests")

from ray import serve  # noqa: E402

from tests.actors.http import assert_no_internals, sse_chunks  # noqa: E402
from writescope.actors.serve_app import build_app, default_max_body_bytes  # noqa: E402
from writescope.engine import Engine  # noqa: E402
from writescope.tools.fuzz_http import TARGET_APP, fuzz  # noqa: E402
from writescope.tools.local_serve import free_port, wait_healthy  # noqa: E402

pytestmark = pytest.mark.ray
MODEL = "tiny-qwen3-moe"
MAX_SEQ_LEN = 2048
INNOCENTS = [f"innocent {i}: " + "a long shared context " * (4 + 3 * i) for i in range(8)]
INNOCENT_TOKENS = 48
MAX_DELAY_S = 2.0
JSON = {"Content-Type": "application/json"}


@pytest.fixture(scope="module")
def server(ray_cluster):
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(build_app({"model": MODEL, "policy": "fixed_half", "max_batch_size": 12, "max_seq_len": MAX_SEQ_LEN,
                         "max_queue": 64}), name="poison", route_prefix="/", blocking=False)
    serve.run(build_app(TARGET_APP), name="fuzz", route_prefix="/fuzz", blocking=False)  # short answers
    base = f"http://127.0.0.1:{port}"
    wait_healthy(base)
    wait_healthy(base + "/fuzz")
    yield base
    serve.shutdown()


@pytest.fixture(scope="module")
def alone():
    engine = Engine.from_pretrained(MODEL, policy="fixed_half", max_batch_size=1, max_seq_len=MAX_SEQ_LEN)
    try:
        return [engine.generate(p, max_new_tokens=INNOCENT_TOKENS)[0].token_ids for p in INNOCENTS]
    finally:
        engine.shutdown()


def body(**fields) -> bytes:
    return json.dumps({"model": MODEL, "prompt": "poison", "max_tokens": 4, **fields}).encode()


NESTED = b'{"model": "tiny-qwen3-moe", "prompt": ' + b"[" * 40_000 + b"]" * 40_000 + b"}"
POISONS = {
    "temperature 1e-300": ("/v1/completions", body(temperature=1e-300), {200}),
    "top_p 1e-300": ("/v1/completions", body(temperature=1.0, top_p=1e-300), {200}),
    "lone surrogate in the prompt": ("/v1/completions", b'{"model": "tiny-qwen3-moe", "prompt": "a\\ud800b"}', {400}),
    "lone surrogate in chat content": ("/v1/chat/completions", b'{"model": "tiny-qwen3-moe", "messages": '
                                       b'[{"role": "user", "content": "x\\udfffy"}]}', {400}),
    "lone surrogate in a stop string": ("/v1/completions", b'{"model": "tiny-qwen3-moe", "prompt": "a", '
                                        b'"stop": ["\\ud83d"]}', {400}),
    "10 MB body": ("/v1/completions", body(prompt="x" * 10_000_000), {413}),
    "50 MB body": ("/v1/completions", body(prompt=[7] * 16_000_000), {413}),
    "empty stop string": ("/v1/completions", body(stop=[""]), {400}),
    "seed 2**80 with sampling": ("/v1/completions", body(seed=2**80, temperature=1.0), {400}),
    "NaN temperature": ("/v1/completions", b'{"model": "tiny-qwen3-moe", "prompt": "a", "temperature": NaN}', {400}),
    "Infinity top_p": ("/v1/completions", b'{"model": "tiny-qwen3-moe", "prompt": "a", "top_p": Infinity}', {400}),
    "nested JSON": ("/v1/completions", NESTED, {400}),
    "invalid UTF-8": ("/v1/completions", b'{"model": "tiny-qwen3-moe", "prompt": "a\xff\xfeb"}', {400}),
    "token id past the vocabulary": ("/v1/completions", body(prompt=[1, 2, 10**30]), {400}),
    "prompt longer than max_seq_len": ("/v1/completions", body(prompt=[5] * MAX_SEQ_LEN), {400}),
    "max_tokens of 10**12": ("/v1/completions", body(max_tokens=10**12), {400}),
    "not an object": ("/v1/completions", b"[1, 2, 3]", {400}),
    "top_k of -5": ("/v1/completions", body(top_k=-5), {400}),
    "logprobs of 10**9": ("/v1/completions", body(logprobs=10**9), {400}),
    "repetition_penalty 0": ("/v1/completions", body(repetition_penalty=0), {400}),
    "stop_token_ids of -1": ("/v1/completions", body(stop_token_ids=[-1]), {400}),
    "10**6 stop_token_ids": ("/v1/completions", body(stop_token_ids=[1] * 10**6), {400, 413}),
    "tools": ("/v1/chat/completions", json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                                                  "tools": [{"type": "function", "function": {"name": "f"}}]}).encode(),
              {400}),
    "n of 3": ("/v1/completions", body(n=3), {400}),
    "tokenize a prompt past max_seq_len": ("/tokenize", json.dumps({"model": MODEL, "prompt": "x" * 10 * MAX_SEQ_LEN}
                                                                   ).encode(), {400}),
    "tokenize messages with a lone surrogate": ("/tokenize", b'{"model": "tiny-qwen3-moe", "messages": '
                                                b'[{"role": "user", "content": "x\\udfffy"}]}', {400}),
    "detokenize an id of 10**30": ("/detokenize", json.dumps({"model": MODEL, "tokens": [1, 10**30]}).encode(), {400}),
    "a template variable that breaks the template": ("/v1/chat/completions", json.dumps({
        "model": MODEL, "messages": [{"role": "user", "content": "x"}],
        "chat_template_kwargs": {"messages": 5}}).encode(), {400}),
}


class Innocents:
    """8 streaming completions decoding at once, with the arrival time of every chunk."""

    def __init__(self, base: str):
        self.results, self.arrivals, self.errors = {}, {i: [] for i in range(len(INNOCENTS))}, []
        self.threads = [threading.Thread(target=self._run, args=(base, i)) for i in range(len(INNOCENTS))]
        for thread in self.threads:
            thread.start()

    def _run(self, base, index):
        try:
            response = requests.post(f"{base}/v1/completions", stream=True, timeout=300, json={
                "model": MODEL, "prompt": INNOCENTS[index], "max_tokens": INNOCENT_TOKENS, "temperature": 0,
                "stream": True})
            assert response.status_code == 200, response.text
            chunks = sse_chunks(response, on_chunk=lambda: self.arrivals[index].append(time.monotonic()))
            assert chunks[-1] == "[DONE]"
            self.results[index] = [t for c in chunks[:-1] for t in c["choices"][0]["token_ids"]]
        except Exception as error:  # noqa: BLE001 - reported by the test's thread
            self.errors.append((index, error))

    def wait_until_all_decode(self, timeout_s=120):
        deadline = time.monotonic() + timeout_s
        while not all(len(a) >= 2 for a in self.arrivals.values()):
            assert not self.errors, self.errors
            assert time.monotonic() < deadline, "the innocent requests did not all start decoding"
            time.sleep(0.01)

    def join(self):
        for thread in self.threads:
            thread.join(timeout=300)
        assert not self.errors, self.errors

    def largest_gap_s(self, since: float) -> float:
        gaps = [b - a for times in self.arrivals.values() for a, b in zip(times, times[1:], strict=False)
                if b >= since]
        return max(gaps, default=0.0)


@pytest.mark.parametrize("name", list(POISONS))
def test_a_poison_request_hurts_no_innocent_one(server, alone, name):
    path, payload, statuses = POISONS[name]
    innocents = Innocents(server)
    innocents.wait_until_all_decode()
    sent = time.monotonic()
    response = requests.post(server + path, data=payload, timeout=120, headers=JSON)
    answered_s = time.monotonic() - sent
    innocents.join()

    assert response.status_code in statuses, response.text[:500]
    assert_no_internals(response.text)
    if response.status_code == 200:  # a degenerate temperature or top_p is greedy: a normal answer
        assert len(response.json()["choices"][0]["token_ids"]) == 4
    else:
        error = response.json()["error"]
        assert error["message"] and error["code"] == response.status_code and "type" in error
    assert answered_s < MAX_DELAY_S, f"the poison took {answered_s:.2f} s to be answered"
    assert [innocents.results[i] for i in range(len(INNOCENTS))] == alone  # every innocent answer is intact
    assert innocents.largest_gap_s(sent) < MAX_DELAY_S
    assert requests.get(server + "/health", timeout=30).status_code == 200  # the engine never went down


def test_degenerate_sampling_is_greedy(server):
    greedy = requests.post(f"{server}/v1/completions", timeout=60, data=body(temperature=0, max_tokens=8),
                           headers=JSON).json()
    for settings in ({"temperature": 1e-300}, {"temperature": 1e-6, "top_p": 0.5},
                     {"temperature": 1.0, "top_p": 1e-300}):
        answer = requests.post(f"{server}/v1/completions", timeout=60, data=body(max_tokens=8, seed=1, **settings),
                               headers=JSON)
        assert answer.json()["choices"][0]["token_ids"] == greedy["choices"][0]["token_ids"], settings


def test_a_body_without_content_length_is_cut_at_the_limit(server):
    def chunks():
        yield b'{"model": "tiny-qwen3-moe", "prompt": "'
        for _ in range(400):
            yield b"x" * 100_000
        yield b'"}'

    sent = time.monotonic()
    response = requests.post(f"{server}/v1/completions", data=chunks(), timeout=120, headers=JSON)
    assert response.status_code == 413, response.text[:300]
    assert str(default_max_body_bytes(MAX_SEQ_LEN)) in response.json()["error"]["message"]
    assert time.monotonic() - sent < MAX_DELAY_S * 5


def test_error_bodies_are_openai_shaped_everywhere(server):
    for response in (requests.get(f"{server}/no/such/route", timeout=30),
                     requests.post(f"{server}/v1/completions", data=b"{broken", timeout=30, headers=JSON),
                     requests.post(f"{server}/v1/completions", data=b'{"model": 1}', timeout=30, headers=JSON),
                     requests.post(f"{server}/v1/completions", data=b"\xff\xfe", timeout=30, headers=JSON),
                     requests.post(f"{server}/v1/completions", data=b"prompt=x", timeout=30)):
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["code"] == response.status_code
        assert_no_internals(response.text)


def test_a_fuzz_run_from_the_openapi_schema_gets_no_5xx(server):
    report = fuzz(server + "/fuzz", examples=40, random_seed=1)
    assert report["server_errors"] == []
    completions = report["operations"]["POST /v1/completions positive"]
    assert completions.get("2xx", 0) > 0 and completions.get("4xx", 0) > 0  # valid bodies were answered
    assert report["operations"]["POST /v1/chat/completions negative"].get("4xx", 0) == 40
