"""DeepSeek-V4 over the checkpoint's named weights (the DeepSeek names `save_pretrained` writes).

What sets it apart from the other three architectures, and where each part lives here:
- Shared-KV multi-query attention: one KV head per layer, read as K and as V (`v_in_k` with V = all
  of K), partial interleaved rope on the trailing `rope_head_dim` channels, undone on the output's
  rope channels at the query's position; a learned sink per head (an extra term of the softmax's
  denominator: `with_sinks`); a grouped low-rank output projection.
- Three layer types. Every layer attends the newest `sliding_window` tokens (`SlidingWindow`, on
  the device). Compressed layers also attend compressed entries: one entry per `rate` tokens,
  pooled by a learned softmax gate when a window of tokens closes (`Compressor`): heavily
  compressed attention (HCA, rate 128) attends every entry; compressed sparse attention (CSA,
  rate 4, windows overlapping by half) attends the `index_topk` entries its lightning indexer
  scores highest for the query (`Indexer`, its own small compressor and keys, on the device).
  The entries are the long-range KV: where they live and how they are attended is the
  `EntryStore`'s (dense tensors here for the reference; InplaceKVCache's regions in the engine).
- Manifold-constrained hyper-connections: the residual is `hc_mult` streams [T, hc, hidden],
  collapsed into a block's input and expanded from its output by weights computed from the
  streams (`hyper_weights`, a Sinkhorn projection for the mixing matrix).
- MoE with sqrt-softplus scores; the first layers route by a fixed token-id table (hash MoE);
  expert pre-activations clipped at `swiglu_limit`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn.functional as F

from writescope import dense, ops
from writescope.models.config import RopeConfig
from writescope.models.layers import apply_rope_interleaved, rope_frequencies

ARCH = "deepseek_v4"
SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
LAYER_TYPES = (SLIDING, CSA, HCA)
MLP_TYPES = ("hash_moe", "moe")
SCORING = ("sqrtsoftplus", "softmax", "sigmoid")
QUERY_CHUNK = 512  # prefill queries attended at a time, at most
QUERY_SCORES = 1 << 24  # score elements a prefill chunk holds, about (64 MiB in float32)


@dataclass(frozen=True)
class DeepseekV4Config:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_q_heads: int
    head_dim: int  # of the one shared KV head, and of each query head
    rope_head_dim: int  # the trailing channels of a head that rope rotates
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    layer_types: tuple[str, ...]
    mlp_layer_types: tuple[str, ...]
    csa_rate: int
    hca_rate: int
    sliding_window: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    num_experts: int
    top_k: int
    moe_intermediate_size: int
    n_shared_experts: int
    scoring_func: str
    routed_scaling_factor: float
    swiglu_limit: float
    rms_norm_eps: float
    main_rope: RopeConfig
    compress_rope: RopeConfig
    tie_word_embeddings: bool = False
    eos_token_ids: tuple[int, ...] = ()
    dtype: str = "float32"
    arch: str = field(default=ARCH, init=False)

    # the vocabulary the engine speaks for every architecture
    @property
    def num_kv_heads(self) -> int:
        return 1

    @property
    def decode_head_dim_qk(self) -> int:
        return self.head_dim

    @property
    def decode_head_dim_v(self) -> int:
        return self.head_dim

    @property
    def attention_scale(self) -> float:
        return self.head_dim ** -0.5

    @property
    def is_mla(self) -> bool:
        return False

    def rate(self, layer: int) -> int:
        """Tokens per compressed entry of a layer; 0 for a sliding-only layer."""
        return {SLIDING: 0, CSA: self.csa_rate, HCA: self.hca_rate}[self.layer_types[layer]]

    def layers_of(self, layer_type: str) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == layer_type)

    @classmethod
    def from_hf(cls, data: dict) -> DeepseekV4Config:
        n = data["num_hidden_layers"]
        layer_types = tuple(data.get("layer_types") or _default_layer_types(n))
        mlp_types = tuple(data.get("mlp_layer_types") or (["hash_moe"] * min(n, 3) + ["moe"] * max(0, n - 3)))
        for name, types, allowed in (("layer_types", layer_types, LAYER_TYPES),
                                     ("mlp_layer_types", mlp_types, MLP_TYPES)):
            if len(types) != n or any(t not in allowed for t in types):
                raise ValueError(f"{name} must list one of {allowed} for each of the {n} layers, got {list(types)}")
        if data.get("num_key_value_heads", 1) != 1:
            raise ValueError(f"DeepSeek-V4 shares one KV head; num_key_value_heads={data['num_key_value_heads']}")
        if data.get("scoring_func", "sqrtsoftplus") not in SCORING:
            raise ValueError(f"scoring_func {data['scoring_func']!r} is not supported; allowed: {', '.join(SCORING)}")
        if data.get("quantization_config"):
            raise ValueError("quantized DeepSeek-V4 checkpoints (FP8/FP4 experts) are not supported: convert the "
                             "weights to bf16 or float32 first")
        head_dim = data["head_dim"]
        rope_head_dim = int(head_dim * (data.get("partial_rotary_factor") or 64 / 512))
        rates = data.get("compress_rates") or {}
        eos = data.get("eos_token_id")
        main, compress = _rope_configs(data)
        return cls(
            vocab_size=data["vocab_size"], hidden_size=data["hidden_size"], num_layers=n,
            num_q_heads=data["num_attention_heads"], head_dim=head_dim, rope_head_dim=rope_head_dim,
            q_lora_rank=data["q_lora_rank"], o_groups=data["o_groups"], o_lora_rank=data["o_lora_rank"],
            layer_types=layer_types, mlp_layer_types=mlp_types, csa_rate=rates.get(CSA, 4),
            hca_rate=rates.get(HCA, 128),
            sliding_window=data["sliding_window"], index_n_heads=data["index_n_heads"],
            index_head_dim=data["index_head_dim"], index_topk=data["index_topk"], hc_mult=data["hc_mult"],
            hc_sinkhorn_iters=data["hc_sinkhorn_iters"], hc_eps=data["hc_eps"],
            num_experts=data["n_routed_experts"], top_k=data["num_experts_per_tok"],
            moe_intermediate_size=data["moe_intermediate_size"], n_shared_experts=data.get("n_shared_experts") or 0,
            scoring_func=data.get("scoring_func", "sqrtsoftplus"),
            routed_scaling_factor=data.get("routed_scaling_factor", 1.0), swiglu_limit=data.get("swiglu_limit", 10.0),
            rms_norm_eps=data.get("rms_norm_eps", 1e-6), main_rope=main, compress_rope=compress,
            tie_word_embeddings=data.get("tie_word_embeddings", False),
            eos_token_ids=tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,)),
            dtype=str(data.get("dtype") or data.get("torch_dtype") or "float32"))


def _default_layer_types(n: int) -> list[str]:
    """transformers' default schedule: two HCA layers, then CSA and HCA alternating."""
    return ([HCA] * min(n, 2) + [CSA if i % 2 else HCA for i in range(max(n - 2, 0))])[:n]


