"""Random-weight presets (fixed seed), with a byte-level tokenizer built offline, on the same code
paths as real checkpoints. TINY_PRESETS: the three architectures, small enough for a 2-core machine.
SHAPE_PRESETS: a paper model's attention as published, with few, small experts: the regime where
the KV dominates a decode step, as in the paper (qwen3-30b-a3b-shape: Qwen3-30B-A3B's 48 layers,
32 query / 4 KV heads of dim 128, hidden 2048; 4 experts of 64, top 2, instead of 128 of 768, top 8)."""

from __future__ import annotations

import torch

from writescope.models import deepseek_v4
from writescope.models.checkpoint import config_from_hf, expected_shapes
from writescope.models.config import ModelConfig

EOS_TOKEN_ID = 256  # bytes are 0..255; then the special tokens
TURN_TOKEN_ID = 257  # <|im_start|>: opens a chat turn
VOCAB_SIZE = 320
# ChatML's turns, each closed by the presets' one end token (<eos>, which also ends generation)
PRESET_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}{{ eos_token }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

TINY_PRESETS = {
    "tiny-deepseek-v2": {
        "model_type": "deepseek_v2", "vocab_size": VOCAB_SIZE, "hidden_size": 128, "intermediate_size": 256,
        "moe_intermediate_size": 64, "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 8,
        "q_lora_rank": None, "kv_lora_rank": 64, "qk_nope_head_dim": 32, "qk_rope_head_dim": 16,
        "v_head_dim": 32, "n_routed_experts": 8, "n_shared_experts": 1, "num_experts_per_tok": 2,
        "first_k_dense_replace": 1, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "eos_token_id": EOS_TOKEN_ID,
    },
    "tiny-qwen3-moe": {
        "model_type": "qwen3_moe", "vocab_size": VOCAB_SIZE, "hidden_size": 128, "intermediate_size": 256,
        "moe_intermediate_size": 64, "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2,
        "head_dim": 32, "num_experts": 8, "num_experts_per_tok": 2, "norm_topk_prob": True, "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0, "eos_token_id": EOS_TOKEN_ID,
    },
    "tiny-mixtral": {
        "model_type": "mixtral", "vocab_size": VOCAB_SIZE, "hidden_size": 128, "intermediate_size": 128,
        "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 16,
        "num_local_experts": 4, "num_experts_per_tok": 2, "rms_norm_eps": 1e-5, "rope_theta": 1000000.0,
        "eos_token_id": EOS_TOKEN_ID,
    },
}

SHAPE_PRESETS = {
    "qwen3-30b-a3b-shape": {
        "model_type": "qwen3_moe", "vocab_size": VOCAB_SIZE, "hidden_size": 2048, "intermediate_size": 256,
        "moe_intermediate_size": 64, "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4,
        "head_dim": 128, "num_experts": 4, "num_experts_per_tok": 2, "norm_topk_prob": True, "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0, "eos_token_id": EOS_TOKEN_ID,
    },
}

# DeepSeek-V4's layer types all present (HCA, CSA, sliding-only), hash and routed MoE layers, four
# hyper-connection streams; the paper's compression rates (4, 128), sliding window (128) and top-512
# selection, so that the sparse step's shape is the release's at any context length.
SPARSE_PRESETS = {
    "tiny-deepseek-v4": {
        "model_type": "deepseek_v4", "vocab_size": VOCAB_SIZE, "hidden_size": 128, "moe_intermediate_size": 64,
        "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 1, "head_dim": 64,
        "partial_rotary_factor": 0.25, "q_lora_rank": 64, "o_groups": 2, "o_lora_rank": 32,
        "layer_types": [deepseek_v4.HCA, deepseek_v4.CSA, deepseek_v4.SLIDING, deepseek_v4.CSA],
        "mlp_layer_types": ["hash_moe", "moe", "moe", "moe"],
        "compress_rates": {deepseek_v4.CSA: 4, deepseek_v4.HCA: 128}, "sliding_window": 128,
        "index_n_heads": 4, "index_head_dim": 32, "index_topk": 512, "hc_mult": 4, "hc_sinkhorn_iters": 20,
        "hc_eps": 1e-6, "n_routed_experts": 8, "n_shared_experts": 1, "num_experts_per_tok": 2,
        "scoring_func": "sqrtsoftplus", "routed_scaling_factor": 1.5, "swiglu_limit": 10.0, "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0, "compress_rope_theta": 160000.0, "eos_token_id": EOS_TOKEN_ID,
    },
}
# DeepSeek-V4-Flash's attention as released (64 query heads of 512 sharing one KV head, rope on 64,
# q-LoRA 1024, 8 output groups of 1024, the indexer's 64 heads of 128, hidden 4096) on the tiny
# preset's four layers, rates, window and top-512, with 4 small experts
SPARSE_PRESETS["deepseek-v4-flash-shape"] = {
    **SPARSE_PRESETS["tiny-deepseek-v4"], "hidden_size": 4096, "num_attention_heads": 64, "head_dim": 512,
    "partial_rotary_factor": 0.125, "q_lora_rank": 1024, "o_groups": 8, "o_lora_rank": 1024, "index_n_heads": 64,
    "index_head_dim": 128, "n_routed_experts": 4,
}

PRESETS = {**TINY_PRESETS, **SHAPE_PRESETS, **SPARSE_PRESETS}


def preset_config(name: str) -> ModelConfig:
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; known: {', '.join(PRESETS)} (or a checkpoint directory)")
    return config_from_hf(PRESETS[name])


def preset_weights(config: ModelConfig, dtype: torch.dtype, seed: int = 0) -> dict[str, torch.Tensor]:
    if config.arch == deepseek_v4.ARCH:
        return deepseek_v4.random_weights(config, dtype, seed)
    generator = torch.Generator().manual_seed(seed)
    weights = {}
    for name, shape in expected_shapes(config).items():
        if len(shape) == 1:  # norms start at one, as in the reference initialisation
            weights[name] = torch.ones(shape, dtype=dtype)
        else:
            weights[name] = (torch.randn(shape, generator=generator) * 0.06).to(dtype)
    return weights


def byte_level_tokenizer():
    """A byte-level tokenizer (256 byte tokens, no merges, then <eos> and <|im_start|>) made offline."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    alphabet = ByteLevel.alphabet()
    byte_to_char = _bytes_to_unicode()
    vocab = {byte_to_char[b]: b for b in range(256)}
    assert set(vocab) == set(alphabet)
    vocab["<eos>"] = EOS_TOKEN_ID
    vocab["<|im_start|>"] = TURN_TOKEN_ID
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(["<eos>", "<|im_start|>"])
    return tokenizer


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from bytes to printable characters (what ByteLevel pre-tokenises to)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars
