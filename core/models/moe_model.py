"""The three MoE architectures as one model over named weights (Hugging Face names).

A layer is split into the pieces the decode task graph schedules separately:
    attention_inputs  norm, q/k/v projections, rope (MLA: the absorbed query) -> q, and the KV to store
    attention_output  (MLA: latent -> heads) output projection, residual
    feed_forward      norm, dense MLP or MoE (router, routed + shared experts), residual
Experts are placed hot (on the engine's device) or cold (computed on the CPU); the result does not
depend on the placement.

At load, projections that read the same input are fused into one matrix, as serving engines do
(q/k/v of GQA; gate/up of every MLP and expert), so a decode step makes one small matmul where it
made two or three; the rope tables are made once per step (`rope`) and shared by every layer. A
MoE layer's experts are stacked (each expert's weights a view of the stack), so that a decode step
runs its few (token, expert) pairs at once over the chosen experts' weights, without reading the
choice on the host; a prefill runs each chosen expert once over its tokens.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from writescope import dense
from writescope.models.config import ModelConfig
from writescope.models.layers import (
    apply_rope_interleaved,
    apply_rope_rotate_half,
    rms_norm,
    rope_frequencies,
    rope_interleaved_rotation,
    rope_rotate_half_tables,
    swiglu,
)


class MoEModel:
    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], *, device="cpu",
                 hot_experts: int | None = None):
        self.config = config
        self.device = torch.device(device)
        self.w = weights
        rope_dim = config.qk_rope_head_dim if config.is_mla else config.head_dim
        inv_freq, self.rope_factor = rope_frequencies(rope_dim, config.rope)
        self.inv_freq = inv_freq.to(self.device)  # [rope_dim / 2], beside the positions it multiplies
        self.expert_device = self._place_experts(hot_experts)
        self.stacked_experts: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # layer -> (gate_up, down)
        if config.is_mla:
            self._absorb_mla()
        self._fuse_projections()

    # ------------------------------------------------------------------ placement
    def _place_experts(self, hot_experts):
        """Layer -> expert -> device: the first `hot_experts` of each MoE layer on the engine's device
        (all when None), the others on the CPU."""
        placement = {}
        for layer in range(self.config.num_layers):
            if not self.config.is_moe_layer(layer):
                continue
            hot = self.config.num_experts if hot_experts is None else hot_experts
            placement[layer] = [self.device if e < hot else torch.device("cpu") for e in range(self.config.num_experts)]
            for e, device in enumerate(placement[layer]):
                for name in self._checkpoint_expert_names(layer, e):
                    self.w[name] = self.w[name].to(device)
        return placement

    def _absorb_mla(self):
        """W_UK and W_UV of each layer, for the absorbed query and output. On a CPU they are kept in
        float32 (a copy): torch's bf16 batched matmul there runs a plain loop. DeepSeek-V2-Lite's
        absorb at batch 4 took 7.1 ms in bf16 and 0.26 ms in float32 on a 2-vCPU Zen 3, two per
        layer; the sums are float32 either way, rounded to the model's dtype once."""
        cfg = self.config
        widen = self.device.type == "cpu"
        for layer in range(cfg.num_layers):
            kv_b = self.w[f"model.layers.{layer}.self_attn.kv_b_proj.weight"]
            kv_b = kv_b.view(cfg.num_q_heads, cfg.qk_nope_head_dim + cfg.v_head_dim, cfg.kv_lora_rank)
            if widen:
                kv_b = kv_b.float()
            self.w[f"absorbed.{layer}.w_uk"] = kv_b[:, : cfg.qk_nope_head_dim]  # [heads, nope, latent]
            self.w[f"absorbed.{layer}.w_uv"] = kv_b[:, cfg.qk_nope_head_dim:]  # [heads, v, latent]

    def _fuse_projections(self):
        """q/k/v (GQA) and every gate/up pair as one matrix each; the separate ones are dropped."""
        cfg = self.config
        for layer in range(cfg.num_layers):
            p = f"model.layers.{layer}."
            if not cfg.is_mla:
                names = [p + f"self_attn.{n}_proj.weight" for n in "qkv"]
                self.w[p + "self_attn.qkv_proj.weight"] = torch.cat([self.w.pop(n) for n in names])
            mlps = [p + "mlp."] if not cfg.is_moe_layer(layer) else [p + "mlp.shared_experts."] * bool(
                cfg.n_shared_experts)
            for mlp in mlps:
                self.w[mlp + "gate_up_proj.weight"] = torch.cat([self.w.pop(mlp + "gate_proj.weight"),
                                                                 self.w.pop(mlp + "up_proj.weight")])
            if cfg.is_moe_layer(layer):
                for expert in range(cfg.num_experts):
                    gate, up, _ = self._checkpoint_expert_names(layer, expert)
                    fused, _ = self._expert_names(layer, expert)
                    self.w[fused] = torch.cat([self.w.pop(gate), self.w.pop(up)])
                self._stack_experts(layer)

    def _stack_experts(self, layer):
        """A layer's experts, all on one device, as two stacked tensors (gate_up [E, 2 * inter, hidden],
        down [E, hidden, inter]); each expert's weights become views of them, so nothing is held twice.
        Experts not all on the engine's device (some or all cold) stay apart."""
        if any(device != self.device for device in self.expert_device[layer]):
            return
        names = [self._expert_names(layer, e) for e in range(self.config.num_experts)]
        gate_up = torch.stack([self.w[n] for n, _ in names])
        down = torch.stack([self.w[n] for _, n in names])
        for e, (gate_up_name, down_name) in enumerate(names):
            self.w[gate_up_name], self.w[down_name] = gate_up[e], down[e]
        self.stacked_experts[layer] = (gate_up, down)

    def rope(self, positions):
        """positions [T] -> the rope tables every layer of a step (or a prefill) applies."""
        if self.config.is_mla:
            return rope_interleaved_rotation(positions, self.inv_freq, self.rope_factor)
        return rope_rotate_half_tables(positions, self.inv_freq, self.rope_factor, self.w["model.norm.weight"].dtype)

    # ------------------------------------------------------------------ embedding and head
    def embed(self, token_ids):
        # token_ids [T] -> [T, hidden]
        return F.embedding(token_ids, self.w["model.embed_tokens.weight"])

    def logits(self, hidden):
        # hidden [T, hidden] -> [T, vocab] float32
        x = rms_norm(hidden, self.w["model.norm.weight"], self.config.rms_norm_eps)
        head = self.w.get("lm_head.weight", self.w["model.embed_tokens.weight"])
        return dense.linear(x, head).float()

    # ------------------------------------------------------------------ attention
    def attention_inputs(self, layer, hidden, rope):
        """hidden [T, hidden], rope: self.rope(positions [T]) -> q [T, num_q_heads, decode_head_dim_qk],
        stored [T, kv_heads, dim] per stored array (K, and V unless V lives inside K)."""
        norm_weight = self.w[f"model.layers.{layer}.input_layernorm.weight"]
        if not self.config.is_mla:
            fused = self._fused_gqa_inputs(layer, hidden, norm_weight, rope)
            if fused is not None:
                q, k, v = fused
                return q, [k, v]
        x = rms_norm(hidden, norm_weight, self.config.rms_norm_eps)
        return self._mla_inputs(layer, x, rope) if self.config.is_mla else self._gqa_inputs(layer, x, rope)

    def _fused_gqa_inputs(self, layer, hidden, norm_weight, rope):
        """The decode step's GQA inputs in one C++ call (dense.gqa_inputs), or None."""
        cfg, p = self.config, f"model.layers.{layer}.self_attn."
        norms = (self.w[p + "q_norm.weight"], self.w[p + "k_norm.weight"]) if cfg.arch == "qwen3_moe" else (None, None)
        return dense.gqa_inputs(hidden, norm_weight, cfg.rms_norm_eps, self.w[p + "qkv_proj.weight"], *norms, *rope,
                                cfg.num_q_heads, cfg.num_kv_heads, cfg.head_dim)

    def _gqa_inputs(self, layer, x, rope):
        cfg, p = self.config, f"model.layers.{layer}.self_attn."
        tokens, q_width, kv_width = x.shape[0], cfg.num_q_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        q, k, v = dense.linear(x, self.w[p + "qkv_proj.weight"]).split([q_width, kv_width, kv_width], dim=-1)
        q = q.view(tokens, cfg.num_q_heads, cfg.head_dim)
        k = k.view(tokens, cfg.num_kv_heads, cfg.head_dim)
        v = v.reshape(tokens, cfg.num_kv_heads, cfg.head_dim)
        if cfg.arch == "qwen3_moe":
            q = rms_norm(q, self.w[p + "q_norm.weight"], cfg.rms_norm_eps)
            k = rms_norm(k, self.w[p + "k_norm.weight"], cfg.rms_norm_eps)
        cos, sin = rope
        return apply_rope_rotate_half(q, cos, sin), [apply_rope_rotate_half(k, cos, sin), v]

    def _mla_inputs(self, layer, x, rotation):
        cfg, p = self.config, f"model.layers.{layer}.self_attn."
        tokens = x.shape[0]
        if cfg.q_lora_rank is None:
            q = dense.linear(x, self.w[p + "q_proj.weight"])
        else:
            q_a = rms_norm(dense.linear(x, self.w[p + "q_a_proj.weight"]), self.w[p + "q_a_layernorm.weight"],
                           cfg.rms_norm_eps)
            q = dense.linear(q_a, self.w[p + "q_b_proj.weight"])
        q = q.view(tokens, cfg.num_q_heads, cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)
        q_nope, q_pe = q.split([cfg.qk_nope_head_dim, cfg.qk_rope_head_dim], dim=-1)
        latent, k_pe = dense.linear(x, self.w[p + "kv_a_proj_with_mqa.weight"]).split(
            [cfg.kv_lora_rank, cfg.qk_rope_head_dim], dim=-1)
        latent = rms_norm(latent, self.w[p + "kv_a_layernorm.weight"], cfg.rms_norm_eps)
        q_pe = apply_rope_interleaved(q_pe, rotation)
        k_pe = apply_rope_interleaved(k_pe[:, None, :], rotation)
        # absorbed: q_nope . (W_UK c) == (q_nope W_UK) . c, so the query meets the latent directly
        w_uk = self.w[f"absorbed.{layer}.w_uk"]
        q_latent = torch.einsum("thn,hnc->thc", q_nope.to(w_uk.dtype), w_uk).to(q_nope.dtype)
        return torch.cat([q_latent, q_pe], dim=-1), [torch.cat([latent[:, None, :], k_pe], dim=-1)]

    def attention_output(self, layer, attention, hidden):
        """attention [T, num_q_heads, decode_head_dim_v] float32, hidden [T, hidden] -> hidden after attention."""
        cfg = self.config
        o_proj = self.w[f"model.layers.{layer}.self_attn.o_proj.weight"]
        if not cfg.is_mla:
            fused = dense.output_projection(attention, o_proj, hidden)
            if fused is not None:
                return fused
        attention = attention.to(hidden.dtype)
        if cfg.is_mla:  # latent -> per-head values
            w_uv = self.w[f"absorbed.{layer}.w_uv"]
            attention = torch.einsum("thc,hvc->thv", attention.to(w_uv.dtype), w_uv).to(hidden.dtype)
        out = dense.linear(attention.reshape(attention.shape[0], -1), o_proj)
        return hidden + out

    # ------------------------------------------------------------------ feed-forward
    def feed_forward(self, layer, hidden):
        # hidden [T, hidden] -> [T, hidden]
        p = f"model.layers.{layer}."
        norm_weight = self.w[p + "post_attention_layernorm.weight"]
        fused = self._fused_moe(layer, hidden, norm_weight)
        if fused is not None:
            return fused
        x = rms_norm(hidden, norm_weight, self.config.rms_norm_eps)
        if not self.config.is_moe_layer(layer):
            out = swiglu(x, self.w[p + "mlp.gate_up_proj.weight"], self.w[p + "mlp.down_proj.weight"])
        else:
            out = self._moe(layer, x)
        return hidden + out

    def _fused_moe(self, layer, hidden, norm_weight):
        """A decode step's MoE layer (softmax top-k routing, stacked experts, no shared experts) with
        its norm and residual in one C++ call (dense.moe_feed_forward), or None."""
        cfg, stacked = self.config, self.stacked_experts.get(layer)
        if stacked is None or cfg.arch == "deepseek_v2" or cfg.n_shared_experts:
            return None
        router = self.w[f"model.layers.{layer}.{'block_sparse_moe' if cfg.arch == 'mixtral' else 'mlp'}.gate.weight"]
        return dense.moe_feed_forward(hidden, norm_weight, cfg.rms_norm_eps, router, *stacked, cfg.top_k,
                                      cfg.norm_topk_prob)

    def _moe(self, layer, x):
        weights, experts = self._route(layer, x)  # [T, top_k] each
        stacked = self.stacked_experts.get(layer)
        if stacked is not None and experts.numel() <= self.config.num_experts:
            if dense.takes_routed_experts(x, weights, *stacked):
                out = dense.routed_experts(x, weights, experts, *stacked)
            else:
                out = _gathered_experts(x, weights, experts, *stacked)
        else:
            out = self._experts_one_by_one(layer, x, weights, experts)
        if self.config.n_shared_experts:
            p = f"model.layers.{layer}.mlp.shared_experts."
            out = out + swiglu(x, self.w[p + "gate_up_proj.weight"], self.w[p + "down_proj.weight"])
        return out

    def _experts_one_by_one(self, layer, x, weights, experts):
        """Each chosen expert once over its tokens (a prefill's many tokens, or experts on two devices);
        reads which experts were chosen on the host."""
        out = torch.zeros_like(x)
        for e in torch.unique(experts).tolist():
            token_idx, slot = torch.where(experts == e)
            device = self.expert_device[layer][e]
            gate_up, down = (self.w[n] for n in self._expert_names(layer, e))
            y = swiglu(x[token_idx].to(device), gate_up, down).to(x.device)
            out.index_add_(0, token_idx, (y * weights[token_idx, slot, None]).to(x.dtype))
        return out

    def _route(self, layer, x):
        cfg = self.config
        gate_name = "block_sparse_moe.gate" if cfg.arch == "mixtral" else "mlp.gate"
        logits = dense.linear(x, self.w[f"model.layers.{layer}.{gate_name}.weight"])
        if cfg.arch == "deepseek_v2":
            scores = F.linear(x.float(), self.w[f"model.layers.{layer}.{gate_name}.weight"].float()).softmax(-1)
            if cfg.topk_method == "group_limited_greedy":
                scores = self._limit_groups(scores)
            weights, experts = torch.topk(scores, cfg.top_k, dim=-1, sorted=False)
            return weights * cfg.routed_scaling_factor, experts
        probs = torch.softmax(logits.float(), dim=-1)
        weights, experts = torch.topk(probs, cfg.top_k, dim=-1)
        if cfg.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(logits.dtype), experts

    def _limit_groups(self, scores):
        cfg = self.config
        per_group = cfg.num_experts // cfg.n_group
        group_scores = scores.view(-1, cfg.n_group, per_group).max(dim=-1).values
        keep = torch.zeros_like(group_scores).scatter_(1, torch.topk(group_scores, cfg.topk_group, dim=-1)[1], 1)
        mask = keep[:, :, None].expand(-1, -1, per_group).reshape(-1, cfg.num_experts)
        return scores.masked_fill(mask == 0, 0.0)

    def _checkpoint_expert_names(self, layer, expert):
        """(gate, up, down) weight names of an expert as the checkpoint has them."""
        if self.config.arch == "mixtral":
            p = f"model.layers.{layer}.block_sparse_moe.experts.{expert}."
            return p + "w1.weight", p + "w3.weight", p + "w2.weight"
        p = f"model.layers.{layer}.mlp.experts.{expert}."
        return p + "gate_proj.weight", p + "up_proj.weight", p + "down_proj.weight"

    def _expert_names(self, layer, expert):
        """(fused gate/up, down) weight names of an expert once loaded."""
        gate, _, down = self._checkpoint_expert_names(layer, expert)
        return gate.rsplit(".", 2)[0] + ".gate_up.weight", down


def _gathered_experts(x, weights, experts, gate_up, down):
    """x [T, hidden], weights and experts [T, top_k], gate_up [E, 2 * inter, hidden], down [E, hidden,
    inter] -> [T, hidden]: every (token, expert) pair at once, over its expert's weights gathered
    (at most E of them: a decode step's few tokens). A fixed number of operations whatever experts were
    chosen, and none reads the choice on the host (no device sync inside the layer)."""
    tokens, top_k = experts.shape
    pairs = experts.reshape(-1)
    h = torch.bmm(gate_up.index_select(0, pairs), x.repeat_interleave(top_k, dim=0)[:, :, None])[..., 0]
    gate, up = h.chunk(2, dim=-1)  # [pairs, inter] each
    y = torch.bmm(down.index_select(0, pairs), (F.silu(gate) * up)[:, :, None])[..., 0]  # [pairs, hidden]
    return (y * weights.reshape(-1, 1)).to(x.dtype).view(tokens, top_k, -1).sum(dim=1)
