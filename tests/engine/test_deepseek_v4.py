"""DeepSeek-V4 on InplaceKVCache against transformers' DeepseekV4ForCausalLM on the same weights:
the checkpoint of tests/deepseek_v4_checkpoint.py, saved with save_pretrained and loaded by
Engine.from_pretrained.
"""

import json
from pathlib import Path

import pytest
import torch

from tests import deepseek_v4_checkpoint as checkpoint_tools
from tests.deepseek_v4_checkpoint import LAYER_TYPES, NEW_TOKENS
from writescope.engine import Engine
from writescope.models.checkpoint import load_weights
from writescope.models.deepseek_v4 import (
    CSA,
    HCA,
    SLIDING,
    DeepseekV4Config,
    DeepseekV4Forward,
    DeepseekV4Model,
    DenseEntries,
    SequenceStates,
    canonical_name,
)
from writescope.policies import POLICY_NAMES, Region

transformers = pytest.importorskip("transformers")

LOGITS = {"atol": 1e-4, "rtol": 1e-4}
REGIONS = {"all_transfer": {Region.CPU_TRANSFER}, "all_cpu": {Region.CPU_COMPUTE},
           "fixed_half": {Region.CPU_COMPUTE, Region.CPU_TRANSFER}, "monolithic": {Region.CPU_COMPUTE}}


def hf_config(**changes):
    return checkpoint_tools.hf_config(transformers, **changes)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return checkpoint_tools.make_checkpoint(transformers, tmp_path_factory.mktemp("deepseek_v4"))


def our_model(path):
    with open(f"{path}/config.json") as f:
        config = DeepseekV4Config.from_hf(json.load(f))
    return DeepseekV4Model(config, load_weights(path, config, torch.float32))


def test_the_model_alone_gives_transformers_logits(checkpoint):
    """Prefill and decode of our model with its entries in plain tensors: the reference the engine's
    split must equal."""
    path, prompts, expected = checkpoint
    model = our_model(path)
    for prompt, (tokens, logits) in zip(prompts, expected, strict=True):
        forward = DeepseekV4Forward(model, SequenceStates(model.config, 2, 256, "cpu", torch.float32), DenseEntries())
        ours = [forward.prefill(torch.tensor(prompt), 1)[0]]
        for i, token in enumerate(tokens[:-1]):
            ours.append(forward.decode(torch.tensor([token]), torch.tensor([len(prompt) + i]), torch.tensor([1]))[0])
        assert [int(row.argmax()) for row in ours] == tokens
        for mine, theirs in zip(ours, logits, strict=True):
            torch.testing.assert_close(mine, theirs.float(), **LOGITS)


def test_a_prompt_prefilled_in_chunks_gives_the_whole_prompts_logits(checkpoint):
    """Chunks of 16 tokens (whole compressor windows), each attending the earlier chunks' sliding
    tokens and entries: the last token's logits as transformers' after the whole prompt."""
    path, prompts, expected = checkpoint
    model = our_model(path)
    for prompt, (_, logits) in zip(prompts, expected, strict=True):
        forward = DeepseekV4Forward(model, SequenceStates(model.config, 1, 256, "cpu", torch.float32), DenseEntries())
        for start in range(0, len(prompt), 16):
            last = forward.prefill(torch.tensor(prompt[start:start + 16]), 0, start, len(prompt))[0]
        torch.testing.assert_close(last, logits[0].float(), **LOGITS)
    with pytest.raises(ValueError, match="must start on a compressor window"):
        forward.prefill(torch.tensor(prompts[0][:8]), 0, 6)


def test_compressed_entries_and_the_selection_change_the_logits(checkpoint):
    """The parity above is not vacuous: without the HCA entries, or with every CSA entry instead of the
    indexer's top-k, the first token's logits move by far more than the tolerance."""
    import dataclasses

    path, prompts, expected = checkpoint
    model = our_model(path)
    for change in ({"index_topk": 10**6}, {"layer_types": tuple(SLIDING if t == HCA else t for t in LAYER_TYPES)}):
        model.config = dataclasses.replace(model.config, **change)
        forward = DeepseekV4Forward(model, SequenceStates(model.config, 1, 256, "cpu", torch.float32), DenseEntries())
        logits = forward.prefill(torch.tensor(prompts[1]), 0)[0]
        assert float((logits - expected[1][1][0]).abs().max()) > 1e-2
        model = our_model(path)


# Whole prompts in one turn, or chunks of 32 tokens (HCA's rate 16 x block 2: whole entry blocks),
# each attending the entries the earlier ones wrote, read back from their regions.
PREFILL_CHUNKS = {"whole": 4096, "chunked": 32}


