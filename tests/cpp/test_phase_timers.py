"""The CPU kernel's phase timers (writescope._cpu.set_phase_timers / phase_timers): counted against the
work items and tiles the launcher plans, off by default, and never a change to a result."""

import pytest
import torch

from writescope import _cpu, ops
from writescope.kv_format import to_paired

PHASES = ("item_start", "first_tile", "gather", "scores", "softmax", "values", "last_tile", "item_end", "merge")
TILE_TOKENS = 64  # both kernels' tiles at 16-token blocks
BLOCK_SIZE = 16


@pytest.fixture(autouse=True)
def timers_off_after():
    yield
    _cpu.set_phase_timers(False)


def one_sequence(seq_len, num_kv_heads, group, head_dim_qk, head_dim_v=None, layout="token_major", mla=False):
    """q [1, num_q_heads, head_dim_qk] and one sequence's KVSource in shuffled 16-token blocks."""
    generator = torch.Generator().manual_seed(seq_len)
    num_blocks = -(-seq_len // BLOCK_SIZE)
    k = torch.randn(num_blocks, num_kv_heads, BLOCK_SIZE, head_dim_qk, generator=generator).to(torch.bfloat16)
    if mla:
        v = k[..., :head_dim_v]
    else:
        v = torch.randn(num_blocks, num_kv_heads, BLOCK_SIZE, head_dim_v or head_dim_qk,
                        generator=generator).to(torch.bfloat16)
    if layout == "paired":
        k, v = to_paired("k", k), to_paired("v", v)
    table = torch.randperm(num_blocks, generator=generator).to(torch.int32)[None]
    q = torch.randn(1, num_kv_heads * group, head_dim_qk, generator=generator).to(torch.bfloat16)
    return q, ops.KVSource(k, v, table, torch.tensor([seq_len], dtype=torch.int32))


def call(q, source, chunk_tokens):
    head_dim_v = source.v_cache.shape[-1] if source.layout == "token_major" else source.v_cache.shape[-2]
    out = torch.empty(1, q.shape[1], head_dim_v)
    lse = torch.empty(1, q.shape[1])
    seconds = _cpu.paged_attention(ops._as_numpy(q), ops._kv_numpy(source.k_cache), ops._kv_numpy(source.v_cache),
                                   ops._as_numpy(source.block_table), ops._as_numpy(source.seq_lens), out.numpy(),
                                   lse.numpy(), q_dtype="bfloat16", kv_dtype="bfloat16", layout=source.layout,
                                   scale=0.1, chunk_tokens=chunk_tokens)
    return out, lse, seconds


def planned(seq_len, num_kv_heads, chunk_tokens):
    """What the launcher plans: items, first tiles, middle tiles, last tiles and merges."""
    items = first = middle = last = 0
    chunks = -(-seq_len // chunk_tokens)
    for c in range(chunks):
        tiles = -(-min(chunk_tokens, seq_len - c * chunk_tokens) // TILE_TOKENS)
        items += 1
        first += 1
        last += tiles > 1
        middle += max(tiles - 2, 0)
    merges = 1 if chunks > 1 else 0
    return {"item_start": items * num_kv_heads, "first_tile": first * num_kv_heads, "middle": middle * num_kv_heads,
            "last_tile": last * num_kv_heads, "item_end": items * num_kv_heads, "merge": merges * num_kv_heads}


CASES = {
    "gqa-token-major": dict(num_kv_heads=2, group=4, head_dim_qk=128),
    "gqa-paired": dict(num_kv_heads=2, group=4, head_dim_qk=128, layout="paired"),
    "mla": dict(num_kv_heads=1, group=16, head_dim_qk=576, head_dim_v=512, mla=True),
}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("seq_len, chunk_tokens", [(1000, 320), (64, 320), (700, 64), (129, 4096)])
def test_counts_are_the_planned_items_and_tiles(cpu_variant, case, seq_len, chunk_tokens):
    q, source = one_sequence(seq_len, **CASES[case])
    _cpu.set_phase_timers(True)
    call(q, source, chunk_tokens)
    counts = {phase: count for phase, (count, _) in _cpu.phase_timers().items()}
    expected = planned(seq_len, CASES[case]["num_kv_heads"], chunk_tokens)
    for phase in ("item_start", "first_tile", "last_tile", "item_end", "merge"):
        assert counts[phase] == expected[phase], phase
    for part in ("gather", "scores", "softmax", "values"):
        assert counts[part] == expected["middle"], part


@pytest.mark.parametrize("case", CASES)
def test_timers_change_no_result(cpu_variant, case):
    q, source = one_sequence(3000, **CASES[case])
    off_out, off_lse, _ = call(q, source, 512)
    _cpu.set_phase_timers(True)
    on_out, on_lse, _ = call(q, source, 512)
    assert torch.equal(off_out, on_out) and torch.equal(off_lse, on_lse)


def test_off_by_default_and_zeroed_when_set():
    q, source = one_sequence(1000, **CASES["gqa-paired"])
    _cpu.set_phase_timers(False)
    call(q, source, 320)
    assert all(count == 0 and seconds == 0.0 for count, seconds in _cpu.phase_timers().values())
    _cpu.set_phase_timers(True)
    call(q, source, 320)
    assert _cpu.phase_timers()["first_tile"][0] == 8
    _cpu.set_phase_timers(True)  # zeroes
    assert all(count == 0 for count, _ in _cpu.phase_timers().values())
    assert tuple(_cpu.phase_timers()) == PHASES


def test_phase_seconds_fit_in_the_threads_kernel_time():
    q, source = one_sequence(20000, **CASES["mla"])
    call(q, source, 2048)  # warm
    _cpu.set_phase_timers(True)
    kernel_s = sum(call(q, source, 2048)[2] for _ in range(5))
    totals = _cpu.phase_timers()
    summed_s = sum(seconds for _, seconds in totals.values())
    assert all(seconds > 0 for count, seconds in totals.values() if count > 0)
    assert 0 < summed_s <= kernel_s * _cpu.num_threads() * 1.05


def test_a_switch_that_is_not_a_bool_is_refused():
    with pytest.raises(TypeError):
        _cpu.set_phase_timers("yes")
