"""An embedded local Ray for one process (the demo, the CLI, a batch run outside `ray job submit`,
tests, a notebook): nothing to set up.

Token authentication stays on (Ray 2.60 turns it on for a new local cluster; we refuse to start
one with it disabled), and the dashboard is not started. Nothing of it listens beyond loopback
when Ray is imported after start_local_ray() set RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0: Ray then
takes 127.0.0.1 as the node's address, and its gRPC servers and its metrics exporters (the
dashboard agent's, the dashboard's on 44227, the autoscaler's on 44217: Prometheus text, no
authentication) bind loopback instead of every interface. Ray reads that variable once, when it is
imported, so the entry points call start_local_ray() (or ensure_ray()) before anything imports Ray;
where Ray was imported first, the cluster binds every interface and a warning says so.
WriteScope's own channels are abstract Unix sockets checked by user id: no network port.
"""

from __future__ import annotations

import logging
import os
import sys

log = logging.getLogger(__name__)
# Ray's own switch (named for the platforms where it is the default): off, a node is 127.0.0.1.
LOOPBACK_SWITCH = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


def start_local_ray(num_cpus: int | None = None, **options) -> None:
    """ray.init() for a new local cluster with token authentication on, no dashboard, loopback only."""
    mode = os.environ.get("RAY_AUTH_MODE", "token")
    if mode.lower() != "token":
        raise ValueError(f"RAY_AUTH_MODE={mode!r}: WriteScope keeps Ray's token authentication on; "
                         f"unset it or set it to 'token'")
    if "ray" not in sys.modules:
        os.environ.setdefault(LOOPBACK_SWITCH, "0")
    import ray

    options.setdefault("include_dashboard", False)
    options.setdefault("log_to_driver", False)
    # Left unset, ray.init() turns token mode on itself (and refreshes its cached config, which
    # setting the variable here after `import ray` would not). address="local": always a new
    # cluster, never one found in /tmp/ray/ray_current_cluster (Ray leaves that file behind when a
    # `ray start --head --block` is killed).
    ray.init(address="local", num_cpus=num_cpus, **options)
    assert os.environ.get("RAY_AUTH_MODE") == "token", "ray.init() left token authentication off"
    if not ray.util.get_node_ip_address().startswith("127."):
        log.warning("Ray was imported before start_local_ray(): this local cluster's gRPC and metrics ports bind "
                    "every interface (the metrics without authentication). Set %s=0 before Ray is imported to "
                    "bind loopback only.", LOOPBACK_SWITCH)


def ensure_ray() -> None:
    """Ray for this process: the one already initialised, the cluster of RAY_ADDRESS (inside
    `ray job submit`), or else a new embedded local one (start_local_ray)."""
    if "ray" in sys.modules and sys.modules["ray"].is_initialized():
        return
    if os.environ.get("RAY_ADDRESS"):
        import ray

        ray.init(log_to_driver=False)
        return
    start_local_ray()
