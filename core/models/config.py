"""One normalised model config for the three architectures, read from a Hugging Face config.json."""

from __future__ import annotations

import math
from dataclasses import dataclass

from writescope.kv_format import KVFormat

ARCHITECTURES = ("deepseek_v2", "qwen3_moe", "mixtral")
ROPE_TYPES = ("default", "yarn")


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding: the default, or YaRN scaling (DeepSeek-V2-Lite's checkpoint uses it)."""

    theta: float = 10000.0
    type: str = "default"
    factor: float = 1.0
    original_max_position_embeddings: int = 0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True

    @classmethod
    def from_hf(cls, data: dict) -> RopeConfig:
        rope = dict(data.get("rope_parameters") or data.get("rope_scaling") or {})
        rope_type = rope.get("rope_type", rope.get("type")) or "default"
        if rope_type not in ROPE_TYPES:
            raise ValueError(f"rope type {rope_type!r} is not supported; supported: {', '.join(ROPE_TYPES)}")
        theta = rope.get("rope_theta", data.get("rope_theta", 10000.0))
        if rope_type == "default":
            return cls(theta=theta)
        original = rope.get("original_max_position_embeddings") or data.get("max_position_embeddings")
        factor = rope.get("factor") or data["max_position_embeddings"] / original
        return cls(theta=theta, type="yarn", factor=factor, original_max_position_embeddings=original,
                   beta_fast=rope.get("beta_fast") or 32.0, beta_slow=rope.get("beta_slow") or 1.0,
                   mscale=rope.get("mscale"), mscale_all_dim=rope.get("mscale_all_dim"),
                   attention_factor=rope.get("attention_factor"), truncate=rope.get("truncate", True))


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


@dataclass(frozen=True)
class ModelConfig:
    arch: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int  # GQA head dim (DeepSeek: qk_rope_head_dim, the rotary dim)
    intermediate_size: int  # dense MLP
    moe_intermediate_size: int
    num_experts: int
    top_k: int
    rms_norm_eps: float
    rope: RopeConfig
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    topk_method: str = "greedy"
    n_group: int | None = None
    topk_group: int | None = None
    n_shared_experts: int = 0
    first_k_dense_replace: int = 0
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    q_lora_rank: int | None = None
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    tie_word_embeddings: bool = False
    eos_token_ids: tuple[int, ...] = ()
    dtype: str = "float32"

    @property
    def is_mla(self) -> bool:
        return self.arch == "deepseek_v2"

    @property
    def decode_head_dim_qk(self) -> int:
        """Per-head query width in decode: MLA's absorbed query is latent + rope."""
        return self.kv_lora_rank + self.qk_rope_head_dim if self.is_mla else self.head_dim

    @property
    def decode_head_dim_v(self) -> int:
        return self.kv_lora_rank if self.is_mla else self.head_dim

    @property
    def attention_scale(self) -> float:
        if not self.is_mla:
            return self.head_dim**-0.5
        scale = (self.qk_nope_head_dim + self.qk_rope_head_dim) ** -0.5
        if self.rope.type == "yarn" and self.rope.mscale_all_dim:  # DeepSeek's YaRN softmax correction
            scale *= yarn_mscale(self.rope.factor, self.rope.mscale_all_dim) ** 2
        return scale

    def is_moe_layer(self, layer: int) -> bool:
        if self.arch == "deepseek_v2":
            return layer >= self.first_k_dense_replace
        if self.arch == "qwen3_moe":
            return layer not in self.mlp_only_layers and (layer + 1) % self.decoder_sparse_step == 0
        return True

    def kv_format(self, dtype: str, block_size: int) -> KVFormat:
        if self.is_mla:  # one latent "head": kv_lora_rank + rope dims; V is the latent
            return KVFormat(self.num_layers, 1, self.kv_lora_rank + self.qk_rope_head_dim, self.kv_lora_rank,
                            dtype=dtype, block_size=block_size, v_in_k=True)
        return KVFormat(self.num_layers, self.num_kv_heads, self.head_dim, self.head_dim, dtype=dtype,
                        block_size=block_size)

    @classmethod
    def from_hf(cls, data: dict) -> ModelConfig:
        arch = data.get("model_type")
        if arch not in ARCHITECTURES:
            raise ValueError(f"model_type {arch!r} is not supported; supported: {', '.join(ARCHITECTURES)}")
        eos = data.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        heads = data["num_attention_heads"]
        common = {
            "arch": arch, "vocab_size": data["vocab_size"], "hidden_size": data["hidden_size"],
            "num_layers": data["num_hidden_layers"], "num_q_heads": heads,
            "num_kv_heads": data.get("num_key_value_heads") or heads,
            "intermediate_size": data.get("intermediate_size", 0),
            "rms_norm_eps": data.get("rms_norm_eps", 1e-6),
            "rope": RopeConfig.from_hf(data),
            "tie_word_embeddings": data.get("tie_word_embeddings", False), "eos_token_ids": eos_ids,
            "dtype": str(data.get("dtype") or data.get("torch_dtype") or "float32"),
            "top_k": data["num_experts_per_tok"],
        }
        if arch == "deepseek_v2":
            return cls(**common, head_dim=data["qk_rope_head_dim"],
                       moe_intermediate_size=data["moe_intermediate_size"],
                       num_experts=data.get("n_routed_experts") or data.get("num_local_experts"),
                       norm_topk_prob=data.get("norm_topk_prob", False),
                       routed_scaling_factor=data.get("routed_scaling_factor", 1.0),
                       topk_method=data.get("topk_method", "greedy"), n_group=data.get("n_group"),
                       topk_group=data.get("topk_group"), n_shared_experts=data.get("n_shared_experts") or 0,
                       first_k_dense_replace=data.get("first_k_dense_replace", 0),
                       q_lora_rank=data.get("q_lora_rank"), kv_lora_rank=data["kv_lora_rank"],
                       qk_nope_head_dim=data["qk_nope_head_dim"], qk_rope_head_dim=data["qk_rope_head_dim"],
                       v_head_dim=data["v_head_dim"])
        head_dim = data.get("head_dim") or data["hidden_size"] // heads
        if arch == "qwen3_moe":
            return cls(**common, head_dim=head_dim, moe_intermediate_size=data["moe_intermediate_size"],
                       num_experts=data.get("num_experts") or data.get("num_local_experts"),
                       norm_topk_prob=data.get("norm_topk_prob", False),
                       decoder_sparse_step=data.get("decoder_sparse_step", 1),
                       mlp_only_layers=tuple(data.get("mlp_only_layers") or ()))
        if data.get("sliding_window"):
            raise ValueError("Mixtral with a sliding window is not supported: set sliding_window to null")
        return cls(**common, head_dim=head_dim, moe_intermediate_size=data["intermediate_size"],
                   num_experts=data["num_local_experts"], norm_topk_prob=True)
