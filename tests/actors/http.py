"""What the HTTP tests share: a free loopback port, waiting for /health, reading server-sent events."""

import json
import socket
import time

import requests


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, timeout_s: float = 240) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if requests.get(url + "/health", timeout=10).status_code == 200:
                return
        except requests.RequestException:
            pass
        time.sleep(1)
    raise AssertionError(f"{url} did not become healthy in {timeout_s} s")


def sse_chunks(response, on_chunk=None) -> list:
    """The decoded `data:` payloads of a streamed response, ending with "[DONE]" if it came."""
    chunks = []
    for line in response.iter_lines(decode_unicode=True):
        if line.startswith("data: "):
            payload = line[len("data: "):]
            if on_chunk is not None:
                on_chunk()
            if payload == "[DONE]":
                chunks.append(payload)
                break
            chunks.append(json.loads(payload))
    return chunks


def assert_no_internals(text: str) -> None:
    """An error a client sees names what was wrong, never the server's insides."""
    for leak in ("Traceback", 'File "', "pid=", "actor_id", "site-packages", "ray::"):
        assert leak not in text, f"the response leaks {leak!r}: {text[:300]}"
