"""An OpenAI-compatible Ray Serve application over the engine's actors.

    serve run cluster_configs/serve.yaml
    serve run writescope.actors.serve_app:build_app model=tiny-qwen3-moe    # the same, from the command line

Routes: POST /v1/completions and /v1/chat/completions (both with "stream": true as server-sent
events), GET /v1/models, GET /health. The ingress (FastAPI inside Serve) holds a RayEngine: the GPU
worker's EngineService batches the requests of every caller together (continuous batching).

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
from dataclasses import dataclass
from typing import Literal

import ray
from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from ray import serve
from ray.util import metrics
from starlette.exceptions import HTTPException as StarletteHTTPException

from writescope.config import FIELD_NAMES, EngineConfig
from writescope.engine import INTERNAL_ERROR, INVALID_REQUEST
from writescope.prompts import check_unicode
from writescope.sampling import SEED_MAX, SEED_MIN, SamplingParams
from writescope.service import QueueFullError

log = logging.getLogger(__name__)
LOOPBACK = ("127.0.0.1", "localhost", "::1")
# OpenAIIngress's own keyword arguments; the rest of an app's args are EngineConfig's fields.
INGRESS_ARGS = ("max_queue", "api_key_env", "served_model_name", "max_body_bytes")
APP_ARGS = (*FIELD_NAMES, *INGRESS_ARGS)
FINISH = {"eos": "stop", "stop": "stop", "length": "length", "abort": "abort"}
HEALTH_TIMEOUT_S = 2.0  # a GPU worker that Ray is restarting does not answer sooner (its calls wait)
RETRY_AFTER_S = 5  # what a client is told to wait while the engine restarts
UNAVAILABLE_MESSAGE = "the engine is restarting: retry the request"


def default_max_body_bytes(max_seq_len: int) -> int:
    """Room for a prompt of max_seq_len tokens written as generously as JSON allows (token ids, or
    text with escapes), plus the other fields; anything larger cannot be a prompt that fits."""
    return 64 * 1024 + 32 * max_seq_len


class _Common(BaseModel):
    model_config = ConfigDict(extra="ignore")  # OpenAI clients send fields we do not use (user, ...)

    model: str = Field(max_length=256)
    temperature: float = Field(default=1.0, ge=0, le=2, allow_inf_nan=False)
    top_p: float = Field(default=1.0, gt=0, le=1, allow_inf_nan=False)
    stream: bool = False
    stop: str | list[str] | None = Field(default=None, description="non-empty strings")
    seed: int | None = Field(default=None, ge=SEED_MIN, le=SEED_MAX)
    n: int = Field(default=1, ge=1, le=1, description="one choice per request")

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data):
        return check_unicode(data)

    @field_validator("stop")
    @classmethod
    def _non_empty_stops(cls, stop):
        stops = [stop] if isinstance(stop, str) else stop or []
        if "" in stops:
            raise ValueError("stop holds an empty string, which would match at once: give non-empty strings")
        return stop

    def params(self, max_tokens: int) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        seed = self.seed if self.seed is not None else secrets.randbits(63)  # unseeded requests differ
        return SamplingParams(max_tokens, self.temperature, self.top_p, seed, tuple(stop))


class CompletionRequest(_Common):
    prompt: str | list[int] = Field(min_length=1)
    max_tokens: int = Field(default=16, ge=1)


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[TextPart]  # a string, or OpenAI's content parts (text only)

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)


class ChatRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)


def chat_prompt(messages: list[ChatMessage]) -> str:
    """A plain role-tagged transcript ending with the assistant's turn (the tiny presets have no
    chat template of their own)."""
    turns = "".join(f"<|{m.role}|>\n{m.text()}\n" for m in messages)
    return turns + "<|assistant|>\n"


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


class RequestGate:
    """ASGI middleware in front of every route: the API key (every path but /health), then the
    body limit. A body announced larger than the limit is refused from its Content-Length before a
    byte is read; a body without one is counted as it arrives and refused at the limit."""

    open_paths = ("/health",)

    def __init__(self, asgi_app):
        self.app = asgi_app

    async def __call__(self, scope, receive, send):
        settings: GateSettings | None = getattr(scope.get("app", app).state, "gate", None)
        if scope["type"] != "http" or settings is None:
            return await self.app(scope, receive, send)
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
    return _error(422, "; ".join(problems) or "invalid request body", param=params[0] if params else None)


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


class _Metrics:
    """Through Ray's metrics API (exported by each node's metrics agent, Prometheus format)."""

    def __init__(self):
        self.requests = metrics.Counter("writescope_requests_total", "HTTP generation requests by route and status",
                                        tag_keys=("route", "status"))
        self.tokens = metrics.Counter("writescope_generated_tokens_total", "tokens generated for HTTP requests")
        self.share = metrics.Gauge("writescope_cpu_share", "r*: the CPU share of the running batch's KV")
        self.waiting = metrics.Gauge("writescope_waiting_requests", "requests waiting for KV capacity")
        self.occupancy = metrics.Gauge("writescope_region_occupancy", "fraction of a KV region's blocks in use",
                                       tag_keys=("region",))

    def update(self, state: dict) -> None:
        if state.get("cpu_share_now") is not None:
            self.share.set(state["cpu_share_now"])
        self.waiting.set(state["waiting"])
        for region, value in state["occupancy"].items():
            self.occupancy.set(value, tags={"region": region})


def _http_host() -> str:
    """The host Serve's HTTP proxies bind, from the controller ("unknown" if it cannot be read)."""
    try:
        from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE

        controller = ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
        return ray.get(controller.get_http_config.remote(), timeout=30).host
    except Exception as error:  # noqa: BLE001 - unknown counts as beyond loopback: a key is then required
        log.warning("could not read Serve's HTTP host (%s): requiring an API key", error)
        return "unknown"


