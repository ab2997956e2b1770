"""A checkpoint's chat template renders the ids transformers' apply_chat_template gives, from
either place a checkpoint keeps it (or one given); generation_config.json's EOS list ends
generation (unless ignore_eos), and the engine honours stop token ids and penalties per request."""

import json
import shutil

import pytest
import torch

from tests.chat_checkpoint import CHATML_TEMPLATE, GENERATION_CONFIG, SPECIAL_IDS, save_chat_checkpoint
from writescope.chat import ChatTemplate, load_chat_template, load_generation_defaults
from writescope.engine import Engine
from writescope.loading import load_tokenizer
from writescope.models.checkpoint import load_config
from writescope.sampling import SamplingParams

transformers = pytest.importorskip("transformers")

CONVERSATIONS = [
    [{"role": "user", "content": "What is 2 + 2?"}],
    [{"role": "system", "content": "Answer in French."}, {"role": "user", "content": "Hello"},
     {"role": "assistant", "content": "Bonjour"}, {"role": "user", "content": "Ça va? \u00e9\u4e2d"}],
]


@pytest.fixture(scope="module", params=["tokenizer_config", "jinja"])
def checkpoint(request, tmp_path_factory):
    return save_chat_checkpoint(tmp_path_factory.mktemp(f"chat-{request.param}"), request.param)


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_the_template_renders_the_ids_transformers_renders(checkpoint, messages, add_generation_prompt):
    reference = transformers.AutoTokenizer.from_pretrained(checkpoint)
    expected = reference.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True,
                                             return_dict=False)
    template = load_chat_template(checkpoint)
    text = template.render(messages, add_generation_prompt)
    ids = load_tokenizer(checkpoint).encode(text, add_special_tokens=False).ids
    assert ids == list(expected)
    assert ids.count(SPECIAL_IDS["<|im_start|>"]) == len(messages) + (messages[0]["role"] != "system") + \
        add_generation_prompt


def test_a_template_given_by_path_or_text_replaces_none(tmp_path):
    bare = save_chat_checkpoint(tmp_path / "bare", "none")
    assert load_chat_template(bare) is None
    file = tmp_path / "template.jinja"
    file.write_text(CHATML_TEMPLATE)
    for override in (str(file), CHATML_TEMPLATE):
        text = load_chat_template(bare, override).render(CONVERSATIONS[0])
        assert text.endswith("<|im_start|>assistant\n") and "What is 2 + 2?<|im_end|>" in text


def test_a_template_that_refuses_the_messages_is_a_value_error(checkpoint):
    with pytest.raises(ValueError, match="Conversation roles must be system, user or assistant"):
        load_chat_template(checkpoint).render([{"role": "tool", "content": "x"}])
    with pytest.raises(ValueError, match="does not parse"):
        load_chat_template(checkpoint, "{% for %}")


def test_the_presets_ship_a_template():
    text = load_chat_template("tiny-qwen3-moe").render(CONVERSATIONS[0])
    ids = load_tokenizer("tiny-qwen3-moe").encode(text, add_special_tokens=False).ids
    assert ids[0] == 257 and ids[-len("assistant\n") - 1] == 257  # <|im_start|> opens each turn


def test_generation_config_gives_the_eos_list_and_sampling_defaults(checkpoint):
    defaults = load_generation_defaults(checkpoint)
    assert defaults.eos_token_ids == tuple(GENERATION_CONFIG["eos_token_id"])
    assert defaults.sampling == {k: GENERATION_CONFIG[k] for k in ("temperature", "top_p", "top_k",
                                                                    "repetition_penalty")}
    assert set(load_config(checkpoint).eos_token_ids) == {SPECIAL_IDS["<|im_end|>"], SPECIAL_IDS["<|endoftext|>"]}


def _engine(path):
    return Engine.from_pretrained(path, policy="all_cpu", dtype="float32", max_batch_size=2, max_seq_len=256,
                                  block_size=4, window_tokens=8)


def test_generation_config_eos_ends_generation_unless_ignore_eos(checkpoint, tmp_path):
    prompt = list(range(20, 60))
    engine = _engine(checkpoint)
    try:
        free = engine.generate(prompt, params=[SamplingParams(12, ignore_eos=True)])[0]
        end = free.token_ids[3]
        as_stop = engine.generate(prompt, params=[SamplingParams(12, stop=(end,))])[0]
    finally:
        engine.shutdown()
    first = free.token_ids.index(end) + 1
    assert as_stop.finish_reason == "stop" and as_stop.token_ids == free.token_ids[:first]
    # the same token as the end of turn of a checkpoint's generation_config.json
    shutil.copytree(checkpoint, tmp_path / "ends", dirs_exist_ok=True)
    (tmp_path / "ends" / "generation_config.json").write_text(json.dumps({"eos_token_id": [end]}))
    engine = _engine(str(tmp_path / "ends"))
    try:
        ended = engine.generate(prompt, max_new_tokens=12)[0]
        ignored = engine.generate(prompt, params=[SamplingParams(12, ignore_eos=True)])[0]
    finally:
        engine.shutdown()
    assert ended.finish_reason == "eos" and ended.token_ids == free.token_ids[:first]
    assert ignored.finish_reason == "length" and ignored.token_ids == free.token_ids


def test_penalties_change_a_request_and_not_its_batch_neighbour(checkpoint):
    engine = _engine(checkpoint)
    try:
        prompts = [[65] * 30, list(range(30, 70))]
        plain = engine.generate(prompts, max_new_tokens=16)
        penalised = engine.generate(prompts, params=[SamplingParams(16, repetition_penalty=5.0,
                                                                    frequency_penalty=2.0),
                                                     SamplingParams(16)])
    finally:
        engine.shutdown()
    assert penalised[1].token_ids == plain[1].token_ids
    assert penalised[0].token_ids != plain[0].token_ids
    counts = torch.bincount(torch.tensor(penalised[0].token_ids)).max()
    assert counts <= torch.bincount(torch.tensor(plain[0].token_ids)).max()


def test_template_kwargs_reach_the_template_and_cannot_replace_its_inputs():
    template = ChatTemplate("{{ greeting }} {{ messages[0]['content'] }}{% if add_generation_prompt %}!{% endif %}")
    assert template.render([{"role": "user", "content": "x"}], True, greeting="hi") == "hi x!"
    for name in ("messages", "add_generation_prompt", "eos_token"):
        with pytest.raises(ValueError, match=f"cannot set \\['{name}'\\]"):
            template.render([{"role": "user", "content": "x"}], True, **{name: 5})


def test_the_sandbox_refuses_reaching_python_internals():
    escape = ChatTemplate("{{ messages.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(ValueError, match="refused"):
        escape.render([{"role": "user", "content": "x"}])
