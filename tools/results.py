"""Where the tools' measurements go: one JSON file each, its folder made when missing."""

from __future__ import annotations

import json
import os


def write_json(path: str, data) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(data, f, indent=2)
