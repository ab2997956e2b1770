"""An embedded local Ray for one process (the demo, tests, a notebook): nothing to set up.

Token authentication stays on (Ray 2.60 turns it on for a new local cluster; we refuse to start
one with it disabled), and the dashboard is not started. Ray 2.60's own gRPC servers bind every
interface (upstream binds the node IP from ray-project/ray#59852 on); the token guards them.
WriteScope's own channels are Unix sockets in a 0700 directory: no network port.
"""

from __future__ import annotations

import os

import ray


def start_local_ray(num_cpus: int | None = None, **options) -> None:
    """ray.init() for a new local cluster with token authentication on and no dashboard."""
    # Left unset, ray.init() turns token mode on itself (and refreshes its cached config, which
    # setting the variable here after `import ray` would not).
    mode = os.environ.get("RAY_AUTH_MODE", "token")
    if mode.lower() != "token":
        raise ValueError(f"RAY_AUTH_MODE={mode!r}: WriteScope keeps Ray's token authentication on; "
                         f"unset it or set it to 'token'")
    options.setdefault("include_dashboard", False)
    options.setdefault("log_to_driver", False)
    # address="local": always a new cluster, never one found in /tmp/ray/ray_current_cluster (Ray
    # leaves that file behind when a `ray start --head --block` is killed)
    ray.init(address="local", num_cpus=num_cpus, **options)
    assert os.environ.get("RAY_AUTH_MODE") == "token", "ray.init() left token authentication off"
