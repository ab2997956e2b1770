"""Partial attention and the exact LSE merge: the contract every backend keeps.

A partial is the attention of the query over one part of the sequence, normalised over that part,
with its log-sum-exp:

    out [num_q_heads, head_dim_v]  float32, softmax(q k^T * scale) v over the part's tokens
    lse [num_q_heads]              float32, natural log of sum exp(q k^T * scale); -inf when empty

Partials of disjoint parts merge exactly (see `merge_partials`), so attention can be split along
the sequence between devices. Backends: "torch" (float32 reference, any device), "cpu" (the C++
kernel, CPU tensors) and "triton" (split-KV Triton kernels: CUDA tensors, or CPU tensors under
`TRITON_INTERPRET=1`).
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import torch

from writescope import env, reference
from writescope.kv_format import DTYPE_NAMES, PAIRED, TOKEN_MAJOR, from_paired

BACKENDS = ("torch", "cpu", "triton")
QUERY_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
KV_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def partial_attention(q, k, v, *, scale=None, backend="cpu"):
    """Attention of one query token over one sequence, head-major KV.

    q [num_q_heads, head_dim_qk]; k [num_kv_heads, seq_len, head_dim_qk];
    v [num_kv_heads, seq_len, head_dim_v] -> out [num_q_heads, head_dim_v], lse [num_q_heads].
    A thin case of `paged_partial_attention`: the sequence is one block.
    """
    _check_tensor(q, "q", 2, "[num_q_heads, head_dim_qk]", QUERY_DTYPES)
    _check_tensor(k, "k", 3, "[num_kv_heads, seq_len, head_dim_qk]", KV_DTYPES)
    _check_tensor(v, "v", 3, "[num_kv_heads, seq_len, head_dim_v]", KV_DTYPES)
    if k.shape[1] != v.shape[1]:
        raise ValueError(f"k and v must hold the same number of tokens, got k {tuple(k.shape)}, v {tuple(v.shape)}")
    seq_len = k.shape[1]
    block_table = torch.zeros((1, 1), dtype=torch.int32, device=k.device)
    seq_lens = torch.tensor([seq_len], dtype=torch.int32, device=k.device)
    out, lse = paged_partial_attention(
        q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), block_table, seq_lens, scale=scale, backend=backend
    )
    return out[0], lse[0]


class KVSource(NamedTuple):
    """One paged KV source of a batch: block_table [num_seqs, max_blocks] int32, seq_lens [num_seqs]
    int32, and the blocks in one of two layouts (kv_format):
        token_major  k_cache [num_blocks, num_kv_heads, block_size, head_dim_qk],
                     v_cache [num_blocks, num_kv_heads, block_size, head_dim_v]
        paired       k_cache [num_blocks, num_kv_heads, head_dim_qk / 2, block_size, 2],
                     v_cache [num_blocks, num_kv_heads, block_size / 2, head_dim_v, 2]
                     (cpu_compute's; the cpu backend reads it as is, the others from a token-major copy)
    The layout is told by k_cache's rank (4 or 5)."""

    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_table: torch.Tensor
    seq_lens: torch.Tensor

    @property
    def layout(self) -> str:
        return PAIRED if self.k_cache.dim() == 5 else TOKEN_MAJOR

    def token_major(self) -> KVSource:
        """This source in the token-major layout (itself when it is; a copy of the blocks when paired)."""
        if self.layout == TOKEN_MAJOR:
            return self
        return KVSource(from_paired("k", self.k_cache), from_paired("v", self.v_cache), self.block_table, self.seq_lens)


def paged_partial_attention(q, k_cache, v_cache, block_table, seq_lens, *, scale=None, backend="cpu"):
    """Decode attention for a batch of sequences over a paged, head-major KV cache.

    q [num_seqs, num_q_heads, head_dim_qk]
    k_cache [num_blocks, num_kv_heads, block_size, head_dim_qk]
    v_cache [num_blocks, num_kv_heads, block_size, head_dim_v]   (may be a view of k_cache, as in MLA)
    block_table [num_seqs, max_blocks_per_seq] int32: sequence s's token t is in block
        block_table[s, t // block_size] at offset t % block_size
    seq_lens [num_seqs] int32
    -> out [num_seqs, num_q_heads, head_dim_v] float32, lse [num_seqs, num_q_heads] float32
    """
    return multi_source_partial_attention(
        q, [KVSource(k_cache, v_cache, block_table, seq_lens)], scale=scale, backend=backend
    )


def multi_source_partial_attention(q, sources, *, scale=None, backend="cpu"):
    """One partial over several paged sources holding disjoint tokens of the same sequences (the
    GPU window and the ping-pong buffer, say). q [num_seqs, num_q_heads, head_dim_qk]; sources: a
    non-empty sequence of `KVSource` -> out [num_seqs, num_q_heads, head_dim_v], lse [num_seqs,
    num_q_heads]. The triton backend fuses the sources into one split-KV reduction; the others
    attend each source and merge."""
    _check_backend(backend)
    if not sources:
        raise ValueError("sources must hold at least one KVSource")
    sources = [KVSource(*source) for source in sources]
    for source in sources:
        _check_paged_structure(q, source)
    if len({_head_dim_v(s) for s in sources}) != 1:
        raise ValueError("every source must have the same head_dim_v")
    _check_devices(backend, q, *(t for source in sources for t in source))
    scale = _resolve_scale(scale, q.shape[-1])
    if backend == "triton":
        for source in sources:
            _check_block_values(source)
    return attend(q, sources, scale, backend)


def attend(q, sources, scale: float, backend: str):
    """multi_source_partial_attention for callers whose sources were checked when they were made
    (the cache validates its tables as blocks are written): no Python checks and no host sync on
    the hot path. The C++ launcher still checks every argument, and every block id, before a read.
    q [num_seqs, num_q_heads, head_dim_qk] -> (out [num_seqs, num_q_heads, head_dim_v], lse [num_seqs, num_q_heads])."""
    if backend == "triton":
        return _triton_module().paged_attention(q, [s.token_major() for s in sources], scale)
    if backend == "torch":
        partials = [reference.paged_attention(q, *source.token_major(), scale) for source in sources]
        return partials[0] if len(partials) == 1 else reference.merge_partials(
            torch.stack([p[0] for p in partials]), torch.stack([p[1] for p in partials]))
    return merge([cpu_paged_attention_timed(q, source, scale)[:2] for source in sources])


class Partial(NamedTuple):
    """A partial with what it cost: out [num_seqs, num_q_heads, head_dim_v], lse [num_seqs, num_q_heads],
    the KV tokens it attended and its seconds (kernel time, or the wall time of a whole path)."""

    out: torch.Tensor
    lse: torch.Tensor
    tokens: int
    seconds: float


def empty_partial(q: torch.Tensor, head_dim_v: int) -> Partial:
    """The partial over no tokens for q [num_seqs, num_q_heads, head_dim_qk]: out 0, lse -inf, which
    leaves any merge it joins unchanged, bit for bit."""
    num_seqs, num_q_heads, _ = q.shape
    return Partial(torch.zeros((num_seqs, num_q_heads, head_dim_v), dtype=torch.float32, device=q.device),
                   torch.full((num_seqs, num_q_heads), -math.inf, dtype=torch.float32, device=q.device), 0, 0.0)


def merge(partials):
    """The one merge of a step: (out, lse) pairs (or Partials) of disjoint parts of the same rows, on
    one device, -> (out, lse) of their union, exact in float32 (see merge_partials): the C++ merge on
    the host, the Triton merge on CUDA."""
    if len(partials) == 1:
        return partials[0][0], partials[0][1]
    outs = torch.stack([p[0] for p in partials])
    lses = torch.stack([p[1] for p in partials])
    if outs.is_cuda:
        return _merge_flattened(outs, lses, _triton_module().merge_partials)
    return _merge_flattened(outs, lses, _cpu_merge_rows)


def merge_partials(outs, lses, *, backend="torch"):
    """Merges partials of disjoint parts of the same sequences into the partial of their union.

    outs [num_parts, *rows, head_dim_v] float32, lses [num_parts, *rows] float32 (natural log,
    -inf for an empty part) -> out [*rows, head_dim_v], lse [*rows]. Rows whose parts are all
    empty give out 0 and lse -inf. With m = max_p lse_p and w_p = exp(lse_p - m):
    out = sum_p w_p out_p / sum_p w_p, lse = m + log(sum_p w_p), all in float32.
    """
    _check_backend(backend)
    _check_merge_args(outs, lses)
    _check_devices(backend, outs, lses)
    if backend == "torch":
        return reference.merge_partials(outs, lses)
    if not (outs.is_contiguous() and lses.is_contiguous()):
        raise ValueError(f"outs and lses must be contiguous for the {backend} backend")
    if backend == "triton":
        return _merge_flattened(outs, lses, _triton_module().merge_partials)
    return _merge_flattened(outs, lses, _cpu_merge_rows)


def _check_backend(backend):
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}; got {backend!r}")


