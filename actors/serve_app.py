"""An OpenAI-compatible Ray Serve application over the engine's actors.

    serve run cluster_configs/serve.yaml
    serve run writescope.actors.serve_app:build_app model=tiny-qwen3-moe    # the same, from the command line

Routes: POST /v1/completions and /v1/chat/completions (both with "stream": true as server-sent
events), POST /tokenize and /detokenize (vLLM's), GET /v1/models, /v1/models/{id}, /health. The
ingress (FastAPI inside Serve) holds a RayEngine: the GPU worker's EngineService batches the
requests of every caller together (continuous batching). Chat renders the checkpoint's chat template
(writescope.chat); request bodies and their parameters are writescope.actors.openai_protocol's, each
honoured or refused with a 400 naming it. Latencies (TTFT, inter-token, e2e, queue time) and token
counters go out through Ray's metrics API under vLLM's names (see _Metrics).

More than one node: each replica owns one engine group, placed with it in one placement-group
bundle on one node (build_app sets `placement_group_bundles`); `num_replicas: N` (or an
autoscaling_config) in serve.yaml is N engines, spread by Serve's router, and every answer names
the node that served it (the x-writescope-node header). A replica whose engine is lost for good
fails Serve's health check and is replaced, with its engine, when a node has room; the others keep
serving.

No request can hurt another. Every input is checked here, before it reaches the engine: the body's
size (413 past max_body_bytes, decided from Content-Length before a byte is read), its JSON and
Unicode, every parameter's range (so sampling cannot fail on any accepted value), and the prompt,
tokenised here (in a thread, off the event loop) and measured against max_seq_len. A request that
fails inside the engine ends alone with an error; a stream that breaks (the GPU worker died) ends
with an OpenAI-shaped error event and `data: [DONE]`. Error bodies are OpenAI's
`{"error": {"message", "type", "param", "code"}}` and never carry a traceback or a path.

Admission: a request waits for KV capacity in the GPU worker's queue; when max_queue requests
already wait, the answer is 429 with Retry-After, and the requests already admitted finish.

Serve's HTTP is outside Ray's token authentication: bind 127.0.0.1 (the default here), and set an
API key (the environment variable named by api_key_env): clients send `Authorization: Bearer KEY`,
as OpenAI clients do, on every route but /health (the docs and the OpenAPI schema included). The
app refuses to start listening beyond loopback without one.

No `from __future__ import annotations` here: FastAPI reads the routes' annotations at run time,
inside the replica, where string annotations of a class Serve pickled by value do not resolve.
"""


import asyncio
import contextlib
import json
import logging
import os
import secrets
import time
from dataclasses import dataclass, field

import ray
from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from ray import serve
from ray.util import metrics
from starlette.exceptions import HTTPException as StarletteHTTPException

from writescope.actors.engine_group import engine_bundle
from writescope.actors.gpu_worker import QueueFullError
from writescope.actors.openai_protocol import (
    ChatRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    chat_logprobs,
    completion_logprobs,
    refused_parameter,
)
from writescope.chat import load_chat_template, load_generation_defaults
from writescope.config import FIELD_NAMES, EngineConfig
from writescope.engine import INTERNAL_ERROR, INVALID_REQUEST

log = logging.getLogger(__name__)
LOOPBACK = ("127.0.0.1", "localhost", "::1")
# OpenAIIngress's own keyword arguments; the rest of an app's args are EngineConfig's fields.
INGRESS_ARGS = ("max_queue", "api_key_env", "served_model_name", "max_body_bytes", "chat_template")
APP_ARGS = (*FIELD_NAMES, *INGRESS_ARGS)
FINISH = {"eos": "stop", "stop": "stop", "length": "length", "abort": "abort"}
HEALTH_TIMEOUT_S = 2.0  # a GPU worker that Ray is restarting does not answer sooner (its calls wait)
RETRY_AFTER_S = 5  # what a client is told to wait while the engine restarts
UNAVAILABLE_MESSAGE = "the engine is restarting: retry the request"


def default_max_body_bytes(max_seq_len: int) -> int:
    """Room for a prompt of max_seq_len tokens written as generously as JSON allows (token ids, or
    text with escapes), plus the other fields; anything larger cannot be a prompt that fits."""
    return 64 * 1024 + 32 * max_seq_len


