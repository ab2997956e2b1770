"""tools/bench_cpu_attention.py end to end on tiny inputs: every row checked against the torch reference
inside the tool, and the figures the README's table is made of."""

import json
import re
import statistics

import numpy as np
import pytest
import torch

from writescope import _cpu, calibration
from writescope.tools import bench_cpu_attention as bench


@pytest.fixture(autouse=True)
def no_allocation_pause(monkeypatch):
    """The pause after a row's arrays are made is for the host's memory, not for what is checked here;
    the in-core measurement runs on at most 256 tokens (a host's cache may hold 16K of MHA's)."""
    monkeypatch.setattr(bench, "ALLOCATION_SETTLE_S", 0.0)
    monkeypatch.setattr(bench, "IN_CORE_MAX_TOKENS", 256)


def test_rows_carry_the_roofline_the_instructions_and_the_machine(tmp_path):
    out = tmp_path / "cpu_attention.json"
    bench.main(["--seq-lens", "64", "256", "--no-peers", "--repeats", "3", "--warmup", "0",
                "--read-bytes", str(1 << 20), "--run-blocks", "2", "--cold-bytes", str(1 << 20), "--out", str(out)])
    result = json.loads(out.read_text())
    machine = result["machine"]
    assert machine["cpu_variant"] == _cpu.__cpu_variant__ and machine["cpu_model"]
    assert machine["read_gbps"] > 0 and machine["fma_gflops"] > 0
    assert (machine["tile_gflops"] is not None) == (_cpu.__cpu_variant__ == "amx")
    assert len(result["rows"]) == 2 * len(bench.SHAPES)
    assert machine["cold_bytes"] == 1 << 20
    for row in result["rows"]:
        shape = next(s for s in bench.SHAPES if s.name == row["shape"])
        assert row["kv_copies"] * bench.kv_bytes(shape, row["seq_len"]) >= 1 << 20  # each call reads cold KV
        assert row["instructions"] in ("fma/fma", "dot/dot", "tile/tile")
        assert row["kernel_ms"] > 0 and row["roofline_ms"] > 0
        assert row["fraction_of_roofline"] == pytest.approx(row["roofline_ms"] / row["kernel_own_ms"])
        # every timed call has the read of its bytes beside it; the paired fraction is recomputed here
        # from the rounds and the machine's peaks, with the roofline's definition
        rounds = row["rounds"]
        assert len(rounds) == 3 and all(r["kernel_s"] >= r["kernel_own_s"] > 0 and r["read_s"] > 0 for r in rounds)
        assert row["kernel_ms"] == pytest.approx(statistics.median(r["kernel_s"] for r in rounds) * 1e3)
        assert row["kernel_own_ms"] == pytest.approx(statistics.median(r["kernel_own_s"] for r in rounds) * 1e3)
        assert row["paired_read_gbps"] == pytest.approx(
            bench.kv_bytes(shape, row["seq_len"]) / statistics.median(r["read_s"] for r in rounds) / 1e9)
        qk, pv = row["instructions"].split("/")
        compute_s = 2 * shape.num_q_heads * row["seq_len"] * (
            shape.head_dim_qk / machine[f"{qk}_gflops"] + shape.head_dim_v / machine[f"{pv}_gflops"]) / 1e9
        assert row["fraction_of_paired_roofline"] == pytest.approx(
            statistics.median(max(r["read_s"], compute_s) / r["kernel_own_s"] for r in rounds))
        assert all(r["block_read_s"] > 0 for r in rounds)
        assert row["fraction_of_block_order_roofline"] == pytest.approx(
            statistics.median(max(r["block_read_s"], compute_s) / r["kernel_own_s"] for r in rounds))
    assert bench.markdown_table(result).count("\n| ") == len(result["rows"]) + 1
    # an in-core time beside every call, from a KV within half the last-level cache, and the ceiling
    # it makes with the read of the same bytes
    assert machine["llc_bytes"] == (calibration.last_level_cache_bytes() or 0)
    for row in result["rows"]:
        shape = next(s for s in bench.SHAPES if s.name == row["shape"])
        tokens = row["in_core_tokens"]
        assert tokens == bench.in_core_tokens(shape, machine["llc_bytes"])
        if tokens is None:
            assert row["in_core_ms"] is None and row["fraction_of_paired_ceiling"] is None
            continue
        assert bench.kv_bytes(shape, tokens) <= machine["llc_bytes"] // 2
        rounds = row["rounds"]
        assert all(r["in_core_s"] > 0 for r in rounds)
        assert row["in_core_ms"] == pytest.approx(statistics.median(r["in_core_s"] for r in rounds) * 1e3)
        qk, pv = row["instructions"].split("/")
        compute_s = 2 * shape.num_q_heads * row["seq_len"] * (
            shape.head_dim_qk / machine[f"{qk}_gflops"] + shape.head_dim_v / machine[f"{pv}_gflops"]) / 1e9
        assert row["fraction_of_paired_ceiling"] == pytest.approx(statistics.median(
            max(r["read_s"], r["in_core_s"], compute_s) / r["kernel_own_s"] for r in rounds))


