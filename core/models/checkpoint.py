"""Loading a local Hugging Face checkpoint directory: config.json, safetensors (one file, or shards
with model.safetensors.index.json), tokenizer.json when present. Every expected weight is checked
by name and shape; what is missing or mismatched is a clear error."""

from __future__ import annotations

import dataclasses
import json
import os

import torch
from safetensors import safe_open

from writescope.models import deepseek_v4
from writescope.models.config import ModelConfig


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every weight the model reads, by its Hugging Face name."""
    h = cfg.hidden_size
    shapes = {"model.embed_tokens.weight": (cfg.vocab_size, h), "model.norm.weight": (h,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, h)
    for layer in range(cfg.num_layers):
        p = f"model.layers.{layer}."
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        shapes.update(_attention_shapes(cfg, p + "self_attn."))
        shapes.update(_ffn_shapes(cfg, layer, p))
    return shapes


def _attention_shapes(cfg, p):
    if cfg.is_mla:
        qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
        shapes = {p + "kv_a_proj_with_mqa.weight": (cfg.kv_lora_rank + cfg.qk_rope_head_dim, cfg.hidden_size),
                  p + "kv_a_layernorm.weight": (cfg.kv_lora_rank,),
                  p + "kv_b_proj.weight": (cfg.num_q_heads * (cfg.qk_nope_head_dim + cfg.v_head_dim),
                                           cfg.kv_lora_rank),
                  p + "o_proj.weight": (cfg.hidden_size, cfg.num_q_heads * cfg.v_head_dim)}
        if cfg.q_lora_rank is None:
            shapes[p + "q_proj.weight"] = (cfg.num_q_heads * qk, cfg.hidden_size)
        else:
            shapes.update({p + "q_a_proj.weight": (cfg.q_lora_rank, cfg.hidden_size),
                           p + "q_a_layernorm.weight": (cfg.q_lora_rank,),
                           p + "q_b_proj.weight": (cfg.num_q_heads * qk, cfg.q_lora_rank)})
        return shapes
    d = cfg.head_dim
    shapes = {p + "q_proj.weight": (cfg.num_q_heads * d, cfg.hidden_size),
              p + "k_proj.weight": (cfg.num_kv_heads * d, cfg.hidden_size),
              p + "v_proj.weight": (cfg.num_kv_heads * d, cfg.hidden_size),
              p + "o_proj.weight": (cfg.hidden_size, cfg.num_q_heads * d)}
    if cfg.arch == "qwen3_moe":
        shapes.update({p + "q_norm.weight": (d,), p + "k_norm.weight": (d,)})
    return shapes


def _mlp_shapes(p, hidden, inter, names=("gate_proj", "up_proj", "down_proj")):
    gate, up, down = names
    return {f"{p}{gate}.weight": (inter, hidden), f"{p}{up}.weight": (inter, hidden),
            f"{p}{down}.weight": (hidden, inter)}


def _ffn_shapes(cfg, layer, p):
    h = cfg.hidden_size
    if not cfg.is_moe_layer(layer):
        return _mlp_shapes(p + "mlp.", h, cfg.intermediate_size)
    if cfg.arch == "mixtral":
        shapes = {p + "block_sparse_moe.gate.weight": (cfg.num_experts, h)}
        for e in range(cfg.num_experts):
            shapes.update(_mlp_shapes(f"{p}block_sparse_moe.experts.{e}.", h, cfg.moe_intermediate_size,
                                      ("w1", "w3", "w2")))
        return shapes
    shapes = {p + "mlp.gate.weight": (cfg.num_experts, h)}
    for e in range(cfg.num_experts):
        shapes.update(_mlp_shapes(f"{p}mlp.experts.{e}.", h, cfg.moe_intermediate_size))
    if cfg.n_shared_experts:
        shapes.update(_mlp_shapes(p + "mlp.shared_experts.", h, cfg.moe_intermediate_size * cfg.n_shared_experts))
    return shapes


def config_from_hf(data: dict) -> ModelConfig | deepseek_v4.DeepseekV4Config:
    """The normalised config of a config.json's contents: DeepSeek-V4 has its own."""
    if data.get("model_type") == deepseek_v4.ARCH:
        return deepseek_v4.DeepseekV4Config.from_hf(data)
    return ModelConfig.from_hf(data)


def load_config(path: str) -> ModelConfig | deepseek_v4.DeepseekV4Config:
    config_path = os.path.join(path, "config.json")
    if not os.path.isfile(config_path):
        raise ValueError(f"{path!r} is not a checkpoint directory: config.json is missing")
    with open(config_path) as f:
        config = config_from_hf(json.load(f))
    from writescope.chat import load_generation_defaults  # chat reads the presets, which import this module

    # generation_config.json's EOS list ends generation too (an instruct model's end-of-turn token)
    generation_eos = load_generation_defaults(path).eos_token_ids
    extra = tuple(e for e in generation_eos if e not in config.eos_token_ids)
    return dataclasses.replace(config, eos_token_ids=config.eos_token_ids + extra) if extra else config


def weight_files(path: str) -> list[str]:
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
        missing = [n for n in names if not os.path.isfile(os.path.join(path, n))]
        if missing:
            raise ValueError(f"checkpoint {path!r}: shards named in the index are missing: {missing}")
        return [os.path.join(path, n) for n in names]
    single = os.path.join(path, "model.safetensors")
    if not os.path.isfile(single):
        raise ValueError(f"checkpoint {path!r} has no model.safetensors nor model.safetensors.index.json")
    return [single]


def load_weights(path: str, cfg: ModelConfig, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The weights the model reads, by name (DeepSeek-V4's canonical: `deepseek_v4.canonical_name`),
    floating point ones in dtype; integer tables (V4's hash routing) as they are."""
    v4 = cfg.arch == deepseek_v4.ARCH
    expected = deepseek_v4.expected_shapes(cfg) if v4 else expected_shapes(cfg)
    weights = {}
    for file in weight_files(path):
        with safe_open(file, framework="pt") as f:
            for stored in f.keys():  # noqa: SIM118 (safe_open has keys(), not __iter__)
                name = deepseek_v4.canonical_name(stored) if v4 else stored
                if name in expected:
                    tensor = f.get_tensor(stored)
                    weights[name] = tensor.to(dtype) if tensor.is_floating_point() else tensor
    check_weights(weights, expected, path)
    return weights


def check_weights(weights, expected, source):
    missing = sorted(set(expected) - set(weights))
    if missing:
        raise ValueError(f"checkpoint {source!r} lacks {len(missing)} weights the config needs, e.g. {missing[:3]}")
    wrong = [(n, tuple(weights[n].shape), s) for n, s in expected.items() if tuple(weights[n].shape) != s]
    if wrong:
        name, got, want = wrong[0]
        raise ValueError(f"checkpoint {source!r}: {name} has shape {got}, the config needs {want} "
                         f"({len(wrong)} mismatched)")
