"""The engine's contract beyond parity: presets, streaming, continuous batching, stopping,
sampling, placement of experts, checkpoints on disk, and bad input."""

import json
import os

import pytest
import torch

from writescope.block_allocator import CapacityError
from writescope.engine import Engine
from writescope.executor import LAYER_OPS, build_decode_graph
from writescope.models.presets import EOS_TOKEN_ID, TINY_PRESETS, byte_level_tokenizer

transformers = pytest.importorskip("transformers")


@pytest.fixture(autouse=True)
def calibration_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("WRITESCOPE_CACHE_DIR", str(tmp_path))


def small_engine(preset="tiny-qwen3-moe", **kwargs):
    options = {"window_tokens": 16, "block_size": 4, "max_batch_size": 2, "max_seq_len": 256, **kwargs}
    return Engine.from_pretrained(preset, **options)


@pytest.mark.parametrize("preset", list(TINY_PRESETS))
def test_presets_generate_text_from_text(preset):
    engine = small_engine(preset)
    try:
        out = engine.generate("The quick brown fox", max_new_tokens=5)[0]
    finally:
        engine.shutdown()
    assert len(out.token_ids) == 5 and out.prompt_tokens == len(b"The quick brown fox")
    assert out.finish_reason == "length"
    assert out.text == byte_level_tokenizer().decode(out.token_ids).rstrip("\ufffd")


def test_stream_yields_the_tokens_generate_returns():
    engine = small_engine()
    try:
        prompts = ["first prompt " * 5, [7, 8, 9] * 30, "third"]
        expected = engine.generate(prompts, max_new_tokens=6)
        events = list(engine.generate_stream(prompts, max_new_tokens=6))
    finally:
        engine.shutdown()
    for index, output in enumerate(expected):
        mine = [e for e in events if e.index == index]
        assert [e.token_id for e in mine] == output.token_ids
        assert "".join(e.text for e in mine) == output.text
        assert [e.finish_reason for e in mine][-1] == "length" and all(e.finish_reason is None for e in mine[:-1])


def test_continuous_batching_gives_each_sequence_its_solo_tokens():
    """Five prompts through a batch of two: sequences join and leave between steps, and each one's
    tokens are those it gets alone."""
    prompts = [list(range(10 + i, 40 + 7 * i)) for i in range(5)]
    engine = small_engine(max_batch_size=2)
    try:
        together = engine.generate(prompts, max_new_tokens=7)
        alone = [engine.generate([p], max_new_tokens=7)[0] for p in prompts]
    finally:
        engine.shutdown()
    assert [o.token_ids for o in together] == [o.token_ids for o in alone]


