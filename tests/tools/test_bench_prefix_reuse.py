"""tools/bench_prefix_reuse.py on a short document: the engine with reuse finds the document in
every later question, prefills less, and answers the tokens of the engine without."""

import json

from writescope.tools import bench_prefix_reuse as bench


def test_later_questions_reuse_the_document_and_answer_alike(tmp_path):
    out = tmp_path / "reuse.json"
    assert bench.main(["--document-tokens", "2048", "--questions", "3", "--new-tokens", "4", "--dtype", "float32",
                       "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["same_tokens"]
    off, on = result["rows"]
    assert off["later_cached_tokens"] == [0, 0] and on["later_cached_tokens"] == [2048, 2048]
    assert on["later_prefill_s_median"] < off["later_prefill_s_median"]
