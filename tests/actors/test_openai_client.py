"""The Serve app as a vLLM user meets it, through the official `openai` client over real HTTP, on a
saved chat checkpoint in a real instruct model's format (ChatML template, generation_config.json):
chat prompts are the ids transformers' apply_chat_template gives; every sampling parameter is
honoured or refused with a 400 naming it; logprobs are transformers' log-softmax; streams end
with a usage chunk when asked; /tokenize, /detokenize and /v1/models/{id} answer; the latency
histograms are exported where Ray exports metrics."""

import re
import time
import urllib.request

import pytest
import ray
import torch

openai = pytest.importorskip("openai")
requests = pytest.importorskip("requests")
transformers = pytest.importorskip("transformers")

from ray import serve  # noqa: E402

from tests.chat_checkpoint import GENERATION_CONFIG, save_chat_checkpoint  # noqa: E402
from writescope.actors.serve_app import build_app  # noqa: E402
from writescope.tools.local_serve import free_port, wait_healthy  # noqa: E402

pytestmark = pytest.mark.ray
MODEL = "chatml"
MAX_SEQ_LEN = 17408
CONVERSATION = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
PROMPT = "The long document says: " + "tokens and more tokens. " * 6


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("served")
    return save_chat_checkpoint(root / "chat"), save_chat_checkpoint(root / "bare", "none")


@pytest.fixture(scope="module")
def server(ray_cluster, checkpoints):
    chat, bare = checkpoints
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    common = {"policy": "fixed_half", "max_batch_size": 4, "max_seq_len": MAX_SEQ_LEN, "dtype": "float32"}
    serve.run(build_app({"model": chat, "served_model_name": MODEL, **common}), name="chat", route_prefix="/",
              blocking=False)
    # the same weights (the same seed), no template, no prefix reuse: the reference of reuse
    serve.run(build_app({"model": bare, "served_model_name": "bare", "enable_prefix_caching": False, **common}),
              name="bare", route_prefix="/bare", blocking=False)
    base = f"http://127.0.0.1:{port}"
    for prefix in ("", "/bare"):
        wait_healthy(base + prefix)
    yield base
    serve.shutdown()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def reference(checkpoints):
    """transformers on the same checkpoint: its tokenizer and model."""
    chat, _ = checkpoints
    return transformers.AutoTokenizer.from_pretrained(chat), transformers.AutoModelForCausalLM.from_pretrained(
        chat, dtype=torch.float32).eval()


def greedy_reference(model, ids: list[int], new_tokens: int):
    """transformers' greedy tokens and the log-softmax of its logits at each."""
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=new_tokens, do_sample=False, output_logits=True,
                             return_dict_in_generate=True, eos_token_id=None, pad_token_id=0)
    tokens = out.sequences[0, len(ids):].tolist()
    return tokens, [torch.log_softmax(step[0].double(), dim=-1) for step in out.logits]


def test_chat_prompts_are_the_checkpoints_template(server, client, reference):
    tokenizer, _ = reference
    expected = tokenizer.apply_chat_template(CONVERSATION, add_generation_prompt=True, tokenize=True,
                                             return_dict=False)
    tokenized = requests.post(f"{server}/tokenize", timeout=60, json={"model": MODEL, "messages": CONVERSATION})
    assert tokenized.status_code == 200, tokenized.text
    assert tokenized.json()["tokens"] == list(expected)
    assert tokenized.json()["max_model_len"] == MAX_SEQ_LEN
    answer = client.chat.completions.create(model=MODEL, messages=CONVERSATION, max_tokens=5, temperature=0)
    assert answer.usage.prompt_tokens == len(expected)
    assert answer.choices[0].message.role == "assistant"


