"""Where one engine runs: an engine group, the unit Ray places.

An engine is a region owner, a policy store, a GPU worker and one CPU worker per NUMA node of its
node. They share memory (the KV regions and the channels are memfds attached through /proc/PID/fd),
so they must run on one node: the group is one placement-group bundle, {"CPU": engine_cpus, "GPU":
1 on a GPU device}, STRICT_PACK, and every actor of the engine is scheduled into it. engine_cpus is
the logical CPUs the engine reserves there; set it to a node's CPU count to place one engine per
node (the CPU workers pin every core of their NUMA node whatever the reservation says).

The bundle is either the engine's own placement group, made here and removed at shutdown (a driver
or a batch job starting engines), or the last bundle of the placement group the caller already runs
in (a Serve replica deployed with `placement_group_bundles`: the replica and its engine are placed
together, and Serve replaces both when their node goes).

What depends on the node is read on the node, by a task in the bundle (`engine_site`): its NUMA
topology (the CPU workers and the cpu_compute shards) and its available memory (the host KV limit).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from writescope.config import EngineConfig
from writescope.deepseek_v4_engine import entry_cache_configs
from writescope.loading import engine_cache_config, load_model_config
from writescope.models.deepseek_v4 import ARCH as DEEPSEEK_V4
from writescope.topology import NumaNode, emulated_topology, topology

log = logging.getLogger(__name__)
PLACEMENT_TIMEOUT_S = 120.0


def engine_bundle(config: EngineConfig) -> dict[str, float]:
    """The resources one engine group reserves on its node."""
    bundle = {"CPU": float(config.engine_cpus)}
    if config.device.startswith("cuda"):
        bundle["GPU"] = 1.0
    return bundle


@dataclass
class EngineGroup:
    """An engine's placement: bundle `bundle_index` of `placement_group`, on node `node_id`."""

    placement_group: PlacementGroup
    bundle_index: int
    owned: bool  # made for this engine (removed at shutdown), not the caller's
    node_id: str = ""

    @classmethod
    def place(cls, config: EngineConfig, timeout_s: float = PLACEMENT_TIMEOUT_S) -> EngineGroup:
        """The caller's placement group's last bundle where the caller runs in one (a Serve replica),
        else a new STRICT_PACK group of one bundle, once a node has room for it (ValueError naming
        the bundle and the cluster's free resources after timeout_s)."""
        current = ray.util.get_current_placement_group()
        if current is not None:
            group = cls(current, len(current.bundle_specs) - 1, owned=False)
            _check_fits(group, engine_bundle(config))
        else:
            bundle = engine_bundle(config)
            group = cls(placement_group([bundle], strategy="STRICT_PACK", name=""), 0, owned=True)
            if not _ready(group.placement_group, timeout_s):
                group.remove()
                raise ValueError(f"no node of the Ray cluster had {bundle} free for an engine group within "
                                 f"{timeout_s:.0f} s (available now: {ray.available_resources()}); lower "
                                 f"engine_cpus or add a node")
        group.node_id = ray.get(_node_id.options(**group.options()).remote())
        return group

    def options(self) -> dict:
        """Actor or task options that run it in this group's bundle."""
        return {"scheduling_strategy": PlacementGroupSchedulingStrategy(
            self.placement_group, placement_group_bundle_index=self.bundle_index,
            placement_group_capture_child_tasks=True)}

    def remove(self) -> None:
        if self.owned:
            remove_placement_group(self.placement_group)


MAIN_CACHE = "kv"  # the name of the one KV cache of an engine over the MoE models


@dataclass(frozen=True)
class EngineSite:
    """What an engine's node gives it, read on that node."""

    nodes: list[NumaNode]
    # name -> inplace_kv_cache.CacheConfig, sized under the node's host limit: {MAIN_CACHE: ...}, or
    # DeepSeek-V4's entry caches by layer type
    cache_configs: dict
    model_config: object  # models.ModelConfig or models.deepseek_v4.DeepseekV4Config

    @property
    def deepseek_v4(self) -> bool:
        return MAIN_CACHE not in self.cache_configs


def size_engine(config: EngineConfig, nodes: list[NumaNode] | None = None) -> EngineSite:
    """The NUMA nodes (config.emulated_nodes emulated ones, else this machine's; or `nodes`) and the
    caches sized for them and this machine's memory, for the engine of `config`."""
    if nodes is None:
        nodes = emulated_topology(config.emulated_nodes) if config.emulated_nodes else topology()
    if config.num_shards not in (None, len(nodes)):
        raise ValueError(f"num_shards={config.num_shards} for {len(nodes)} NUMA nodes: one shard per node")
    model_config, torch_dtype = load_model_config(config.model, config.dtype)
    limit = None if config.max_host_kv_gb is None else int(config.max_host_kv_gb * 2**30)
    sizes = dict(block_size=config.block_size, max_batch_size=config.max_batch_size, max_seq_len=config.max_seq_len,
                 num_shards=len(nodes), window_tokens=config.window_tokens, pingpong_blocks=config.pingpong_blocks,
                 device=config.device)
    if model_config.arch == DEEPSEEK_V4:
        configs = entry_cache_configs(model_config, torch_dtype, max_host_kv_bytes=limit, **sizes)
    else:
        configs = {MAIN_CACHE: engine_cache_config(model_config, torch_dtype, **sizes).with_host_limit(limit)}
    shard_nodes = None if any(n.emulated for n in nodes) else tuple(n.index for n in nodes)
    return EngineSite(nodes, {name: dataclasses.replace(c, shard_nodes=shard_nodes) for name, c in configs.items()},
                      model_config)


def engine_site(group: EngineGroup, config: EngineConfig, nodes: list[NumaNode] | None = None) -> EngineSite:
    """size_engine run on the group's node."""
    return ray.get(_size_engine.options(**group.options()).remote(config, nodes))


@ray.remote(num_cpus=0)
def _size_engine(config: EngineConfig, nodes):
    return size_engine(config, nodes)


@ray.remote(num_cpus=0)
def _node_id() -> str:
    return ray.get_runtime_context().get_node_id()


def _ready(group: PlacementGroup, timeout_s: float) -> bool:
    try:
        ray.get(group.ready(), timeout=timeout_s)
        return True
    except ray.exceptions.GetTimeoutError:
        return False


def _check_fits(group: EngineGroup, bundle: dict[str, float]) -> None:
    """The caller's bundle holds what the engine needs (a Serve replica deployed with too small a one
    is refused here rather than leaving an actor pending for ever)."""
    given = group.placement_group.bundle_specs[group.bundle_index]
    short = {k: v for k, v in bundle.items() if given.get(k, 0) < v}
    if short:
        raise ValueError(f"the placement group this runs in gives its last bundle {given}; an engine group needs "
                         f"{bundle}: deploy with placement_group_bundles=[{bundle}] (serve_app.build_app does)")