@pytest.mark.parametrize("argv, message", [
    (["--seq-lens", "100"], "multiples of the block size 16"),
    (["--run-blocks", "0"], "--run-blocks must be >= 1"),
    (["--cold-bytes", "-1"], "--cold-bytes must be >= 0"),
    (["--repeats", "0"], "--repeats must be >= 1"),
    (["--peer-repeats", "0"], "--peer-repeats must be >= 1"),
])
def test_bad_arguments_are_refused(argv, message, capsys):
    with pytest.raises(SystemExit):
        bench.main(argv)
    assert message in capsys.readouterr().err


def test_in_core_context_fills_at_most_half_the_last_level_cache():
    mixtral, mha = bench.SHAPES[0], bench.SHAPES[2]
    per_step = bench.kv_bytes(mixtral, bench.IN_CORE_TOKEN_STEP)
    assert bench.in_core_tokens(mixtral, 2 * 3 * per_step) == 3 * bench.IN_CORE_TOKEN_STEP
    assert bench.in_core_tokens(mixtral, 2 * 3 * per_step - 1) == 2 * bench.IN_CORE_TOKEN_STEP
    assert bench.in_core_tokens(mixtral, 1 << 40) == bench.IN_CORE_MAX_TOKENS  # capped
    assert bench.in_core_tokens(mha, bench.kv_bytes(mha, bench.IN_CORE_TOKEN_STEP)) is None  # half holds no step
    assert bench.in_core_tokens(mha, 0) is None  # size unknown


def test_the_in_core_probe_runs_unpaced_from_cache_and_leaves_pacing_as_it_was(monkeypatch):
    mixtral = bench.SHAPES[0]
    calls = []  # pacing during each kernel call
    kernel = bench.ops.cpu_paged_attention_timed

    def spy(q, source, scale):
        calls.append(_cpu.pacing())
        return kernel(q, source, scale)

    probe = bench.in_core_probe(mixtral, 128, 2)
    monkeypatch.setattr(bench.ops, "cpu_paged_attention_timed", spy)
    before = _cpu.pacing()
    try:
        for pacing in (True, False):
            _cpu.set_pacing(pacing)
            assert probe() > 0
            assert _cpu.pacing() is pacing
    finally:
        _cpu.set_pacing(before)
    assert calls == [False] * (2 * bench.IN_CORE_CALLS)


def test_copies_keep_the_cold_bytes_between_two_reads_of_one():
    mixtral = bench.SHAPES[0]
    per_copy = bench.kv_bytes(mixtral, 1024)
    assert bench.copies_for(mixtral, 1024, 10 * per_copy + 1) == 11
    assert bench.copies_for(mixtral, 1024, 0) == 1


def test_the_bf16_peers_share_one_rotation_over_their_copies(monkeypatch):
    read = []  # the storage each peer call read, by peer
    for name in ("sdpa", "bmm_softmax"):
        monkeypatch.setattr(bench, name, lambda q, k, v, scale, name=name: read.append((name, k.dtype, k.data_ptr())))
    shape = bench.SHAPES[0]
    q, k, v = bench.make_inputs(shape, 64)
    peers = bench.peer_calls(shape, q, k, v, 0.1, num_copies=3)
    for _ in range(3):
        for call, _ in peers.values():
            call()
    bf16 = [ptr for _, dtype, ptr in read if dtype == torch.bfloat16]
    fp32 = [ptr for _, dtype, ptr in read if dtype == torch.float32]
    assert len(set(bf16)) == 3 and bf16[:3] == bf16[3:6]  # six calls of two peers: copies 0 1 2 0 1 2
    assert all(a != b for a, b in zip(bf16, bf16[1:], strict=False))
    assert len(set(fp32)) == 3 and k.data_ptr() not in bf16 + fp32