def test_stop_string_stop_token_and_eos():
    engine = small_engine()
    try:
        free = engine.generate([[1, 2, 3, 4]], max_new_tokens=8)[0]
        token = free.token_ids[2]
        by_id = engine.generate([[1, 2, 3, 4]], max_new_tokens=8, stop=[token])[0]
        assert by_id.token_ids == free.token_ids[: free.token_ids.index(token) + 1] and by_id.finish_reason == "stop"
        text = free.text
        assert text, "the byte-level preset turns any token below 256 into text"
        needle = text[len(text) // 2:][:1]
        by_text = engine.generate([[1, 2, 3, 4]], max_new_tokens=8, stop=needle)[0]
        assert by_text.finish_reason == "stop" and needle not in by_text.text
        streamed = list(engine.generate_stream([[1, 2, 3, 4]], max_new_tokens=8, stop=needle))
        assert "".join(e.text for e in streamed) == by_text.text
        engine.config = dataclass_replace(engine.config, eos_token_ids=(token,))
        by_eos = engine.generate([[1, 2, 3, 4]], max_new_tokens=8)[0]
        assert by_eos.finish_reason == "eos" and by_eos.token_ids[-1] == token
    finally:
        engine.shutdown()


def dataclass_replace(obj, **changes):
    import dataclasses

    return dataclasses.replace(obj, **changes)


def test_sampling_is_seeded():
    engine = small_engine()
    try:
        a = engine.generate(["abc"] * 2, max_new_tokens=12, temperature=1.5, top_p=0.9, seed=3)
        b = engine.generate(["abc"] * 2, max_new_tokens=12, temperature=1.5, top_p=0.9, seed=3)
        c = engine.generate(["abc"] * 2, max_new_tokens=12, temperature=1.5, top_p=0.9, seed=4)
    finally:
        engine.shutdown()
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert [o.token_ids for o in a] != [o.token_ids for o in c]
    assert a[0].token_ids != a[1].token_ids  # each prompt has its own stream


def test_expert_placement_does_not_change_results():
    tokens = []
    for hot in (None, 0, 3):
        engine = small_engine("tiny-mixtral", hot_experts=hot)
        try:
            tokens.append(engine.generate([[5, 6, 7] * 20], max_new_tokens=6, return_logits=True)[0])
        finally:
            engine.shutdown()
    assert tokens[0].token_ids == tokens[1].token_ids == tokens[2].token_ids
    for other in tokens[1:]:
        for a, b in zip(tokens[0].logits, other.logits, strict=True):
            torch.testing.assert_close(a, b)


def test_host_regions_in_huge_pages_give_the_same_tokens_and_logits(monkeypatch):
    """WRITESCOPE_HUGE_PAGES=on lays the host regions out in 2 MB pages (segments of 2 MB runs, the
    mappings advised for huge pages: 4 KB pages where the host's shmem_enabled is never): the KV lands
    at other offsets, the tokens and logits stay the same."""
    results = []
    for setting in ("off", "on"):
        monkeypatch.setenv("WRITESCOPE_HUGE_PAGES", setting)
        engine = small_engine("tiny-mixtral", policy="fixed_half")
        try:
            assert engine.cache.config.huge_pages is (setting == "on")
            regions = [*engine.cache.compute, engine.cache.transfer]
            assert {r.page_bytes for r in regions} == {4096 if setting == "off" else 2 * 2**20}
            results.append(engine.generate([[5, 6, 7] * 20], max_new_tokens=6, return_logits=True)[0])
        finally:
            engine.shutdown()
    assert results[0].token_ids == results[1].token_ids
    for a, b in zip(results[0].logits, results[1].logits, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_bad_requests_are_refused_and_the_engine_stays_usable():
    engine = small_engine(max_seq_len=64)
    try:
        with pytest.raises(ValueError, match="prompt 0 is empty"):
            engine.generate([[]])
        with pytest.raises(ValueError, match="exceeds max_seq_len=64"):
            engine.generate([list(range(60))], max_new_tokens=10)
        with pytest.raises(ValueError, match="outside \\[0, 320\\)"):
            engine.generate([[1, 2, 999]])
        with pytest.raises(ValueError, match="max_new_tokens must be an integer >= 1"):
            engine.generate(["x"], max_new_tokens=0)
        allocators = [engine.cache.transfer_alloc, *engine.cache.compute_alloc]
        assert not engine.cache.seqs and all(a.num_free == a.num_blocks for a in allocators)  # nothing held
        assert engine.cache.free_blocks() == engine.cache.config.host_budget_blocks()
        assert len(engine.generate(["still works"], max_new_tokens=3)[0].token_ids) == 3
    finally:
        engine.shutdown()


def test_a_batch_beyond_capacity_is_refused_before_any_write():
    engine = Engine.from_pretrained("tiny-qwen3-moe", window_tokens=16, block_size=4, max_batch_size=1,
                                    max_seq_len=64)
    try:
        engine.cache.admit("squatter", 60, 4)  # all the capacity
        with pytest.raises(CapacityError, match="slots are in use|needs"):
            engine.generate([list(range(30))], max_new_tokens=4)
        engine.cache.finish("squatter")
        engine.cache.check_integrity()
        assert len(engine.generate([list(range(30))], max_new_tokens=4)[0].token_ids) == 4
    finally:
        engine.shutdown()


@pytest.mark.parametrize("name,message", [
    ("tiny-llama", "neither a checkpoint directory nor a preset; presets: tiny-deepseek-v2"),
])
def test_unknown_preset_lists_the_known_ones(name, message):
    with pytest.raises(ValueError, match=message):
        Engine.from_pretrained(name)


def test_unknown_policy_and_executor_list_the_known_ones():
    with pytest.raises(ValueError, match="known: writescope, all_transfer, all_cpu, fixed_half, monolithic"):
        Engine.from_pretrained("tiny-mixtral", policy="greedy")
    with pytest.raises(ValueError, match="unknown executor 'threads'; known: local, ray"):
        Engine.from_pretrained("tiny-mixtral", executor="threads")


@pytest.fixture(scope="module")
def saved_mixtral(tmp_path_factory):
    torch.manual_seed(1)
    config = transformers.MixtralConfig(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                        eos_token_id=None, pad_token_id=0)
    model = transformers.MixtralForCausalLM(config).eval()
    single = tmp_path_factory.mktemp("single")
    model.save_pretrained(single)
    sharded = tmp_path_factory.mktemp("sharded")
    model.save_pretrained(sharded, max_shard_size="100KB")
    return model, single, sharded


def test_sharded_checkpoint_loads_the_same_weights(saved_mixtral):
    _, single, sharded = saved_mixtral
    assert os.path.isfile(sharded / "model.safetensors.index.json")
    outputs = []
    for path in (single, sharded):
        engine = Engine.from_pretrained(str(path), window_tokens=16, block_size=4, max_batch_size=1, max_seq_len=128)
        try:
            outputs.append(engine.generate([[3, 4, 5] * 10], max_new_tokens=5)[0].token_ids)
        finally:
            engine.shutdown()
    assert outputs[0] == outputs[1]


def test_checkpoint_without_tokenizer_takes_token_ids_only(saved_mixtral):
    _, single, _ = saved_mixtral
    engine = Engine.from_pretrained(str(single), window_tokens=16, block_size=4, max_batch_size=1, max_seq_len=128)
    try:
        assert engine.generate([[1, 2, 3]], max_new_tokens=2)[0].text == ""
        with pytest.raises(ValueError, match="no tokenizer.json: pass prompts as lists of token ids"):
            engine.generate("text")
    finally:
        engine.shutdown()


def test_bfloat16_runs_on_a_float32_checkpoint(saved_mixtral):
    _, single, _ = saved_mixtral
    engine = Engine.from_pretrained(str(single), dtype="bfloat16", window_tokens=16, block_size=4, max_batch_size=1,
                                    max_seq_len=128)
    try:
        assert engine.cache.config.format.dtype == "bfloat16"
        assert len(engine.generate([[1, 2, 3] * 9], max_new_tokens=4)[0].token_ids) == 4
    finally:
        engine.shutdown()


def test_broken_checkpoints_get_clear_errors(saved_mixtral, tmp_path):
    _, single, _ = saved_mixtral
    with pytest.raises(ValueError, match="config.json is missing|neither a checkpoint"):
        Engine.from_pretrained(str(tmp_path))
    broken = tmp_path / "no_weights"
    broken.mkdir()
    (broken / "config.json").write_text((single / "config.json").read_text())
    with pytest.raises(ValueError, match="has no model.safetensors"):
        Engine.from_pretrained(str(broken))
    mismatched = tmp_path / "mismatched"
    mismatched.mkdir()
    config = json.loads((single / "config.json").read_text())
    config["hidden_size"] = 32
    (mismatched / "config.json").write_text(json.dumps(config))
    os.symlink(single / "model.safetensors", mismatched / "model.safetensors")
    with pytest.raises(ValueError, match="has shape .* the config needs"):
        Engine.from_pretrained(str(mismatched))
    other = tmp_path / "other_arch"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({**config, "model_type": "llama"}))
    with pytest.raises(ValueError, match="model_type 'llama' is not supported; supported: deepseek_v2"):
        Engine.from_pretrained(str(other))


def test_decode_graph_is_inspectable():
    graph = build_decode_graph(num_layers=3)
    names = [n.name for n in graph.nodes]
    assert names[0] == "embed" and names[-2:] == ["logits", "commit"]
    for layer in range(3):
        assert sorted(n.op for n in graph.layer_nodes(layer)) == sorted(LAYER_OPS)
    # layer 2's copy starts right after layer 1's device partial, before layer 1's merge and MoE
    assert names.index("L2.transfer") == names.index("L1.device_partial") + 1
    assert graph.node("L1.device_partial").inputs[-1] == "L1.transfer"
    cpu = graph.node("L1.cpu_partial")
    assert cpu.place == "cpu" and cpu.inputs == ("L1.qkv",)  # free to overlap the device's window write
    seen = set()
    for node in graph.nodes:  # topological order
        assert set(node.inputs) <= seen
        seen.add(node.name)


def test_eos_of_the_preset_is_its_tokenizers_eos():
    engine = small_engine()
    try:
        assert engine.config.eos_token_ids == (EOS_TOKEN_ID,)
        assert engine.tokenizer.token_to_id("<eos>") == EOS_TOKEN_ID
    finally:
        engine.shutdown()


def test_a_request_that_fails_in_the_step_ends_alone_and_the_batch_goes_on():
    """One request's logits turn NaN mid-decode (an embedding row of a token it generates is NaN):
    it ends with an error, the requests batched with it finish with their solo tokens."""
    engine = small_engine(max_batch_size=3)
    try:
        prompts = [[10, 11, 12] * 9, [40, 41] * 15, [70, 71, 72, 73] * 7]
        solo = [engine.generate(p, max_new_tokens=8)[0].token_ids for p in prompts]
        innocent_tokens = set(solo[0]) | set(solo[2]) | set(prompts[0]) | set(prompts[2]) | set(prompts[1])
        poison = next(t for t in solo[1][2:] if t not in innocent_tokens)  # generated by request 1 only
        engine.model.w["model.embed_tokens.weight"][poison] = float("nan")
        outputs = engine.generate(prompts, max_new_tokens=8)
        assert [outputs[0].token_ids, outputs[2].token_ids] == [solo[0], solo[2]]
        failed = outputs[1]
        assert failed.finish_reason == "error" and "not finite" in failed.error
        assert failed.token_ids == solo[1][: solo[1].index(poison) + 1]  # it ran until its logits broke
        engine.cache.check_integrity()
        assert not engine.cache.seqs  # its KV was freed with the others'
    finally:
        engine.shutdown()


def test_a_text_prompt_is_checked_before_it_is_tokenised():
    engine = small_engine(max_seq_len=64)
    try:
        with pytest.raises(ValueError, match="lone surrogate .U\\+D800. at character 1"):
            engine.generate(["a\ud800b"])
        with pytest.raises(ValueError, match="characters, more than a prompt of max_seq_len=64"):
            engine.generate(["x" * 10_000_000])  # refused from its length, not tokenised
        with pytest.raises(ValueError, match="exceeds max_seq_len=64"):
            engine.generate([list(range(10_000_000))])  # measured before a single id is read
        with pytest.raises(ValueError, match="integer token ids only"):
            engine.generate([[1, 2.5, 3]])
        assert len(engine.generate(["still works"], max_new_tokens=3)[0].token_ids) == 3
    finally:
        engine.shutdown()


def test_the_share_reported_is_the_share_blocks_are_routed_with():
    """placement() and the batch job's progress report the share the policy wants for the tokens
    outside the window (what route_blocks is given), not for every token: with a share that falls
    with L the two differ."""
    from writescope.actors.batch_job import LocalEngine
    from writescope.engine import placement
    from writescope.perf_model import PerfModel
    from writescope.policies import make_policy

    policy = make_policy("writescope", PerfModel(2e-7, 1e-7, 2e-6, 1e-5))  # r* 0.60 at 100 tokens, 0.44 at 240
    # the model as given: the online correction would learn this host's rates, which may put r* at 1
    # at every length, where the two shares could not differ
    policy.observe_step = lambda *args: None
    policy.end_step = lambda: None
    engine = small_engine(policy=policy, max_batch_size=1)
    local = LocalEngine(engine, max_waiting=1)
    try:
        checked, differed = 0, 0
        for event in engine.generate_stream([list(range(1, 150))], max_new_tokens=40):
            spilled = engine.cache.spilled_tokens()
            every_token = sum(s.num_tokens for s in engine.cache.seqs.values())
            if not spilled or event.finish_reason is not None:
                continue
            wanted = policy.preview_share(spilled)
            assert placement(engine)["cpu_share_spilled"] == wanted == local.current_share()
            differed += wanted != policy.preview_share(every_token)  # the window's tokens are not the policy's L
            checked += 1
        assert checked >= 30 and differed >= checked // 2
    finally:
        local.shutdown()


def test_a_running_stream_gets_tokens_while_a_long_prompt_is_prefilled():
    """Chunked prefill interleaved with decode: the short request's tokens keep coming while the
    long one is prefilled chunk by chunk (15 chunks of 8 tokens), and each gets its solo tokens."""
    from collections import deque

    from writescope.sampling import SamplingParams

    short, long = list(range(1, 6)), [(7 * i) % 250 + 1 for i in range(120)]
    engine = small_engine(prefill_chunk_tokens=8, enable_prefix_caching=False)  # the solo run would cache the long one
    try:
        solo = [engine.generate([p], max_new_tokens=n)[0].token_ids for p, n in ((short, 30), (long, 4))]
        requests = [engine.make_request(i, p, SamplingParams(max_new_tokens=n))
                    for i, (p, n) in enumerate(((short, 30), (long, 4)))]
        events = list(engine.run_loop(deque(requests)))
    finally:
        engine.shutdown()
    long_first = next(i for i, e in enumerate(events) if e.index == 1)
    short_before = sum(1 for e in events[:long_first] if e.index == 0)
    assert short_before >= 10, short_before  # about one token per 8-token chunk of the long prompt
    assert [r.tokens for r in requests] == solo


def test_a_request_cancelled_during_its_prefill_stops_at_the_next_chunk_and_frees_its_kv():
    from collections import deque

    from writescope.sampling import SamplingParams

    engine = small_engine(prefill_chunk_tokens=8)
    try:
        short = engine.make_request(0, list(range(1, 6)), SamplingParams(max_new_tokens=20))
        long = engine.make_request(1, list(range(1, 200)), SamplingParams(max_new_tokens=4))
        seen = []
        for event in engine.run_loop(deque([short, long])):
            seen.append(event)
            if event.index == 0 and len(seen) == 3:
                assert 0 < long.prefilled < len(long.prompt)  # mid-prefill
                long.cancelled = True
        assert [e.finish_reason for e in seen if e.index == 1] == ["abort"]
        assert long.prefilled < len(long.prompt) and not engine.cache.seqs
        assert len(short.tokens) == 20
        engine.cache.check_integrity()
    finally:
        engine.shutdown()


@pytest.mark.parametrize("preset", list(TINY_PRESETS))
def test_a_prompt_prefilled_in_chunks_after_a_prefix_read_in_pieces_decodes_as_one_prefilled_whole(preset):
    """8-token chunks attend to their prefix read back in pieces of 64 tokens (a 200-token prompt:
    up to four pieces a chunk): the same tokens and logits as one whole-prompt prefill."""
    prompt = [(7 * i) % 250 + 1 for i in range(200)]
    outputs = []
    for chunk in (8, 256):
        engine = small_engine(preset, prefill_chunk_tokens=chunk)
        try:
            assert engine.prefix_piece_tokens == 8 * chunk
            outputs.append(engine.generate([prompt], max_new_tokens=6, return_logits=True)[0])
        finally:
            engine.shutdown()
    pieces, whole = outputs
    assert pieces.token_ids == whole.token_ids
    torch.testing.assert_close(pieces.logits, whole.logits, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("chunk, message", [(0, "prefill_chunk_tokens must be an integer >= 1"),
                                            (6, "prefill_chunk_tokens must be a multiple of block_size 4")])
def test_bad_prefill_chunks_are_refused(chunk, message):
    with pytest.raises(ValueError, match=message):
        small_engine(prefill_chunk_tokens=chunk)


def test_a_prefill_chunk_beyond_the_devices_memory_is_refused_with_both_figures():
    """4M-token chunks of tiny-qwen3-moe (about 8 KiB of float32 activations a token: 32 GiB a chunk)
    on a host with less available; its KV alone (4 GiB) would fit."""
    with pytest.raises(ValueError, match=r"prefill_chunk_tokens=4194304 takes about 3\d\.\d\d GiB of activations a "
                                         r"chunk .*; the host has available \d+\.\d\d GiB: lower prefill_chunk_tokens"):
        Engine.from_pretrained("tiny-qwen3-moe", policy="all_cpu", max_batch_size=1, max_seq_len=2**22,
                               prefill_chunk_tokens=2**22)


def test_a_request_that_fails_mid_prefill_ends_alone_and_the_running_stream_goes_on(monkeypatch):
    """A failure in a later chunk of one prompt's prefill (reading its prefix back) ends that request
    with an error event and frees its KV; the stream decoding beside it keeps its solo tokens."""
    from collections import deque

    from writescope.sampling import SamplingParams

    engine = small_engine(prefill_chunk_tokens=8, enable_prefix_caching=False)  # chunks from token 0
    try:
        solo = engine.generate([list(range(1, 6))], max_new_tokens=12)[0].token_ids
        short = engine.make_request(0, list(range(1, 6)), SamplingParams(max_new_tokens=12))
        long = engine.make_request(1, list(range(1, 100)), SamplingParams(max_new_tokens=4))
        read_back = engine.cache.sequence_kv

        def failing(seq_id, layer, num_tokens=None, first_token=0):
            if seq_id == long.seq_id and num_tokens == 24:
                raise RuntimeError("injected: the prefix could not be read")
            return read_back(seq_id, layer, num_tokens, first_token)

        monkeypatch.setattr(engine.cache, "sequence_kv", failing)
        events = list(engine.run_loop(deque([short, long])))
        engine.cache.check_integrity()
    finally:
        engine.shutdown()
    errors = [e for e in events if e.index == 1]
    assert [e.finish_reason for e in errors] == ["error"] and "during its prefill" in errors[0].error
    assert short.tokens == solo and not engine.cache.seqs


@pytest.mark.parametrize("num_q_heads, num_kv_heads, dim_v", [(8, 2, 16), (4, 1, 12), (4, 4, 24)])
def test_a_chunk_after_its_prefix_attends_as_the_whole_prompt_does(num_q_heads, num_kv_heads, dim_v):
    """causal_attention of a chunk with the prefix given head-major (two fused calls merged by LSE)
    against torch's causal SDPA over the whole prompt, for the chunk's rows."""
    from writescope.models.layers import causal_attention

    torch.manual_seed(0)
    length, dim = 300, 24
    q, k = torch.randn(length, num_q_heads, dim), torch.randn(length, num_kv_heads, dim)
    v = torch.randn(length, num_kv_heads, dim_v)
    v_padded = torch.nn.functional.pad(v, (0, dim - dim_v))  # SDPA's fused path wants V as wide as K
    whole = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v_padded.transpose(0, 1)[None],
        is_causal=True, scale=0.2, enable_gqa=True)[0].transpose(0, 1)[..., :dim_v]
    for start in (16, 160, 284):
        for piece in (start, 48):  # the prefix in one piece, and read back in pieces of 48 (the last shorter)
            cuts = [*range(0, start, piece), start]
            prefix = [(k[a:b].transpose(0, 1), v[a:b].transpose(0, 1)) for a, b in zip(cuts, cuts[1:], strict=False)]
            chunk = causal_attention(q[start:], k[start:], v[start:], 0.2, prefix=iter(prefix))
            torch.testing.assert_close(chunk, whole[start:], atol=1e-5, rtol=1e-5)