_EVENT_STATUS = {INVALID_REQUEST: 400, INTERNAL_ERROR: 500}  # anything else: the engine is unavailable (503)


# Serve pickles the ingress class when it is decorated: everything it calls is defined above.
@serve.deployment(name="OpenAIIngress", max_ongoing_requests=256)
@serve.ingress(app)
class OpenAIIngress:
    def __init__(self, max_queue: int = 64, api_key_env: str = "WRITESCOPE_API_KEY",
                 served_model_name: str | None = None, max_body_bytes: int | None = None, **engine_fields):
        """engine_fields: EngineConfig's fields (model, policy, max_seq_len, hot_experts, ...), with
        its defaults; the rest are the app's own."""
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
        app.state.gate = GateSettings(api_key, max_body_bytes)
        self.model_name = served_model_name or os.path.basename(config.model.rstrip("/"))
        self.engine = RayEngine.from_pretrained(config=config, max_waiting=max_queue)
        self._metrics = _Metrics()
        self._poller = None

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
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": 0,
                                             "owned_by": "writescope"}]}

    @app.post("/v1/completions")
    async def completions(self, body: CompletionRequest):
        return await self._answer(body.prompt, body, body.max_tokens, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(self, body: ChatRequest):
        max_tokens = body.max_completion_tokens or body.max_tokens or 256
        return await self._answer(chat_prompt(body.messages), body, max_tokens, chat=True)

    # ------------------------------------------------------------------ helpers
    async def _answer(self, prompt, body, max_tokens: int, chat: bool):
        self._start_metrics()
        route = "chat" if chat else "completions"
        response = await self._submit(prompt, body, max_tokens)
        if isinstance(response, JSONResponse):
            self._metrics.requests.inc(tags={"route": route, "status": str(response.status_code)})
            return response
        submitted = response
        self._metrics.requests.inc(tags={"route": route, "status": "200"})
        completion_id = f"{'chatcmpl' if chat else 'cmpl'}-{secrets.token_hex(12)}"
        events = self.engine.stream(submitted["id"])
        if body.stream:
            return StreamingResponse(self._sse(events, completion_id, chat), media_type="text/event-stream")
        return await self._complete(events, completion_id, chat, submitted["prompt_tokens"])

    async def _submit(self, prompt, body, max_tokens: int):
        """{"id", "prompt_tokens"} of the queued request, or the error response."""
        if body.model != self.model_name:
            return _error(404, f"model {body.model!r} is not served here; served: {self.model_name!r}",
                          "model_not_found", param="model")
        try:
            params = body.params(max_tokens)
        except ValueError as error:
            return _error(400, str(error))
        try:
            return await self.engine.submit_request(prompt, params)
        except QueueFullError as error:
            return _error(429, str(error), headers={"Retry-After": str(error.retry_after_s)})
        except ValueError as error:  # the prompt: too long, bad ids, not tokenisable (our own messages)
            return _error(400, str(error), param="messages" if isinstance(prompt, str) and
                          isinstance(body, ChatRequest) else "prompt")
        except Exception as error:  # noqa: BLE001 - the engine is failing or restarting
            log.warning("submit failed: %s", error)
            return _unavailable()

    async def _complete(self, events, completion_id: str, chat: bool, prompt_tokens: int):
        tokens, text, finish = [], [], None
        try:
            async for event in events:
                if event.finish_reason == "error":
                    status = _EVENT_STATUS.get(event.error_kind, 503)
                    return _error(status, event.error,
                                  headers={"Retry-After": str(RETRY_AFTER_S)} if status == 503 else None)
                if event.token_id >= 0:
                    tokens.append(event.token_id)
                    text.append(event.text)
                finish = event.finish_reason
        except Exception as error:  # noqa: BLE001 - the GPU worker died during generation
            log.warning("generation %s lost: %s", completion_id, error)
            return _unavailable()
        self._metrics.tokens.inc(len(tokens))
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": len(tokens),
                 "total_tokens": prompt_tokens + len(tokens)}
        choice = {"index": 0, "finish_reason": FINISH.get(finish, finish), "token_ids": tokens}
        if chat:
            choice["message"] = {"role": "assistant", "content": "".join(text)}
        else:
            choice.update(text="".join(text), logprobs=None)
        return {"id": completion_id, "object": "chat.completion" if chat else "text_completion",
                "created": int(time.time()), "model": self.model_name, "choices": [choice], "usage": usage}

    async def _sse(self, events, completion_id: str, chat: bool):
        """The stream's chunks; whatever ends it early (an error event, the GPU worker's death) is
        sent as an error event, and every stream ends with `data: [DONE]`."""
        created = int(time.time())
        try:
            async for event in events:
                if event.finish_reason == "error":
                    status = _EVENT_STATUS.get(event.error_kind, 503)
                    yield f"data: {json.dumps(_error_body(status, event.error))}\n\n"
                    break
                yield f"data: {json.dumps(self._chunk(event, completion_id, created, chat))}\n\n"
        except Exception as error:  # noqa: BLE001 - the engine died mid-stream: the client is told so
            log.warning("stream %s lost: %s", completion_id, error)
            yield f"data: {json.dumps(_error_body(503, UNAVAILABLE_MESSAGE))}\n\n"
        finally:
            with contextlib.suppress(Exception):
                await events.aclose()  # a client that went away cancels its request
        yield "data: [DONE]\n\n"

    def _chunk(self, event, completion_id: str, created: int, chat: bool) -> dict:
        finish = FINISH.get(event.finish_reason, event.finish_reason)
        token_ids = [event.token_id] if event.token_id >= 0 else []
        self._metrics.tokens.inc(len(token_ids))
        if chat:
            choice = {"index": 0, "delta": {"role": "assistant", "content": event.text}, "finish_reason": finish,
                      "token_ids": token_ids}
        else:
            choice = {"index": 0, "text": event.text, "finish_reason": finish, "logprobs": None,
                      "token_ids": token_ids}
        return {"id": completion_id, "object": "chat.completion.chunk" if chat else "text_completion",
                "created": created, "model": self.model_name, "choices": [choice]}

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
    engine_fields = EngineConfig.from_mapping({k: v for k, v in args.items() if k in FIELD_NAMES}).to_dict()
    own = {k: int(v) if k in ("max_queue", "max_body_bytes") and v is not None else v
           for k, v in args.items() if k in INGRESS_ARGS}
    return OpenAIIngress.bind(**own, **engine_fields)
