"""The OpenAI (and vLLM) request bodies the Serve app accepts, how they become SamplingParams, and
how logprobs are written back.

Every generation parameter a body may carry is either honoured or refused with a 400 that names it:
`refused_parameter(body)` finds the first one set to something this server does not do (tools,
response_format other than text, n or best_of above 1, logit_bias, ...). Fields no generation
depends on (user, metadata, store, ...) are accepted and unused, as OpenAI clients send them.

A sampling field left out takes the checkpoint's generation_config.json value (vLLM's
`--generation-config auto`), else OpenAI's default.
"""

from __future__ import annotations

import secrets
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from writescope.prompts import check_unicode
from writescope.sampling import MAX_LOGPROBS, MAX_REPETITION_PENALTY, SEED_MAX, SEED_MIN, SamplingParams

OPENAI_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0}
MAX_STOP_TOKEN_IDS = 1024


def _unset(value) -> bool:
    return value is None or value == [] or value == {} or value == ""


# A parameter this server does not honour -> the values that ask for nothing (so can be accepted).
_HARMLESS = {
    "tools": _unset, "functions": _unset, "tool_choice": lambda v: _unset(v) or v == "none",
    "function_call": lambda v: _unset(v) or v == "none",
    "response_format": lambda v: _unset(v) or (isinstance(v, dict) and v.get("type") == "text"),
    "best_of": lambda v: v is None or v == 1, "logit_bias": _unset, "suffix": _unset, "prompt_logprobs": _unset,
    "min_tokens": lambda v: v is None or v == 0, "guided_json": _unset, "guided_regex": _unset,
    "guided_choice": _unset, "guided_grammar": _unset, "structured_outputs": _unset, "audio": _unset,
    "modalities": lambda v: _unset(v) or v == ["text"], "prediction": _unset, "web_search_options": _unset,
    "reasoning_effort": _unset, "continue_final_message": lambda v: v is None or v is False,
}
_WHY = {"tools": "tool calling", "functions": "tool calling", "tool_choice": "tool calling",
        "function_call": "tool calling", "response_format": "structured output (only {\"type\": \"text\"})",
        "guided_json": "structured output", "guided_regex": "structured output", "guided_choice": "structured output",
        "guided_grammar": "structured output", "structured_outputs": "structured output",
        "best_of": "several candidates per request", "prompt_logprobs": "the prompt's logprobs",
        "audio": "audio", "modalities": "output other than text"}


def refused_parameter(body: BaseModel) -> tuple[str, str] | None:
    """(parameter, message) of the first parameter the body sets that is not supported, else None."""
    for name, value in (body.model_extra or {}).items():
        harmless = _HARMLESS.get(name)
        if harmless is not None and not harmless(value):
            what = _WHY.get(name, name)
            return name, f"{name} is not supported by this server ({what}): leave it out or set it to its default"
    return None


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class _Common(BaseModel):
    model_config = ConfigDict(extra="allow")  # extras are checked by refused_parameter, then unused

    model: str = Field(max_length=256)
    temperature: float | None = Field(default=None, ge=0, le=2, allow_inf_nan=False)
    top_p: float | None = Field(default=None, gt=0, le=1, allow_inf_nan=False)
    top_k: int | None = Field(default=None, ge=-1, description="0 or -1: every token")
    min_p: float | None = Field(default=None, ge=0, le=1, allow_inf_nan=False)
    presence_penalty: float = Field(default=0.0, ge=-2, le=2, allow_inf_nan=False)
    frequency_penalty: float = Field(default=0.0, ge=-2, le=2, allow_inf_nan=False)
    repetition_penalty: float | None = Field(default=None, gt=0, le=MAX_REPETITION_PENALTY, allow_inf_nan=False)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = Field(default=None, description="non-empty strings")
    stop_token_ids: list[int] | None = Field(default=None, max_length=MAX_STOP_TOKEN_IDS)
    ignore_eos: bool = False
    seed: int | None = Field(default=None, ge=SEED_MIN, le=SEED_MAX)
    n: int = Field(default=1, ge=1, description="one choice per request")

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data):
        return check_unicode(data)

    @field_validator("stop")
    @classmethod
    def _non_empty_stops(cls, stop):
        stops = [stop] if isinstance(stop, str) else stop or []
        if "" in stops:
            raise ValueError("stop holds an empty string, which would match at once: give non-empty strings")
        return stop

    @field_validator("stop_token_ids")
    @classmethod
    def _token_ids(cls, ids):
        if ids and min(ids) < 0:
            raise ValueError("stop_token_ids must be token ids >= 0")
        return ids

    @field_validator("n")
    @classmethod
    def _one_choice(cls, n):
        if n != 1:
            raise ValueError(f"n={n} is not supported: this server gives one choice per request (send n "
                             f"requests, they are batched together)")
        return n

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def params(self, max_tokens: int, defaults: dict, logprobs: int | None) -> SamplingParams:
        """The request's SamplingParams: its own fields, else the checkpoint's defaults, else OpenAI's."""
        def pick(name):
            value = getattr(self, name)
            return value if value is not None else defaults.get(name, OPENAI_DEFAULTS[name])

        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        seed = self.seed if self.seed is not None else secrets.randbits(63)  # unseeded requests differ
        return SamplingParams(max_tokens, pick("temperature"), pick("top_p"), seed,
                              (*stop, *(self.stop_token_ids or ())), top_k=pick("top_k"), min_p=pick("min_p"),
                              presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
                              repetition_penalty=pick("repetition_penalty"), ignore_eos=self.ignore_eos,
                              logprobs=logprobs)


