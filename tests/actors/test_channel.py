"""A real CPU worker (a Ray actor) over its shared-memory channel, fed by this process: each request
names one of the worker's shard regions and whether its table indexes blocks or single tokens (a
sparse attention's selection). A selection's partial equals torch's softmax attention over the
chosen rows of the region it names; a request for a region, layer or token the worker does not
have comes back as an error naming it, and the worker goes on answering."""

import os
import secrets

import pytest
import ray
import torch

from writescope import ops
from writescope.actors.cpu_worker import (
    BLOCKS,
    Q_DTYPES,
    REQUEST,
    TOKENS,
    ChannelSpec,
    CPUWorker,
    PartialClient,
    create_segment,
)
from writescope.deepseek_v4_engine import EntryFormat
from writescope.inplace_kv_cache import selected_source
from writescope.kv_regions import HostRegion
from writescope.topology import emulated_topology

pytestmark = pytest.mark.ray
HEADS, DIM, TOKENS_PER_REGION = 4, 32, 64


def region(num_layers: int, seed: int, dtype: str = "float32") -> HostRegion:
    """A cpu_compute region of DeepSeek-V4 entries (one KV head read as K and V), filled at random."""
    fmt = EntryFormat(num_layers, DIM).kv_format(dtype, block_size=4)
    made = HostRegion.create("cpu_compute", fmt, TOKENS_PER_REGION // 4, segment_blocks=TOKENS_PER_REGION // 4,
                             shard=0, pin=False, label=f"test{os.getpid()}")
    made.commit(0)
    generator = torch.Generator().manual_seed(seed)
    made.arrays[0].copy_(torch.randn(made.arrays[0].shape, generator=generator))
    return made


def reference(q, rows, scale):
    """q [B, H, D], rows [B, n, D] -> softmax attention out [B, H, D] and lse [B, H]."""
    scores = torch.einsum("bhd,bnd->bhn", q, rows) * scale
    return torch.einsum("bhn,bnd->bhd", scores.softmax(-1), rows), scores.logsumexp(-1)


@pytest.fixture(scope="module")
def worker(ray_cluster):
    regions = [region(2, seed=1), region(1, seed=2), region(1, seed=3, dtype="bfloat16")]
    spec = ChannelSpec(shm_name="named below", owner_pid=0, fd=-1,
                       socket_address=f"\0writescope-test-{secrets.token_hex(4)}", max_seqs=2, max_blocks=8,
                       num_q_heads=HEADS, head_dim_qk=DIM, head_dim_v=DIM)
    spec, segment = create_segment(spec, f"test_channel_{os.getpid()}")
    actor = CPUWorker.remote(emulated_topology(1)[0], [r.handle.to_bytes() for r in regions], spec)
    assert ray.get(actor.check_health.remote())
    client = PartialClient(spec, reconnect_timeout_s=30)
    yield client, regions
    client.close()
    ray.kill(actor)
    segment.close()
    for made in regions:
        made.close()


def tokens_of(made: HostRegion, layer: int) -> torch.Tensor:
    return made.arrays[0][layer].reshape(-1, DIM)  # [tokens, DIM]: token-major, one KV head


