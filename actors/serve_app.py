"""An OpenAI-compatible Ray Serve application over the engine's actors.

    serve run cluster_configs/serve.yaml
    serve run writescope.actors.serve_app:build_app model=tiny-qwen3-moe    # the same, from the command line

Routes: POST /v1/completions and /v1/chat/completions (both with "stream": true as server-sent
events), GET /v1/models, GET /health. The ingress (FastAPI inside Serve) holds a RayEngine: the GPU
worker's EngineService batches the requests of every caller together (continuous batching).

Admission: a request waits for KV capacity in the GPU worker's queue; when max_queue requests
already wait, the answer is 429 with Retry-After, and the requests already admitted finish. Bad
bodies get 400/422 with a message (OpenAI's error shape), never a 500.

Serve's HTTP is outside Ray's token authentication: bind 127.0.0.1 (the default here), and set an
API key (the environment variable named by api_key_env): clients send `Authorization: Bearer KEY`,
as OpenAI clients do. The app refuses to start listening beyond loopback without one.

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
from typing import Literal

import ray
from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from ray import serve
from ray.util import metrics

from writescope.engine import SamplingParams
from writescope.service import QueueFullError

log = logging.getLogger(__name__)
LOOPBACK = ("127.0.0.1", "localhost", "::1")
APP_ARGS = ("model", "policy", "max_batch_size", "max_seq_len", "max_queue", "api_key_env", "dtype", "device",
            "emulated_nodes", "served_model_name")  # OpenAIIngress's keyword arguments
FINISH = {"eos": "stop", "stop": "stop", "length": "length", "abort": "abort"}


class _Common(BaseModel):
    model_config = ConfigDict(extra="ignore")  # OpenAI clients send fields we do not use (user, ...)

    model: str
    temperature: float = Field(default=1.0, ge=0, le=2)
    top_p: float = Field(default=1.0, gt=0, le=1)
    stream: bool = False
    stop: str | list[str] | None = None
    seed: int | None = None
    n: int = Field(default=1, ge=1, le=1, description="one choice per request")

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


def _error(status: int, message: str, kind: str = "invalid_request_error", headers=None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}}, status_code=status,
                        headers=headers)


app = FastAPI(title="WriteScope", description="OpenAI-compatible completions on WriteScope")


@app.exception_handler(RequestValidationError)
async def _invalid_body(request: Request, error: RequestValidationError):
    problems = "; ".join(f"{'.'.join(str(p) for p in e['loc'][1:]) or 'body'}: {e['msg']}" for e in error.errors())
    return _error(422, problems or "invalid request body")


@app.exception_handler(HTTPException)
async def _http_error(request: Request, error: HTTPException):
    return _error(error.status_code, str(error.detail), headers=error.headers)


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
        import ray
        from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE

        controller = ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
        return ray.get(controller.get_http_config.remote(), timeout=30).host
    except Exception as error:  # noqa: BLE001 - unknown counts as beyond loopback: a key is then required
        log.warning("could not read Serve's HTTP host (%s): requiring an API key", error)
        return "unknown"


# Serve pickles the ingress class when it is decorated: everything it calls is defined above.
@serve.deployment(name="OpenAIIngress", max_ongoing_requests=256)
@serve.ingress(app)
class OpenAIIngress:
    def __init__(self, model: str = "tiny-qwen3-moe", policy: str = "writescope", max_batch_size: int = 8,
                 max_seq_len: int = 32768, max_queue: int = 64, api_key_env: str = "WRITESCOPE_API_KEY",
                 dtype: str | None = None, device: str = "cpu", emulated_nodes: int | None = None,
                 served_model_name: str | None = None):
        from writescope.engine import Engine
        from writescope.topology import emulated_topology, topology

        self.api_key = os.environ.get(api_key_env) or None
        host = _http_host()
        if host not in LOOPBACK and self.api_key is None:
            raise ValueError(f"Serve listens on {host!r}, beyond loopback: set an API key in ${api_key_env} "
                             f"(clients send 'Authorization: Bearer KEY'), or bind 127.0.0.1")
        self.model_name = served_model_name or os.path.basename(model.rstrip("/"))
        nodes = emulated_topology(emulated_nodes) if emulated_nodes else topology()
        self.engine = Engine.from_pretrained(model, policy=policy, executor="ray", max_batch_size=max_batch_size,
                                             max_seq_len=max_seq_len, dtype=dtype, device=device,
                                             executor_options={"nodes": nodes, "max_waiting": max_queue})
        self._metrics = _Metrics()
        self._poller = None

    # ------------------------------------------------------------------ routes
    @app.get("/health")
    async def health(self):
        await self.engine.gpu_worker.check_health.remote()
        self._start_metrics()
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models(self, request: Request):
        self._authorize(request)
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": 0,
                                             "owned_by": "writescope"}]}

    @app.post("/v1/completions")
    async def completions(self, body: CompletionRequest, request: Request):
        self._authorize(request)
        return await self._answer(body.prompt, body.params(body.max_tokens), body, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(self, body: ChatRequest, request: Request):
        self._authorize(request)
        max_tokens = body.max_completion_tokens or body.max_tokens or 256
        return await self._answer(chat_prompt(body.messages), body.params(max_tokens), body, chat=True)

    # ------------------------------------------------------------------ helpers
    def _authorize(self, request: Request) -> None:
        if self.api_key is None:
            return
        given = request.headers.get("authorization", "")
        if not secrets.compare_digest(given.encode(), f"Bearer {self.api_key}".encode()):
            raise HTTPException(401, "missing or wrong API key: send 'Authorization: Bearer KEY'",
                                headers={"WWW-Authenticate": "Bearer"})

    async def _answer(self, prompt, params: SamplingParams, body, chat: bool):
        self._start_metrics()
        route = "chat" if chat else "completions"
        if body.model != self.model_name:
            self._metrics.requests.inc(tags={"route": route, "status": "404"})
            return _error(404, f"model {body.model!r} is not served here; served: {self.model_name!r}",
                          "model_not_found")
        try:
            submitted = await self.engine.submit_request(prompt, params)
        except QueueFullError as error:
            self._metrics.requests.inc(tags={"route": route, "status": "429"})
            return _error(429, str(error), "rate_limit_exceeded", headers={"Retry-After": str(error.retry_after_s)})
        except ValueError as error:
            self._metrics.requests.inc(tags={"route": route, "status": "400"})
            return _error(400, str(error))
        except (RuntimeError, ray.exceptions.RayError) as error:  # the engine is failing or restarting
            self._metrics.requests.inc(tags={"route": route, "status": "503"})
            return _error(503, f"the engine is unavailable, retry later: {error}", "server_error",
                          headers={"Retry-After": "5"})
        self._metrics.requests.inc(tags={"route": route, "status": "200"})
        completion_id = f"{'chatcmpl' if chat else 'cmpl'}-{secrets.token_hex(12)}"
        events = self.engine.stream(submitted["id"])
        if body.stream:
            return StreamingResponse(self._sse(events, completion_id, chat), media_type="text/event-stream")
        tokens, text, finish = [], [], None
        try:
            async for event in events:
                if event.finish_reason == "error":
                    return _error(503, f"generation failed: {event.error}", "server_error")
                if event.token_id >= 0:
                    tokens.append(event.token_id)
                    text.append(event.text)
                finish = event.finish_reason
        except ray.exceptions.RayError as error:
            return _error(503, f"the engine failed during generation, retry: {error}", "server_error",
                          headers={"Retry-After": "5"})
        self._metrics.tokens.inc(len(tokens))
        usage = {"prompt_tokens": submitted["prompt_tokens"], "completion_tokens": len(tokens),
                 "total_tokens": submitted["prompt_tokens"] + len(tokens)}
        choice = {"index": 0, "finish_reason": FINISH.get(finish, finish), "token_ids": tokens}
        if chat:
            choice["message"] = {"role": "assistant", "content": "".join(text)}
        else:
            choice.update(text="".join(text), logprobs=None)
        return {"id": completion_id, "object": "chat.completion" if chat else "text_completion",
                "created": int(time.time()), "model": self.model_name, "choices": [choice], "usage": usage}

    async def _sse(self, events, completion_id: str, chat: bool):
        created = int(time.time())
        try:
            async for event in events:
                if event.finish_reason == "error":
                    yield f"data: {json.dumps({'error': {'message': event.error, 'type': 'server_error'}})}\n\n"
                    break
                finish = FINISH.get(event.finish_reason, event.finish_reason)
                token_ids = [event.token_id] if event.token_id >= 0 else []
                self._metrics.tokens.inc(len(token_ids))
                if chat:
                    choice = {"index": 0, "delta": {"role": "assistant", "content": event.text},
                              "finish_reason": finish, "token_ids": token_ids}
                else:
                    choice = {"index": 0, "text": event.text, "finish_reason": finish, "logprobs": None,
                              "token_ids": token_ids}
                chunk = {"id": completion_id, "object": "chat.completion.chunk" if chat else "text_completion",
                         "created": created, "model": self.model_name, "choices": [choice]}
                yield f"data: {json.dumps(chunk)}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            with contextlib.suppress(Exception):
                await events.aclose()  # a client that went away cancels its request

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
    OpenAIIngress's keyword arguments (model, policy, max_batch_size, max_seq_len, max_queue,
    api_key_env, dtype, device, emulated_nodes, served_model_name)."""
    allowed = set(APP_ARGS)
    unknown = set(args) - allowed
    if unknown:
        raise ValueError(f"unknown app args {sorted(unknown)}; allowed: {sorted(allowed)}")
    integers = {"max_batch_size", "max_seq_len", "max_queue", "emulated_nodes"}
    typed = {k: int(v) if k in integers and v is not None else v for k, v in args.items()}
    return OpenAIIngress.bind(**typed)