def _rope_configs(data: dict) -> tuple[RopeConfig, RopeConfig]:
    """(main, compress) rope: sliding layers use the plain rope at rope_theta; compressed layers, their
    compressors and indexers the compress rope (compress_rope_theta, YaRN where configured, with an
    attention factor of 1 as the reference code has it)."""
    params = data.get("rope_parameters") or {}
    if isinstance(params.get("main"), dict) and isinstance(params.get("compress"), dict):
        main, compress = dict(params["main"]), dict(params["compress"])
    else:
        main = {"rope_type": "default", "rope_theta": data.get("rope_theta", 10000.0)}
        compress = {**{k: v for k, v in params.items() if k not in ("main", "compress")},
                    "rope_theta": data.get("compress_rope_theta", 160000.0)}
        compress.setdefault("rope_type", "default")
    if compress.get("rope_type") == "yarn":
        compress.setdefault("attention_factor", 1.0)
    limits = {"max_position_embeddings": data.get("max_position_embeddings", 1 << 20)}
    return (RopeConfig.from_hf({**limits, "rope_parameters": main}),
            RopeConfig.from_hf({**limits, "rope_parameters": compress}))


# ---------------------------------------------------------------------------------------------- names
_PREFIX_RENAMES = {"embed_tokens.weight": "embed.weight", "lm_head.weight": "head.weight",
                   "hc_head.hc_fn": "hc_head_fn", "hc_head.hc_base": "hc_head_base",
                   "hc_head.hc_scale": "hc_head_scale"}


def canonical_name(name: str) -> str:
    """A checkpoint weight's name as DeepSeek's release spells it (`layers.3.attn.wq_a.weight`): the
    `model.` prefix and the few names transformers' save writes its own way are mapped back."""
    name = name.removeprefix("model.")
    return _PREFIX_RENAMES.get(name, name)


def expected_shapes(cfg: DeepseekV4Config) -> dict[str, tuple[int, ...]]:
    """Every weight the model reads, by canonical name, with its shape."""
    d, hc, mix = cfg.hidden_size, cfg.hc_mult, (2 + cfg.hc_mult) * cfg.hc_mult
    shapes = {"embed.weight": (cfg.vocab_size, d), "norm.weight": (d,), "hc_head_fn": (hc, hc * d),
              "hc_head_base": (hc,), "hc_head_scale": (1,)}
    if not cfg.tie_word_embeddings:
        shapes["head.weight"] = (cfg.vocab_size, d)
    for layer in range(cfg.num_layers):
        p = f"layers.{layer}."
        shapes.update({p + "attn_norm.weight": (d,), p + "ffn_norm.weight": (d,)})
        for block in ("attn", "ffn"):
            shapes.update({p + f"hc_{block}_fn": (mix, hc * d), p + f"hc_{block}_base": (mix,),
                           p + f"hc_{block}_scale": (3,)})
        shapes.update(_attention_shapes(cfg, layer, p + "attn."))
        shapes.update(_ffn_shapes(cfg, layer, p + "ffn."))
    return shapes


def _attention_shapes(cfg, layer, p):
    d, hd, heads = cfg.hidden_size, cfg.head_dim, cfg.num_q_heads
    shapes = {p + "wq_a.weight": (cfg.q_lora_rank, d), p + "q_norm.weight": (cfg.q_lora_rank,),
              p + "wq_b.weight": (heads * hd, cfg.q_lora_rank), p + "wkv.weight": (hd, d), p + "norm.weight": (hd,),
              p + "wo_a.weight": (cfg.o_groups * cfg.o_lora_rank, heads * hd // cfg.o_groups),
              p + "wo_b.weight": (d, cfg.o_groups * cfg.o_lora_rank), p + "attn_sink": (heads,)}
    kind = cfg.layer_types[layer]
    if kind == SLIDING:
        return shapes
    rate, width = cfg.rate(layer), (2 if kind == CSA else 1) * hd
    shapes.update({p + "compressor.wkv.weight": (width, d), p + "compressor.wgate.weight": (width, d),
                   p + "compressor.ape": (rate, width), p + "compressor.norm.weight": (hd,)})
    if kind == CSA:
        di = cfg.index_head_dim
        shapes.update({p + "indexer.compressor.wkv.weight": (2 * di, d),
                       p + "indexer.compressor.wgate.weight": (2 * di, d),
                       p + "indexer.compressor.ape": (rate, 2 * di), p + "indexer.compressor.norm.weight": (di,),
                       p + "indexer.wq_b.weight": (cfg.index_n_heads * di, cfg.q_lora_rank),
                       p + "indexer.weights_proj.weight": (cfg.index_n_heads, d)})
    return shapes


def _ffn_shapes(cfg, layer, p):
    d, inter, experts = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts
    shapes = {p + "gate.weight": (experts, d)}
    if cfg.mlp_layer_types[layer] == "hash_moe":
        shapes[p + "gate.tid2eid"] = (cfg.vocab_size, cfg.top_k)
    else:
        shapes[p + "gate.bias"] = (experts,)
    for e in range(experts):
        shapes.update({p + f"experts.{e}.w1.weight": (inter, d), p + f"experts.{e}.w3.weight": (inter, d),
                       p + f"experts.{e}.w2.weight": (d, inter)})
    if cfg.n_shared_experts:
        shared = inter * cfg.n_shared_experts
        shapes.update({p + "shared_experts.w1.weight": (shared, d), p + "shared_experts.w3.weight": (shared, d),
                       p + "shared_experts.w2.weight": (d, shared)})
    return shapes


# ---------------------------------------------------------------------------------------------- pieces
def unweighted_rms_norm(x, eps):
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


def rms_norm_fp32_weight(x, weight, eps):
    # V4 keeps its norm weights in float32: the scaling is done there, then cast once
    x32 = x.float()
    return (weight.float() * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps))).to(x.dtype)


