"""The KV format, defined once: every size of every region is computed here.

A token's KV for one layer is num_kv_heads rows of head_dim_k (K) and head_dim_v (V) elements.
MLA (DeepSeek-V2) stores one latent "head" of kv_lora_rank + rope dims as K, and V is the first
head_dim_v (= kv_lora_rank) dims of it: `v_in_k=True` stores K only.

Layouts (outermost first), all in blocks of block_size tokens:
    cpu_compute   head-major: the CPU kernel streams one head's blocks of one layer from one
                  contiguous range; within a block the layout is the kernel's operand layout
                  ("paired", fixed when the block is written, never converted):
                    K [num_layers, num_kv_heads, num_blocks, head_dim_k / 2, block_size, 2]
                      K transposed in pairs of dims: one vector load is a dim pair of W tokens
                    V [num_layers, num_kv_heads, num_blocks, block_size / 2, head_dim_v, 2]
                      V in pairs of tokens: one vector load is a dim range of a token pair
                  MLA (v_in_k) keeps [num_layers, num_kv_heads, num_blocks, block_size, head_dim_k]
                  ("token_major"): V is a prefix of each token's latent, which pairs would split
    cpu_transfer  [num_layers, num_blocks, num_kv_heads, block_size, head_dim]   block-major: a span
                  of consecutive blocks of one layer is one contiguous DMA
    gpu_window    [num_layers, max_seqs, num_kv_heads, window_tokens, head_dim]
    gpu_pingpong  [2, num_blocks, num_kv_heads, block_size, head_dim]            one layer's chunk each
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from enum import Enum

import torch

# The one table of dtype names (weights, KV, kernel arguments): name -> torch dtype, and back.
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}
TOKEN_MAJOR = "token_major"  # a block's K and V [block_size, head_dim]
PAIRED = "paired"  # a block's K [head_dim / 2, block_size, 2] and V [block_size / 2, head_dim, 2]


class Region(str, Enum):
    """The four regions, the one set of their names (a member equals its name as a string)."""
    CPU_COMPUTE = "cpu_compute"
    CPU_TRANSFER = "cpu_transfer"
    GPU_WINDOW = "gpu_window"
    GPU_PINGPONG = "gpu_pingpong"


HOST_REGIONS = (Region.CPU_COMPUTE.value, Region.CPU_TRANSFER.value)  # the two in host memory (handles)
LAYOUTS = {
    Region.CPU_COMPUTE.value: ("layer", "kv_head", "block", "block_layout"),
    Region.CPU_TRANSFER.value: ("layer", "block", "kv_head", "token", "dim"),
    Region.GPU_WINDOW.value: ("layer", "seq", "kv_head", "token", "dim"),
    Region.GPU_PINGPONG.value: ("buffer", "block", "kv_head", "token", "dim"),
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
        if self.compute_layout == PAIRED:
            odd = [name for name in ("head_dim_k", "head_dim_v", "block_size") if getattr(self, name) % 2]
            if odd:
                raise ValueError(f"KVFormat.{', '.join(odd)} must be even: cpu_compute stores K in pairs of dims "
                                 f"and V in pairs of tokens; got {', '.join(f'{n}={getattr(self, n)}' for n in odd)}")

    @property
    def compute_layout(self) -> str:
        """The block layout of cpu_compute: paired, or token_major where V is inside K (MLA)."""
        return TOKEN_MAJOR if self.v_in_k else PAIRED

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
    def token_bytes(self) -> int:
        """Raw KV bytes of one token in every layer: what a region holds for it."""
        return self.token_bytes_per_layer * self.num_layers

    def shape(self, kind: str, count: int, head_dim: int, *, window_tokens: int = 0,
              array: str = "k") -> tuple[int, ...]:
        """Shape of one stored array (array "k" or "v") of a region; count is blocks, or seqs for the window."""
        if kind == "cpu_compute":
            outer = (self.num_layers, self.num_kv_heads, count)
            if self.compute_layout == TOKEN_MAJOR:
                return (*outer, self.block_size, head_dim)
            return (*outer, *paired_block_shape(array, self.block_size, head_dim))
        if kind == "cpu_transfer":
            return (self.num_layers, count, self.num_kv_heads, self.block_size, head_dim)
        if kind == "gpu_window":
            return (self.num_layers, count, self.num_kv_heads, window_tokens, head_dim)
        if kind == "gpu_pingpong":
            return (2, count, self.num_kv_heads, self.block_size, head_dim)
        raise ValueError(f"unknown region kind {kind!r}; known: {', '.join(LAYOUTS)}")

    @property
    def stored_arrays(self) -> tuple[tuple[str, int], ...]:
        """(name, head_dim) of each stored array: (("k", K),) when V lives inside K."""
        return tuple(zip(("k", "v"), self.stored_dims, strict=False))

    def nbytes(self, kind: str, count: int, *, window_tokens: int = 0) -> int:
        total = 0
        for array, dim in self.stored_arrays:
            elements = 1
            for size in self.shape(kind, count, dim, window_tokens=window_tokens, array=array):
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


def paired_block_shape(array: str, block_size: int, head_dim: int) -> tuple[int, int, int]:
    """A block's K [head_dim / 2, block_size, 2] or V [block_size / 2, head_dim, 2] in the paired layout."""
    if array == "k":
        return (head_dim // 2, block_size, 2)
    if array == "v":
        return (block_size // 2, head_dim, 2)
    raise ValueError(f"array must be 'k' or 'v', got {array!r}")


def to_paired(array: str, blocks: torch.Tensor) -> torch.Tensor:
    """[..., block_size, head_dim] token-major blocks -> the paired layout of K or V (a copy):
    K [..., head_dim / 2, block_size, 2], V [..., block_size / 2, head_dim, 2]."""
    if array == "k":
        return blocks.unflatten(-1, (-1, 2)).transpose(-3, -2).contiguous()
    if array == "v":
        return blocks.unflatten(-2, (-1, 2)).transpose(-2, -1).contiguous()
    raise ValueError(f"array must be 'k' or 'v', got {array!r}")


def from_paired(array: str, blocks: torch.Tensor) -> torch.Tensor:
    """The inverse of to_paired: paired K or V blocks -> [..., block_size, head_dim] (a copy)."""
    if array == "k":
        return blocks.transpose(-3, -2).flatten(-2)
    if array == "v":
        return blocks.transpose(-2, -1).flatten(-3, -2)
    raise ValueError(f"array must be 'k' or 'v', got {array!r}")
