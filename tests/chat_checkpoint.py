"""A saved chat checkpoint in a real instruct model's format: a random-weight Qwen3-MoE written by
transformers' save_pretrained, a byte-level BPE tokenizer.json with ChatML's special tokens, a
tokenizer_config.json holding a Qwen-style chat template, and a generation_config.json with an
EOS list and sampling defaults, as Qwen's instruct checkpoints ship them."""

import json

import torch

ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
VOCAB_SIZE = 300
SPECIAL_IDS = {ENDOFTEXT: 256, IM_START: 257, IM_END: 258}
CHATML_TEMPLATE = (
    "{%- if messages[0]['role'] != 'system' %}{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{- raise_exception('Conversation roles must be system, user or assistant') }}{%- endif %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
GENERATION_CONFIG = {"eos_token_id": [SPECIAL_IDS[IM_END], SPECIAL_IDS[ENDOFTEXT]], "do_sample": True,
                     "temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05}


def chatml_tokenizer():
    """Byte-level BPE (256 byte tokens, no merges) plus ChatML's three special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from writescope.models.presets import _bytes_to_unicode

    vocab = {char: byte for byte, char in _bytes_to_unicode().items()}
    vocab.update(SPECIAL_IDS)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(list(SPECIAL_IDS))
    return tokenizer


def save_chat_checkpoint(path, template_in: str = "tokenizer_config") -> str:
    """The checkpoint under path; template_in: "tokenizer_config" (the chat_template key),
    "jinja" (chat_template.jinja, transformers 5's file) or "none"."""
    import transformers

    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
        vocab_size=VOCAB_SIZE, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, intermediate_size=96, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
        norm_topk_prob=True, rms_norm_eps=1e-6, eos_token_id=SPECIAL_IDS[ENDOFTEXT], pad_token_id=0)).eval()
    model.save_pretrained(path)
    chatml_tokenizer().save(str(path / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None, "eos_token": IM_END,
              "pad_token": ENDOFTEXT, "model_max_length": 4096}
    if template_in == "tokenizer_config":
        config["chat_template"] = CHATML_TEMPLATE
    elif template_in == "jinja":
        (path / "chat_template.jinja").write_text(CHATML_TEMPLATE)
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    (path / "generation_config.json").write_text(json.dumps(GENERATION_CONFIG))
    return str(path)
