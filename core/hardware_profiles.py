"""Hardware profiles as data: the figures a simulation needs to build a PerfModel for a model shape.

A profile pairs a GPU and its host link with a host CPU. Every figure carries its source kind
("spec", "measured", "paper" or "assumption") and a short note; the data lives in
`data/hardware_profiles.json`. For a model with `kv` bytes of KV per token and layer:

    A       = kv / (CPU memory bandwidth * attention fraction)   s/token, CPU attention in place
    B       = kv / pinned H2D bandwidth                           s/token, shipped to the GPU
    B_pg    = kv / (pinned H2D * pageable ratio)                  s/token, pageable copies (monolithic)
    contended: the H2D bandwidths times the contention ratio (KV copies overlapped with expert traffic)

A calibrated CPU rate (seconds per token measured on the real machine) can replace A.
GB means 1e9 bytes.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from writescope.perf_model import PerfModel

DATA_DIR = Path(__file__).resolve().parent / "data"
PROFILES_PATH = DATA_DIR / "hardware_profiles.json"
MODELS_PATH = DATA_DIR / "paper_models.json"

KINDS = ("spec", "measured", "paper", "assumption")
KV_BYTES_KEY = "kv_cache_bytes_per_token_per_layer_bf16"
_GB = 1e9
_US = 1e-6


@dataclass(frozen=True)
class Figure:
    """One number with where it comes from."""

    value: float
    kind: str
    source: str

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"figure kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if not self.value > 0:
            raise ValueError(f"figure value must be > 0, got {self.value} ({self.source})")

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Figure:
        return cls(float(data["value"]), str(data["kind"]), str(data["source"]))


@dataclass(frozen=True)
class HardwareProfile:
    name: str
    gpu: str
    link: str
    cpu: str
    cpu_pairing_kind: str
    cpu_pairing_source: str
    hbm_gbps: Figure
    link_theoretical_gbps: Figure
    h2d_pinned_gbps: Figure
    pageable_ratio: Figure
    contention_ratio: Figure
    gpu_fixed_us: Figure
    cpu_memory_gbps: Figure
    cpu_attention_fraction: Figure
    cpu_fixed_us: Figure

    def __post_init__(self):
        if self.cpu_pairing_kind not in KINDS:
            raise ValueError(f"{self.name}: cpu pairing kind must be one of {', '.join(KINDS)}")
        for name in ("pageable_ratio", "contention_ratio", "cpu_attention_fraction"):
            value = getattr(self, name).value
            if not 0 < value <= 1:
                raise ValueError(f"{self.name}: {name} must be in (0, 1], got {value}")
        if self.h2d_pinned_gbps.value > self.link_theoretical_gbps.value:
            raise ValueError(f"{self.name}: pinned H2D exceeds the link's theoretical bandwidth")

    # Derived bandwidths (GB/s).
    @property
    def h2d_pageable_gbps(self) -> float:
        return self.h2d_pinned_gbps.value * self.pageable_ratio.value

    def h2d_gbps(self, *, pageable: bool = False, contended: bool = False) -> float:
        """H2D bandwidth for pinned or pageable copies, alone or overlapped with expert traffic."""
        gbps = self.h2d_pageable_gbps if pageable else self.h2d_pinned_gbps.value
        return gbps * (self.contention_ratio.value if contended else 1.0)

    @property
    def cpu_effective_gbps(self) -> float:
        """The KV read bandwidth assumed for CPU decode attention."""
        return self.cpu_memory_gbps.value * self.cpu_attention_fraction.value

    # Per-token costs (s per token of KV per layer).
    def cpu_s_per_token(self, shape: Mapping[str, Any] | int) -> float:
        return kv_bytes_per_token_per_layer(shape) / (self.cpu_effective_gbps * _GB)

    def transfer_s_per_token(self, shape: Mapping[str, Any] | int, *, contended: bool = False) -> float:
        return kv_bytes_per_token_per_layer(shape) / (self.h2d_gbps(contended=contended) * _GB)

    def pageable_s_per_token(self, shape: Mapping[str, Any] | int, *, contended: bool = False) -> float:
        """B for pageable copies: the monolithic cache ships all spilled KV this way every step."""
        return kv_bytes_per_token_per_layer(shape) / (self.h2d_gbps(pageable=True, contended=contended) * _GB)

    def perf_model(self, shape: Mapping[str, Any] | int, cpu_s_per_token: float | None = None, *,
                   contended: bool = False) -> PerfModel:
        """The per-layer PerfModel of this machine for a model shape.

        shape: a model's entry of paper_models.json (or its KV bytes per token per layer).
        cpu_s_per_token: a calibrated A (e.g. from the CPU kernel benchmark) replacing the profile's.
        contended: B at the H2D bandwidth seen while expert weights share the link.
        """
        a = self.cpu_s_per_token(shape) if cpu_s_per_token is None else float(cpu_s_per_token)
        return PerfModel(
            cpu_s_per_token=a,
            transfer_s_per_token=self.transfer_s_per_token(shape, contended=contended),
            cpu_fixed_s=self.cpu_fixed_us.value * _US,
            gpu_fixed_s=self.gpu_fixed_us.value * _US,
        )

    def figures(self) -> dict[str, Figure]:
        """Every figure of the profile, derived ones included, by name (for reports)."""
        pinned, ratio, cont = self.h2d_pinned_gbps, self.pageable_ratio, self.contention_ratio
        frac = self.cpu_attention_fraction
        return {
            "hbm_gbps": self.hbm_gbps,
            "link_theoretical_gbps": self.link_theoretical_gbps,
            "h2d_pinned_gbps": pinned,
            "pageable_ratio": ratio,
            "h2d_pageable_gbps": Figure(self.h2d_pageable_gbps, "assumption",
                                        f"{ratio.value:g} x pinned {pinned.value:g} GB/s"),
            "contention_ratio": cont,
            "h2d_pinned_contended_gbps": Figure(self.h2d_gbps(contended=True), cont.kind,
                                                f"{cont.value:g} x pinned {pinned.value:g} GB/s"),
            "gpu_fixed_us": self.gpu_fixed_us,
            "cpu_memory_gbps": self.cpu_memory_gbps,
            "cpu_attention_fraction": frac,
            "cpu_effective_gbps": Figure(self.cpu_effective_gbps, "assumption",
                                         f"{frac.value:g} x {self.cpu_memory_gbps.value:g} GB/s"),
            "cpu_fixed_us": self.cpu_fixed_us,
        }

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name, "gpu": self.gpu, "link": self.link, "cpu": self.cpu,
            "cpu_pairing": {"kind": self.cpu_pairing_kind, "source": self.cpu_pairing_source},
            "figures": {k: {"value": f.value, "kind": f.kind, "source": f.source} for k, f in self.figures().items()},
        }


def kv_bytes_per_token_per_layer(shape: Mapping[str, Any] | int) -> int:
    if isinstance(shape, Mapping):
        if KV_BYTES_KEY not in shape:
            raise ValueError(f"model shape has no {KV_BYTES_KEY!r}")
        value = shape[KV_BYTES_KEY]
    else:
        value = shape
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"KV bytes per token per layer must be a positive int, got {value!r}")
    return value


@cache
def _profiles_data() -> dict[str, Any]:
    with open(PROFILES_PATH) as f:
        return json.load(f)


@cache
def _models_data() -> dict[str, Any]:
    with open(MODELS_PATH) as f:
        return json.load(f)


def known_profiles() -> tuple[str, ...]:
    return tuple(_profiles_data()["profiles"])


def known_models() -> tuple[str, ...]:
    return tuple(k for k in _models_data() if not k.startswith("_"))


def load_model_shape(name: str) -> dict[str, Any]:
    """A model's shape from paper_models.json (a copy)."""
    if name not in known_models():
        raise ValueError(f"unknown model {name!r}; known: {', '.join(known_models())}")
    return dict(_models_data()[name])


