import os

import pytest


@pytest.fixture(scope="session")
def ray_cluster(tmp_path_factory):
    """One real local Ray for the whole test session (token auth on, no dashboard)."""
    from writescope.actors.local_ray import start_local_ray

    os.environ.setdefault("WRITESCOPE_CACHE_DIR", str(tmp_path_factory.mktemp("calibration")))
    start_local_ray(num_cpus=8)  # logical: room for several engine groups (engine_cpus=1 each) at once
    yield
    import ray

    ray.shutdown()