@pytest.mark.parametrize("prefill", list(PREFILL_CHUNKS))
@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_engine_gives_transformers_tokens_under_every_policy(checkpoint, policy, prefill, device, tmp_path,
                                                             monkeypatch):
    """Both prompts decode in one batch, at different positions; each entry cache's window flushes to
    the regions the policy routes to, and the CSA selection is attended from every place it lies."""
    monkeypatch.setenv("WRITESCOPE_CACHE_DIR", str(tmp_path))
    path, prompts, expected = checkpoint
    engine = Engine.from_pretrained(path, policy=policy, dtype="float32", window_tokens=4, block_size=2,
                                    max_batch_size=2, max_seq_len=256, device=device,
                                    prefill_chunk_tokens=PREFILL_CHUNKS[prefill])
    regions = {kind: set() for kind in engine.cache.caches}
    try:
        outputs = []
        for event in engine.generate_stream(prompts, max_new_tokens=NEW_TOKENS):
            for kind, cache in engine.cache.caches.items():
                regions[kind].update(p.region for state in cache.seqs.values() for p in state.blocks)
                cache.check_integrity()
            outputs.append(event)
        attended, gathered = engine.store.attended, set(engine.store.gathers)
        finished = engine.generate(prompts, max_new_tokens=NEW_TOKENS, return_logits=True)
        assert not engine.cache.seqs and all(not c.seqs for c in engine.cache.caches.values())
    finally:
        engine.shutdown()
    if policy in REGIONS:
        assert regions == dict.fromkeys(regions, REGIONS[policy])
    if device == "cuda" and attended[CSA]["transfer"]:  # beside a GPU the selection's share went through the spans
        assert gathered == {CSA}
    if policy == "fixed_half":  # the selection was split: some entries attended on each side
        assert attended[CSA]["cpu"] > 0 and attended[CSA]["device"] > 0
        assert attended[HCA]["cpu"] > 0 and attended[HCA]["device"] > 0
    for output, (tokens, logits) in zip(finished, expected, strict=True):
        assert output.token_ids == tokens
        for ours, theirs in zip(output.logits, logits, strict=True):
            torch.testing.assert_close(ours.cpu(), theirs.float(), **LOGITS)


@pytest.mark.parametrize("policy", ["fixed_half", "monolithic"])
def test_the_gathered_device_path_gives_the_same_tokens(checkpoint, policy, tmp_path, monkeypatch):
    """Beside a GPU the device's share of a selection is gathered into one span and copied: the same
    path run here on the CPU (monolithic: cpu_compute's share gathered with it)."""
    monkeypatch.setenv("WRITESCOPE_CACHE_DIR", str(tmp_path))
    path, prompts, expected = checkpoint
    engine = Engine.from_pretrained(path, policy=policy, dtype="float32", window_tokens=4, block_size=2,
                                    max_batch_size=2, max_seq_len=256)
    engine.store.device_in_place = False
    try:
        outputs = engine.generate(prompts, max_new_tokens=NEW_TOKENS)
        gathered_s = engine.store.gather_s
    finally:
        engine.shutdown()
    assert [o.token_ids for o in outputs] == [tokens for tokens, _ in expected]
    assert gathered_s > 0


def test_the_gpu_path_through_the_triton_kernels_gives_the_same_tokens(checkpoint, tmp_path, monkeypatch):
    """The device side as beside a GPU, its kernels Triton's (run here by the interpreter): HCA's
    window and cpu_transfer through device_side, the CSA selection gathered through the staging and
    device buffers, alternate layers using alternate buffers."""
    from writescope import env

    if not env.TRITON_INTERPRET.enabled():
        pytest.skip("TRITON_INTERPRET is off in this process (the CUDA tests cover this path compiled)")
    monkeypatch.setenv("WRITESCOPE_CACHE_DIR", str(tmp_path))
    path, prompts, expected = checkpoint
    engine = Engine.from_pretrained(path, policy="fixed_half", dtype="float32", window_tokens=4, block_size=2,
                                    max_batch_size=2, max_seq_len=256)
    engine.store.device_in_place, engine.store.backend = False, "triton"
    try:
        outputs = engine.generate(prompts, max_new_tokens=NEW_TOKENS)
        attended, gathers, gather_s = engine.store.attended, engine.store.gathers, engine.store.gather_s
    finally:
        engine.shutdown()
    assert [o.token_ids for o in outputs] == [tokens for tokens, _ in expected]
    assert attended[CSA]["transfer"] > 0 and attended[HCA]["device"] > 0 and set(gathers) == {CSA}
    assert gather_s > 0


def test_a_running_stream_gets_tokens_while_another_prompt_is_prefilled(checkpoint, tmp_path, monkeypatch):
    """Chunks of 32 tokens: the 93-token prompt takes three turns of the loop, and the stream already
    running gets a token at each of them, not only after that prefill."""
    monkeypatch.setenv("WRITESCOPE_CACHE_DIR", str(tmp_path))
    path, prompts, expected = checkpoint
    engine = Engine.from_pretrained(path, policy="fixed_half", dtype="float32", window_tokens=4, block_size=2,
                                    max_batch_size=2, max_seq_len=256, prefill_chunk_tokens=32)
    short = prompts[0][:40]
    try:
        events = [(e.index, e.token_id) for e in engine.generate_stream([short, prompts[1]], max_new_tokens=NEW_TOKENS)]
    finally:
        engine.shutdown()
    long_first = next(i for i, (index, _) in enumerate(events) if index == 1)
    assert sum(index == 0 for index, _ in events[:long_first]) >= 3
    assert [token for index, token in events if index == 1] == expected[1][0]