def test_completion_logprobs_are_transformers_log_softmax(client, reference):
    tokenizer, model = reference
    ids = tokenizer(PROMPT, add_special_tokens=True)["input_ids"]
    tokens, logps = greedy_reference(model, ids, 6)
    answer = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=3,
                                       extra_body={"ignore_eos": True})
    logprobs = answer.choices[0].logprobs
    assert answer.choices[0].model_extra["token_ids"] == tokens
    for token, value, top, reference_logp in zip(tokens, logprobs.token_logprobs, logprobs.top_logprobs, logps,
                                                 strict=True):
        assert value == pytest.approx(float(reference_logp[token]), abs=1e-4)
        best = torch.topk(reference_logp, 3)
        expected_top = {tokenizer.decode([i]): float(v) for i, v in zip(best.indices, best.values, strict=True)}
        assert top.keys() == expected_top.keys()
        assert list(top.values()) == pytest.approx(list(expected_top.values()), abs=1e-4)
    assert logprobs.tokens == [tokenizer.decode([t]) for t in tokens]  # a byte of a character: U+FFFD, as vLLM


def test_chat_logprobs_stream_and_usage_chunk(client, reference):
    tokenizer, model = reference
    ids = tokenizer.apply_chat_template(CONVERSATION, add_generation_prompt=True, tokenize=True, return_dict=False)
    tokens, logps = greedy_reference(model, list(ids), 4)
    stream = client.chat.completions.create(model=MODEL, messages=CONVERSATION, max_tokens=4, temperature=0,
                                            logprobs=True, top_logprobs=2, stream=True, extra_body={"ignore_eos": True},
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    usage = chunks[-1]
    assert usage.choices == [] and usage.usage.completion_tokens == 4 and usage.usage.prompt_tokens == len(ids)
    entries = [entry for chunk in chunks[:-1] for entry in (chunk.choices[0].logprobs.content
                                                            if chunk.choices[0].logprobs else [])]
    assert len(entries) == 4
    for token, entry, reference_logp in zip(tokens, entries, logps, strict=True):
        assert entry.token == tokenizer.decode([token])
        assert entry.logprob == pytest.approx(float(reference_logp[token]), abs=1e-4)
        assert len(entry.top_logprobs) == 2 and entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
    without = list(client.chat.completions.create(model=MODEL, messages=CONVERSATION, max_tokens=2, stream=True))
    assert all(chunk.usage is None for chunk in without) and without[-1].choices


def _tokens(answer) -> list[int]:
    return answer.choices[0].model_extra["token_ids"]


def test_sampling_parameters_are_honoured(client):
    def complete(**fields):
        extra = {k: fields.pop(k) for k in ("top_k", "min_p", "repetition_penalty", "stop_token_ids", "ignore_eos")
                 if k in fields}
        return client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, extra_body=extra or None,
                                         **fields)

    greedy = _tokens(complete(temperature=0, ignore_eos=True))
    # top_k=1 and min_p=1 leave only the most likely token, whatever the temperature
    assert _tokens(complete(temperature=1.8, top_k=1, seed=3, ignore_eos=True)) == greedy
    assert _tokens(complete(temperature=1.8, min_p=1.0, seed=4, ignore_eos=True)) == greedy
    drawn = [_tokens(complete(temperature=1.8, seed=s, ignore_eos=True)) for s in (5, 6)]
    assert drawn[0] != drawn[1]
    assert _tokens(complete(temperature=0, presence_penalty=2.0, ignore_eos=True)) != greedy
    assert _tokens(complete(temperature=0, frequency_penalty=2.0, ignore_eos=True)) != greedy
    assert _tokens(complete(temperature=0, repetition_penalty=3.0, ignore_eos=True)) != greedy
    stopped = complete(temperature=0, stop_token_ids=[greedy[4]], ignore_eos=True)
    assert stopped.choices[0].finish_reason == "stop"
    assert _tokens(stopped) == greedy[:greedy.index(greedy[4]) + 1]
    echoed = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0, echo=True)
    assert echoed.choices[0].text.startswith(PROMPT) and len(echoed.choices[0].text) > len(PROMPT)


def test_generation_config_sampling_is_the_default(client):
    """Unset fields take generation_config.json's values: the same seed gives the same tokens with
    them left out as with them written, and others with OpenAI's defaults written."""
    written = {k: GENERATION_CONFIG[k] for k in ("temperature", "top_p")}
    extra = {"top_k": GENERATION_CONFIG["top_k"], "repetition_penalty": GENERATION_CONFIG["repetition_penalty"],
             "ignore_eos": True}
    results = []
    for fields, body in (({}, {"ignore_eos": True}), (written, extra),
                         ({"temperature": 1.0, "top_p": 1.0}, {"top_k": 0, "repetition_penalty": 1.0,
                                                               "ignore_eos": True})):
        runs = [_tokens(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, seed=seed,
                                                  extra_body=body, **fields)) for seed in range(4)]
        results.append(runs)
    assert results[0] == results[1]
    assert results[0] != results[2]