def hyper_weights(streams, fn, base, scale, iters: int, eps: float, norm_eps: float):
    """streams [T, hc, hidden] -> (pre [T, hc], post [T, hc], comb [T, hc, hc]) float32: how a block's
    input is collapsed from the streams, its output spread back, and the streams mixed (comb made
    doubly stochastic by Sinkhorn-Knopp iterations)."""
    tokens, hc = streams.shape[0], streams.shape[1]
    mixes = F.linear(unweighted_rms_norm(streams.reshape(tokens, -1).float(), norm_eps), fn.float())
    pre_w, post_w, comb_w = mixes.split([hc, hc, hc * hc], dim=-1)
    pre_b, post_b, comb_b = base.float().split([hc, hc, hc * hc])
    pre = torch.sigmoid(pre_w * scale[0] + pre_b) + eps
    post = 2 * torch.sigmoid(post_w * scale[1] + post_b)
    comb = torch.softmax(comb_w.view(tokens, hc, hc) * scale[2] + comb_b.view(hc, hc), dim=-1) + eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return pre, post, comb


def rope_rotation(positions, inv_freq, factor: float):
    """positions [T], a rope's inverse frequencies [rope_head_dim / 2] and attention factor -> the
    interleaved rotation [T, 1, rope_head_dim / 2] (complex)."""
    freqs = positions[:, None].float() * inv_freq[None, :]
    return (torch.polar(torch.ones_like(freqs), freqs) * factor)[:, None, :]


def apply_trailing_rope(x, rotation):
    """x [T, heads, dim]: rope on the trailing channels (rotation [T, 1, rd / 2] complex); the rest as is."""
    rope_dim = rotation.shape[-1] * 2
    return torch.cat([x[..., :-rope_dim], apply_rope_interleaved(x[..., -rope_dim:], rotation)], dim=-1)


def with_sinks(out, lse, sinks):
    """out [B, H, D], lse [B, H] of the attended KV, sinks [H] -> out with each head's sink in the
    softmax's denominator: exp(lse) / (exp(lse) + exp(sink)) of it (0 for an empty part)."""
    keep = torch.sigmoid(lse - sinks.float()[None, :])
    return out * keep[..., None]


def attention_with_lse(q, k, scale, bias=None):
    """q [T, H, D], k [S, D] or per query [T, S, D] (V = K), bias [T, S] additive (-inf masked) or None
    -> (out [T, H, D], lse [T, H]) in float32; a row with nothing visible gives out 0 and lse -inf."""
    keys, k32 = ("tsd" if k.dim() == 3 else "sd"), k.float()
    scores = torch.einsum(f"thd,{keys}->ths", q.float(), k32) * scale
    if bias is not None:
        scores = scores + bias[:, None, :]
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - torch.where(torch.isinf(lse), 0.0, lse)[..., None])
    return torch.einsum(f"ths,{keys}->thd", probs, k32), lse


