"""tools/bench_serving.py's own part (GuideLLM itself runs in its own environment, see the README):
the preset's tokenizer exported for GuideLLM counts tokens as the served model does."""

import pytest

from writescope.models.presets import byte_level_tokenizer
from writescope.tools import bench_serving as bench

transformers = pytest.importorskip("transformers")


def test_the_exported_tokenizer_counts_tokens_as_the_server_does(tmp_path):
    directory = bench.export_tokenizer("tiny-qwen3-moe", str(tmp_path / "tokenizer"))
    exported = transformers.AutoTokenizer.from_pretrained(directory)
    text = "A long document, with accents: é and 中. <eos>"
    assert exported(text, add_special_tokens=True)["input_ids"] == byte_level_tokenizer().encode(text).ids
    assert exported.eos_token == "<eos>"
