"""Loading: a checkpoint directory or a preset into its ModelConfig, weights and tokenizer, the
KV format of a model at a dtype, and the cache sized for an engine's limits. What the driver (to
size the regions) and the engine (to build itself) both need, without building an engine."""

from __future__ import annotations

import logging
import os

import torch

from writescope.inplace_kv_cache import CacheConfig
from writescope.kv_format import DTYPE_NAMES, DTYPES
from writescope.kv_regions import HUGE_PAGE_BYTES, PAGE_BYTES, huge_pages_wanted, segment_blocks_for
from writescope.models.checkpoint import load_config, load_weights
from writescope.models.config import ModelConfig
from writescope.models.presets import PRESETS, byte_level_tokenizer, preset_config, preset_weights

log = logging.getLogger(__name__)


def _torch_dtype(dtype) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not supported; allowed: {', '.join(DTYPES)}")
    return DTYPES[dtype]


def load_model(path_or_preset: str, dtype=None, seed: int = 0):
    """(ModelConfig, weights on the CPU, tokenizer or None, torch dtype) of a checkpoint directory or preset."""
    config, torch_dtype = load_model_config(path_or_preset, dtype)
    if os.path.isdir(path_or_preset):
        weights = load_weights(path_or_preset, config, torch_dtype)
    else:
        weights = preset_weights(config, torch_dtype, seed)
    return config, weights, load_tokenizer(path_or_preset), torch_dtype


def load_tokenizer(path_or_preset: str):
    """The tokenizer of a checkpoint directory (None without tokenizer.json) or of a preset."""
    return _load_tokenizer(path_or_preset) if os.path.isdir(path_or_preset) else byte_level_tokenizer()


def load_model_config(path_or_preset: str, dtype=None) -> tuple[ModelConfig, torch.dtype]:
    """The ModelConfig and KV dtype alone (no weights): what sizing the regions needs."""
    torch_dtype = _torch_dtype(dtype)
    if os.path.isdir(path_or_preset):
        config = load_config(path_or_preset)
        default = config.dtype if config.dtype in DTYPES else "float32"
        return config, torch_dtype or _torch_dtype(default)
    if path_or_preset in PRESETS:
        return preset_config(path_or_preset), torch_dtype or torch.float32
    raise ValueError(f"{path_or_preset!r} is neither a checkpoint directory nor a preset; "
                     f"presets: {', '.join(PRESETS)}")


def kv_format(config: ModelConfig, torch_dtype, block_size: int):
    return config.kv_format(DTYPE_NAMES[torch_dtype], block_size)


def _load_tokenizer(path: str):
    file = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(file):
        log.info("%s has no tokenizer.json: prompts must be token ids", path)
        return None
    from tokenizers import Tokenizer

    return Tokenizer.from_file(file)


# One ping-pong buffer's default ceiling: it then holds a whole layer's cpu_transfer blocks of the
# batch (one fill, one device partial per layer) unless they pass this many bytes.
PINGPONG_BUFFER_BYTES = 512 * 2**20


def engine_cache_config(config: ModelConfig, torch_dtype, *, block_size: int, max_batch_size: int, max_seq_len: int,
                        num_shards: int, window_tokens: int, pingpong_blocks: int | None, device: str,
                        huge_pages: bool | None = None) -> CacheConfig:
    """Regions sized so that max_batch_size sequences of max_seq_len fit under any policy (address
    space: a region takes memory segment by segment, as KV is placed in it), in whole segments of
    about SEGMENT_BYTES (in 2 MB pages: of at least 2 MB per layer, kv head and array); ping-pong
    buffers of pingpong_blocks blocks (None: every transfer block of a layer, up to
    PINGPONG_BUFFER_BYTES). huge_pages None: as WRITESCOPE_HUGE_PAGES says (by default where the host
    gives shared memory huge pages)."""
    fmt = kv_format(config, torch_dtype, block_size)
    huge_pages = huge_pages_wanted() if huge_pages is None else huge_pages
    page_bytes = HUGE_PAGE_BYTES if huge_pages else PAGE_BYTES
    blocks_per_seq = -(-max_seq_len // block_size)
    blocks = max_batch_size * blocks_per_seq
    step = segment_blocks_for(fmt, 0, page_bytes)  # the smallest segment whose runs are whole pages
    segment_blocks = min(segment_blocks_for(fmt, page_bytes=page_bytes), -(-blocks // step) * step)
    if pingpong_blocks is None:
        pingpong_blocks = PINGPONG_BUFFER_BYTES // (fmt.nbytes("gpu_pingpong", 1) // 2)
    return CacheConfig(fmt, compute_blocks_per_shard=_whole(-(-blocks // num_shards), segment_blocks),
                       transfer_blocks=_whole(blocks, segment_blocks), max_seqs=max_batch_size,
                       pingpong_blocks=max(1, min(pingpong_blocks, blocks)), num_shards=num_shards,
                       window_tokens=window_tokens, device=device, max_blocks_per_seq=blocks_per_seq,
                       segment_blocks=segment_blocks, huge_pages=huge_pages)


def _whole(blocks: int, segment_blocks: int) -> int:
    """blocks rounded up to whole segments."""
    return -(-blocks // segment_blocks) * segment_blocks