class EntryStore(Protocol):
    """Where a layer's compressed entries live, and how a query attends them."""

    def write(self, layer: int, slots: torch.Tensor, entries: torch.Tensor) -> None:
        """entries [n, head_dim]: each slot's next entry of `layer`."""

    def attend(self, layer: int, slots: torch.Tensor, q: torch.Tensor, scale: float,
               selected: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """q [B, H, D] of the slots' sequences -> (out [B, H, D], lse [B, H]) over their entries of
        `layer` (every one, or those of selected [B, k], -1 for none)."""

    def write_many(self, layer: int, slot: int, entries: torch.Tensor, first: int) -> None:
        """entries [n, head_dim]: one sequence's entries [first, first + n) of `layer` (a prompt's)."""

    def read(self, layer: int, slot: int, count: int) -> torch.Tensor:
        """[count, head_dim]: a sequence's first `count` entries of `layer`, as written (a later
        prefill chunk's read of the earlier ones)."""


class DenseEntries:
    """The reference store: each sequence's entries of each layer as one growing device tensor."""

    def __init__(self):
        self.store: dict[tuple[int, int], torch.Tensor] = {}

    def write(self, layer, slots, entries):
        for slot, entry in zip(slots.tolist(), entries, strict=True):
            held = self.store.get((layer, slot))
            self.store[(layer, slot)] = entry[None] if held is None else torch.cat([held, entry[None]])

    def write_many(self, layer, slot, entries, first):
        held = self.store.get((layer, slot))
        written = 0 if held is None else held.shape[0]
        if first != written:
            raise ValueError(f"entries of layer {layer} continue at {written}, not {first}")
        self.store[(layer, slot)] = entries if held is None else torch.cat([held, entries])

    def read(self, layer, slot, count):
        return self.store[(layer, slot)][:count]

    def attend(self, layer, slots, q, scale, selected):
        outs, lses = [], []
        for row, slot in enumerate(slots.tolist()):
            held = self.store.get((layer, slot))
            if held is None:
                outs.append(torch.zeros_like(q[row], dtype=torch.float32))
                lses.append(torch.full(q.shape[1:2], float("-inf"), device=q.device))
                continue
            bias = None
            if selected is not None:
                chosen = selected[row][selected[row] >= 0]
                bias = torch.full((1, held.shape[0]), float("-inf"), device=q.device)
                bias[0, chosen] = 0.0
            out, lse = attention_with_lse(q[row:row + 1], held, scale, bias)
            outs.append(out[0])
            lses.append(lse[0])
        return torch.stack(outs), torch.stack(lses)


# ---------------------------------------------------------------------------------------------- per-sequence state
class SequenceStates:
    """What decoding a sequence keeps besides its compressed entries, per slot, on the device: each
    layer's newest `sliding_window` tokens (a ring: token p at p % window), each compressor's tokens of
    the window still open (their projections, gates with the position bias added) and, for CSA, the
    last closed window's first half (the overlap the next entry pools), and each indexer's keys."""

    def __init__(self, cfg: DeepseekV4Config, max_seqs: int, max_seq_len: int, device, dtype):
        self.cfg = cfg
        hd, w = cfg.head_dim, cfg.sliding_window
        self.ring = torch.zeros(cfg.num_layers, max_seqs, w, hd, dtype=dtype, device=device)
        self.pools: dict[int, Pool] = {}
        self.index_pools: dict[int, Pool] = {}
        self.index_keys: dict[int, torch.Tensor] = {}  # CSA layer -> [max_seqs, max_entries, index_head_dim]
        for layer in range(cfg.num_layers):
            rate = cfg.rate(layer)
            if not rate:
                continue
            overlap = cfg.layer_types[layer] == CSA
            self.pools[layer] = Pool(max_seqs, rate, hd, overlap, device, dtype)
            if overlap:
                self.index_pools[layer] = Pool(max_seqs, rate, cfg.index_head_dim, True, device, dtype)
                # float32, as the indexer scores in it: no conversion of every key at every step
                self.index_keys[layer] = torch.zeros(max_seqs, max_seq_len // rate + 1, cfg.index_head_dim,
                                                     dtype=torch.float32, device=device)

    def reset(self, slot: int) -> None:
        for pool in [*self.pools.values(), *self.index_pools.values()]:
            pool.reset(slot)


class Pool:
    """One compressor's open window per slot: kv and gate [max_seqs, rate, width] (width = 2 * dim with
    overlap: the first half feeds the next entry, the second this one; gates in float32), and the
    overlap carried."""

    def __init__(self, max_seqs, rate, dim, overlap: bool, device, dtype):
        width = 2 * dim if overlap else dim
        self.rate, self.dim, self.overlap = rate, dim, overlap
        self.kv = torch.zeros(max_seqs, rate, width, dtype=dtype, device=device)
        self.gate = torch.zeros(max_seqs, rate, width, dtype=torch.float32, device=device)
        if overlap:
            self.prev_kv = torch.zeros(max_seqs, rate, dim, dtype=dtype, device=device)
            self.prev_gate = torch.full((max_seqs, rate, dim), float("-inf"), dtype=torch.float32, device=device)

    def reset(self, slot: int) -> None:
        if self.overlap:  # the first entry has no earlier window: its half weighs nothing
            self.prev_kv[slot] = 0
            self.prev_gate[slot] = float("-inf")


def _pool_windows(kv, gate, prev_kv, prev_gate, dim):
    """Closed windows -> what each entry pools. kv, gate [n, windows, rate, width]; with overlap
    (prev_* [n, rate, dim]: the window before the first) -> [n, windows, 2 * rate, dim] each: the
    previous window's first half, then this window's second half; without: as they are."""
    if prev_kv is None:
        return kv, gate
    first_kv = torch.cat([prev_kv[:, None], kv[:, :-1, :, :dim]], dim=1)
    first_gate = torch.cat([prev_gate[:, None], gate[:, :-1, :, :dim]], dim=1)
    return torch.cat([first_kv, kv[..., dim:]], dim=2), torch.cat([first_gate, gate[..., dim:]], dim=2)


# ---------------------------------------------------------------------------------------------- the model
class DeepseekV4Model:
    """The forward pass as functions over the named weights (canonical names, `expected_shapes`).

    A decode step runs, per layer: `attention_block` (hyper-connection in, projections, the sliding
    window and the compressed entries attended, output projection, hyper-connection out) and
    `ffn_block` (the same around the MoE). Prefill runs the same pieces over a prompt's tokens."""

    def __init__(self, config: DeepseekV4Config, weights: dict[str, torch.Tensor], *, device="cpu"):
        self.config = config
        self.device = torch.device(device)
        self.w = {canonical_name(n): t.to(self.device) for n, t in weights.items()}
        self.dtype = self.w["embed.weight"].dtype
        # each rope's (inverse frequencies on the device, attention factor), made once
        self.frequencies = {name: (inv_freq.to(self.device), factor) for name, (inv_freq, factor) in (
            ("main", rope_frequencies(config.rope_head_dim, config.main_rope)),
            ("compress", rope_frequencies(config.rope_head_dim, config.compress_rope)))}
        for layer in range(config.num_layers):
            for name in self._expert_names(layer):
                gate, up = self.w.pop(name + "w1.weight"), self.w.pop(name + "w3.weight")
                self.w[name + "gate_up"] = torch.cat([gate, up])

    def _expert_names(self, layer):
        p = f"layers.{layer}.ffn."
        names = [p + f"experts.{e}." for e in range(self.config.num_experts)]
        return names + ([p + "shared_experts."] if self.config.n_shared_experts else [])

    # ------------------------------------------------------------------ embedding and head
    def embed(self, token_ids):
        # token_ids [T] -> streams [T, hc, hidden]: every stream starts as the embedding
        x = F.embedding(token_ids, self.w["embed.weight"])
        return x[:, None, :].expand(-1, self.config.hc_mult, -1).contiguous()

    def logits(self, streams):
        # streams [T, hc, hidden] -> [T, vocab] float32
        cfg = self.config
        flat = unweighted_rms_norm(streams.flatten(1).float(), cfg.rms_norm_eps)
        mixes = F.linear(flat, self.w["hc_head_fn"].float())
        pre = torch.sigmoid(mixes * self.w["hc_head_scale"].float() + self.w["hc_head_base"].float()) + cfg.hc_eps
        hidden = (pre[..., None] * streams).sum(dim=1).to(streams.dtype)
        hidden = rms_norm_fp32_weight(hidden, self.w["norm.weight"], cfg.rms_norm_eps)
        head = self.w.get("head.weight", self.w["embed.weight"])
        return dense.linear(hidden, head).float()

    def rotations(self, positions):
        """positions [T] -> {"main", "compress"}: the rope rotations every layer of a step shares."""
        return {name: rope_rotation(positions, *frequencies) for name, frequencies in self.frequencies.items()}

    # ------------------------------------------------------------------ hyper-connections
    def _collapse(self, layer, block, streams):
        """streams [T, hc, hidden] -> (block input [T, hidden], post, comb) of one block of a layer."""
        cfg, p = self.config, f"layers.{layer}.hc_{block}_"
        pre, post, comb = hyper_weights(streams, self.w[p + "fn"], self.w[p + "base"], self.w[p + "scale"].float(),
                                        cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.rms_norm_eps)
        return (pre[..., None] * streams).sum(dim=1).to(streams.dtype), post, comb

    @staticmethod
    def _expand(streams, out, post, comb):
        # the block's output spread over the streams, plus the streams mixed (comb read transposed)
        dtype = streams.dtype
        return post.to(dtype)[..., None] * out[:, None, :] + torch.matmul(comb.to(dtype).transpose(-1, -2), streams)

    # ------------------------------------------------------------------ attention
    def attention_inputs(self, layer, streams, rotations):
        """streams [T, hc, hidden] -> (x [T, hidden] the block's normed input, q_residual [T, q_lora_rank],
        q [T, heads, head_dim], kv [T, head_dim] roped, post, comb)."""
        cfg, p = self.config, f"layers.{layer}.attn."
        collapsed, post, comb = self._collapse(layer, "attn", streams)
        x = rms_norm_fp32_weight(collapsed, self.w[f"layers.{layer}.attn_norm.weight"], cfg.rms_norm_eps)
        rotation = rotations[self._rope_type(layer)]
        q_residual = rms_norm_fp32_weight(dense.linear(x, self.w[p + "wq_a.weight"]), self.w[p + "q_norm.weight"],
                                          cfg.rms_norm_eps)
        q = dense.linear(q_residual, self.w[p + "wq_b.weight"]).view(x.shape[0], cfg.num_q_heads, cfg.head_dim)
        q = apply_trailing_rope(unweighted_rms_norm(q, cfg.rms_norm_eps), rotation)
        kv = rms_norm_fp32_weight(dense.linear(x, self.w[p + "wkv.weight"]), self.w[p + "norm.weight"],
                                  cfg.rms_norm_eps)
        kv = apply_trailing_rope(kv[:, None, :], rotation)[:, 0]
        return x, q_residual, q, kv, post, comb

    def _rope_type(self, layer):
        return "main" if self.config.layer_types[layer] == SLIDING else "compress"

    def attention_output(self, layer, attention, streams, post, comb, rotations):
        """attention [T, heads, head_dim] float32 (sinks applied) -> the streams after the block: the rope
        of V (V is K) undone at the query's position, the grouped output projection, the expansion."""
        cfg, p = self.config, f"layers.{layer}.attn."
        attention = apply_trailing_rope(attention.to(streams.dtype), rotations[self._rope_type(layer)].conj())
        tokens, groups = attention.shape[0], cfg.o_groups
        grouped = attention.reshape(tokens, groups, -1).transpose(0, 1)  # [groups, T, heads * dim / groups]
        wo_a = self.w[p + "wo_a.weight"].view(groups, cfg.o_lora_rank, -1).transpose(1, 2)
        low_rank = torch.bmm(grouped, wo_a).transpose(0, 1).reshape(tokens, -1)  # [T, groups * o_lora_rank]
        return self._expand(streams, dense.linear(low_rank, self.w[p + "wo_b.weight"]), post, comb)

    def sinks(self, layer):
        return self.w[f"layers.{layer}.attn.attn_sink"]

    # ------------------------------------------------------------------ compressors
    def compressor_inputs(self, layer, x, slots_in_window, indexer=False):
        """x [T, hidden] -> (kv, gate) [T, width] of a layer's compressor (or its indexer's), the gate with
        the position bias of each token's slot in its window (slots_in_window [T])."""
        p = f"layers.{layer}.attn." + ("indexer.compressor." if indexer else "compressor.")
        # the position bias stays in float32 (as the checkpoint keeps it), so the gate does too
        gate = dense.linear(x, self.w[p + "wgate.weight"]) + self.w[p + "ape"][slots_in_window].float()
        return dense.linear(x, self.w[p + "wkv.weight"]), gate

    def pool(self, layer, kv, gate, starts, indexer=False):
        """What closed windows pool into their entries. kv, gate [n, 2 * rate or rate, dim] (overlap laid
        out), starts [n] the windows' first positions -> entries [n, dim], normed and roped there."""
        p = f"layers.{layer}.attn." + ("indexer.compressor." if indexer else "compressor.")
        pooled = (kv * gate.softmax(dim=1, dtype=torch.float32).to(kv.dtype)).sum(dim=1)
        pooled = rms_norm_fp32_weight(pooled, self.w[p + "norm.weight"], self.config.rms_norm_eps)
        rotation = rope_rotation(starts, *self.frequencies["compress"])
        return apply_trailing_rope(pooled[:, None, :], rotation)[:, 0]

    def index_scores(self, layer, x, q_residual, rotation, keys):
        """The lightning indexer: x [T, hidden], q_residual [T, q_lora_rank], keys [T or 1, n, index_head_dim]
        -> [T, n] float32, sum_h w_h relu(q_h . k)."""
        cfg, p = self.config, f"layers.{layer}.attn.indexer."
        q = dense.linear(q_residual, self.w[p + "wq_b.weight"]).view(x.shape[0], cfg.index_n_heads, cfg.index_head_dim)
        q = apply_trailing_rope(q, rotation)
        scores = F.relu(torch.einsum("thd,tnd->thn", q.float(), keys.float().expand(x.shape[0], -1, -1)))
        scores = scores * cfg.index_head_dim ** -0.5
        weights = dense.linear(x, self.w[p + "weights_proj.weight"]).float() * cfg.index_n_heads ** -0.5
        return (scores * weights[..., None]).sum(dim=1)

    # ------------------------------------------------------------------ feed-forward
    def ffn_block(self, layer, streams, token_ids):
        """streams [T, hc, hidden], token_ids [T] (the hash layers route by them) -> streams after the MoE."""
        cfg = self.config
        collapsed, post, comb = self._collapse(layer, "ffn", streams)
        x = rms_norm_fp32_weight(collapsed, self.w[f"layers.{layer}.ffn_norm.weight"], cfg.rms_norm_eps)
        return self._expand(streams, self._moe(layer, x, token_ids), post, comb)

    def _moe(self, layer, x, token_ids):
        cfg, p = self.config, f"layers.{layer}.ffn."
        weights, experts = self._route(layer, x, token_ids)
        out = torch.zeros_like(x)
        for e in torch.unique(experts).tolist():
            token_idx, slot = torch.where(experts == e)
            y = self._clipped_swiglu(x[token_idx], p + f"experts.{e}.")
            out.index_add_(0, token_idx, (y * weights[token_idx, slot, None]).to(x.dtype))
        if cfg.n_shared_experts:
            out = out + self._clipped_swiglu(x, p + "shared_experts.")
        return out

    def _clipped_swiglu(self, x, name):
        gate, up = dense.linear(x, self.w[name + "gate_up"]).chunk(2, dim=-1)
        limit = self.config.swiglu_limit
        return dense.linear(F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit), self.w[name + "w2.weight"])

    def _route(self, layer, x, token_ids):
        """x [T, hidden] -> (weights [T, top_k], experts [T, top_k]): hash layers take the token's fixed
        experts, the others the top-k of score + bias; weights are the scores, normalised and scaled."""
        cfg, p = self.config, f"layers.{layer}.ffn.gate."
        logits = dense.linear(x, self.w[p + "weight"])
        if cfg.scoring_func == "sqrtsoftplus":
            scores = F.softplus(logits).sqrt()
        elif cfg.scoring_func == "softmax":
            scores = logits.softmax(dim=-1)
        else:
            scores = logits.sigmoid()
        if cfg.mlp_layer_types[layer] == "hash_moe":
            experts = self.w[p + "tid2eid"][token_ids].long()
        else:
            experts = torch.topk(scores + self.w[p + "bias"].to(scores.dtype), cfg.top_k, dim=-1, sorted=False).indices
        weights = scores.gather(1, experts)
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * cfg.routed_scaling_factor, experts