def test_a_chunk_size_off_the_entry_blocks_is_refused(checkpoint):
    with pytest.raises(ValueError, match="prefill_chunk_tokens must be a positive multiple of 32"):
        Engine.from_pretrained(checkpoint[0], window_tokens=4, block_size=2, max_seq_len=256, prefill_chunk_tokens=48)


def test_preset_generates_the_same_tokens_at_any_batch(tmp_path, monkeypatch):
    """tiny-deepseek-v4 (the release's rates, window and top-512): a sequence decoded alone and beside
    another gives the same tokens."""
    monkeypatch.setenv("WRITESCOPE_CACHE_DIR", str(tmp_path))
    engine = Engine.from_pretrained("tiny-deepseek-v4", policy="fixed_half", window_tokens=16, block_size=4,
                                    max_batch_size=2, max_seq_len=1024)
    try:
        long_prompt = list(range(256)) * 3
        alone = engine.generate([long_prompt], max_new_tokens=24)[0].token_ids
        together = engine.generate([long_prompt, "a shorter prompt"], max_new_tokens=24)
    finally:
        engine.shutdown()
    assert together[0].token_ids == alone
    assert len(together[1].token_ids) == 24


def test_weights_load_by_the_release_names(checkpoint):
    """save_pretrained writes DeepSeek's names (with transformers' model. prefix and a few of its own);
    they load under the release's names, hash routes as integers."""
    path = checkpoint[0]
    with open(f"{path}/config.json") as f:
        config = DeepseekV4Config.from_hf(json.load(f))
    weights = load_weights(path, config, torch.bfloat16)
    assert "embed.weight" in weights and "head.weight" in weights and "hc_head_fn" in weights
    assert weights["layers.0.ffn.gate.tid2eid"].dtype == torch.int64
    assert weights["layers.1.attn.wq_a.weight"].dtype == torch.bfloat16
    assert canonical_name("model.layers.2.attn.compressor.ape") == "layers.2.attn.compressor.ape"


@pytest.mark.parametrize("change, message", [
    ({"num_key_value_heads": 2}, "shares one KV head"),
    ({"layer_types": [SLIDING, CSA]}, "layer_types must list"),
    ({"layer_types": [SLIDING, "full_attention", CSA, HCA]}, "layer_types must list"),
    ({"quantization_config": {"quant_method": "fp8"}}, "quantized DeepSeek-V4"),
    ({"scoring_func": "relu"}, "scoring_func"),
])
def test_bad_configs_are_named(change, message):
    data = {**hf_config().to_dict(), **change}
    with pytest.raises(ValueError, match=message):
        DeepseekV4Config.from_hf(data)


def test_a_missing_weight_is_a_clear_error(checkpoint, tmp_path):
    from safetensors.torch import load_file, save_file

    path = checkpoint[0]
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text((Path(path) / "config.json").read_text())
    weights = load_file(f"{path}/model.safetensors")
    del weights["model.layers.1.attn.indexer.wq_b.weight"]
    save_file(weights, str(broken / "model.safetensors"))
    with pytest.raises(ValueError, match="lacks 1 weights"):
        Engine.from_pretrained(str(broken), max_seq_len=256)


def test_the_host_limit_is_shared_by_the_entry_caches(checkpoint):
    """Each entry cache takes the part of max_host_kv_gb its entries take of the whole (CSA's 2 layers
    one entry per 4 tokens, HCA's 1 layer one per 16, entries of one size: 8/9 and 1/9), so together
    they stay within it; a limit too small for one sequence names the cache and what its entries
    stand for."""
    from writescope.deepseek_v4_engine import entry_cache_configs

    path = checkpoint[0]
    config = our_model(path).config
    sizes = dict(block_size=2, window_tokens=4, max_batch_size=2, num_shards=1, pingpong_blocks=None, device="cpu")
    limited = entry_cache_configs(config, torch.float32, max_seq_len=256, max_host_kv_bytes=2**20, **sizes)
    assert sum(c.host_kv_bytes for c in limited.values()) <= 2**20
    assert limited[CSA].host_kv_bytes == pytest.approx(8 * limited[HCA].host_kv_bytes, rel=1e-3)
    with pytest.raises(ValueError, match=r"compressed_sparse_attention entries \(one per 4 tokens, 65536 tokens"):
        entry_cache_configs(config, torch.float32, max_seq_len=65536, max_host_kv_bytes=2**16, **sizes)