_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                413: "invalid_request_error", 422: "invalid_request_error", 429: "rate_limit_exceeded",
                500: "server_error", 503: "server_error"}


def _error_body(status: int, message: str, kind: str | None = None, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind or _ERROR_TYPES.get(status, "invalid_request_error"),
                      "param": param, "code": status}}


def _error(status: int, message: str, kind: str | None = None, headers=None, param: str | None = None) -> JSONResponse:
    return JSONResponse(_error_body(status, message, kind, param), status_code=status, headers=headers)


def _unavailable() -> JSONResponse:
    return _error(503, UNAVAILABLE_MESSAGE, headers={"Retry-After": str(RETRY_AFTER_S)})


app = FastAPI(title="WriteScope", description="OpenAI-compatible completions on WriteScope")


@dataclass(frozen=True)
class GateSettings:
    """What the replica's gate enforces before a route runs (set by OpenAIIngress.__init__)."""

    api_key: str | None
    max_body_bytes: int
    node_id: str = ""  # the Ray node of this replica and its engine group


NODE_HEADER = "x-writescope-node"


class RequestGate:
    """ASGI middleware in front of every route: the API key (every path but /health), then the
    body limit. A body announced larger than the limit is refused from its Content-Length before a
    byte is read; a body without one is counted as it arrives and refused at the limit. Every
    answer carries the Ray node that served it (NODE_HEADER): with several replicas, which one
    answered."""

    open_paths = ("/health",)

    def __init__(self, asgi_app):
        self.app = asgi_app

    async def __call__(self, scope, receive, send):
        settings: GateSettings | None = getattr(scope.get("app", app).state, "gate", None)
        if scope["type"] != "http" or settings is None:
            return await self.app(scope, receive, send)
        send = _with_header(send, NODE_HEADER, settings.node_id)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        if settings.api_key is not None and _route(scope) not in self.open_paths \
                and not secrets.compare_digest(headers.get("authorization", "").encode(),
                                               f"Bearer {settings.api_key}".encode()):
            return await _send(send, 401, _error_body(401, "missing or wrong API key: send 'Authorization: Bearer "
                                                           "KEY'"), {"www-authenticate": "Bearer"})
        declared = headers.get("content-length", "")
        if declared.isdigit() and int(declared) > settings.max_body_bytes:
            return await _send(send, 413, _too_large(int(declared), settings.max_body_bytes))
        return await self.app(scope, _limited(receive, settings.max_body_bytes), send)


def _with_header(send, name: str, value: str):
    """send() that adds one header to the response's start."""
    extra = (name.encode("latin-1"), value.encode("latin-1"))

    async def send_with_header(message):
        if message["type"] == "http.response.start":
            message = {**message, "headers": [*message.get("headers", []), extra]}
        await send(message)

    return send_with_header


def _route(scope) -> str:
    path, root = scope.get("path", ""), scope.get("root_path", "")
    return path[len(root):] if root and path.startswith(root) else path


def _too_large(size: int, limit: int, param: str | None = None) -> dict:
    return _error_body(413, f"the request body has {size} bytes or more; the limit is {limit} (max_body_bytes, "
                            f"sized from max_seq_len)", param=param)


def _limited(receive, limit: int):
    """receive() that refuses a body growing past limit bytes (FastAPI re-raises an HTTPException
    raised while it reads the body)."""
    received = 0

    async def receive_within_limit():
        nonlocal received
        message = await receive()
        if message["type"] == "http.request":
            received += len(message.get("body", b""))
            if received > limit:
                raise HTTPException(413, _too_large(received, limit)["error"]["message"])
        return message

    return receive_within_limit


async def _send(send, status: int, body: dict, headers: dict | None = None) -> None:
    payload = json.dumps(body).encode()
    raw_headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
    raw_headers += [(k.encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw_headers})
    await send({"type": "http.response.body", "body": payload})


app.add_middleware(RequestGate)