def _check_tensor(t, name, ndim, layout, dtypes):
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor {layout}, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-d {layout}, got shape {tuple(t.shape)}")
    if t.dtype not in dtypes:
        allowed = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise ValueError(f"{name} has dtype {str(t.dtype).removeprefix('torch.')}; allowed: {allowed}")


def _check_devices(backend, *tensors):
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(map(str, devices))}")
    device = devices.pop()
    if backend == "cpu" and device.type != "cpu":
        raise ValueError(f"the cpu backend takes CPU tensors, got {device}")
    if backend == "triton":
        interpreted = env.TRITON_INTERPRET.enabled()
        if device.type == "cpu" and not interpreted:
            raise ValueError("the triton backend takes CUDA tensors; for CPU tensors set TRITON_INTERPRET=1 "
                             "before writescope.triton_attention is imported")
        if device.type == "cuda" and interpreted:
            raise ValueError("TRITON_INTERPRET is set: the triton backend runs interpreted on CPU tensors only")
        if device.type not in ("cpu", "cuda"):
            raise ValueError(f"the triton backend takes CUDA tensors, got {device}")


def _head_dim_v(source: KVSource) -> int:
    return source.v_cache.shape[-2] if source.layout == PAIRED else source.v_cache.shape[-1]


def _check_paged_structure(q, source: KVSource):
    k_cache, v_cache, block_table, seq_lens = source
    _check_tensor(q, "q", 3, "[num_seqs, num_q_heads, head_dim_qk]", QUERY_DTYPES)
    if isinstance(k_cache, torch.Tensor) and k_cache.dim() == 5:
        _check_tensor(k_cache, "k_cache", 5, "[num_blocks, num_kv_heads, head_dim_qk / 2, block_size, 2] (paired)",
                      KV_DTYPES)
        _check_tensor(v_cache, "v_cache", 5, "[num_blocks, num_kv_heads, block_size / 2, head_dim_v, 2] (paired)",
                      KV_DTYPES)
        num_blocks, num_kv_heads, k_pairs, block_size, k_pair = k_cache.shape
        k_dim = 2 * k_pairs
        v_blocks, v_heads, v_pairs, _, v_pair = v_cache.shape
        if (v_blocks, v_heads, 2 * v_pairs, k_pair, v_pair) != (num_blocks, num_kv_heads, block_size, 2, 2):
            raise ValueError(f"paired k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} must agree in "
                             "blocks, heads and block size, with pairs of 2")
    else:
        _check_tensor(k_cache, "k_cache", 4, "[num_blocks, num_kv_heads, block_size, head_dim_qk]", KV_DTYPES)
        _check_tensor(v_cache, "v_cache", 4, "[num_blocks, num_kv_heads, block_size, head_dim_v]", KV_DTYPES)
        num_blocks, num_kv_heads, block_size, k_dim = k_cache.shape
        if tuple(v_cache.shape[:3]) != (num_blocks, num_kv_heads, block_size):
            raise ValueError(
                f"v_cache {tuple(v_cache.shape)} must match k_cache {tuple(k_cache.shape)} in blocks, heads and "
                "block size")
    _check_tensor(block_table, "block_table", 2, "[num_seqs, max_blocks_per_seq]", (torch.int32,))
    _check_tensor(seq_lens, "seq_lens", 1, "[num_seqs]", (torch.int32,))
    if k_cache.dtype != v_cache.dtype:
        raise ValueError(f"k_cache ({k_cache.dtype}) and v_cache ({v_cache.dtype}) must have the same dtype")
    num_seqs, num_q_heads, head_dim_qk = q.shape
    if k_dim != head_dim_qk:
        raise ValueError(f"k_cache head_dim_qk {k_dim} differs from q's {head_dim_qk}")
    if num_kv_heads < 1 or num_q_heads % num_kv_heads != 0:
        raise ValueError(f"num_q_heads ({num_q_heads}) must be a positive multiple of num_kv_heads ({num_kv_heads})")
    if block_table.shape[0] != num_seqs or seq_lens.shape[0] != num_seqs:
        raise ValueError(
            f"block_table {tuple(block_table.shape)} and seq_lens {tuple(seq_lens.shape)} must have "
            f"num_seqs = {num_seqs} rows, as q"
        )


