"""EngineConfig: every setting of an engine, in one frozen dataclass with one default per field.

The driver (`Engine.from_pretrained`, `RayEngine.from_pretrained`), the GPU worker, the batch job,
the Serve app and the CLI all build it the same way (from keyword arguments, a mapping such as a
Serve config's `args`, or command-line flags made from the fields themselves), so a field exists
everywhere and has the same default everywhere. Values are checked here, at the boundary, with an
error that names the field and what it allows; deeper checks (a window that is not a multiple of
the block size, a checkpoint that does not exist) stay where the knowledge is.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from writescope.kv_format import DTYPES
from writescope.policies import POLICY_NAMES, Policy, check_policy, policy_argument

DTYPE_NAMES = tuple(DTYPES)


def _help(text: str) -> dict:
    return {"help": text}


@dataclass(frozen=True)
class EngineConfig:
    model: str = field(default="tiny-qwen3-moe", metadata=_help("a checkpoint directory or a preset name"))
    dtype: str | None = field(default=None, metadata=_help(
        f"weights and KV dtype: {', '.join(DTYPE_NAMES)} (default: the checkpoint's; presets: float32)"))
    # A Policy object works in-process only (tests, sweeps); across processes the policy goes by name.
    policy: str | Policy = field(default="writescope", metadata=_help(
        f"KV placement policy: {', '.join(POLICY_NAMES)}, or share:R (R in [0, 1])"))
    window_tokens: int = field(default=256, metadata=_help("tokens of each sequence kept in the GPU window"))
    block_size: int = field(default=16, metadata=_help("tokens per KV block"))
    max_batch_size: int = field(default=8, metadata=_help("sequences decoded together"))
    max_seq_len: int = field(default=32768, metadata=_help(
        "prompt + new tokens of one sequence, at most; with max_batch_size it sizes the host KV regions"))
    device: str = field(default="cpu", metadata=_help("cpu, or cuda[:N] on a GPU machine"))
    prefill_chunk_tokens: int = field(default=4096, metadata=_help(
        "prompt tokens prefilled per turn, between decode steps of the running batch (a multiple of block_size)"))
    hot_experts: int | None = field(default=None, metadata=_help(
        "experts of each MoE layer kept on the device, the rest run on the CPU (default: all)"))
    num_shards: int | None = field(default=None, metadata=_help(
        "cpu_compute shards (default: 1 in one process; one per NUMA node under Ray)"))
    emulated_nodes: int | None = field(default=None, metadata=_help(
        "under Ray: split this machine's CPUs into N emulated NUMA nodes, one CPU worker each"))
    engine_cpus: int = field(default=1, metadata=_help(
        "under Ray: logical CPUs an engine group reserves on its node, with its GPU (a node's CPU count "
        "places one engine per node)"))
    max_host_kv_gb: float | None = field(default=None, metadata=_help(
        "host memory (GiB) the KV may take at most (default: what the machine has available)"))
    pingpong_blocks: int | None = field(default=None, metadata=_help(
        "blocks per ping-pong buffer (default: a layer's cpu_transfer blocks, up to 512 MiB)"))
    weights_seed: int = field(default=0, metadata=_help("seed of a preset's random weights"))
    enable_prefix_caching: bool = field(default=True, metadata=_help(
        "reuse the KV of a prompt's prefix already written for another request (block-aligned, as vLLM)"))

    def __post_init__(self):
        if not isinstance(self.model, str) or not self.model:
            raise ValueError(f"model must be a checkpoint directory or a preset name, got {self.model!r}")
        if self.dtype is not None and self.dtype not in DTYPE_NAMES:
            raise ValueError(f"dtype {self.dtype!r} is not supported; allowed: {', '.join(DTYPE_NAMES)} "
                             f"(or none: the checkpoint's)")
        check_policy(self.policy)
        for name in ("window_tokens", "block_size", "max_batch_size", "max_seq_len", "prefill_chunk_tokens",
                     "engine_cpus"):
            _check_int(name, getattr(self, name), minimum=1)
        for name in ("num_shards", "emulated_nodes", "pingpong_blocks"):
            _check_int(name, getattr(self, name), minimum=1, optional=True)
        _check_int("hot_experts", self.hot_experts, minimum=0, optional=True)
        if self.max_host_kv_gb is not None and (isinstance(self.max_host_kv_gb, bool) or not isinstance(
                self.max_host_kv_gb, (int, float)) or not self.max_host_kv_gb > 0):
            raise ValueError(f"max_host_kv_gb must be a number of GiB > 0 or none, got {self.max_host_kv_gb!r}")
        _check_int("weights_seed", self.weights_seed, minimum=0)
        if not isinstance(self.enable_prefix_caching, bool):
            raise ValueError(f"enable_prefix_caching must be true or false, got {self.enable_prefix_caching!r}")
        if self.prefill_chunk_tokens % self.block_size:
            raise ValueError(f"prefill_chunk_tokens must be a multiple of block_size {self.block_size}, "
                             f"got {self.prefill_chunk_tokens}")
        if not isinstance(self.device, str) or not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ValueError(f"device must be 'cpu' or 'cuda[:N]', got {self.device!r}")

    def replace(self, **changes) -> EngineConfig:
        """This config with some fields changed (checked like any other); unknown names are refused."""
        _check_names(changes)
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    @classmethod
    def from_mapping(cls, values: Mapping[str, Any]) -> EngineConfig:
        """From a mapping of field names (a Serve config's args, a JSON object): integers may come as
        their decimal text (`serve run ... max_seq_len=8192`); unknown names are refused."""
        _check_names(values)
        integers = {f.name for f in dataclasses.fields(cls) if "int" in str(f.type)}
        numbers = {f.name for f in dataclasses.fields(cls) if "float" in str(f.type)}
        switches = {f.name for f in dataclasses.fields(cls) if str(f.type) == "bool"}
        return cls(**{k: _parse(k, v, int, "an integer") if k in integers else
                      _parse(k, v, float, "a number") if k in numbers else
                      _parse(k, v, _switch, "true or false") if k in switches else v for k, v in values.items()})

    @staticmethod
    def add_arguments(parser: argparse.ArgumentParser, exclude: tuple[str, ...] = ()) -> None:
        """One --flag per field (--max-seq-len for max_seq_len), each with the field's default."""
        defaults = EngineConfig()
        for f in dataclasses.fields(EngineConfig):
            if f.name in exclude:
                continue
            flag = "--" + f.name.replace("_", "-")
            if str(f.type) == "bool":  # --enable-prefix-caching / --no-enable-prefix-caching, as vLLM
                parser.add_argument(flag, default=getattr(defaults, f.name), help=f.metadata["help"],
                                    action=argparse.BooleanOptionalAction)
                continue
            options = {"type": int if "int" in str(f.type) else float if "float" in str(f.type) else str}
            if f.name == "policy":
                options["type"] = policy_argument
            elif f.name == "dtype":
                options["choices"] = DTYPE_NAMES
            parser.add_argument(flag, default=getattr(defaults, f.name), help=f.metadata["help"], **options)

    @classmethod
    def from_args(cls, args: argparse.Namespace, **overrides) -> EngineConfig:
        """From parsed flags (add_arguments' fields that the namespace has), then overrides."""
        names = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in vars(args).items() if k in names}
        return cls(**{**values, **overrides})


FIELD_NAMES = tuple(f.name for f in dataclasses.fields(EngineConfig))


def _check_names(values: Mapping[str, Any]) -> None:
    unknown = sorted(set(values) - set(FIELD_NAMES))
    if unknown:
        raise ValueError(f"unknown engine config fields {unknown}; allowed: {', '.join(FIELD_NAMES)}")


def _check_int(name: str, value, *, minimum: int, optional: bool = False) -> None:
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        allowed = f"an integer >= {minimum}" + (" or none" if optional else "")
        raise ValueError(f"{name} must be {allowed}, got {value!r}")


def _switch(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered not in ("true", "false", "1", "0", "yes", "no"):
        raise ValueError(text)
    return lowered in ("true", "1", "yes")


def _parse(name: str, value, kind, what: str):
    """A value from a config file or the command line: its text parsed as `kind`, else as given."""
    if isinstance(value, str):
        try:
            return kind(value)
        except ValueError:
            raise ValueError(f"{name} must be {what}, got {value!r}") from None
    return value


__all__ = ["DTYPE_NAMES", "FIELD_NAMES", "EngineConfig"]
