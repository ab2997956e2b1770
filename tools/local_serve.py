"""The Serve app on an embedded local Ray, on a free loopback port: what the HTTP tools (fuzz, soak)
run against when they are not pointed at a running server."""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import sys
import time

import requests

log = logging.getLogger(__name__)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(base_url: str, timeout_s: float = 300.0) -> None:
    """Returns once GET /health answers 200; RuntimeError past timeout_s."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(requests.RequestException):
            if requests.get(base_url + "/health", timeout=10).status_code == 200:
                return
        time.sleep(0.5)
    raise RuntimeError(f"{base_url} did not become healthy in {timeout_s:.0f} s")


def sse_payloads(response):
    """The `data:` payloads of a streamed (server-sent events) response as they arrive: each decoded
    from JSON, and "[DONE]" as it is."""
    for line in response.iter_lines(decode_unicode=True):
        if line.startswith("data: "):
            payload = line[len("data: "):]
            yield payload if payload == "[DONE]" else json.loads(payload)


@contextlib.contextmanager
def local_serve_app(app_args: dict, name: str = "writescope"):
    """Yields the base URL of the Serve app (build_app(app_args)) on 127.0.0.1, on an embedded local
    Ray unless this process already has one; Serve (and a Ray started here) are shut down after."""
    from writescope.actors.local_ray import start_local_ray

    started_here = not ("ray" in sys.modules and sys.modules["ray"].is_initialized())
    if started_here:
        start_local_ray()  # before Ray is imported here: it then binds loopback only
    import ray
    from ray import serve

    from writescope.actors.serve_app import build_app

    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        serve.run(build_app(app_args), name=name, route_prefix="/", blocking=False)
        base_url = f"http://127.0.0.1:{port}"
        wait_healthy(base_url)
        log.info("serving %s on %s", app_args.get("model"), base_url)
        yield base_url
    finally:
        serve.shutdown()
        if started_here:
            ray.shutdown()
