"""What a checkpoint says about serving it: its chat template and its generation defaults.

    template = load_chat_template("/path/to/checkpoint")          # None when it has none
    text = template.render(messages, add_generation_prompt=True)  # the prompt, as its model was trained
    defaults = load_generation_defaults("/path/to/checkpoint")    # generation_config.json's sampling

The template is the checkpoint's Jinja `chat_template` (chat_template.jinja, else tokenizer_config
.json's `chat_template`, a string or a list of named templates), or one given by path or as text.
It is rendered in Jinja's immutable sandbox with what transformers' apply_chat_template gives a
template (bos_token, eos_token, raise_exception, strftime_now, tojson), so a template renders here
the text transformers renders. A template that raises (a role it does not allow, say) is the
request's error, a ValueError naming the template's message.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from datetime import datetime

from writescope.models.presets import PRESET_CHAT_TEMPLATE, PRESETS

TEMPLATE_FILE = "chat_template.jinja"
# generation_config.json's sampling fields a request falls back to (vLLM's --generation-config auto)
DEFAULT_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


class ChatTemplate:
    def __init__(self, source: str, bos_token: str = "", eos_token: str = ""):
        import jinja2
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        self.source = source
        self.special = {"bos_token": bos_token, "eos_token": eos_token}
        environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        environment.filters["tojson"] = _tojson
        environment.globals["raise_exception"] = _raise
        environment.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            self._template = environment.from_string(source)
        except jinja2.TemplateError as error:
            raise ValueError(f"the chat template does not parse: {error}") from None

    def render(self, messages: list[dict], add_generation_prompt: bool = True, /, **variables) -> str:
        """messages: [{"role", "content"}, ...] -> the prompt text; variables: more names for the
        template (vLLM's chat_template_kwargs). ValueError when the template refuses them."""
        fixed = {"messages": messages, "add_generation_prompt": add_generation_prompt, "tools": None,
                 "documents": None, **self.special}
        taken = sorted(set(variables) & set(fixed))
        if taken:
            raise ValueError(f"chat_template_kwargs cannot set {taken}: the server sets them")
        try:
            return self._template.render(**fixed, **variables)
        except Exception as error:  # noqa: BLE001 - a template that fails on these messages fails this request
            raise ValueError(f"the chat template refused the messages: {error}") from None


def _raise(message: str):
    import jinja2

    raise jinja2.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def load_chat_template(path_or_preset: str, override: str | None = None) -> ChatTemplate | None:
    """The chat template to render chat requests with: override (a file path, or the template's
    text), else the checkpoint's, else None (chat requests are then refused)."""
    special = _special_tokens(path_or_preset)
    if override:
        source = _read(override) if os.path.isfile(override) else override
        return ChatTemplate(source, **special)
    if not os.path.isdir(path_or_preset):
        return ChatTemplate(PRESET_CHAT_TEMPLATE, **special) if path_or_preset in PRESETS else None
    source = _checkpoint_template(path_or_preset)
    return ChatTemplate(source, **special) if source else None


def _checkpoint_template(path: str) -> str | None:
    file = os.path.join(path, TEMPLATE_FILE)
    if os.path.isfile(file):
        return _read(file)
    template = _tokenizer_config(path).get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        named = {entry.get("name"): entry.get("template") for entry in template if isinstance(entry, dict)}
        template = named.get("default")
    return template if isinstance(template, str) and template else None


def _special_tokens(path_or_preset: str) -> dict[str, str]:
    if not os.path.isdir(path_or_preset):
        return {"bos_token": "", "eos_token": "<eos>"} if path_or_preset in PRESETS else {}
    config = _tokenizer_config(path_or_preset)
    return {name: _token_text(config.get(name)) for name in ("bos_token", "eos_token")}


def _token_text(token) -> str:
    if isinstance(token, dict):  # {"content": "<s>", "lstrip": false, ...}
        token = token.get("content")
    return token if isinstance(token, str) else ""


def _tokenizer_config(path: str) -> dict:
    return _json(os.path.join(path, "tokenizer_config.json"))


def _json(file: str) -> dict:
    if not os.path.isfile(file):
        return {}
    with open(file, encoding="utf-8") as f:
        try:
            data = json.load(f)
        except json.JSONDecodeError as error:
            raise ValueError(f"{file} is not valid JSON: {error}") from None
    return data if isinstance(data, dict) else {}


def _read(file: str) -> str:
    with open(file, encoding="utf-8") as f:
        return f.read()


@dataclass(frozen=True)
class GenerationDefaults:
    """generation_config.json's EOS ids and the sampling settings it recommends (only those it sets)."""

    eos_token_ids: tuple[int, ...] = ()
    sampling: dict = field(default_factory=dict)  # a subset of DEFAULT_FIELDS -> value


def load_generation_defaults(path_or_preset: str) -> GenerationDefaults:
    """A checkpoint's generation_config.json (empty defaults without one, and for presets).
    do_sample false means greedy, as transformers reads it."""
    if not os.path.isdir(path_or_preset):
        return GenerationDefaults()
    data = _json(os.path.join(path_or_preset, "generation_config.json"))
    eos = data.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
    sampling = {name: data[name] for name in DEFAULT_FIELDS if isinstance(data.get(name), int | float)}
    if data.get("do_sample") is False:
        sampling["temperature"] = 0.0
    return GenerationDefaults(tuple(int(e) for e in eos_ids if isinstance(e, int)), sampling)
