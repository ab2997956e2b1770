"""Parity with Hugging Face transformers on the same weights: tokens identical, logits close.

Each architecture is a random-weight transformers model saved with save_pretrained (safetensors)
and loaded through Engine.from_pretrained; prompts of 200-300 tokens with an 8-token window make
the KV land in the CPU regions and the window flush twice per sequence; every policy, with whole or
chunked prefill, must give the tokens of transformers' greedy generate.
"""


import pytest
import torch

from tests.hf_reference import save_with_greedy_answers
from writescope.engine import Engine
from writescope.policies import POLICY_NAMES, Region
from writescope.sampling import SamplingParams

transformers = pytest.importorskip("transformers")

PROMPT_LENS = (211, 287)
NEW_TOKENS = 16
LOGITS = {"atol": 1e-4, "rtol": 1e-4}
REGIONS = {"all_transfer": {Region.CPU_TRANSFER}, "all_cpu": {Region.CPU_COMPUTE},
           "fixed_half": {Region.CPU_COMPUTE, Region.CPU_TRANSFER}, "monolithic": {Region.CPU_COMPUTE}}


def hf_models():
    common = {"vocab_size": 300, "hidden_size": 64, "num_hidden_layers": 3, "num_attention_heads": 4,
              "eos_token_id": None, "pad_token_id": 0, "rms_norm_eps": 1e-6}
    return {
        "deepseek_v2": transformers.DeepseekV2ForCausalLM(transformers.DeepseekV2Config(
            **common, intermediate_size=96, moe_intermediate_size=32, num_key_value_heads=4, q_lora_rank=None,
            kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=4,
            n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1)),
        "deepseek_v2_q_lora": transformers.DeepseekV2ForCausalLM(transformers.DeepseekV2Config(
            **common, intermediate_size=96, moe_intermediate_size=32, num_key_value_heads=4, q_lora_rank=24,
            kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=4,
            n_shared_experts=2, num_experts_per_tok=2, first_k_dense_replace=0)),
        "deepseek_v2_yarn": transformers.DeepseekV2ForCausalLM(transformers.DeepseekV2Config(
            **common, intermediate_size=96, moe_intermediate_size=32, num_key_value_heads=4, q_lora_rank=None,
            kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=4,
            n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1, max_position_embeddings=1024,
            rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0, "beta_fast": 32,
                             "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707,
                             "original_max_position_embeddings": 128})),
        "qwen3_moe": transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
            **common, intermediate_size=96, moe_intermediate_size=32, num_key_value_heads=2, head_dim=16,
            num_experts=4, num_experts_per_tok=2, norm_topk_prob=True)),
        "mixtral": transformers.MixtralForCausalLM(transformers.MixtralConfig(
            **common, intermediate_size=96, num_key_value_heads=2, num_local_experts=4)),
    }


@pytest.fixture(scope="module", params=list(hf_models()))
def checkpoint(request, tmp_path_factory):
    torch.manual_seed(0)
    model = hf_models()[request.param].eval()
    return save_with_greedy_answers(model, tmp_path_factory.mktemp(request.param), PROMPT_LENS, NEW_TOKENS)


# Whole prompts in one turn, or 64-token chunks: each chunk attends to the KV the earlier ones wrote
# (read back from its regions), and the first sequence decodes while the second is still prefilled.
PREFILL_CHUNKS = {"whole": 4096, "chunked": 64}


@pytest.mark.parametrize("prefill", list(PREFILL_CHUNKS))
@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_same_tokens_and_logits_as_transformers(checkpoint, policy, prefill, device, tmp_path, monkeypatch):
    monkeypatch.setenv("WRITESCOPE_CACHE_DIR", str(tmp_path))
    path, prompts, expected = checkpoint
    engine = Engine.from_pretrained(path, policy=policy, dtype="float32", window_tokens=8, block_size=4,
                                    max_batch_size=2, max_seq_len=320, device=device,
                                    prefill_chunk_tokens=PREFILL_CHUNKS[prefill])
    flushed, regions = 0, set()
    original_flush = engine.cache._flush_window

    def counting_flush(seq_id):
        nonlocal flushed
        flushed += 1
        original_flush(seq_id)
        regions.update(p.region for p in engine.cache.seqs[seq_id].blocks)

    monkeypatch.setattr(engine.cache, "_flush_window", counting_flush)
    try:
        outputs = engine.generate(prompts, max_new_tokens=NEW_TOKENS, return_logits=True)
        assert not engine.cache.seqs  # finished sequences released their blocks
        engine.cache.check_integrity()
    finally:
        engine.shutdown()
    assert flushed >= 2 * len(prompts)
    if policy in REGIONS:
        assert regions == REGIONS[policy]
    for output, (tokens, logits) in zip(outputs, expected, strict=True):
        assert output.token_ids == tokens
        assert output.finish_reason == "length"
        for ours, theirs in zip(output.logits, logits, strict=True):
            torch.testing.assert_close(ours, theirs.float(), **LOGITS)


def test_greedy_logprobs_are_the_log_softmax_of_transformers_logits(checkpoint, tmp_path, monkeypatch):
    """What the HTTP logprobs report: the model's log-probability of each chosen token and its five
    most likely alternatives, against transformers' logits on the same weights."""
    monkeypatch.setenv("WRITESCOPE_CACHE_DIR", str(tmp_path))
    path, prompts, expected = checkpoint
    engine = Engine.from_pretrained(path, policy="fixed_half", dtype="float32", window_tokens=8, block_size=4,
                                    max_batch_size=2, max_seq_len=320)
    try:
        params = [SamplingParams(NEW_TOKENS, 0.0, logprobs=5)] * len(prompts)
        outputs = engine.generate(prompts, params=params)
    finally:
        engine.shutdown()
    for output, (tokens, logits) in zip(outputs, expected, strict=True):
        assert output.token_ids == tokens
        assert len(output.logprobs) == NEW_TOKENS
        for token, ours, theirs in zip(tokens, output.logprobs, logits, strict=True):
            reference = torch.log_softmax(theirs.double(), dim=-1)
            assert ours.logprob == pytest.approx(float(reference[token]), abs=1e-4)
            top = torch.topk(reference, 5)
            assert [i for i, _ in ours.top] == top.indices.tolist()
            assert [v for _, v in ours.top] == pytest.approx(top.values.tolist(), abs=1e-4)