@app.exception_handler(RequestValidationError)
async def _invalid_body(request: Request, error: RequestValidationError):
    problems, params = [], []
    for e in error.errors():
        where = ".".join(str(p) for p in e["loc"][1:]) or "body"
        if e.get("type") == "json_invalid":
            problems.append(f"the body is not valid JSON at character {where}: {e.get('ctx', {}).get('error', '')}")
        elif e.get("type") == "value_error" and where == "body":  # a model validator's message names its field
            problems.append(e["msg"].removeprefix("Value error, "))
        else:
            problems.append(f"{where}: {e['msg']}")
            params.append(where)
    return _error(400, "; ".join(problems) or "invalid request body", param=params[0] if params else None)


@app.exception_handler(StarletteHTTPException)
async def _http_error(request: Request, error: StarletteHTTPException):
    message = str(error.detail)
    if error.status_code == 400 and message == "There was an error parsing the body":  # FastAPI's words
        message = "the body could not be parsed: it must be JSON in UTF-8, nested no deeper than Python's limit"
    return _error(error.status_code, message, headers=error.headers)


@app.exception_handler(Exception)
async def _internal_error(request: Request, error: Exception):
    log.exception("unhandled error on %s", request.url.path)  # the details stay in the replica's log
    return _error(500, "internal server error: the server's log has the details")


# vLLM's histogram buckets, so dashboards built for vLLM read these the same way
TTFT_BUCKETS_S = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                  40.0, 80.0, 160.0, 640.0, 2560.0]
ITL_BUCKETS_S = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
                 80.0]
REQUEST_BUCKETS_S = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                     480.0, 960.0, 1920.0, 7680.0]


class _Metrics:
    """Through Ray's metrics API: each node's metrics agent exports them in Prometheus text on the
    node's metrics export port (`ray start --metrics-export-port`), with Ray's `ray_` prefix. The
    names after `writescope_` are vLLM's (vllm:time_to_first_token_seconds, ...)."""

    def __init__(self):
        self.requests = metrics.Counter("writescope_requests_total", "HTTP generation requests by route and status",
                                        tag_keys=("route", "status"))
        self.ttft = metrics.Histogram("writescope_time_to_first_token_seconds", "arrival to the first token",
                                      boundaries=TTFT_BUCKETS_S)
        self.itl = metrics.Histogram("writescope_inter_token_latency_seconds", "between a request's tokens",
                                     boundaries=ITL_BUCKETS_S)
        self.e2e = metrics.Histogram("writescope_e2e_request_latency_seconds", "arrival to the last token",
                                     boundaries=REQUEST_BUCKETS_S)
        self.queue = metrics.Histogram("writescope_request_queue_time_seconds", "waiting for KV capacity",
                                       boundaries=REQUEST_BUCKETS_S)
        self.prompt_tokens = metrics.Counter("writescope_prompt_tokens_total", "prompt tokens of admitted requests")
        self.generation_tokens = metrics.Counter("writescope_generation_tokens_total", "tokens generated")
        self.finished = metrics.Counter("writescope_request_success_total", "finished requests by finish reason",
                                        tag_keys=("finished_reason",))
        self.prefix_queries = metrics.Counter("writescope_prefix_cache_queries_total",
                                              "prompt tokens looked up in the prefix cache")
        self.prefix_hits = metrics.Counter("writescope_prefix_cache_hits_total",
                                           "prompt tokens found in the prefix cache (not prefilled)")
        self.share = metrics.Gauge("writescope_cpu_share", "r*: the CPU share of the running batch's KV")
        self.waiting = metrics.Gauge("writescope_num_requests_waiting", "requests waiting for KV capacity")
        self.running = metrics.Gauge("writescope_num_requests_running", "sequences holding KV")
        self.usage = metrics.Gauge("writescope_kv_cache_usage_perc", "fraction of a KV region's blocks in use",
                                   tag_keys=("region",))

    def update(self, state: dict) -> None:
        if state.get("cpu_share_now") is not None:
            self.share.set(state["cpu_share_now"])
        self.waiting.set(state["waiting"])
        self.running.set(state["running_seqs"])
        for region, value in state["occupancy"].items():
            self.usage.set(value, tags={"region": region})