def _check_block_values(source):
    """Every block a sequence uses is inside the cache, and no sequence is longer than its table:
    checked on the tensors' device with one host sync, before any kernel reads through them."""
    num_blocks = source.k_cache.shape[0]
    block_size = source.k_cache.shape[3 if source.layout == PAIRED else 2]
    table, lens = source.block_table, source.seq_lens
    capacity = table.shape[1] * block_size
    lens64 = lens.long()
    used_blocks = (lens64 + max(block_size, 1) - 1) // max(block_size, 1)
    used = torch.arange(table.shape[1], device=table.device)[None, :] < used_blocks[:, None]
    bad_block = used & ((table < 0) | (table >= num_blocks))
    bad_len = (lens64 < 0) | (lens64 > capacity)
    if bool(bad_block.any() | bad_len.any()):
        if bad_len.any():
            s = int(bad_len.nonzero()[0, 0])
            raise ValueError(
                f"seq_lens[{s}] = {int(lens[s])} is outside [0, {capacity}] (max_blocks_per_seq x block_size)"
            )
        s, j = (int(x) for x in bad_block.nonzero()[0])
        raise ValueError(f"block_table[{s}, {j}] = {int(table[s, j])} is outside [0, {num_blocks})")


def _check_merge_args(outs, lses):
    _check_tensor(lses, "lses", lses.dim() if isinstance(lses, torch.Tensor) else 2, "[num_parts, *rows]",
                  (torch.float32,))
    _check_tensor(outs, "outs", lses.dim() + 1, "[num_parts, *rows, head_dim_v]", (torch.float32,))
    if lses.dim() < 1 or lses.shape[0] < 1:
        raise ValueError(f"lses must be [num_parts >= 1, *rows], got shape {tuple(lses.shape)}")
    if tuple(outs.shape[:-1]) != tuple(lses.shape):
        raise ValueError(f"outs {tuple(outs.shape)} must be lses {tuple(lses.shape)} plus a head_dim_v dimension")
    if torch.isnan(lses).any() or torch.isposinf(lses).any():
        raise ValueError("lses holds NaN or +inf; allowed: finite values, or -inf for an empty part")


