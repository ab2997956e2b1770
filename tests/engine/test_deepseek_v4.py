"""DeepSeek-V4 on InplaceKVCache against transformers' DeepseekV4ForCausalLM on the same weights.

A random-weight checkpoint with every layer type (sliding-only, CSA, HCA), hash and routed MoE
layers and hyper-connections, its sinks, position biases, router biases and hash routes drawn at
random (transformers initialises them to zero), saved with save_pretrained and loaded by
Engine.from_pretrained. Compression rates 4 (CSA) and 16 (HCA), an indexer keeping 3 entries, and
entry windows of 4 entries in blocks of 2: prompts of 70-93 tokens flush the entry windows to the
host regions and the indexer selects from every region.
"""

import json
from pathlib import Path

import pytest
import torch

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

PROMPT_LENS = (70, 93)
NEW_TOKENS = 16
LOGITS = {"atol": 1e-4, "rtol": 1e-4}
LAYER_TYPES = [SLIDING, CSA, HCA, CSA]
REGIONS = {"all_transfer": {Region.CPU_TRANSFER}, "all_cpu": {Region.CPU_COMPUTE},
           "fixed_half": {Region.CPU_COMPUTE, Region.CPU_TRANSFER}, "monolithic": {Region.CPU_COMPUTE}}


def hf_config(**changes):
    settings = dict(
        vocab_size=300, hidden_size=64, moe_intermediate_size=32, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=1, head_dim=32, q_lora_rank=48, num_experts_per_tok=2, n_routed_experts=4,
        n_shared_experts=1, layer_types=LAYER_TYPES, compress_rates={CSA: 4, HCA: 16}, hc_mult=2,
        hc_sinkhorn_iters=5, mlp_layer_types=["hash_moe", "moe", "moe", "moe"], sliding_window=8, o_groups=2,
        o_lora_rank=16, index_n_heads=2, index_head_dim=16, index_topk=3, partial_rotary_factor=0.5,
        eos_token_id=None, pad_token_id=0)
    settings.update(changes)
    return transformers.DeepseekV4Config(**settings)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    torch.manual_seed(0)
    model = transformers.DeepseekV4ForCausalLM(hf_config()).eval()
    with torch.no_grad():  # what the initialisation leaves at zero, drawn, so that each part counts
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            if name.endswith("tid2eid"):
                tensor.copy_(torch.randint(0, 4, tensor.shape))
            elif any(part in name for part in ("sinks", "position_bias", ".base", "hc_base", "e_score")):
                tensor.normal_(0, 0.5)
    path = tmp_path_factory.mktemp("deepseek_v4")
    model.save_pretrained(path)
    prompts = [torch.randint(1, 300, (n,)).tolist() for n in PROMPT_LENS]
    expected = []
    with torch.no_grad():
        for prompt in prompts:
            out = model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False,
                                 output_logits=True, return_dict_in_generate=True)
            expected.append((out.sequences[0, len(prompt):].tolist(), [step[0] for step in out.logits]))
    return str(path), prompts, expected


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
        attended = engine.store.attended
        finished = engine.generate(prompts, max_new_tokens=NEW_TOKENS, return_logits=True)
        assert not engine.cache.seqs and all(not c.seqs for c in engine.cache.caches.values())
    finally:
        engine.shutdown()
    if policy in REGIONS:
        assert regions == dict.fromkeys(regions, REGIONS[policy])
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


def test_a_missing_weight_and_the_ray_executor_are_clear_errors(checkpoint, tmp_path):
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
    with pytest.raises(ValueError, match="local executor only"):
        Engine.from_pretrained(path, executor="ray")