class _RequestTimer:
    """One request's latencies as its events pass the ingress: TTFT on its first token, the gaps
    between tokens, e2e and its finish reason on its last event, its queue time as the engine
    measured it."""

    def __init__(self, recorder: _Metrics, arrival_s: float, prompt_tokens: int):
        self.recorder, self.arrival_s, self.last_s, self.prompt_tokens = recorder, arrival_s, None, prompt_tokens
        self.cached_tokens = 0  # prompt tokens the prefix cache had, from the first token's event

    def observe(self, event) -> None:
        now = time.monotonic()
        if event.token_id >= 0:
            if self.last_s is None:
                self.recorder.ttft.observe(now - self.arrival_s)
            else:
                self.recorder.itl.observe(max(now - self.last_s, 1e-9))
            self.last_s = now
            self.recorder.generation_tokens.inc()
        if event.queue_s is not None:
            self.recorder.queue.observe(max(event.queue_s, 1e-9))
        if event.cached_tokens is not None:
            self.cached_tokens = event.cached_tokens
            self.recorder.prefix_queries.inc(self.prompt_tokens)
            if event.cached_tokens:
                self.recorder.prefix_hits.inc(event.cached_tokens)
        if event.finish_reason is not None:
            self.recorder.e2e.observe(now - self.arrival_s)
            self.recorder.finished.inc(tags={"finished_reason": FINISH.get(event.finish_reason, event.finish_reason)})


def _http_host() -> str:
    """The host Serve's HTTP proxies bind, from the controller ("unknown" if it cannot be read)."""
    try:
        from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE

        controller = ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
        return ray.get(controller.get_http_config.remote(), timeout=30).host
    except Exception as error:  # noqa: BLE001 - unknown counts as beyond loopback: a key is then required
        log.warning("could not read Serve's HTTP host (%s): requiring an API key", error)
        return "unknown"


_EVENT_STATUS = {INVALID_REQUEST: 400, INTERNAL_ERROR: 500}