def _resolve_scale(scale, head_dim_qk):
    if scale is None:
        return head_dim_qk**-0.5
    scale = float(scale)
    if not math.isfinite(scale):
        raise ValueError(f"scale must be finite, got {scale}")
    return scale


def _as_numpy(t):
    """Zero-copy numpy view; bfloat16 travels as its int16 bit pattern (numpy has no bfloat16)."""
    t = t.detach()
    return t.view(torch.int16).numpy() if t.dtype == torch.bfloat16 else t.numpy()


def kept_numpy_view(t: torch.Tensor):
    """_as_numpy of a host tensor, made on first use and kept on it: for a tensor that lives as long as
    what holds it and never moves (a cache's per-layer KV view, a model's weight), which a decode step
    passes to a C++ kernel every step, where making the view costs about 3 us a call (measured on a
    2-vCPU Zen 4)."""
    array = getattr(t, "_writescope_numpy", None)
    if array is None:
        array = _as_numpy(t)
        t._writescope_numpy = array
    return array


def keep_numpy_view(t: torch.Tensor) -> torch.Tensor:
    """t with its kept numpy view made now (kept_numpy_view), for the caches' KV views, which the
    kernel calls then find made; t is returned, and a device tensor is left as it is."""
    if t.device.type == "cpu":
        kept_numpy_view(t)
    return t


