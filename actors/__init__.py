"""Ray actors, the Ray executor, the Serve app and the batch-job entry (they build on `writescope`).

`from writescope.actors import RayEngine` imports Ray (on first use of the name): call
`writescope.actors.local_ray.ensure_ray()` first where the embedded local cluster must bind
loopback only (Ray reads that setting when it is imported; RayEngine.from_pretrained then finds
the cluster ensure_ray started)."""


def __getattr__(name: str):
    if name in ("RayEngine", "WorkerLostError"):
        from writescope.actors import ray_engine

        return getattr(ray_engine, name)
    raise AttributeError(f"module 'writescope.actors' has no attribute {name!r}")


__all__ = ["RayEngine", "WorkerLostError"]