def _data(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"


@dataclass
class _Reply:
    """How one request's answer is written: its id and kind (chat or completion), its prompt's
    length for usage, the tokenizer for logprobs' token texts, the prompt's text when echoed."""

    completion_id: str
    model: str
    chat: bool
    prompt_tokens: int
    tokenizer: object
    echo: str | None = None
    created: int = field(default_factory=lambda: int(time.time()))

    def _usage(self, completion_tokens: int, cached_tokens: int) -> dict:
        """OpenAI's usage; prompt_tokens_details.cached_tokens: the prompt tokens reused, not prefilled."""
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": self.prompt_tokens + completion_tokens,
                "prompt_tokens_details": {"cached_tokens": cached_tokens}}

    def _logprobs(self, token_ids: list[int], logprobs: list, text_start: int):
        if not logprobs:
            return None
        if self.chat:
            return chat_logprobs(self.tokenizer, token_ids, logprobs)
        return completion_logprobs(self.tokenizer, token_ids, logprobs, text_start)

    def whole(self, tokens: list[int], text: str, logprobs: list, finish: str | None, cached_tokens: int) -> dict:
        choice = {"index": 0, "finish_reason": FINISH.get(finish, finish), "token_ids": tokens,
                  "logprobs": self._logprobs(tokens, logprobs, len(self.echo or ""))}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = (self.echo or "") + text
        return {"id": self.completion_id, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": [choice],
                "usage": self._usage(len(tokens), cached_tokens)}

    def chunk(self, text: str, token_ids: list[int], logprobs, finish: str | None) -> dict:
        finish = FINISH.get(finish, finish)
        entry = self._logprobs(token_ids, [logprobs] if logprobs is not None else [], 0)
        if self.chat:
            choice = {"index": 0, "delta": {"role": "assistant", "content": text}, "finish_reason": finish,
                      "token_ids": token_ids, "logprobs": entry}
        else:
            choice = {"index": 0, "text": text, "finish_reason": finish, "logprobs": entry, "token_ids": token_ids}
        return {"id": self.completion_id, "object": self._chunk_object, "created": self.created,
                "model": self.model, "choices": [choice]}

    def usage_chunk(self, completion_tokens: int, cached_tokens: int) -> dict:
        """stream_options.include_usage: the last chunk, with no choices and the request's usage."""
        return {"id": self.completion_id, "object": self._chunk_object, "created": self.created,
                "model": self.model, "choices": [], "usage": self._usage(completion_tokens, cached_tokens)}

    @property
    def _chunk_object(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"
  # anything else: the engine is unavailable (503)


# Serve pickles the ingress class when it is decorated: everything it calls is defined above.
@serve.deployment(name="OpenAIIngress", max_ongoing_requests=256)
@serve.ingress(app)
class OpenAIIngress:
    def __init__(self, max_queue: int = 64, api_key_env: str = "WRITESCOPE_API_KEY",
                 served_model_name: str | None = None, max_body_bytes: int | None = None,
                 chat_template: str | None = None, **engine_fields):
        """engine_fields: EngineConfig's fields (model, policy, max_seq_len, hot_experts, ...), with
        its defaults; the rest are the app's own. chat_template: a Jinja template (a file's path,
        or its text) replacing the checkpoint's."""
        from writescope.actors.ray_engine import RayEngine

        config = EngineConfig.from_mapping(engine_fields)
        api_key = os.environ.get(api_key_env) or None
        host = _http_host()
        if host not in LOOPBACK and api_key is None:
            raise ValueError(f"Serve listens on {host!r}, beyond loopback: set an API key in ${api_key_env} "
                             f"(clients send 'Authorization: Bearer KEY'), or bind 127.0.0.1")
        max_body_bytes = default_max_body_bytes(config.max_seq_len) if max_body_bytes is None else max_body_bytes
        if max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes must be >= 1024, got {max_body_bytes}")
        app.state.gate = GateSettings(api_key, max_body_bytes, ray.get_runtime_context().get_node_id())
        self.model_name = served_model_name or os.path.basename(config.model.rstrip("/"))
        self.chat_template = load_chat_template(config.model, chat_template)
        self.sampling_defaults = load_generation_defaults(config.model).sampling
        self.engine = RayEngine.from_pretrained(config=config, max_waiting=max_queue)
        self.tokenizer = self.engine.prompts.tokenizer
        self._metrics = _Metrics()
        self._poller = None

    async def check_health(self):
        """Serve's own check of the replica (every health_check_period_s): an engine lost for good
        (its region owner gone) fails it, so Serve replaces the replica and its engine group; a GPU
        worker that Ray is restarting does not."""
        if await self.engine.lost(timeout_s=HEALTH_TIMEOUT_S * 5):
            raise RuntimeError(f"the engine on node {self.engine.node_id} is lost: its region owner is gone")

    # ------------------------------------------------------------------ routes
    @app.get("/health")
    async def health(self):
        """200 when the engine answers; 503 with Retry-After while it starts or restarts."""
        try:
            await asyncio.wait_for(self.engine.gpu_worker.check_health.remote(), timeout=HEALTH_TIMEOUT_S)
        except Exception as error:  # noqa: BLE001 - unreachable, restarting, or its loop failed: not ready
            log.warning("health check failed: %s", error)
            return _unavailable()
        self._start_metrics()
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models(self):
        return {"object": "list", "data": [self._model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(self, model_id: str):
        if model_id != self.model_name:
            return self._not_served(model_id)
        return self._model_card()

    @app.post("/v1/completions")
    async def completions(self, body: CompletionRequest):
        return await self._answer(body.prompt, body, body.max_tokens, chat=False, arrival_s=time.monotonic())

    @app.post("/v1/chat/completions")
    async def chat_completions(self, body: ChatRequest):
        arrival_s = time.monotonic()
        max_tokens = body.max_completion_tokens or body.max_tokens or 256
        rendered = self._render(body)
        if isinstance(rendered, JSONResponse):
            return rendered
        return await self._answer(rendered, body, max_tokens, chat=True, arrival_s=arrival_s)

    @app.post("/tokenize")
    async def tokenize(self, body: TokenizeRequest):
        """vLLM's: the ids of a prompt, or of chat messages as the chat template renders them."""
        if body.model != self.model_name:
            return self._not_served(body.model)
        text = body.prompt
        if body.messages is not None:
            text = self._render(body)
            if isinstance(text, JSONResponse):
                return text
        special = body.add_special_tokens if body.add_special_tokens is not None else body.messages is None
        try:
            ids = await asyncio.to_thread(self.engine.prompts.encode, text, 0, 0, special)
        except ValueError as error:
            return _error(400, str(error), param="messages" if body.messages is not None else "prompt")
        answer = {"count": len(ids), "max_model_len": self.engine.max_seq_len, "tokens": ids}
        if body.return_token_strs:
            answer["token_strs"] = [self.tokenizer.id_to_token(i) for i in ids] if self.tokenizer else []
        return answer

    @app.post("/detokenize")
    async def detokenize(self, body: DetokenizeRequest):
        if body.model != self.model_name:
            return self._not_served(body.model)
        vocab = self.engine.prompts.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            return _error(400, f"tokens holds ids outside [0, {vocab}): {bad[:5]}", param="tokens")
        if self.tokenizer is None:
            return _error(400, "this checkpoint has no tokenizer.json: there is no text to give", param="tokens")
        text = await asyncio.to_thread(self.tokenizer.decode, body.tokens, skip_special_tokens=False)
        return {"prompt": text}

    # ------------------------------------------------------------------ helpers
    def _model_card(self) -> dict:
        return {"id": self.model_name, "object": "model", "created": 0, "owned_by": "writescope",
                "max_model_len": self.engine.max_seq_len}

    def _not_served(self, name: str) -> JSONResponse:
        return _error(404, f"model {name!r} is not served here; served: {self.model_name!r}", "model_not_found",
                      param="model")

    def _render(self, body):
        """The chat prompt's text from the chat template, or a 400 (no template, or it refused)."""
        if self.chat_template is None:
            return _error(400, "this model has no chat template (neither chat_template.jinja nor a chat_template "
                               "in tokenizer_config.json) and the app was given none (app arg chat_template): use "
                               "/v1/completions, or give a template", param="messages")
        try:
            return self.chat_template.render([m.for_template() for m in body.messages], body.add_generation_prompt,
                                             **(body.chat_template_kwargs or {}))
        except ValueError as error:
            return _error(400, str(error), param="messages")

    async def _answer(self, prompt, body, max_tokens: int, chat: bool, arrival_s: float):
        self._start_metrics()
        route = "chat" if chat else "completions"
        response = await self._submit(prompt, body, max_tokens, chat)
        if isinstance(response, JSONResponse):
            self._metrics.requests.inc(tags={"route": route, "status": str(response.status_code)})
            return response
        submitted = response
        self._metrics.requests.inc(tags={"route": route, "status": "200"})
        self._metrics.prompt_tokens.inc(submitted["prompt_tokens"])  # >= 1: the encoder refuses empty prompts
        timer = _RequestTimer(self._metrics, arrival_s, submitted["prompt_tokens"])
        reply = _Reply(f"{'chatcmpl' if chat else 'cmpl'}-{secrets.token_hex(12)}", self.model_name, chat,
                       submitted["prompt_tokens"], self.tokenizer,
                       echo=self._echo_text(prompt) if getattr(body, "echo", False) else None)
        events = self.engine.stream(submitted["id"])
        if body.stream:
            return StreamingResponse(self._sse(events, reply, timer, body.include_usage),
                                     media_type="text/event-stream")
        return await self._complete(events, reply, timer)

    def _echo_text(self, prompt) -> str:
        if isinstance(prompt, str):
            return prompt
        return self.tokenizer.decode(prompt, skip_special_tokens=False) if self.tokenizer else ""

    async def _submit(self, prompt, body, max_tokens: int, chat: bool):
        """{"id", "prompt_tokens"} of the queued request, or the error response."""
        if body.model != self.model_name:
            return self._not_served(body.model)
        refused = refused_parameter(body)
        if refused is not None:
            return _error(400, refused[1], param=refused[0])
        try:
            params = body.params(max_tokens, self.sampling_defaults, body.num_logprobs if chat else body.logprobs)
        except ValueError as error:
            return _error(400, str(error))
        try:
            return await self.engine.submit_request(prompt, params, add_special_tokens=not chat)
        except QueueFullError as error:
            return _error(429, str(error), headers={"Retry-After": str(error.retry_after_s)})
        except ValueError as error:  # the prompt: too long, bad ids, not tokenisable (our own messages)
            return _error(400, str(error), param="messages" if chat else "prompt")
        except Exception as error:  # noqa: BLE001 - the engine is failing or restarting
            log.warning("submit failed: %s", error)
            return _unavailable()

    async def _complete(self, events, reply: _Reply, timer: _RequestTimer):
        tokens, text, logprobs, finish = [], [], [], None
        try:
            async for event in events:
                timer.observe(event)
                if event.finish_reason == "error":
                    status = _EVENT_STATUS.get(event.error_kind, 503)
                    return _error(status, event.error,
                                  headers={"Retry-After": str(RETRY_AFTER_S)} if status == 503 else None)
                if event.token_id >= 0:
                    tokens.append(event.token_id)
                    text.append(event.text)
                    if event.logprobs is not None:
                        logprobs.append(event.logprobs)
                finish = event.finish_reason
        except Exception as error:  # noqa: BLE001 - the GPU worker died during generation
            log.warning("generation %s lost: %s", reply.completion_id, error)
            return _unavailable()
        return reply.whole(tokens, "".join(text), logprobs, finish, timer.cached_tokens)

    async def _sse(self, events, reply: _Reply, timer: _RequestTimer, include_usage: bool):
        """The stream's chunks, then the usage chunk when asked; whatever ends it early (an error
        event, the GPU worker's death) is sent as an error event, and every stream ends with
        `data: [DONE]`."""
        completion_tokens, finished = 0, False
        try:
            if reply.echo:
                yield _data(reply.chunk(reply.echo, [], None, None))
            async for event in events:
                timer.observe(event)
                if event.finish_reason == "error":
                    status = _EVENT_STATUS.get(event.error_kind, 503)
                    yield _data(_error_body(status, event.error))
                    break
                token_ids = [event.token_id] if event.token_id >= 0 else []
                completion_tokens += len(token_ids)
                yield _data(reply.chunk(event.text, token_ids, event.logprobs, event.finish_reason))
                finished = event.finish_reason is not None
        except Exception as error:  # noqa: BLE001 - the engine died mid-stream: the client is told so
            log.warning("stream %s lost: %s", reply.completion_id, error)
            yield _data(_error_body(503, UNAVAILABLE_MESSAGE))
        finally:
            with contextlib.suppress(Exception):
                await events.aclose()  # a client that went away cancels its request
        if include_usage and finished:
            yield _data(reply.usage_chunk(completion_tokens, timer.cached_tokens))
        yield "data: [DONE]\n\n"

    def _start_metrics(self) -> None:
        if self._poller is None:
            self._poller = asyncio.get_running_loop().create_task(self._poll_metrics())

    async def _poll_metrics(self) -> None:
        while True:
            with contextlib.suppress(Exception):
                state = await self.engine.gpu_worker.state.remote()
                self._metrics.update(state)
            await asyncio.sleep(2)

    def __del__(self):  # Serve calls it when the replica shuts down: the engine's actors and memory go too
        engine, self.engine = getattr(self, "engine", None), None
        if engine is not None:
            with contextlib.suppress(Exception):
                engine.shutdown()


def build_app(args: dict) -> serve.Application:
    """The application builder (`import_path: writescope.actors.serve_app:build_app`); args are
    EngineConfig's fields (model, policy, max_batch_size, max_seq_len, dtype, device, hot_experts,
    emulated_nodes, ...) and the ingress's own (max_queue, api_key_env, served_model_name,
    max_body_bytes). The engine's are checked here, before anything is deployed."""
    unknown = set(args) - set(APP_ARGS)
    if unknown:
        raise ValueError(f"unknown app args {sorted(unknown)}; allowed: {sorted(APP_ARGS)}")
    config = EngineConfig.from_mapping({k: v for k, v in args.items() if k in FIELD_NAMES})
    own = {k: int(v) if k in ("max_queue", "max_body_bytes") and v is not None else v
           for k, v in args.items() if k in INGRESS_ARGS}
    return ingress_deployment(config).bind(**own, **config.to_dict())


def ingress_deployment(config: EngineConfig, **options) -> serve.Deployment:
    """OpenAIIngress with each replica and its engine group in one placement-group bundle on one
    node: Serve places them together and replaces both when their node goes, so N replicas
    (`num_replicas`, an `autoscaling_config`, in options or serve.yaml) are N engines."""
    return OpenAIIngress.options(placement_group_bundles=[engine_bundle(config)],
                                 placement_group_strategy="STRICT_PACK", ray_actor_options={"num_cpus": 0}, **options)
