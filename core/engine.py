"""The engine: a MoE model decoding on InplaceKVCache, each step one run of the decode task graph.

    engine = Engine.from_pretrained("tiny-qwen3-moe" or "/path/to/checkpoint", policy="writescope")
    outputs = engine.generate(["a prompt", [1, 2, 3]], max_new_tokens=32)
    for event in engine.generate_stream(prompts, max_new_tokens=32): ...
    engine.shutdown()

Sequences join and leave the running batch between steps (continuous batching): a request is
admitted (capacity reserved, or it waits while others run), prefilled one sequence at a time
straight into its KV regions, then decoded with the rest of the batch until EOS, a stop string or
token, or max_new_tokens.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from writescope import ops
from writescope.block_allocator import CapacityError
from writescope.config import EngineConfig
from writescope.executor import DecodeGraph, LocalExecutor, build_decode_graph, device_side
from writescope.inplace_kv_cache import CacheConfig, InplaceKVCache, host_memory_available
from writescope.loading import engine_cache_config, load_model, load_model_config
from writescope.models.config import ModelConfig
from writescope.models.deepseek_v4 import ARCH as DEEPSEEK_V4
from writescope.models.layers import causal_attention
from writescope.models.moe_model import MoEModel
from writescope.perf_model import PerfModel
from writescope.policies import Policy, check_policy, make_policy
from writescope.prompts import PromptEncoder
from writescope.sampling import (
    FAILED,
    Sampled,
    SamplerRow,
    SamplingParams,
    TokenLogprobs,
    call_params,
    make_generator,
    sample,
)

log = logging.getLogger(__name__)

# StreamEvent.error_kind: whose failure ended a request, and so what its caller should do.
INVALID_REQUEST = "invalid_request"  # the request itself (a prompt that can never fit): do not retry it
INTERNAL_ERROR = "internal"  # this request failed inside the engine; the others went on
UNAVAILABLE = "unavailable"  # the engine failed or restarts: the request did nothing wrong, retry it
# A chunk of a prefill attends to its prefix read back in pieces of this many chunks: one fused call
# and one merge per piece, and a piece's float32 copy on the device at a time (8 x 4096 tokens of
# Qwen3-30B-A3B's 4 kv heads: 128 MiB a layer), whatever the prompt's length.
PREFIX_PIECES_PER_CHUNK = 8


@dataclass
class GenerationOutput:
    token_ids: list[int]  # the new tokens
    text: str
    finish_reason: str  # "eos", "stop", "length", or "error" (see error)
    prompt_tokens: int
    logits: list[torch.Tensor] | None = None  # [vocab] float32 per new token, when asked for
    error: str | None = None  # why, when finish_reason is "error" (this request failed, the others did not)
    logprobs: list[TokenLogprobs] | None = None  # per new token, when its SamplingParams ask for them


class StepTimes(NamedTuple):
    """What one decode step cost, as the engine timed it inside the step."""

    step_s: float  # the whole step, the sampling included
    attention_s: float  # each layer's span from its first partial to its merge, summed over layers
    cpu_kernel_s: float  # the CPU partials' own kernel time (as their kernel timed it), summed over layers


@dataclass(frozen=True)
class StreamEvent:
    index: int  # which prompt (or, in an EngineService, which request)
    token_id: int  # -1 on an error event
    text: str  # the text this token adds
    finish_reason: str | None  # set on a sequence's last event: "eos", "stop", "length", "abort" or "error"
    error: str | None = None  # why, when finish_reason is "error": a message fit for the request's client
    error_kind: str | None = None  # INVALID_REQUEST, INTERNAL_ERROR or UNAVAILABLE, with finish_reason "error"
    logprobs: TokenLogprobs | None = None  # the token's, when its request asked for them
    queue_s: float | None = None  # on a request's first token: how long it waited for admission
    cached_tokens: int | None = None  # on a request's first token: prompt tokens reused, not prefilled

    @property
    def retryable(self) -> bool:
        """The request failed through no fault of its own: the same request may succeed later."""
        return self.error_kind == UNAVAILABLE


@dataclass
class _Request:
    index: int
    prompt: list[int]
    params: SamplingParams
    sampler: SamplerRow  # its settings, random stream and penalty counts
    stop_strings: tuple[str, ...]
    stop_ids: frozenset[int]
    keep_logits: bool = False
    logits: list[torch.Tensor] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    error: str | None = None
    prefix_offset: int = 0  # incremental detokenisation: tokens before prefix_offset are settled text
    read_offset: int = 0

    cancelled: bool = False
    prefilled: int = 0  # prompt tokens whose KV is written in every layer (a chunked prefill's progress)
    created_s: float = field(default_factory=time.monotonic)  # when it was made (queued)
    admitted_s: float | None = None  # when the cache admitted it (its queue time ends)
    cached_tokens: int = 0  # prompt tokens whose KV the prefix cache had (its prefill starts after them)
    block_names: list[bytes] | None = None  # its full blocks' prefix-cache names (None: no reuse)

    @property
    def max_new_tokens(self) -> int:
        return self.params.max_new_tokens

    @property
    def seq_id(self):
        return ("request", self.index, id(self))


@dataclass
class _Step:
    requests: list[_Request]
    seq_ids: list
    tokens: torch.Tensor  # [batch]
    rope: object  # the rope tables of the batch's positions, shared by every layer
    view: object  # the cache's StepView: every layer's tables
    device_began: float = 0.0  # when the current layer's device partial began
    # per layer, what its two sides cost: (cpu tokens, cpu kernel s, device tokens, device clock, attention s)
    layers: list = field(default_factory=list)


class _DeviceClock:
    """Times the device path of a layer without a host sync: CUDA events, read once the step's
    logits have reached the host; wall time on the CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def start(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def stop(self, started):
        if not self.cuda:
            return time.perf_counter() - started
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return started, event

    def seconds(self, stopped) -> float:
        return stopped if not self.cuda else stopped[0].elapsed_time(stopped[1]) / 1e3


class Engine:
    def __init__(self, model: MoEModel, tokenizer, *, policy: Policy, cache: InplaceKVCache, executor,
                 max_batch_size: int, max_seq_len: int, prefill_chunk_tokens: int = EngineConfig.prefill_chunk_tokens,
                 enable_prefix_caching: bool = EngineConfig.enable_prefix_caching):
        if prefill_chunk_tokens < 1 or prefill_chunk_tokens % cache.block_size:
            raise ValueError(f"prefill_chunk_tokens must be a positive multiple of the block size "
                             f"{cache.block_size}, got {prefill_chunk_tokens}")
        self.prefill_chunk_tokens = prefill_chunk_tokens  # prompt tokens prefilled per turn of the loop
        self.prefix_piece_tokens = PREFIX_PIECES_PER_CHUNK * prefill_chunk_tokens
        # neither a chunk nor a prefix piece is longer than a prompt can be
        _check_chunk_fits(model, min(prefill_chunk_tokens, max_seq_len), min(self.prefix_piece_tokens, max_seq_len))
        self.model = model
        self.config: ModelConfig = model.config
        self.tokenizer = tokenizer
        self.policy = policy
        self.cache = cache
        self.executor = executor
        self.cpu_partial = executor.make_cpu_partial(cache)
        self._clock = _DeviceClock(model.device)
        self.step_history: deque[StepTimes] = deque(maxlen=4096)  # of recent decode steps
        self.max_batch_size = max_batch_size
        self.max_seq_len = max_seq_len
        self.prompts = PromptEncoder(tokenizer, self.config.vocab_size, max_seq_len)
        self.graph: DecodeGraph = build_decode_graph(self.config.num_layers)
        self._device_backend = "triton" if model.device.type == "cuda" else "cpu"
        self.stats = {"steps": 0, "decode_s": 0.0, "tokens": 0, "attention_s": 0.0, "prompt_tokens": 0,
                      "cached_prompt_tokens": 0, "prefill_s": 0.0}
        self.enable_prefix_caching = enable_prefix_caching
        # torch's intra-op threads (None: leave torch's setting). On the CPU the C++ kernel's pool
        # runs the attention on every CPU; a decode step's small matmuls gain nothing from more
        # torch threads, whose OpenMP workers would spin against that pool between ops (measured:
        # 4 x 32K, 27.5 ms a step with 2, 18.5 with 1). A prefill's large matmuls want them all.
        self.decode_threads: int | None = 1 if model.device.type == "cpu" else None
        self.prefill_threads: int | None = None

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_pretrained(cls, model: str | None = None, *, config: EngineConfig | None = None, executor: str = "local",
                        executor_options: dict | None = None, region_handles=None, **fields):
        """An engine for a preset name (PRESETS) or a local Hugging Face checkpoint directory.

        config: an EngineConfig (default: EngineConfig()); model and any of its fields given as
        keywords replace its values (`max_seq_len=8192`). executor "local" runs the engine in this
        process; executor "ray" is an alias of `writescope.actors.RayEngine.from_pretrained` (the
        engine's actors on the running Ray cluster, or an embedded local one), with executor_options
        its keywords (`nodes`, `max_waiting`). region_handles: ([cpu_compute shard handle bytes],
        cpu_transfer handle bytes) of regions created elsewhere, attached instead of created (for
        DeepSeek-V4 a dict of those by layer type, one per entry cache)."""
        config = (config or EngineConfig()).replace(**({"model": model} if model is not None else {}), **fields)
        if executor == "ray":
            if region_handles is not None:
                raise ValueError("region_handles are for an in-process engine; executor 'ray' creates its own")
            return _ray_engine(config, executor_options or {})
        if executor != "local":
            raise ValueError(f"unknown executor {executor!r}; known: {', '.join(EXECUTORS)}")
        options = dict(executor_options or {})
        unknown = set(options) - {"concurrent"}
        if unknown:
            raise ValueError(f"unknown executor_options {sorted(unknown)}; executor 'local' takes concurrent")
        return cls.from_config(config, region_handles=region_handles, **options)

    @classmethod
    def from_config(cls, config: EngineConfig, *, executor=None, concurrent: bool | None = None,
                    region_handles=None, cache_config: CacheConfig | None = None):
        """The in-process engine of a config: the weights loaded onto config.device, then from_model.
        executor: an executor object (the GPU worker's channel executor, say); default a
        LocalExecutor, concurrent when the device is not the CPU (the two sides then run at once).
        cache_config: the regions as sized already (by the Ray driver, with region_handles). For
        DeepSeek-V4 both are dicts by layer type (its entry caches: deepseek_v4_engine)."""
        if _is_deepseek_v4(config):
            from writescope.deepseek_v4_engine import DeepseekV4Engine  # it builds on this module

            return DeepseekV4Engine.from_config(config, executor=executor, region_handles=region_handles,
                                                cache_configs=cache_config)
        model_config, weights, tokenizer, torch_dtype = load_model(config.model, config.dtype, config.weights_seed)
        weights = {name: w.to(config.device) for name, w in weights.items()}
        model = MoEModel(model_config, weights, device=config.device, hot_experts=config.hot_experts)
        if executor is None:
            executor = LocalExecutor(concurrent=model.device.type != "cpu" if concurrent is None else concurrent)
        return cls.from_model(model, tokenizer, torch_dtype, policy=config.policy, executor=executor,
                              window_tokens=config.window_tokens, max_batch_size=config.max_batch_size,
                              max_seq_len=config.max_seq_len, block_size=config.block_size,
                              num_shards=config.num_shards, pingpong_blocks=config.pingpong_blocks,
                              prefill_chunk_tokens=config.prefill_chunk_tokens, region_handles=region_handles,
                              cache_config=cache_config, max_host_kv_gb=config.max_host_kv_gb,
                              enable_prefix_caching=config.enable_prefix_caching)

    @classmethod
    def from_model(cls, model: MoEModel, tokenizer, kv_dtype: torch.dtype, *, policy: str | Policy = "writescope",
                   executor=None, window_tokens: int = EngineConfig.window_tokens,
                   max_batch_size: int = EngineConfig.max_batch_size, max_seq_len: int = EngineConfig.max_seq_len,
                   block_size: int = EngineConfig.block_size, num_shards: int | None = None,
                   pingpong_blocks: int | None = None,
                   prefill_chunk_tokens: int = EngineConfig.prefill_chunk_tokens, region_handles=None,
                   cache_config: CacheConfig | None = None, max_host_kv_gb: float | None = None,
                   enable_prefix_caching: bool = EngineConfig.enable_prefix_caching):
        """An engine around a model already built (on its device): a new cache, executor and policy,
        so that several engines can share one model's weights (a sweep over policies, say).
        executor: an executor object, default a LocalExecutor (concurrent beside a GPU)."""
        check_policy(policy)
        if cache_config is None:
            cache_config = engine_cache_config(model.config, kv_dtype, block_size=block_size,
                                               max_batch_size=max_batch_size, max_seq_len=max_seq_len,
                                               num_shards=num_shards or 1, window_tokens=window_tokens,
                                               pingpong_blocks=pingpong_blocks, device=str(model.device))
        if executor is None:
            executor = LocalExecutor(concurrent=model.device.type != "cpu")
        calibrate = policy == "writescope"
        if not isinstance(policy, Policy):  # writescope: a provisional model until calibrate() below
            policy = make_policy(policy, PROVISIONAL_MODEL if calibrate else None)
        if cache_config.host_kv_bytes is None:  # a driver elsewhere (the Ray one) may have set it already
            cache_config = cache_config.with_host_limit(None if max_host_kv_gb is None else int(max_host_kv_gb * 2**30))
        cache = InplaceKVCache(cache_config, policy, region_handles=region_handles)
        log.info(cache_config.capacity_line())
        try:
            engine = cls(model, tokenizer, policy=policy, cache=cache, executor=executor,
                         max_batch_size=max_batch_size, max_seq_len=max_seq_len,
                         prefill_chunk_tokens=prefill_chunk_tokens, enable_prefix_caching=enable_prefix_caching)
            if calibrate:
                policy.estimator.reset_to(engine.calibrate())
            return engine
        except BaseException:  # the executor's CPU partial could not be made (a CPU worker's channel, say)
            cache.close()  # the shared-memory regions must not outlive a failed construction
            executor.shutdown()
            raise

    def calibrate(self, *, force: bool = False, lengths: tuple[int, ...] | None = None) -> PerfModel:
        """The PerfModel of this engine's attention on this machine, timed on its own cache, CPU
        partial and executor (see writescope.calibration): measured once per setup, then cached.
        Before any request: the cache must be empty."""
        from writescope.calibration import MAX_BATCH, CalibrationSetup, calibrate

        setup = CalibrationSetup(self.config.num_q_heads, self.config.attention_scale,
                                 batch=min(self.max_batch_size, MAX_BATCH),
                                 cpu_partial=type(self.cpu_partial).__name__,
                                 cpu_in_thread=getattr(self.executor, "concurrent", False))
        with torch.inference_mode():
            return calibrate(self.cache, self.cpu_partial, setup, force=force, lengths=lengths)

    def cache_state(self) -> dict:
        """The KV's occupancy and placement and the CPU share the policy wants, for metrics."""
        cache = self.cache
        return {"cpu_share_now": cache.wanted_share(), "cpu_share_at_32k": self.policy.preview_share(32768),
                "occupancy": cache.occupancy(),
                "prefix_cache": {"registered_blocks": cache.prefix.num_registered,
                                 "evictable_blocks": cache.prefix.num_evictable,
                                 "queried_tokens": cache.prefix.queried_tokens, "hit_tokens": cache.prefix.hit_tokens,
                                 "allocated_blocks": cache.allocated_blocks()},
                **placement(self)}

    def shutdown(self) -> None:
        self.executor.shutdown()
        self.cpu_partial.close()
        self.cache.close()

    # ------------------------------------------------------------------ generation
    def generate(self, prompts, *, max_new_tokens: int = 32, temperature: float = 0.0, top_p: float = 1.0,
                 seed: int | None = None, stop=None, return_logits: bool = False,
                 params: list[SamplingParams] | None = None) -> list[GenerationOutput]:
        """params: one SamplingParams per prompt, overriding the call-wide settings."""
        requests = self._make_requests(prompts, SamplingParams(max_new_tokens, temperature, top_p, seed, stop or ()),
                                       params)
        for request in requests:
            request.keep_logits = return_logits
        for _ in self._run(requests):
            pass
        return [GenerationOutput(r.tokens, r.text, r.finish_reason, len(r.prompt), r.logits if return_logits else None,
                                 r.error, r.logprobs if r.params.logprobs is not None else None) for r in requests]

    def generate_stream(self, prompts, *, max_new_tokens: int = 32, temperature: float = 0.0, top_p: float = 1.0,
                        seed: int | None = None, stop=None,
                        params: list[SamplingParams] | None = None) -> Iterator[StreamEvent]:
        requests = self._make_requests(prompts, SamplingParams(max_new_tokens, temperature, top_p, seed, stop or ()),
                                       params)
        yield from self._run(requests)

    def _make_requests(self, prompts, defaults: SamplingParams, params=None) -> list[_Request]:
        prompts, per_prompt = call_params(prompts, defaults, params)
        return [self.make_request(index, prompt, p, call_seed=defaults.seed)
                for index, (prompt, p) in enumerate(zip(prompts, per_prompt, strict=True))]

    def make_request(self, index: int, prompt, params: SamplingParams, call_seed: int | None = None,
                     position: int | None = None) -> _Request:
        """A checked request: the prompt encoded, its length against max_seq_len, its sampler seeded
        (params.seed, else from call_seed and the prompt's position in its call, default index)."""
        position = index if position is None else position
        ids = self.prompts.encode(prompt, params.max_new_tokens, position)
        generator = None
        if not params.greedy:
            seed = params.seed if params.seed is not None else (call_seed or 0) * 1_000_003 + position
            generator = make_generator(seed)
        stop_strings = tuple(s for s in params.stop if isinstance(s, str))
        stop_ids = frozenset(s for s in params.stop if isinstance(s, int))
        # hashed here, in the caller's thread, once: not in the engine's loop each turn the request waits
        names = self.cache.block_names(ids) if self.enable_prefix_caching else None
        return _Request(index, ids, params, SamplerRow(params, generator, ids, self.config.vocab_size), stop_strings,
                        stop_ids, block_names=names)

    def _run(self, requests: list[_Request]) -> Iterator[StreamEvent]:
        """Generates a fixed set of requests to the end; a request that can never fit raises."""
        yield from self.run_loop(deque(requests))

    def run_loop(self, waiting: deque, poll: Callable[[bool], list[_Request]] | None = None) -> Iterator[StreamEvent]:
        """The continuous-batching loop. Between steps, poll(block) adds new requests (block: nothing
        is running or waiting, so it may wait for one; [] then ends the loop). Without poll, a request
        that cannot fit even alone raises CapacityError; with poll, it gets an error event instead.

        Each turn admits what fits, prefills up to prefill_chunk_tokens of the admitted prompts (a
        long prompt a chunk per turn, short ones several to a turn), then runs one decode step of the
        running batch: a long prefill delays the running streams by a chunk, not by the prompt."""
        running, prefilling, admitted = [], deque(), {}  # admitted: id -> request holding KV blocks
        try:
            while True:
                if poll is not None:
                    waiting.extend(poll(not waiting and not running and not prefilling))
                if not waiting and not running and not prefilling:
                    return
                yield from self._admit(waiting, running, prefilling, admitted, fail_alone=poll is not None)
                yield from self._prefill_turn(prefilling, running, admitted)
                if running:
                    sampled = self._decode_step(running)
                    for request, token, logprobs in zip(running, sampled.tokens, sampled.logprobs, strict=True):
                        yield self._accept(request, token, logprobs)
                    for request in [r for r in running if r.finish_reason is not None or r.cancelled]:
                        if request.finish_reason is None:
                            request.finish_reason = "abort"
                            yield StreamEvent(request.index, -1, "", "abort")
                        self._release(request, admitted)
                        running.remove(request)
        finally:  # a consumer that stops early, or an error, still releases every admitted sequence
            for request in admitted.values():
                if request.seq_id in self.cache.seqs:
                    self.cache.finish(request.seq_id)

    def _admit(self, waiting: deque, running: list, prefilling: deque, admitted: dict,
               fail_alone: bool) -> Iterator[StreamEvent]:
        """Waiting requests into the cache, in order, while there are batch slots and KV for them."""
        while waiting and len(running) + len(prefilling) < self.max_batch_size:
            request = waiting[0]
            if request.cancelled:
                waiting.popleft()
                yield StreamEvent(request.index, -1, "", "abort")
                continue
            try:
                cached = self.cache.admit(request.seq_id, len(request.prompt), request.max_new_tokens,
                                          block_names=request.block_names)
            except CapacityError:
                if running or prefilling:
                    return  # it waits for a running sequence to finish
                if not fail_alone:
                    raise
                waiting.popleft()
                yield self._fail(request, f"the request's {len(request.prompt)} prompt tokens and "
                                 f"max_new_tokens={request.max_new_tokens} do not fit this engine's KV "
                                 f"cache even alone: {self.cache.capacity_text()}", INVALID_REQUEST)
                continue
            waiting.popleft()
            request.admitted_s = time.monotonic()
            request.cached_tokens = request.prefilled = cached  # its prefill starts after the reused blocks
            self.stats["prompt_tokens"] += len(request.prompt)
            self.stats["cached_prompt_tokens"] += cached
            admitted[id(request)] = request
            prefilling.append(request)

    def _prefill_turn(self, prefilling: deque, running: list, admitted: dict) -> Iterator[StreamEvent]:
        """Prefill chunks of the admitted prompts, oldest first, up to prefill_chunk_tokens this turn; a
        request cancelled during its prefill stops here and frees its KV."""
        budget = self.prefill_chunk_tokens
        while prefilling and budget > 0:
            request = prefilling[0]
            if request.cancelled:
                prefilling.popleft()
                request.finish_reason = "abort"
                self._release(request, admitted)
                yield StreamEvent(request.index, -1, "", "abort")
                continue
            before = request.prefilled
            event = self._prefill_step(request)
            budget -= max(request.prefilled - before, 1)
            if event is None:
                continue  # more chunks to come, next turn if the budget is spent
            prefilling.popleft()
            yield event
            if request.finish_reason is None:
                running.append(request)
            else:
                self._release(request, admitted)

    def _release(self, request: _Request, admitted: dict) -> None:
        self.cache.finish(request.seq_id)
        del admitted[id(request)]

    @staticmethod
    def _fail(request: _Request, message: str, kind: str) -> StreamEvent:
        request.finish_reason, request.error = "error", message
        return StreamEvent(request.index, -1, "", "error", message, kind)

    def _accept(self, request: _Request, token: int, logprobs: TokenLogprobs | None = None) -> StreamEvent:
        """The event of a sampled token; a token that could not be sampled, or any failure in the
        request's own text handling, ends this request alone with an error event."""
        if token == FAILED:
            return self._fail(request, "the model's logits for this request were not finite: it was ended, the "
                              "other requests go on", INTERNAL_ERROR)
        try:
            return self._accept_token(request, token, logprobs)
        except Exception:  # noqa: BLE001 - detokenisation or stop matching of one request
            log.exception("request %s failed after token %d", request.index, token)
            return self._fail(request, "an internal error ended this request; the engine's log has the details",
                              INTERNAL_ERROR)

    def _accept_token(self, request: _Request, token: int, logprobs: TokenLogprobs | None = None) -> StreamEvent:
        request.tokens.append(token)
        if logprobs is not None:
            request.logprobs.append(logprobs)
        request.sampler.observe(token)
        text_before = len(request.text)
        added = self._decode_text(request)
        if token in self.config.eos_token_ids and not request.params.ignore_eos:
            request.finish_reason = "eos"
        elif token in request.stop_ids or (request.stop_strings and self._cut_at_stop(request, added)):
            request.finish_reason = "stop"
        elif len(request.tokens) >= request.max_new_tokens:
            request.finish_reason = "length"
        # after a stop string cut, the event carries only what is left of the new text; the first
        # token's event also says how long the request queued and how much of its prompt was reused
        first = len(request.tokens) == 1 and request.admitted_s is not None
        return StreamEvent(request.index, token, request.text[text_before:], request.finish_reason,
                           logprobs=logprobs, queue_s=request.admitted_s - request.created_s if first else None,
                           cached_tokens=request.cached_tokens if first else None)

    def _decode_text(self, request: _Request) -> str:
        """The text the newest token adds, decoding only the tokens since the last settled point (a
        token that ends inside a multi-byte character adds nothing until the character completes)."""
        if self.tokenizer is None:
            return ""
        tokens = request.tokens
        settled = self.tokenizer.decode(tokens[request.prefix_offset:request.read_offset])
        current = self.tokenizer.decode(tokens[request.prefix_offset:])
        if len(current) <= len(settled) or current.endswith("\ufffd"):
            return ""
        added = current[len(settled):]
        request.prefix_offset, request.read_offset = request.read_offset, len(tokens)
        request.text += added
        return added

    @staticmethod
    def _cut_at_stop(request: _Request, added: str) -> bool:
        """Looks for a stop string in the text's tail that the new text touches; cuts the text there."""
        longest = max(len(s) for s in request.stop_strings)
        start = max(0, len(request.text) - len(added) - longest + 1)
        hits = [i for i in (request.text.find(s, start) for s in request.stop_strings) if i >= 0]
        if not hits:
            return False
        request.text = request.text[: min(hits)]
        return True

    # ------------------------------------------------------------------ prefill
    def _prefill_step(self, request: _Request) -> StreamEvent | None:
        """One chunk of an admitted request's prefill; its first token's event after the last chunk,
        else None. A failure ends the request alone, with an error event."""
        try:
            began = time.perf_counter()
            with _torch_threads(self.prefill_threads):
                sampled = self._prefill_chunk(request)
            self.stats["prefill_s"] += time.perf_counter() - began
        except Exception:  # noqa: BLE001 - one request's prefill (out of memory, a bad prompt) ends only it
            log.exception("prefill of request %s failed", request.index)
            return self._fail(request, "an internal error ended this request during its prefill; the engine's "
                              "log has the details", INTERNAL_ERROR)
        return None if sampled is None else self._accept(request, sampled.tokens[0], sampled.logprobs[0])

    @torch.inference_mode()
    def _prefill_chunk(self, request: _Request) -> Sampled | None:
        """Prompt tokens [prefilled, prefilled + prefill_chunk_tokens) through every layer: each layer's
        chunk attends to the prompt's KV already written (read back from its regions) and to itself,
        causally, and its KV goes straight to its regions. The sampled first token after the last
        chunk, else None. Activations are the chunk's, whatever the prompt's length."""
        model, device = self.model, self.model.device
        start = request.prefilled
        end = min(start + self.prefill_chunk_tokens, len(request.prompt))
        hidden = model.embed(torch.tensor(request.prompt[start:end], device=device))
        rope = model.rope(torch.arange(start, end, device=device))
        for layer in range(self.config.num_layers):
            q, stored = model.attention_inputs(layer, hidden, rope)  # stored: [chunk, num_kv_heads, dim] each
            self.cache.write_prefill_chunk(request.seq_id, layer, start, *[s.transpose(0, 1) for s in stored])
            attention = causal_attention(q, stored[0], self._values(stored), self.config.attention_scale,
                                         prefix=self._prefix_pieces(request, layer, start))
            hidden = model.feed_forward(layer, model.attention_output(layer, attention, hidden))
        request.prefilled = end
        if end < len(request.prompt):
            return None
        return self._sample([request], model.logits(hidden[-1:]))

    def _prefix_pieces(self, request: _Request, layer: int, start: int) -> Iterator[tuple[torch.Tensor, ...]]:
        """The prompt's KV written before token `start`, read back from its regions a piece of
        prefix_piece_tokens at a time (head-major (k, v) [num_kv_heads, piece, dim], on the device),
        so a chunk's memory is bounded by the chunk and one piece, not by the prompt."""
        for first in range(0, start, self.prefix_piece_tokens):
            end = min(first + self.prefix_piece_tokens, start)
            written = [p.to(self.model.device) for p in self.cache.sequence_kv(request.seq_id, layer, end, first)]
            yield written[0], self._values(written)

    def _values(self, stored: list[torch.Tensor]) -> torch.Tensor:
        """V of stored arrays (any layout: V's dims are last): MLA's is the first decode_head_dim_v
        dims of its latent, inside K."""
        return stored[0][..., : self.config.decode_head_dim_v] if self.config.is_mla else stored[1]

    # ------------------------------------------------------------------ decode
    @torch.inference_mode()
    def _decode_step(self, running: list[_Request]) -> Sampled:
        began = time.perf_counter()
        seq_ids = [r.seq_id for r in running]
        device = self.model.device
        view = self.cache.step_view(seq_ids)  # the step's tables, once, for every layer
        positions = torch.tensor([self.cache.seqs[s].num_tokens for s in seq_ids], device=device)
        # The whole step at decode_threads, the rope and the sampling too: an op of the step on more
        # torch threads leaves them spinning into the layers' CPU kernel, on the cores its pool runs on.
        with _torch_threads(self.decode_threads):
            step = _Step(running, seq_ids, torch.tensor([r.tokens[-1] for r in running], device=device),
                         self.model.rope(positions), view)
            values = self.executor.run(self.graph, self._bindings(), step)
            tokens = self._sample(running, values["logits"])  # the host reads the logits: the device work is done
        self._account(step.layers, len(running), time.perf_counter() - began)
        return tokens

    def _account(self, layers: list[tuple], batch: int, step_s: float) -> None:
        """Feeds the policy each layer's measured costs (its one feed) and keeps the step's times.
        layers: per layer (CPU tokens, CPU seconds, device tokens, the device clock's stop marker,
        the layer's attention span), the markers read here, once the step's logits are on the host."""
        attention_s = cpu_kernel_s = 0.0
        for cpu_tokens, cpu_s, device_tokens, device_clock, layer_attention_s in layers:
            self.policy.observe_step(cpu_tokens, cpu_s, device_tokens, self._clock.seconds(device_clock))
            attention_s += layer_attention_s
            cpu_kernel_s += cpu_s
        self.policy.end_step()
        self.stats["steps"] += 1
        self.stats["tokens"] += batch
        self.stats["decode_s"] += step_s
        self.stats["attention_s"] += attention_s
        self.step_history.append(StepTimes(step_s, attention_s, cpu_kernel_s))

    def _bindings(self):
        return {"embed": self._embed, "transfer": self._transfer, "qkv": self._qkv, "window_write": self._window_write,
                "cpu_partial": self._cpu_partial, "device_partial": self._device_partial, "merge": self._merge,
                "out_proj": self._out_proj, "ffn": self._ffn, "logits": self._logits, "commit": self._commit}

    def _embed(self, step, node):
        return self.model.embed(step.tokens)

    def _transfer(self, step, node, _after):
        self.cache.start_transfer(node.layer, step.view)

    def _qkv(self, step, node, hidden):
        return self.model.attention_inputs(node.layer, hidden, step.rope)

    def _window_write(self, step, node, qkv):
        _, stored = qkv
        self.cache.write_window(node.layer, step.view, stored)

    def _cpu_partial(self, step, node, qkv):
        """The split's CPU side over cpu_compute: (its PendingPartial, when it began), or None when
        the policy ships cpu_compute to the device instead (monolithic)."""
        if self.policy.ships_cpu_compute:
            return None
        began = time.perf_counter()
        return self.cpu_partial.attend(node.layer, qkv[0].to("cpu"), step.view, self.config.attention_scale), began

    def _device_partial(self, step, node, qkv, _written, _transfer_started):
        """The split's device side: the window (with this step's token) and cpu_transfer, one call per
        group of sources (one in all unless the ping-pong buffer needs several fills), plus, for the
        monolithic policy, the cpu_compute KV shipped whole."""
        step.device_began = time.perf_counter()
        started = self._clock.start()
        out, lse = device_side(self.cache, node.layer, step.view, qkv[0], self.config.attention_scale,
                               self._device_backend, ships_compute=self.policy.ships_cpu_compute)
        return ops.Partial(out, lse, step.view.transfer_tokens, self._clock.stop(started))

    def _merge(self, step, node, cpu, device):
        """The layer's two partials merged; what each side cost joins the step's record. A layer's
        attention time is its span on this thread: from the first of its two partials to the merge."""
        if cpu is None:
            step.layers.append((0, 0.0, device.tokens, device.seconds, time.perf_counter() - step.device_began))
            return device.out
        pending, began = cpu
        partial = pending.result()  # the CPU workers' answer, or the worker thread's
        if partial.tokens == 0:  # merging an empty partial (out 0, lse -inf) returns device.out unchanged
            out = device.out
        else:
            out, _ = ops.merge([(partial.out.to(device.out.device), partial.lse.to(device.out.device)),
                                (device.out, device.lse)])
        span = time.perf_counter() - min(began, step.device_began)
        step.layers.append((partial.tokens, partial.seconds, device.tokens, device.seconds, span))
        return out

    def _out_proj(self, step, node, attention, hidden):
        return self.model.attention_output(node.layer, attention, hidden)

    def _ffn(self, step, node, hidden):
        return self.model.feed_forward(node.layer, hidden)

    def _logits(self, step, node, hidden):
        return self.model.logits(hidden)

    def _commit(self, step, node, logits):
        self.cache.commit(step.seq_ids)
        return logits

    @staticmethod
    def _sample(requests: list[_Request], logits: torch.Tensor) -> Sampled:
        """logits [batch, vocab] -> one token per request (FAILED where its logits were not finite)."""
        for request, row in zip(requests, logits, strict=True):
            if request.keep_logits:
                request.logits.append(row.detach().float().cpu())
        return sample(logits, [r.sampler for r in requests])


@contextlib.contextmanager
def _torch_threads(count: int | None):
    """torch's intra-op threads set to count for the block (process-wide: the engine's thread is
    the one that runs torch), then restored; None leaves them as they are."""
    if count is None:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def placement(engine: Engine) -> dict:
    """Where the live sequences' KV is (tokens per region), the tokens outside the window, and the
    CPU share the policy wants for them now."""
    cache = engine.cache
    placed = cache.placed_tokens()
    spilled = placed["cpu_compute"] + placed["cpu_transfer"]
    return {"placed_tokens": placed, "spilled_tokens": spilled, "cpu_share_spilled": cache.wanted_share()}


def prefill_chunk_bytes(config: ModelConfig, chunk_tokens: int, piece_tokens: int) -> int:
    """About the device bytes a prefill chunk's live activations take at their peak in one layer (in
    float32, as the prefill computes): the hidden states and their norms, q/k/v and their float32
    copies, the MoE's gate/up/activation of the chosen experts (or the dense MLP's), plus one
    piece of the prefix read back with its float32 copy."""
    dim_qk, dim_v = config.decode_head_dim_qk, config.decode_head_dim_v
    qkv = config.num_q_heads * dim_qk + config.num_kv_heads * (dim_qk + dim_v)
    mlp = 3 * max(config.top_k * config.moe_intermediate_size, config.intermediate_size) + config.num_experts
    per_token = 4 * (4 * config.hidden_size + 2 * qkv + mlp)
    per_piece_token = 2 * 4 * config.num_kv_heads * (dim_qk + dim_v)
    return chunk_tokens * per_token + piece_tokens * per_piece_token


def _check_chunk_fits(model: MoEModel, chunk_tokens: int, piece_tokens: int) -> None:
    """ValueError when a prefill chunk's activations cannot fit the memory free on the model's device."""
    if model.device.type == "cuda":
        free, where = torch.cuda.mem_get_info(model.device)[0], f"{model.device} has free"
    else:
        free, where = host_memory_available()[0], "the host has available"
    needed = prefill_chunk_bytes(model.config, chunk_tokens, piece_tokens)
    if needed > free:
        raise ValueError(f"prefill_chunk_tokens={chunk_tokens} takes about {needed / 2**30:.2f} GiB of activations "
                         f"a chunk (with its prefix piece of {piece_tokens} tokens); {where} {free / 2**30:.2f} GiB: "
                         f"lower prefill_chunk_tokens")


EXECUTORS = ("local", "ray")


def _is_deepseek_v4(config: EngineConfig) -> bool:
    return load_model_config(config.model)[0].arch == DEEPSEEK_V4


def _ray_engine(config: EngineConfig, options: dict):
    """executor="ray": the one place core reaches into writescope.actors, lazily, so that core imports
    no Ray unless asked. Ray is found or started (ensure_ray) before anything imports it."""
    from writescope.actors.local_ray import ensure_ray

    ensure_ray()
    from writescope.actors.ray_engine import RayEngine

    return RayEngine.from_pretrained(config=config, **options)


# The writescope policy's model until the engine is calibrated (from_model replaces it at once).
PROVISIONAL_MODEL = PerfModel(1e-9, 1e-9)

