"""tools/bench_prefill_interleave.py --http on a short context, against the Serve app on the session's
real local Ray through a real HTTP client: with chunks, the running stream's server-sent events keep
coming during the long prefill; whole, it waits for all of it."""

import json

import pytest

from writescope.tools import bench_prefill_interleave as bench

pytestmark = pytest.mark.ray


def test_over_http_a_running_stream_gets_tokens_during_another_requests_prefill(ray_cluster, tmp_path):
    out = tmp_path / "interleave_http.json"
    # 2048 tokens: the prefill (about 0.2 s here) well above what HTTP adds to the time to first token
    assert bench.main(["--http", "--context", "2048", "--chunks", "64", "2048", "--warm-tokens", "3",
                       "--short-tokens", "400", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["path"] == "http"
    chunked, whole = result["rows"]
    assert chunked["gaps_during_prefill"] >= 8  # about a token per chunk (32 chunks of 64)
    # whole: one stall holding most of the long prompt's time to first token (the rest is the ingress
    # reading its 2048 ids, while the short stream still gets tokens), and fewer gaps than with chunks
    assert whole["max_gap_during_prefill_s"] >= 0.5 * whole["long_ttft_s"]
    assert whole["gaps_during_prefill"] < chunked["gaps_during_prefill"]
    assert chunked["prefill_tok_s"] > 0 and whole["long_ttft_s"] > 0