class CompletionRequest(_Common):
    prompt: str | list[int] = Field(min_length=1)
    max_tokens: int = Field(default=16, ge=1)
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False

    @model_validator(mode="after")
    def _echo_without_logprobs(self):
        if self.echo and self.logprobs is not None:
            raise ValueError("echo with logprobs would need the prompt's logprobs, which this server does not "
                             "compute: drop echo or logprobs")
        return self


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # name, ... reach the template as they came

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[TextPart]  # a string, or OpenAI's content parts (text only)

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)

    def for_template(self) -> dict:
        """The message as a chat template reads it: role and content as text, and its other fields."""
        return {**(self.model_extra or {}), "role": self.role, "content": self.text()}


class ChatRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True  # vLLM's: end the prompt with the assistant's turn opened
    chat_template_kwargs: dict | None = None  # vLLM's: more variables for the template (enable_thinking, ...)

    @model_validator(mode="after")
    def _top_logprobs_needs_logprobs(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class TokenizeRequest(BaseModel):
    """vLLM's /tokenize: a prompt, or chat messages rendered by the chat template."""

    model_config = ConfigDict(extra="ignore")
    model: str = Field(max_length=256)
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    add_generation_prompt: bool = True
    add_special_tokens: bool | None = None  # default: on for a prompt, off for messages (the template's own)
    return_token_strs: bool = False
    chat_template_kwargs: dict | None = None

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data):
        return check_unicode(data)

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt or messages")
        return self


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str = Field(max_length=256)
    tokens: list[int] = Field(max_length=2**24)


LOWEST_LOGPROB = -9999.0  # what a token of probability 0 reports (JSON has no -Infinity), as vLLM does


def _finite(value: float) -> float:
    return max(value, LOWEST_LOGPROB)


def token_text(tokenizer, token_id: int) -> str:
    """The text of one token as it stands alone (a byte-level piece of a character: U+FFFD)."""
    return tokenizer.decode([token_id], skip_special_tokens=False) if tokenizer is not None else ""


def completion_logprobs(tokenizer, token_ids: list[int], logprobs: list, text_start: int) -> dict:
    """The legacy completions `logprobs` object of these tokens; text_start: their text's offset."""
    tokens, offsets, offset = [], [], text_start
    for token_id in token_ids:
        text = token_text(tokenizer, token_id)
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": [_finite(lp.logprob) for lp in logprobs],
            "top_logprobs": [{token_text(tokenizer, i): _finite(value) for i, value in lp.top} for lp in logprobs],
            "text_offset": offsets}


def chat_logprobs(tokenizer, token_ids: list[int], logprobs: list) -> dict:
    """The chat `logprobs` object: {"content": [{token, logprob, bytes, top_logprobs}]}."""
    def entry(token_id: int, value: float) -> dict:
        text = token_text(tokenizer, token_id)
        return {"token": text, "logprob": _finite(value), "bytes": list(text.encode("utf-8"))}

    return {"content": [{**entry(token_id, lp.logprob), "top_logprobs": [entry(i, v) for i, v in lp.top]}
                        for token_id, lp in zip(token_ids, logprobs, strict=True)]}
