"""tools/bench_scaleout.py's own parts (the cluster runs are tests/actors/test_multinode.py's): its
prompts and its refusals."""

import json

import pytest

from writescope.tools import bench_scaleout


def test_the_prompts_have_the_asked_length_and_count(tmp_path):
    path = tmp_path / "prompts.jsonl"
    bench_scaleout.write_prompts(str(path), requests=5, context=40, new_tokens=3)
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [line["id"] for line in lines] == [f"r{i}" for i in range(5)]
    assert all(len(line["prompt"]) == 40 and line["max_new_tokens"] == 3 for line in lines)
    assert all(1 <= t < 256 for line in lines for t in line["prompt"])  # byte-level vocabulary, no 0


@pytest.mark.parametrize("argv, message", [
    (["--engines", "0"], "--engines must be counts >= 1"),
    (["--requests", "0"], "--requests must be >= 1"),
    (["--node-cpus", "0"], "--node-cpus must be >= 1"),
])
def test_bad_arguments_are_refused(argv, message, capsys):
    with pytest.raises(SystemExit):
        bench_scaleout.main(argv)
    assert message in capsys.readouterr().err