def _kv_numpy(t):
    """_as_numpy of a KV array: the view kept on it, if any. A caller's own tensor gets none kept:
    it may be resized or refilled in another storage after the call."""
    array = getattr(t, "_writescope_numpy", None)
    return _as_numpy(t) if array is None else array


def _triton_module():
    from writescope import triton_attention

    return triton_attention


def cpu_rounds_probabilities(q_dtype, kv_dtype) -> bool:
    """Whether the "cpu" backend rounds the softmax probabilities to bf16 before PV, as a GPU
    tensor-core dot and transformers' bf16 attention do: for bf16 q and KV, its bf16-dot path (where
    the extension measured the dot faster than float32 FMAs) and its AMX tile products. Each output
    dim is then within `reference.probability_rounding_atol(v)` of the float32 reference; lse stays
    float32-exact."""
    return q_dtype == kv_dtype == torch.bfloat16 and _cpu_module().rounds_probabilities()


@functools.cache
def _cpu_module():
    # Imported on first use, so that this module imports before the extension is built; cached (a
    # function-level import took 295 ns a call here, the cached lookup 33; the step makes dozens).
    from writescope import _cpu

    return _cpu


def cpu_paged_attention_timed(q, source: KVSource, scale):
    """The C++ kernel over one source (either layout) -> (out, lse, the kernel's own seconds: a wait
    for its pool, held by another caller, is not counted)."""
    k_cache, v_cache, block_table, seq_lens = source
    num_seqs, num_q_heads, _ = q.shape
    out = torch.empty((num_seqs, num_q_heads, _head_dim_v(source)), dtype=torch.float32)
    lse = torch.empty((num_seqs, num_q_heads), dtype=torch.float32)
    seconds = _cpu_module().paged_attention(
        _as_numpy(q), _kv_numpy(k_cache), _kv_numpy(v_cache), _as_numpy(block_table), _as_numpy(seq_lens),
        out.numpy(), lse.numpy(),
        q_dtype=DTYPE_NAMES[q.dtype], kv_dtype=DTYPE_NAMES[k_cache.dtype], layout=source.layout, scale=scale,
    )
    return out, lse, seconds


def _merge_flattened(outs, lses, merge_rows):
    """Runs a [num_parts, rows, dim] merge over outs [num_parts, *rows, dim] (contiguous: views only)."""
    rows_shape = tuple(lses.shape[1:])
    num_parts, head_dim_v = lses.shape[0], outs.shape[-1]
    num_rows = math.prod(rows_shape)
    out, lse = merge_rows(outs.reshape(num_parts, num_rows, head_dim_v), lses.reshape(num_parts, num_rows))
    return out.reshape(*rows_shape, head_dim_v), lse.reshape(rows_shape)


def _cpu_merge_rows(outs, lses):
    num_parts, num_rows, head_dim_v = outs.shape
    out = torch.empty((num_rows, head_dim_v), dtype=torch.float32)
    lse = torch.empty((num_rows,), dtype=torch.float32)
    _cpu_module().merge_partials(_as_numpy(outs), _as_numpy(lses), out.numpy(), lse.numpy())
    return out, lse