def test_each_peer_takes_turns_with_the_kernel_in_its_own_cycles(monkeypatch):
    monkeypatch.setattr(bench, "SETTLE_S", 0.0)
    log = []
    seconds = iter([9, 1, 3, 2, 0, 5, 4, 6] * 2)  # the kernel turns' seconds, untimed turns first

    def kernel_turn():
        log.append("kernel")
        return {"kernel_s": next(seconds)}

    peers = {"a": (lambda: log.append("a"), 0), "b": (lambda: log.append("b"), 0)}
    cycles, skipped = bench.peer_cycles(kernel_turn, peers, lambda: log.append("wake"), cycles=2)
    # per peer: its untimed first call, then cycles of an untimed kernel turn, CYCLE_KERNEL_CALLS
    # timed ones (their median), the wake-up call and one call of the peer
    assert bench.CYCLE_KERNEL_CALLS == 3
    cycle = ["kernel"] * 4 + ["wake"]
    assert log == ["a"] + (cycle + ["a"]) * 2 + ["b"] + (cycle + ["b"]) * 2
    assert list(cycles) == ["a", "b"]
    assert [c["kernel_s"] for c in cycles["a"]] == [2, 5] and [c["kernel_s"] for c in cycles["b"]] == [2, 5]
    assert all(set(c) == {"kernel_s", "peer_s"} and c["peer_s"] >= 0 for runs in cycles.values() for c in runs)
    assert skipped == {}


def test_a_peer_whose_call_would_not_fit_in_memory_is_skipped_not_called(monkeypatch):
    monkeypatch.setattr(bench, "SETTLE_S", 0.0)
    available = bench.available_memory_bytes()
    assert available is not None and available > 0  # Linux: /proc/meminfo
    called = []
    peers = {"fits": (lambda: called.append("fits"), 1 << 20),
             "too_big": (lambda: called.append("too_big"), 2 * available)}
    cycles, skipped = bench.peer_cycles(lambda: {"kernel_s": 1.0}, peers, lambda: None, cycles=1)
    assert called == ["fits", "fits"] and list(cycles) == ["fits"]
    assert list(skipped) == ["too_big"] and "GiB available" in skipped["too_big"]


def test_sdpa_over_grouped_heads_is_estimated_at_its_repeated_float32_kv():
    mla = next(s for s in bench.SHAPES if s.v_in_k)
    mha = next(s for s in bench.SHAPES if s.num_q_heads == s.num_kv_heads)
    # measured: 13.0-13.5 GB a call at MLA 128K
    assert 12e9 < bench.sdpa_transient_bytes(mla, 131072) < 15e9
    assert bench.sdpa_transient_bytes(mha, 131072) == 0


def test_rows_with_peers_take_the_ratio_within_each_cycle(tmp_path):
    out = tmp_path / "cpu_attention.json"
    bench.main(["--seq-lens", "64", "--shapes", "mixtral", "deepseek-v2-lite-mla", "--repeats", "4",
                "--peer-repeats", "2", "--warmup", "0", "--read-bytes", str(1 << 20), "--out", str(out)])
    for row in json.loads(out.read_text())["rows"]:
        assert len(row["rounds"]) == 4
        assert list(row["peer_cycles"]) == ["bmm_softmax_bf16", "sdpa_bf16", "sdpa_fp32"] and row["peers_skipped"] == {}
        for name, cycles in row["peer_cycles"].items():
            assert len(cycles) == 2
            assert row[f"{name}_ms"] == pytest.approx(statistics.median(c["peer_s"] for c in cycles) * 1e3)
            assert row[f"speedup_vs_{name}"] == pytest.approx(
                statistics.median(c["peer_s"] / c["kernel_s"] for c in cycles))
    # the targets hold from 8K on: none of these rows is held to them, and the table says so
    result = json.loads(out.read_text())
    assert result["targets"] == [] and "no row of at least 8K" in bench.markdown_table(result)
    # held from 64 tokens on, each row is checked against its fastest peer: the smallest ratio
    checks = bench.target_checks(result["rows"], min_seq_len=64)
    assert [c["shape"] for c in checks] == ["mixtral", "deepseek-v2-lite-mla"]
    for row, check in zip(result["rows"], checks, strict=True):
        ratios = {peer: row[f"speedup_vs_{peer}"] for peer in bench.PEERS}
        assert check["vs_fastest_peer"] == min(ratios.values()) == ratios[check["fastest_peer"]]
        assert check["peer_met"] == (min(ratios.values()) >= bench.PEER_TARGET)
        assert check["fraction"] == row["fraction_of_paired_roofline"]
    assert checks[1]["fraction_target"] == 0.7 and checks[0]["fraction_target"] == 0.8


def _row(shape: str, seq_len: int, fraction: float, **speedups) -> dict:
    return {"shape": shape, "seq_len": seq_len, "fraction_of_paired_roofline": fraction,
            **{f"speedup_vs_{peer}": ratio for peer, ratio in speedups.items()}}