def load_profile(name: str) -> HardwareProfile:
    """The named profile; ValueError listing the known names for an unknown one."""
    data = _profiles_data()
    if name not in data["profiles"]:
        raise ValueError(f"unknown hardware profile {name!r}; known: {', '.join(known_profiles())}")
    p = data["profiles"][name]
    cpu = data["cpus"][p["cpu"]]
    return HardwareProfile(
        name=name,
        gpu=p["gpu"],
        link=p["link"],
        cpu=cpu["name"],
        cpu_pairing_kind=p["cpu_pairing"]["kind"],
        cpu_pairing_source=p["cpu_pairing"]["source"],
        hbm_gbps=Figure.from_json(p["hbm_gbps"]),
        link_theoretical_gbps=Figure.from_json(p["link_theoretical_gbps"]),
        h2d_pinned_gbps=Figure.from_json(p["h2d_pinned_gbps"]),
        pageable_ratio=Figure.from_json(p["pageable_ratio"]),
        contention_ratio=Figure.from_json(p["contention_ratio"]),
        gpu_fixed_us=Figure.from_json(p["gpu_fixed_us"]),
        cpu_memory_gbps=Figure.from_json(cpu["memory_gbps"]),
        cpu_attention_fraction=Figure.from_json(cpu["attention_fraction"]),
        cpu_fixed_us=Figure.from_json(cpu["fixed_us"]),
    )
