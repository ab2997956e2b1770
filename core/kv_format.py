"""The KV format, defined once: every size of every region is computed here.

A token's KV for one layer is num_kv_heads rows of head_dim_k (K) and head_dim_v (V) elements.
MLA (DeepSeek-V2) stores one latent "head" of kv_lora_rank + rope dims as K, and V is the first
head_dim_v (= kv_lora_rank) dims of it: `v_in_k=True` stores K only.

Layouts (outermost first), all in blocks of block_size tokens:
    cpu_compute   [num_layers, num_kv_heads, num_blocks, block_size, head_dim]   head-major: the CPU
                  kernel streams one head's blocks of one layer from one contiguous range
    cpu_transfer  [num_layers, num_blocks, num_kv_heads, block_size, head_dim]   block-major: a span
                  of consecutive blocks of one layer is one contiguous DMA
    gpu_window    [num_layers, max_seqs, num_kv_heads, window_tokens, head_dim]
    gpu_pingpong  [2, num_blocks, num_kv_heads, block_size, head_dim]            one layer's chunk each
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
LAYOUTS = {
    "cpu_compute": ("layer", "kv_head", "block", "token", "dim"),
    "cpu_transfer": ("layer", "block", "kv_head", "token", "dim"),
    "gpu_window": ("layer", "seq", "kv_head", "token", "dim"),
    "gpu_pingpong": ("buffer", "block", "kv_head", "token", "dim"),
}


@dataclass(frozen=True)
class KVFormat:
    num_layers: int
    num_kv_heads: int
    head_dim_k: int
    head_dim_v: int
    dtype: str = "bfloat16"
    block_size: int = 16
    v_in_k: bool = False

    def __post_init__(self):
        for name in ("num_layers", "num_kv_heads", "head_dim_k", "head_dim_v", "block_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"KVFormat.{name} must be a positive integer, got {value!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"KVFormat.dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.v_in_k and self.head_dim_v > self.head_dim_k:
            raise ValueError(f"v_in_k needs head_dim_v ({self.head_dim_v}) <= head_dim_k ({self.head_dim_k})")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def itemsize(self) -> int:
        return torch.empty((), dtype=self.torch_dtype).element_size()

    @property
    def stored_dims(self) -> tuple[int, ...]:
        """Elements per (token, head) of each stored array: (K,) when V lives inside K, else (K, V)."""
        return (self.head_dim_k,) if self.v_in_k else (self.head_dim_k, self.head_dim_v)

    @property
    def token_bytes_per_layer(self) -> int:
        return self.num_kv_heads * sum(self.stored_dims) * self.itemsize

    @property
    def block_bytes(self) -> int:
        """One block of every layer: what a region gives per allocated block id."""
        return self.token_bytes_per_layer * self.block_size * self.num_layers

    def shape(self, kind: str, count: int, head_dim: int, *, window_tokens: int = 0) -> tuple[int, ...]:
        """Shape of one stored array (K or V) of a region; count is blocks, or seqs for the window."""
        if kind == "cpu_compute":
            return (self.num_layers, self.num_kv_heads, count, self.block_size, head_dim)
        if kind == "cpu_transfer":
            return (self.num_layers, count, self.num_kv_heads, self.block_size, head_dim)
        if kind == "gpu_window":
            return (self.num_layers, count, self.num_kv_heads, window_tokens, head_dim)
        if kind == "gpu_pingpong":
            return (2, count, self.num_kv_heads, self.block_size, head_dim)
        raise ValueError(f"unknown region kind {kind!r}; known: {', '.join(LAYOUTS)}")

    def nbytes(self, kind: str, count: int, *, window_tokens: int = 0) -> int:
        total = 0
        for dim in self.stored_dims:
            elements = 1
            for size in self.shape(kind, count, dim, window_tokens=window_tokens):
                elements *= size
            total += elements * self.itemsize
        return total

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> KVFormat:
        if not isinstance(data, dict) or set(data) != set(cls.__dataclass_fields__):
            raise ValueError(f"a KVFormat needs exactly the fields {sorted(cls.__dataclass_fields__)}, got {data!r}")
        return cls(**data)
