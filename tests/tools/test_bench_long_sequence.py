"""tools/bench_long_sequence.py on a short context: the whole prompt placed, decoded, and its host
memory the KV written."""

import json

from writescope.tools import bench_long_sequence as bench


def test_a_long_sequence_is_placed_and_decoded(tmp_path):
    out = tmp_path / "long.json"
    assert bench.main(["--context", "2048", "--new-tokens", "4", "--prefill-chunk-tokens", "512",
                       "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["placed_tokens"]["cpu_compute"] == 2048 - 2048 % 16  # all_cpu: every full block
    assert result["decode_tok_s"] > 0 and result["prefill_tok_s"] > 0
    assert 0.95 <= result["resident_over_raw"] <= 1.3