# ---------------------------------------------------------------------------------------------- the forward passes
class DeepseekV4Forward:
    """Prefill and decode over one model, its per-sequence states and an EntryStore: the attention
    of a layer is the sliding window's partial and the entries' partial, merged by LSE, with the
    sinks in the denominator."""

    def __init__(self, model: DeepseekV4Model, states: SequenceStates, store: EntryStore):
        self.model, self.states, self.store = model, states, store
        self.cfg = model.config
        # False: decode attends every CSA entry (the indexer's selection disabled): the dense peer of
        # the sparse step in benchmarks; the model's own attention keeps it True
        self.select_entries = True

    # ------------------------------------------------------------------ decode
    @torch.inference_mode()
    def decode(self, token_ids, positions, slots):
        """token_ids, positions, slots [B] (on the model's device) -> logits [B, vocab]: one token of each
        sequence at its position."""
        model = self.model
        rotations = model.rotations(positions)
        streams = model.embed(token_ids)
        for layer in range(self.cfg.num_layers):
            x, q_residual, q, kv, post, comb = model.attention_inputs(layer, streams, rotations)
            attention = self.decode_attention(layer, x, q_residual, q, kv, positions, slots, rotations)
            streams = model.attention_output(layer, attention, streams, post, comb, rotations)
            streams = model.ffn_block(layer, streams, token_ids)
        return model.logits(streams)

    def decode_attention(self, layer, x, q_residual, q, kv, positions, slots, rotations):
        cfg, window = self.cfg, self.cfg.sliding_window
        ring = self.states.ring[layer]
        ring[slots, positions % window] = kv
        visible = torch.arange(window, device=q.device)[None, :] <= positions[:, None]
        bias = torch.zeros(visible.shape, device=q.device).masked_fill(~visible, float("-inf"))
        partial = attention_with_lse(q, ring[slots], cfg.attention_scale, bias)
        if cfg.rate(layer):
            selected = self.decode_compress(layer, x, q_residual, positions, slots, rotations)
            partial = ops.merge([partial, self.store.attend(layer, slots, q, cfg.attention_scale, selected)])
        return with_sinks(*partial, self.model.sinks(layer))

    def decode_compress(self, layer, x, q_residual, positions, slots, rotations):
        """This token into the layer's open windows; windows it closes pooled into entries and written.
        -> the CSA indexer's selection [B, k] (-1: none), or None for HCA (every entry)."""
        rate = self.cfg.rate(layer)
        in_window = positions % rate
        closes = in_window == rate - 1
        entry = self._decode_pool(layer, self.states.pools[layer], x, in_window, closes, positions, slots, False)
        if entry is not None:
            self.store.write(layer, slots[closes], entry)
        if layer not in self.states.index_pools:
            return None
        keys = self.states.index_keys[layer]
        key = self._decode_pool(layer, self.states.index_pools[layer], x, in_window, closes, positions, slots, True)
        if key is not None:
            keys[slots[closes], (positions[closes] + 1) // rate - 1] = key.float()
        if not self.select_entries:
            return None
        counts = (positions + 1) // rate  # entries each sequence has now
        width = max(int(counts.max()), 1)
        # the batch's keys: a view for one sequence, else one gather of the rows' first `width`
        batch_keys = keys[slots[0], :width][None] if slots.shape[0] == 1 else keys[:, :width].index_select(0, slots)
        scores = self.model.index_scores(layer, x, q_residual, rotations["compress"], batch_keys)
        return _top_entries(scores, counts.tolist(), self.cfg.index_topk)

    def _decode_pool(self, layer, pool, x, in_window, closes, positions, slots, indexer):
        kv, gate = self.model.compressor_inputs(layer, x, in_window, indexer)
        pool.kv[slots, in_window] = kv
        pool.gate[slots, in_window] = gate
        if not bool(closes.any()):
            return None
        rows = slots[closes]
        window_kv, window_gate = pool.kv[rows][:, None], pool.gate[rows][:, None]  # [n, 1 window, rate, width]
        prev_kv = pool.prev_kv[rows] if pool.overlap else None
        prev_gate = pool.prev_gate[rows] if pool.overlap else None
        kv, gate = _pool_windows(window_kv, window_gate, prev_kv, prev_gate, pool.dim)
        if pool.overlap:
            pool.prev_kv[rows] = window_kv[:, 0, :, : pool.dim]
            pool.prev_gate[rows] = window_gate[:, 0, :, : pool.dim]
        starts = positions[closes] - pool.rate + 1
        return self.model.pool(layer, kv[:, 0], gate[:, 0], starts, indexer)

    # ------------------------------------------------------------------ prefill
    @torch.inference_mode()
    def prefill(self, token_ids, slot: int, start: int = 0, prompt_tokens: int | None = None):
        """token_ids [T]: a prompt's tokens [start, start + T) -> the last one's logits [1, vocab]; the
        sliding windows, open compressor windows, entries and indexer keys written. start 0: a new
        sequence (its state reset); else a later chunk of the same prompt, starting on a window of
        every compressor (start a multiple of each rate), which attends what the earlier chunks wrote:
        its sliding windows' earlier tokens from the rings, the earlier entries read back.
        prompt_tokens: the whole prompt's length (default: up to this chunk's end)."""
        model, cfg = self.model, self.cfg
        if start == 0:
            self.states.reset(slot)
        elif any(start % rate for rate in map(cfg.rate, range(cfg.num_layers)) if rate):
            raise ValueError(f"a prefill chunk must start on a compressor window (a multiple of "
                             f"{sorted({cfg.csa_rate, cfg.hca_rate})}), got {start}")
        positions = torch.arange(start, start + token_ids.shape[0], device=model.device)
        rotations = model.rotations(positions)
        streams = model.embed(token_ids)
        for layer in range(cfg.num_layers):
            x, q_residual, q, kv, post, comb = model.attention_inputs(layer, streams, rotations)
            window_kv = torch.cat([self._ring_before(layer, slot, start), kv])  # the chunk's and before it
            self._prefill_ring(layer, kv, slot, start)
            entries, keys = self._prefill_compress(layer, x, slot, start) if cfg.rate(layer) else (None, None)
            attention = self._prefill_attention(layer, x, q_residual, q, window_kv, entries, keys, rotations, start,
                                                prompt_tokens or start + token_ids.shape[0])
            streams = model.attention_output(layer, attention, streams, post, comb, rotations)
            streams = model.ffn_block(layer, streams, token_ids)
        return model.logits(streams[-1:])

    def _ring_before(self, layer, slot, start):
        """[earlier, head_dim]: the tokens before `start` a chunk's first query still sees (window - 1)."""
        window = self.cfg.sliding_window
        earlier = torch.arange(max(0, start - window + 1), start, device=self.states.ring.device)
        return self.states.ring[layer, slot, earlier % window]

    def _prefill_ring(self, layer, kv, slot, start):
        window = self.cfg.sliding_window
        last = torch.arange(max(0, kv.shape[0] - window), kv.shape[0], device=kv.device)
        self.states.ring[layer, slot, (start + last) % window] = kv[last]

    def _prefill_compress(self, layer, x, slot, start):
        """The chunk's closed windows pooled into entries (written to the store) and indexer keys; its
        last, open window left in the pools. -> (every entry of the sequence so far [n, head_dim], its
        indexer keys [n, index_head_dim] float32 or None)."""
        first = start // self.cfg.rate(layer)  # the chunk's first entry
        new = self._prefill_pool(layer, self.states.pools[layer], x, slot, False, start)
        if new.shape[0]:
            self.store.write_many(layer, slot, new, first)
        entries = torch.cat([self.store.read(layer, slot, first).to(new.dtype), new]) if first else new
        if layer not in self.states.index_pools:
            return entries, None
        keys = self.states.index_keys[layer][slot]
        new_keys = self._prefill_pool(layer, self.states.index_pools[layer], x, slot, True, start)
        keys[first: first + new_keys.shape[0]] = new_keys
        return entries, keys[: entries.shape[0]]

    def _prefill_pool(self, layer, pool, x, slot, indexer, start):
        tokens, rate = x.shape[0], pool.rate
        kv, gate = self.model.compressor_inputs(layer, x, torch.arange(tokens, device=x.device) % rate, indexer)
        closed = tokens // rate * rate
        open_tokens = tokens - closed
        pool.kv[slot, :open_tokens] = kv[closed:]
        pool.gate[slot, :open_tokens] = gate[closed:]
        windows = closed // rate
        if not windows:
            return kv.new_zeros((0, pool.dim))
        window_kv = kv[:closed].view(1, windows, rate, -1)
        window_gate = gate[:closed].view(1, windows, rate, -1)
        prev_kv = pool.prev_kv[slot:slot + 1] if pool.overlap else None
        prev_gate = pool.prev_gate[slot:slot + 1] if pool.overlap else None
        pooled_kv, pooled_gate = _pool_windows(window_kv, window_gate, prev_kv, prev_gate, pool.dim)
        if pool.overlap:
            pool.prev_kv[slot] = window_kv[0, -1, :, : pool.dim]
            pool.prev_gate[slot] = window_gate[0, -1, :, : pool.dim]
        starts = start + torch.arange(windows, device=x.device) * rate
        return self.model.pool(layer, pooled_kv[0], pooled_gate[0], starts, indexer)

    def _prefill_attention(self, layer, x, q_residual, q, window_kv, entries, keys, rotations, start, prompt_tokens):
        """Every query of the chunk over its sliding window (window_kv: the chunk's tokens and the ones
        before it they see) and the entries it may see (HCA: every closed window before it; CSA: the
        indexer's top-k of those, gathered), a part of the queries at a time."""
        cfg, window, tokens = self.cfg, self.cfg.sliding_window, q.shape[0]
        earlier = window_kv.shape[0] - tokens  # window_kv[j] is position start - earlier + j
        count = 0 if entries is None else entries.shape[0]
        out = torch.empty(tokens, cfg.num_q_heads, cfg.head_dim, dtype=torch.float32, device=q.device)
        part_size = _query_chunk(cfg, window + (min(count, cfg.index_topk) if keys is not None else count))
        for first in range(0, tokens, part_size):
            last = min(first + part_size, tokens)
            query_pos = torch.arange(start + first, start + last, device=q.device)
            key_first = max(0, earlier + first - window + 1)  # in window_kv
            key_pos = start - earlier + torch.arange(key_first, earlier + last, device=q.device)
            distance = query_pos[:, None] - key_pos[None, :]
            bias = _mask_bias((distance >= 0) & (distance < window))
            partial = attention_with_lse(q[first:last], window_kv[key_first:earlier + last], cfg.attention_scale,
                                         bias)
            if count:
                visible = torch.arange(count, device=q.device)[None, :] < ((query_pos + 1) // cfg.rate(layer))[:, None]
                if keys is None:
                    part = attention_with_lse(q[first:last], entries, cfg.attention_scale, _mask_bias(visible))
                else:
                    part = self._selected_attention(layer, x[first:last], q_residual[first:last], q[first:last],
                                                    rotations["compress"][first:last], entries, keys, visible,
                                                    max(prompt_tokens // cfg.rate(layer), count))
                partial = ops.merge([partial, part])
            out[first:last] = with_sinks(*partial, self.model.sinks(layer))
        return out

    def _selected_attention(self, layer, x, q_residual, q, rotation, entries, keys, visible, prompt_entries):
        """CSA: each query over the indexer's top-k of the entries it may see, gathered -> (out, lse). The
        scores are laid over the whole prompt's entries (prompt_entries; the later chunks' at -inf), so
        that a chunk's top-k breaks ties as the whole prompt's does (ReLU scores tie at 0 often)."""
        count = entries.shape[0]
        scores = self.model.index_scores(layer, x, q_residual, rotation, keys[None])
        scores = F.pad(scores.masked_fill(~visible, float("-inf")), (0, prompt_entries - count), value=float("-inf"))
        top = scores.topk(min(self.cfg.index_topk, prompt_entries), dim=-1).indices  # [chunk, k]
        chosen = F.pad(visible, (0, prompt_entries - count)).gather(1, top)
        top = torch.where(chosen, top, 0)
        gathered = entries.index_select(0, top.flatten()).view(*top.shape, entries.shape[-1])  # [chunk, k, dim]
        return attention_with_lse(q, gathered, self.cfg.attention_scale, _mask_bias(chosen))


def _top_entries(scores, counts: list[int], k: int):
    """scores [B, width] of the rows' first counts[b] entries -> the top min(k, count) of each row
    [B, k'] (-1 past a row's own). Each row's top-k is taken over exactly its own entries: ReLU scores
    tie at 0 often, and which of tied entries a top-k keeps depends on the length it is taken over,
    so a row padded to the batch's longest would not keep what the same sequence keeps alone."""
    width = min(k, max(counts + [1]))
    top = torch.full((scores.shape[0], width), -1, dtype=torch.int64, device=scores.device)
    if len(set(counts)) == 1:
        if counts[0]:
            top[:, : min(k, counts[0])] = scores[:, : counts[0]].topk(min(k, counts[0]), dim=-1).indices
        return top
    for row, count in enumerate(counts):
        if count:
            top[row, : min(k, count)] = scores[row, :count].topk(min(k, count)).indices
    return top


def _mask_bias(visible):
    """A bool mask -> its additive bias: 0 where visible, -inf elsewhere."""
    return torch.zeros(visible.shape, device=visible.device).masked_fill(~visible, float("-inf"))


def _query_chunk(cfg: DeepseekV4Config, keys: int) -> int:
    """Prefill queries attended at a time, so that a chunk's scores ([chunk, heads, keys] and the
    indexer's [chunk, index heads, entries]) stay near QUERY_SCORES elements."""
    return max(16, min(QUERY_CHUNK, QUERY_SCORES // (max(cfg.num_q_heads, cfg.index_n_heads) * max(keys, 1))))


def random_weights(cfg: DeepseekV4Config, dtype: torch.dtype, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random weights of the release's names and shapes (a preset's): norms and hyper-connection scales
    at one, biases, sinks and position biases at zero, hash routes at random, matrices normal."""
    generator = torch.Generator().manual_seed(seed)
    weights = {}
    for name, shape in expected_shapes(cfg).items():
        if name.endswith("tid2eid"):
            weights[name] = torch.randint(0, cfg.num_experts, shape, generator=generator)
        elif name.endswith(("norm.weight", "_scale")):
            weights[name] = torch.ones(shape, dtype=dtype)
        elif name.endswith(("_base", "attn_sink", ".ape", "gate.bias")):
            weights[name] = torch.zeros(shape, dtype=dtype)
        else:
            weights[name] = (torch.randn(shape, generator=generator) * 0.06).to(dtype)
    return weights
