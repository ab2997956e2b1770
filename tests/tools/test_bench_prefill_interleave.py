"""tools/bench_prefill_interleave.py on a short context: with chunks the running stream gets tokens
during the long prefill; whole, it waits for all of it."""

import json

from writescope.tools import bench_prefill_interleave as bench


def test_chunked_prefill_keeps_the_running_stream_going(tmp_path):
    out = tmp_path / "interleave.json"
    assert bench.main(["--context", "2048", "--chunks", "64", "2048", "--warm-tokens", "3",
                       "--short-tokens", "400", "--out", str(out)]) == 0
    chunked, whole = json.loads(out.read_text())["rows"]
    assert chunked["gaps_during_prefill"] >= 8  # a token per chunk or so (32 chunks of 64)
    # whole: one stall holding most of the long prompt's time to first token. Not a count of gaps: the
    # first token is stamped by another thread, which may read it some decode steps late on a loaded host
    assert whole["max_gap_during_prefill_s"] >= 0.5 * whole["long_ttft_s"]
    assert whole["gaps_during_prefill"] < chunked["gaps_during_prefill"]
    assert chunked["prefill_tok_s"] > 0 and whole["long_ttft_s"] > 0