def test_a_selection_of_tokens_gives_torch_attention_over_them(worker):
    client, regions = worker
    q = torch.randn(2, HEADS, DIM)
    table = torch.tensor([[5, 63, 17, 0, 0, 0], [40, 2, 33, 8, 61, 12]], dtype=torch.int32)
    lens = torch.tensor([3, 6], dtype=torch.int32)
    for index, layer in [(0, 1), (1, 0)]:  # the same table names different bytes in each region
        client.send(layer, q, table, lens, 0.125, region=index, unit=TOKENS)
        out, lse, seconds = client.receive()
        rows = tokens_of(regions[index], layer)
        for row in range(2):
            expected_out, expected_lse = reference(q[row:row + 1], rows[table[row, : lens[row]].long()][None], 0.125)
            torch.testing.assert_close(out[row], expected_out[0], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(lse[row], expected_lse[0], atol=1e-5, rtol=1e-5)
        assert seconds > 0


def test_blocks_and_tokens_index_the_same_region_differently(worker):
    client, regions = worker
    q = torch.randn(1, HEADS, DIM)
    table, lens = torch.tensor([[3, 1]], dtype=torch.int32), torch.tensor([8], dtype=torch.int32)
    client.send(0, q, table, lens, 0.125, region=0, unit=BLOCKS)  # blocks 3 and 1: tokens 12-15, 4-7
    out, _, _ = client.receive()
    rows = tokens_of(regions[0], 0)[torch.tensor([12, 13, 14, 15, 4, 5, 6, 7])]
    torch.testing.assert_close(out, reference(q, rows[None], 0.125)[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("q_dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_q_crosses_in_its_dtype_and_gives_the_local_kernels_result_exactly(worker, q_dtype):
    # A bf16 q over bf16 KV takes the kernel's bf16-dot path (probabilities rounded to bf16) where the
    # CPU has a faster dot; sent as float32 it would take the float32 path and differ by ~1e-3.
    client, regions = worker
    q = torch.randn(2, HEADS, DIM).to(q_dtype)
    table = torch.tensor([[5, 63, 17, 0, 0, 0], [40, 2, 33, 8, 61, 12]], dtype=torch.int32)
    lens = torch.tensor([3, 6], dtype=torch.int32)
    client.send(0, q, table, lens, 0.125, region=2, unit=TOKENS)
    out, lse, _ = client.receive()
    local_out, local_lse, _ = ops.cpu_paged_attention_timed(q, selected_source(regions[2], 0, table, lens), 0.125)
    assert torch.equal(out, local_out) and torch.equal(lse, local_lse)


def test_a_request_with_an_unknown_q_dtype_is_an_error_naming_it_and_the_worker_goes_on(worker):
    # PartialClient.send only writes the codes of Q_DTYPES: forge the header as another client could.
    client, _ = worker
    q = torch.randn(1, HEADS, DIM)
    table, lens = torch.tensor([[1]], dtype=torch.int32), torch.tensor([1], dtype=torch.int32)
    client.send(0, q, table, lens, 0.125, region=0, unit=TOKENS)
    client.receive()
    request_id = REQUEST.unpack(client._request[0])[0] + 1  # noqa: SLF001 - forging the wire on purpose
    client._next_id = request_id  # noqa: SLF001
    forged = REQUEST.pack(request_id, 0, 0, 1, 1, TOKENS, len(Q_DTYPES), 0.125)
    client._request = (forged, q, table.numpy(), lens.numpy())  # noqa: SLF001
    client._transmit()  # noqa: SLF001
    with pytest.raises(RuntimeError, match=r"q dtype code 3 is outside \[0, 3\)"):
        client.receive()
    client.send(0, q, table, lens, 0.125, region=0, unit=TOKENS)
    out, _, _ = client.receive()  # still answering
    assert torch.isfinite(out).all()


@pytest.mark.parametrize(("region", "layer", "table", "unit", "message"), [
    (3, 0, [[1]], TOKENS, r"region 3 is outside \[0, 3\)"),
    (1, 1, [[1]], TOKENS, r"layer 1 is outside \[0, 1\) of region 1"),
    (0, 0, [[TOKENS_PER_REGION]], TOKENS, r"\[0, 0\] = 64 is outside \[0, 64\)"),  # one past its last token
    (0, 0, [[-3]], TOKENS, r"\[0, 0\] = -3 is outside \[0, 64\)"),
    (0, 0, [[TOKENS_PER_REGION // 4]], BLOCKS, r"\[0, 0\] = 16 is outside \[0, 16\)"),  # past its last block
    (0, 0, [[1]], 7, "table unit 7"),
])
def test_a_bad_request_is_an_error_naming_it_and_the_worker_goes_on(worker, region, layer, table, unit, message):
    client, _ = worker
    q = torch.randn(1, HEADS, DIM)
    client.send(layer, q, torch.tensor(table, dtype=torch.int32), torch.tensor([1], dtype=torch.int32), 0.125,
                region=region, unit=unit)
    with pytest.raises(RuntimeError, match=message):
        client.receive()
    client.send(0, q, torch.tensor([[1]], dtype=torch.int32), torch.tensor([1], dtype=torch.int32), 0.125,
                region=0, unit=TOKENS)
    out, _, _ = client.receive()  # still answering
    assert torch.isfinite(out).all()
