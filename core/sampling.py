"""Sampling: one request's settings (SamplingParams) and the batched sampler of a decode step.

The sampler cannot fail on any valid setting: it works in float32 on logits shifted by their row
maximum, so even a temperature of 1e-300 or a top_p of 1e-300 gives a distribution with at least
one token of probability > 0 (the most likely one is always kept). A row whose logits are not
finite (NaN, +inf, or every token -inf) is that request's failure alone: its token is -1 and the
engine ends that request with an error, never the batch.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass

import torch

# Below this temperature sampling is greedy (vLLM's rule): dividing by it would only amplify
# rounding noise between near-equal logits.
SAMPLING_EPS = 1e-5
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1  # what torch.Generator.manual_seed takes
FAILED = -1  # the token of a row that could not be sampled


@dataclass(frozen=True)
class SamplingParams:
    """One request's generation settings. temperature 0 (or below SAMPLING_EPS) is greedy. seed:
    the request's own sampling stream (the same tokens whatever else is batched with it, and across
    a resumed batch); None derives one from the call's seed and the prompt's position."""

    max_new_tokens: int = 32
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple = ()

    def __post_init__(self):
        if not _is_int(self.max_new_tokens) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}")
        if not _is_real(self.temperature) or not 0 <= self.temperature < math.inf:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not _is_real(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be a number in (0, 1], got {self.top_p!r}")
        if self.seed is not None and (not _is_int(self.seed) or not SEED_MIN <= self.seed <= SEED_MAX):
            raise ValueError(f"seed must be an integer in [-2**63, 2**64 - 1], got {self.seed!r}")
        stop = [self.stop] if isinstance(self.stop, str | int) else list(self.stop or [])
        if not all(isinstance(s, str) or (_is_int(s) and s >= 0) for s in stop):
            raise ValueError(f"stop must be strings or token ids >= 0, got {self.stop!r}")
        if "" in stop:
            raise ValueError("stop holds an empty string, which would match at once: give non-empty strings")
        object.__setattr__(self, "stop", tuple(stop))

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS


def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_real(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and not math.isnan(value)


def make_generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def sample(logits: torch.Tensor, temperatures: list[float], top_ps: list[float],
           generators: list[torch.Generator | None]) -> list[int]:
    """logits [batch, vocab] (any float dtype, any device) -> one token per row, FAILED for a row
    whose logits are not finite. Rows with temperature < SAMPLING_EPS take the argmax; the others
    draw from the temperature-scaled softmax restricted to the top_p nucleus, with one uniform
    number from their own generator (so a request's tokens do not depend on its batch)."""
    logits = logits.detach().float().cpu()  # one device-to-host copy for the whole batch
    tokens = torch.argmax(logits, dim=-1)
    failed = torch.isnan(logits).any(-1) | torch.isposinf(logits).any(-1) | torch.isneginf(logits).all(-1)
    rows = [i for i, t in enumerate(temperatures) if t >= SAMPLING_EPS and not failed[i]]
    if rows:
        uniforms = torch.stack([torch.rand((), generator=generators[i]) for i in rows])
        tokens[rows] = _sample_rows(logits[rows], torch.tensor([temperatures[i] for i in rows]),
                                    torch.tensor([top_ps[i] for i in rows]), uniforms)
    tokens[failed] = FAILED
    return tokens.tolist()


def _sample_rows(logits: torch.Tensor, temperatures: torch.Tensor, top_ps: torch.Tensor,
                 uniforms: torch.Tensor) -> torch.Tensor:
    """logits [rows, vocab] float32, finite or -inf; temperatures, top_ps, uniforms [rows] -> tokens [rows]."""
    shifted = logits - logits.max(dim=-1, keepdim=True).values  # <= 0, the top token at exactly 0
    probs = torch.softmax(shifted / temperatures[:, None], dim=-1)  # the top token keeps exp(0) = 1 in the sum
    # stable: among equal probabilities the lowest id comes first, as argmax picks it
    sorted_probs, order = torch.sort(probs, dim=-1, descending=True, stable=True)
    before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs  # mass of the more likely tokens
    keep = before < top_ps[:, None]
    keep[:, 0] = True  # the nucleus holds at least the most likely token, whatever top_p is
    kept = torch.where(keep, sorted_probs, torch.zeros_like(sorted_probs))
    cdf = torch.cumsum(kept, dim=-1)
    target = (uniforms * cdf[:, -1])[:, None]
    index = torch.searchsorted(cdf, target, right=True)
    index = torch.minimum(index, keep.sum(dim=-1, keepdim=True) - 1)  # rounding at the top end
    return order.gather(1, index)[:, 0]


def call_params(prompts, defaults: SamplingParams, params=None) -> tuple[list, list[SamplingParams]]:
    """One call's prompts as a list, and each prompt's SamplingParams: its own, else the call's
    settings with no seed of their own (the call's seed then seeds each prompt by its position)."""
    if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
        prompts = [prompts]
    if not prompts:
        raise ValueError("prompts is empty: pass one or more strings or lists of token ids")
    if params is not None and len(params) != len(prompts):
        raise ValueError(f"{len(params)} SamplingParams for {len(prompts)} prompts: one per prompt")
    return list(prompts), list(params) if params is not None else [dataclasses.replace(defaults, seed=None)] * len(
        prompts)
