"""tools/bench_prefill_interleave.py on a short context: with chunks the running stream gets tokens
during the long prefill; whole, it waits for all of it."""

import json

from writescope.tools import bench_prefill_interleave as bench


def test_chunked_prefill_keeps_the_running_stream_going(tmp_path):
    out = tmp_path / "interleave.json"
    assert bench.main(["--context", "1024", "--chunks", "64", "1024", "--warm-tokens", "3",
                       "--short-tokens", "400", "--out", str(out)]) == 0
    chunked, whole = json.loads(out.read_text())["rows"]
    assert chunked["gaps_during_prefill"] >= 8  # a token per chunk or so (16 chunks of 64)
    # one stall: the whole prompt at once (and the gaps it began and ended in: the long prompt's first
    # token is stamped by another thread, which may read it a token late)
    assert whole["gaps_during_prefill"] <= 3
    assert chunked["prefill_tok_s"] > 0 and whole["long_ttft_s"] > 0
