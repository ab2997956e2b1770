"""The GPU worker: the model, the window and ping-pong buffers, the device partial and the merge
of each decode step; the CPU partials go to the CPU workers over their channels.

Authoritative state: none that outlives it. Rebuilt on (re)start: the weights (from the checkpoint
or preset), the device buffers, the attachment of the regions and channels, and the policy snapshot
(from the scheduler, which keeps r* and its EWMA across restarts). Lost with the process: the
placement tables of the sequences it was decoding. A restarted worker starts with an empty batch
and free regions; the caller of a lost generation gets an error naming its requests.
"""

from __future__ import annotations

import os

import ray


@ray.remote(max_restarts=-1, max_task_retries=0, concurrency_groups={"control": 1})
class GPUWorker:
    def __init__(self, path_or_preset: str, options: dict, region_handles, channel_specs, scheduler):
        from writescope.actors.ray_engine import ChannelExecutor  # noqa: F401 - registers "channel"
        from writescope.actors.scheduler import RemotePolicy
        from writescope.engine import Engine, calibrated_model, kv_format, load_model_config

        options = dict(options)
        policy_name = options.pop("policy")
        model_fit = None
        if policy_name == "writescope":
            config, torch_dtype = load_model_config(path_or_preset, options.get("dtype"))
            fmt = kv_format(config, torch_dtype, options["block_size"])
            model_fit = calibrated_model(config, fmt, options["device"])
        snapshot = ray.get(scheduler.configure.remote(policy_name, model_fit))
        self.engine = Engine.from_pretrained(path_or_preset, executor="channel",
                                             executor_options={"specs": channel_specs},
                                             policy=RemotePolicy(scheduler, snapshot), region_handles=region_handles,
                                             num_shards=len(channel_specs), **options)

    def generate(self, prompts, kwargs: dict):
        return self.engine.generate(prompts, **kwargs)

    @ray.method(num_returns="streaming")
    def generate_stream(self, prompts, kwargs: dict):
        yield from self.engine.generate_stream(prompts, **kwargs)

    def check_integrity(self) -> None:
        self.engine.cache.check_integrity()

    def stats(self) -> dict:
        return dict(self.engine.stats)

    def shutdown(self) -> None:
        self.engine.shutdown()

    @ray.method(concurrency_group="control")
    def pid(self) -> int:
        return os.getpid()

    @ray.method(concurrency_group="control")
    def check_health(self) -> bool:
        return self.engine is not None
