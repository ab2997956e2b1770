"""A random-weight DeepSeek-V4 checkpoint and transformers' greedy answers on it: the oracle of the
engine's DeepSeek-V4 tests, local (tests/engine) and on Ray (tests/actors).

Every layer type (sliding-only, CSA, HCA), hash and routed MoE layers and hyper-connections; its
sinks, position biases, router biases and hash routes drawn at random (transformers initialises
them to zero). Compression rates 4 (CSA) and 16 (HCA), an indexer keeping 3 entries; with entry
windows of 4 entries in blocks of 2, prompts of 70-93 tokens flush the entry windows to the host
regions and the indexer selects from every region.
"""

import torch

from tests.hf_reference import save_with_greedy_answers
from writescope.models.deepseek_v4 import CSA, HCA, SLIDING

PROMPT_LENS = (70, 93)
NEW_TOKENS = 16
LAYER_TYPES = [SLIDING, CSA, HCA, CSA]
# the engine's settings under which the prompts reach every region (float32: token-exact)
ENGINE_OPTIONS = {"dtype": "float32", "window_tokens": 4, "block_size": 2, "max_batch_size": 2, "max_seq_len": 256}


def hf_config(transformers, **changes):
    settings = dict(
        vocab_size=300, hidden_size=64, moe_intermediate_size=32, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=1, head_dim=32, q_lora_rank=48, num_experts_per_tok=2, n_routed_experts=4,
        n_shared_experts=1, layer_types=LAYER_TYPES, compress_rates={CSA: 4, HCA: 16}, hc_mult=2,
        hc_sinkhorn_iters=5, mlp_layer_types=["hash_moe", "moe", "moe", "moe"], sliding_window=8, o_groups=2,
        o_lora_rank=16, index_n_heads=2, index_head_dim=16, index_topk=3, partial_rotary_factor=0.5,
        eos_token_id=None, pad_token_id=0)
    settings.update(changes)
    return transformers.DeepseekV4Config(**settings)


def make_checkpoint(transformers, path) -> tuple[str, list[list[int]], list[tuple[list[int], list[torch.Tensor]]]]:
    """Saves the checkpoint in path -> (path, prompts, per prompt (greedy tokens, logits per step))."""
    torch.manual_seed(0)
    model = transformers.DeepseekV4ForCausalLM(hf_config(transformers)).eval()
    with torch.no_grad():  # what the initialisation leaves at zero, drawn, so that each part counts
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            if name.endswith("tid2eid"):
                tensor.copy_(torch.randint(0, 4, tensor.shape))
            elif any(part in name for part in ("sinks", "position_bias", ".base", "hc_base", "e_score")):
                tensor.normal_(0, 0.5)
    return save_with_greedy_answers(model, path, PROMPT_LENS, NEW_TOKENS)