@pytest.mark.parametrize("fields, param", [
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}, "tools"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"n": 2}, "n"),
    ({"logit_bias": {"5": 10}}, "logit_bias"),
    ({"top_logprobs": 2}, None),  # needs logprobs
])
def test_unsupported_parameters_are_refused_naming_them(client, fields, param):
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=MODEL, messages=CONVERSATION, max_tokens=2, **fields)
    error = refused.value.body
    assert error["param"] == param if param else "top_logprobs" in error["message"]
    assert (param or "logprobs") in error["message"]


def test_completions_refuse_best_of_and_echo_with_logprobs(client):
    with pytest.raises(openai.BadRequestError, match="best_of"):
        client.completions.create(model=MODEL, prompt="x", max_tokens=2, best_of=3)
    with pytest.raises(openai.BadRequestError, match="echo"):
        client.completions.create(model=MODEL, prompt="x", max_tokens=2, echo=True, logprobs=1)


def test_chat_without_a_template_is_a_400_that_says_so(server):
    bare = openai.OpenAI(base_url=f"{server}/bare/v1", api_key="unused", max_retries=0, timeout=120)
    with pytest.raises(openai.BadRequestError, match="no chat template"):
        bare.chat.completions.create(model="bare", messages=CONVERSATION, max_tokens=2)
    assert bare.completions.create(model="bare", prompt="still fine", max_tokens=2).choices[0].text is not None


def test_tokenize_detokenize_and_model_routes(server, client, reference):
    tokenizer, _ = reference
    tokenized = requests.post(f"{server}/tokenize", timeout=60, json={"model": MODEL, "prompt": PROMPT,
                                                                       "return_token_strs": True}).json()
    assert tokenized["tokens"] == tokenizer(PROMPT)["input_ids"] and tokenized["count"] == len(tokenized["tokens"])
    assert len(tokenized["token_strs"]) == tokenized["count"]
    back = requests.post(f"{server}/detokenize", timeout=60, json={"model": MODEL, "tokens": tokenized["tokens"]})
    assert back.json() == {"prompt": PROMPT}
    bad = requests.post(f"{server}/detokenize", timeout=60, json={"model": MODEL, "tokens": [1, 10**9]})
    assert bad.status_code == 400 and "outside" in bad.json()["error"]["message"]
    both = requests.post(f"{server}/tokenize", timeout=60, json={"model": MODEL, "prompt": "x",
                                                                 "messages": CONVERSATION})
    assert both.status_code == 400 and "exactly one" in both.json()["error"]["message"]
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")


def _scrape() -> str:
    port = next(node["MetricsExportPort"] for node in ray.nodes() if node["Alive"])
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        return response.read().decode()


HISTOGRAMS = ("time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds",
              "request_queue_time_seconds")


def test_latency_histograms_are_exported_after_traffic(client):
    for _ in range(3):
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0)
    deadline = time.monotonic() + 60
    while True:  # Ray's agents export every few seconds: until every figure shows the traffic
        text = _scrape()
        counts = {name: _summed(text, f"ray_writescope_{name}_count") for name in HISTOGRAMS}
        # summed over the series of both apps' replicas (each its own worker)
        finished = _summed(text, "ray_writescope_request_success_total", 'finished_reason="[a-z]+"')
        prompt_tokens = _summed(text, "ray_writescope_prompt_tokens_total")
        if (min(counts.values()) >= 1 and finished >= 3 and prompt_tokens >= 3 * 20) or time.monotonic() > deadline:
            break
        time.sleep(2)
    assert min(counts.values()) >= 1, counts
    assert finished >= 3 and prompt_tokens >= 3 * 20, (finished, prompt_tokens)


def _summed(text: str, name: str, label: str = "") -> float:
    pattern = rf"^{name}{{[^}}]*{label}[^}}]*}} (\S+)$"
    return sum(float(value) for value in re.findall(pattern, text, re.MULTILINE))