def test_the_targets_name_every_row_that_falls_short_and_by_how_much():
    rows = [
        _row("mixtral", 4096, 0.10, sdpa_bf16=1.0),  # below 8K: not held to the targets
        _row("mixtral", 8192, 0.80, sdpa_bf16=3.0, sdpa_fp32=2.0, bmm_softmax_bf16=2.5),
        _row("qwen3-moe", 8192, 0.797, sdpa_bf16=5.0, bmm_softmax_bf16=1.9),
        _row("mha", 32768, 0.89, sdpa_bf16=1.4, sdpa_fp32=2.3),
        _row("deepseek-v2-lite-mla", 32768, 0.69, bmm_softmax_bf16=5.0),
        _row("deepseek-v2-lite-mla", 131072, 0.70),  # every peer skipped: no ratio to hold
    ]
    checks = bench.target_checks(rows)
    assert [(c["shape"], c["seq_len"]) for c in checks] == [(r["shape"], r["seq_len"]) for r in rows[1:]]
    assert [c["fraction_met"] for c in checks] == [True, False, True, False, True]
    fastest = ["sdpa_fp32", "bmm_softmax_bf16", "sdpa_bf16", "bmm_softmax_bf16", None]
    assert [c["fastest_peer"] for c in checks] == fastest
    assert [c["peer_met"] for c in checks] == [True, False, False, True, None]
    summary = bench.targets_summary(checks)
    assert ("in 3 of 5 rows; short: qwen3-moe 8K 0.797 (target 0.8), deepseek-v2-lite-mla 32K 0.690 (target 0.7)"
            in summary)
    assert ("in 2 of 4 rows with a peer; short: qwen3-moe 8K 1.9x (bmm_softmax_bf16), mha 32K 1.4x (sdpa_bf16)."
            in summary)
    assert bench.targets_summary(bench.target_checks(rows[-1:])).endswith("no torch peer measured.")


@pytest.mark.parametrize("shape", bench.SHAPES, ids=lambda s: s.name)
def test_the_paired_read_covers_the_bytes_the_kernel_reads(shape):
    q, k, v = bench.make_inputs(shape, 256)
    source = bench.cache_source(shape, k, v, torch.Generator().manual_seed(0), 4)
    buffers = bench.probe_buffers(shape, source)
    assert sum(b.nbytes for b in buffers) == bench.kv_bytes(shape, 256)
    # the very storage the kernel's source views, not a copy
    stored = [source.k_cache] if shape.v_in_k else [source.k_cache, source.v_cache]
    assert [b.ctypes.data for b in buffers] == [t.data_ptr() for t in stored]


@pytest.mark.parametrize("shape", bench.SHAPES, ids=lambda s: s.name)
def test_the_block_order_read_takes_every_byte_once_in_the_kernels_order(shape):
    q, k, v = bench.make_inputs(shape, 256)
    source = bench.cache_source(shape, k, v, torch.Generator().manual_seed(0), 4)
    buffers, ranges = bench.block_order_ranges(shape, source)
    assert ranges.dtype == np.int64 and ranges.shape[1] == 3
    # every block of every buffer once
    for index, buffer in enumerate(buffers):
        mine = ranges[ranges[:, 0] == index]
        block_bytes = buffer[0, 0].nbytes
        assert np.all(mine[:, 2] == block_bytes)
        assert sorted(mine[:, 1].tolist()) == list(range(0, buffer.nbytes, block_bytes))
    # head 0's first 64-token tile: its K blocks in the sequence's order, then its V blocks
    num_blocks = buffers[0].shape[1]
    first_tile = source.block_table[0, :4].tolist()
    k_bytes = buffers[0][0, 0].nbytes
    assert ranges[:4, 1].tolist() == [b * k_bytes for b in first_tile] and np.all(ranges[:4, 0] == 0)
    if not shape.v_in_k:
        assert ranges[4:8, 0].tolist() == [1] * 4
    # kv heads one after another: a row's head is its offset over a head's blocks
    heads = [offset // buffers[index][0, 0].nbytes // num_blocks for index, offset, _ in ranges.tolist()]
    assert heads == sorted(heads) and heads[-1] == shape.num_kv_heads - 1
    assert _cpu.ranges_read_seconds(buffers, ranges) > 0


@pytest.mark.parametrize("rows, message", [
    ([[1, 0, 64]], "buffer index 1 is outside [0, 1)"),
    ([[0, 4096, 64]], "must be a non-empty range of 4-byte words inside buffers[0] (4096 bytes)"),
    ([[0, 2, 64]], "must be a non-empty range"),
    ([[0, 0, 0]], "must be a non-empty range"),
])
def test_ranges_read_refuses_ranges_outside_their_buffer(rows, message):
    buffer = np.zeros(1024, dtype=np.float32)
    with pytest.raises(ValueError, match=re.escape(message)):
        _cpu.ranges_read_seconds([buffer], np.array(rows, dtype=np.int64))
    with pytest.raises(ValueError, match="expected int64"):
        _cpu.ranges_read_seconds([buffer], np.array(rows, dtype=np.int32))
