"""transformers as the oracle: a model saved as a checkpoint beside its greedy answers."""

import torch


def save_with_greedy_answers(model, path, prompt_lens, new_tokens: int):
    """Saves model in path (save_pretrained) and draws one random prompt per length -> (path, prompts,
    per prompt (the greedy tokens of `generate`, its logits per step))."""
    model.save_pretrained(path)
    prompts = [torch.randint(1, 300, (n,)).tolist() for n in prompt_lens]
    expected = []
    with torch.no_grad():
        for prompt in prompts:
            out = model.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False,
                                 output_logits=True, return_dict_in_generate=True)
            expected.append((out.sequences[0, len(prompt):].tolist(), [step[0] for step in out.logits]))
    return str(path), prompts, expected
