"""Prompts in, checked token ids out: the one boundary every entry point (Engine, RayEngine, the
Serve ingress, the batch driver) passes a prompt through before it reaches the engine's loop.

The work is bounded by the limit, not by the input: a list of ids is measured before it is read, a
text longer than any prompt of max_seq_len tokens could be is refused before it is tokenised, and
every failure is a ValueError that names the prompt and what is allowed (a lone surrogate, a
tokenizer that cannot read the text, an id outside the vocabulary), never a tokenizer's own error.
"""

from __future__ import annotations

import logging
import numbers
from collections.abc import Sequence

log = logging.getLogger(__name__)

# A normaliser may compose characters (NFKC), so a text can hold a little more characters than its
# tokens' strings do: this factor keeps the character bound on the safe side.
_COMPOSITION_SLACK = 2


def find_lone_surrogate(text: str) -> int | None:
    """Index of the first lone surrogate (U+D800..U+DFFF) in text, or None: such text is not valid
    Unicode and has no UTF-8 encoding (JSON's "\\ud800" escape produces it)."""
    try:
        text.encode("utf-8")
        return None
    except UnicodeEncodeError as error:
        return error.start


def check_unicode(value, path: str = ""):
    """Returns a JSON value unchanged; ValueError naming the first string (or key) in it that is not
    valid Unicode, by its path ("messages[0].content"). Boundaries (HTTP bodies, batch lines) call
    it before anything reads the text."""
    if isinstance(value, str):
        at = find_lone_surrogate(value)
        if at is not None:
            raise ValueError(f"{path or 'a string'} holds a lone surrogate (U+{ord(value[at]):04X}) at character "
                             f"{at}: strings must be valid Unicode")
    elif isinstance(value, dict):
        for key, item in value.items():
            check_unicode(key, f"a key of {path or 'the object'}")
            check_unicode(item, f"{path}.{key}" if path else str(key))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            check_unicode(item, f"{path}[{index}]")
    return value


class PromptEncoder:
    """Text or token ids -> token ids checked against the vocabulary and max_seq_len."""

    def __init__(self, tokenizer, vocab_size: int, max_seq_len: int):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_seq_len = max_seq_len
        self.max_prompt_chars = max_seq_len * _longest_token_chars(tokenizer) * _COMPOSITION_SLACK

    def encode(self, prompt, max_new_tokens: int = 0, position: int = 0, add_special_tokens: bool = True) -> list[int]:
        """The prompt's ids; ValueError when it is empty, bad, or longer than max_seq_len -
        max_new_tokens (the messages name prompt `position` of its call). add_special_tokens: the
        tokenizer's own (a BOS, say); off for a chat template's text, which writes its own."""
        room = self.max_seq_len - max_new_tokens
        ids = self._text_ids(prompt, position, add_special_tokens) if isinstance(prompt, str) else \
            self._checked_ids(prompt, room, position)
        if not ids:
            raise ValueError(f"prompt {position} is empty")
        if len(ids) > room:
            raise ValueError(f"prompt {position} has {len(ids)} tokens; with max_new_tokens={max_new_tokens} it "
                             f"exceeds max_seq_len={self.max_seq_len}")
        return ids

    def _text_ids(self, text: str, position: int, add_special_tokens: bool = True) -> list[int]:
        if self.tokenizer is None:
            raise ValueError("this checkpoint has no tokenizer.json: pass prompts as lists of token ids")
        at = find_lone_surrogate(text)
        if at is not None:
            raise ValueError(f"prompt {position} holds a lone surrogate (U+{ord(text[at]):04X}) at character {at}: "
                             f"text must be valid Unicode")
        if len(text) > self.max_prompt_chars:
            raise ValueError(f"prompt {position} has {len(text)} characters, more than a prompt of "
                             f"max_seq_len={self.max_seq_len} tokens can hold ({self.max_prompt_chars}): "
                             f"it exceeds max_seq_len")
        try:
            return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids
        except Exception as error:  # noqa: BLE001 - a tokenizer's failure on one text is that prompt's fault
            log.warning("the tokenizer failed on prompt %d: %s", position, error)
            raise ValueError(f"prompt {position} could not be tokenised: the tokenizer refused its text") from None

    def _checked_ids(self, prompt, room: int, position: int) -> list[int]:
        if hasattr(prompt, "tolist") and getattr(prompt, "ndim", None) == 1:  # a torch tensor or numpy array
            prompt = prompt.tolist()
        if not isinstance(prompt, Sequence):
            raise ValueError(f"prompt {position} must be a string or a list of token ids, "
                             f"got {type(prompt).__name__}")
        if len(prompt) > room:  # measured before a single element is read
            raise ValueError(f"prompt {position} has {len(prompt)} tokens; it exceeds max_seq_len={self.max_seq_len} "
                             f"(with max_new_tokens={self.max_seq_len - room})")
        if not all(isinstance(t, numbers.Integral) and not isinstance(t, bool) for t in prompt):
            raise ValueError(f"prompt {position} must hold integer token ids only")
        ids = [int(t) for t in prompt]
        if ids and not 0 <= min(ids) <= max(ids) < self.vocab_size:
            bad = [t for t in ids if not 0 <= t < self.vocab_size]
            raise ValueError(f"prompt {position} holds token ids outside [0, {self.vocab_size}): {bad[:5]}")
        return ids


def _longest_token_chars(tokenizer) -> int:
    """The longest token string of the vocabulary (an upper bound on the characters one token covers)."""
    if tokenizer is None:
        return 1
    return max((len(token) for token in tokenizer.get_vocab(with_added_tokens=True)), default=1)
