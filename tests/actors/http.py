"""What the HTTP tests share: reading server-sent events, checking error bodies (free_port and
wait_healthy come from writescope.tools.local_serve)."""

import json


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
