"""EngineConfig: one default per field, the same fields in the CLI, the batch job and the Serve app,
and bad values refused with the field's name."""

import dataclasses
import os

import pytest
import yaml

from writescope.config import FIELD_NAMES, EngineConfig
from writescope.engine import Engine
from writescope.tools import cli

CONFIGS = os.path.join(os.path.dirname(__file__), "..", "..", "cluster_configs")


def batch_parser():
    from writescope.actors import batch_job

    return batch_job.build_parser()


def cli_parser(command: str):
    commands = next(a for a in cli.build_parser()._actions if a.dest == "command")
    return commands.choices[command]


ENTRY_POINTS = {
    "writescope generate": (lambda: cli_parser("generate"), ["--prompt", "x"]),
    "writescope serve": (lambda: cli_parser("serve"), []),
    "batch job": (batch_parser, ["--input", "in.jsonl", "--output", "out.jsonl"]),
}


@pytest.mark.parametrize("entry", list(ENTRY_POINTS))
def test_every_entry_point_has_every_field_with_the_one_default(entry):
    make_parser, required = ENTRY_POINTS[entry]
    args = make_parser().parse_args(required)
    assert EngineConfig.from_args(args) == EngineConfig()
    flags = {option for action in make_parser()._actions for option in action.option_strings}
    assert {"--" + name.replace("_", "-") for name in FIELD_NAMES} <= flags


@pytest.mark.parametrize("entry", list(ENTRY_POINTS))
def test_flags_reach_the_config(entry):
    make_parser, required = ENTRY_POINTS[entry]
    args = make_parser().parse_args([*required, "--hot-experts", "2", "--max-seq-len", "8192", "--dtype", "bfloat16",
                                     "--policy", "share:0.3", "--emulated-nodes", "2", "--engine-cpus", "32"])
    config = EngineConfig.from_args(args)
    assert (config.hot_experts, config.max_seq_len, config.dtype, config.policy, config.emulated_nodes,
            config.engine_cpus) == (2, 8192, "bfloat16", "share:0.3", 2, 32)


def test_the_engine_and_its_model_constructor_use_the_config_defaults():
    defaults = EngineConfig()
    params = dataclasses.fields(EngineConfig)
    import inspect

    from_model = inspect.signature(Engine.from_model).parameters
    for f in params:
        if f.name in from_model and from_model[f.name].default is not inspect.Parameter.empty:
            assert from_model[f.name].default == getattr(defaults, f.name), f.name


@pytest.mark.parametrize("values, message", [
    ({"max_seq_len": 0}, "max_seq_len must be an integer >= 1, got 0"),
    ({"max_batch_size": True}, "max_batch_size must be an integer >= 1"),
    ({"hot_experts": -1}, "hot_experts must be an integer >= 0 or none"),
    ({"dtype": "int8"}, "dtype 'int8' is not supported; allowed: float32, bfloat16, float16"),
    ({"policy": "fastest"}, "unknown policy 'fastest'"),
    ({"device": "tpu"}, "device must be 'cpu' or 'cuda"),
    ({"window_tokens": "many"}, "window_tokens must be an integer, got 'many'"),
    ({"batch": 3}, r"unknown engine config fields \['batch'\]; allowed: model, dtype"),
    ({"model": ""}, "model must be a checkpoint directory or a preset name"),
    ({"max_host_kv_gb": 0}, "max_host_kv_gb must be a number of GiB > 0 or none, got 0"),
    ({"max_host_kv_gb": "lots"}, "max_host_kv_gb must be a number, got 'lots'"),
    ({"prefill_chunk_tokens": 100}, "prefill_chunk_tokens must be a multiple of block_size 16, got 100"),
    ({"engine_cpus": 0}, "engine_cpus must be an integer >= 1, got 0"),
])
def test_bad_values_name_the_field_and_what_is_allowed(values, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig.from_mapping(values)


def test_text_integers_from_a_config_file_and_the_round_trip():
    config = EngineConfig.from_mapping({"max_seq_len": "8192", "emulated_nodes": "2", "model": "tiny-mixtral"})
    assert (config.max_seq_len, config.emulated_nodes) == (8192, 2)
    assert EngineConfig.from_mapping(config.to_dict()) == config
    with pytest.raises(ValueError, match="unknown engine config fields"):
        config.replace(max_len=3)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.max_seq_len = 1  # type: ignore[misc]


@pytest.mark.parametrize("name, path", [("serve.yaml", ("applications", 0, "args")),
                                        ("rayservice.yaml", ("spec", "serveConfigV2"))])
def test_the_serve_configs_run_bf16_kv(name, path):
    with open(os.path.join(CONFIGS, name)) as f:
        document = yaml.safe_load(f)
    if name == "rayservice.yaml":
        document = yaml.safe_load(document["spec"]["serveConfigV2"])
        path = ("applications", 0, "args")
    args = document
    for key in path:
        args = args[key]
    engine_args = {k: v for k, v in args.items() if k in FIELD_NAMES}
    assert EngineConfig.from_mapping(engine_args).dtype == "bfloat16"


def test_an_engine_follows_its_config(monkeypatch, tmp_path):
    monkeypatch.setenv("WRITESCOPE_CACHE_DIR", str(tmp_path))
    config = EngineConfig(model="tiny-mixtral", policy="all_cpu", window_tokens=16, block_size=4, max_batch_size=2,
                          max_seq_len=128, hot_experts=1)
    engine = Engine.from_pretrained(config=config)
    try:
        assert (engine.max_seq_len, engine.cache.block_size, engine.cache.config.window_tokens) == (128, 4, 16)
        assert engine.cache.config.max_seqs == 2 and engine.policy.name == "all_cpu"
        out = engine.generate("hello", max_new_tokens=3)[0]
        assert len(out.token_ids) == 3
    finally:
        engine.shutdown()
    with pytest.raises(ValueError, match="max_seq_len must be"):
        Engine.from_pretrained(config=config, max_seq_len=-5)  # keywords replace the config's fields, checked


def test_a_host_limit_that_cannot_hold_one_sequence_is_refused_before_anything_is_allocated():
    with pytest.raises(ValueError, match=r"the host KV limit, 0.001 GiB \(max_host_kv_gb\), cannot hold one sequence "
                                         r"of 32768 tokens: its KV takes 0.031 GiB, .*; lower max_seq_len or raise "
                                         r"max_host_kv_gb$"):
        Engine.from_pretrained("tiny-mixtral", max_host_kv_gb=0.001)
    with pytest.raises(ValueError, match=r"\((MemAvailable|the cgroup's memory.max)\), cannot hold one sequence of "
                                         r"400000000 tokens: its KV takes 381.470 GiB, .*; lower max_seq_len$"):
        Engine.from_pretrained("tiny-mixtral", max_seq_len=400_000_000)


def test_more_sequences_than_the_host_limit_holds_start_and_wait_for_each_other(monkeypatch, tmp_path):
    """8 x 16K would take 0.125 GiB (tiny-mixtral in float32: 1 KiB a token); a limit of 0.1 GiB, less
    two segments per region, holds two 15K-token sequences at a time: the engine starts and runs all
    four requests, two at a time."""
    monkeypatch.setenv("WRITESCOPE_CACHE_DIR", str(tmp_path))
    engine = Engine.from_pretrained("tiny-mixtral", policy="all_cpu", max_host_kv_gb=0.1, max_seq_len=16384)
    try:
        config = engine.cache.config
        assert config.host_limit_source == "max_host_kv_gb" and config.host_kv_bytes == int(0.1 * 2**30)
        assert 2 * 15008 < config.host_tokens() < 3 * 15008
        order = [(e.index, e.finish_reason or "") for e in engine.generate_stream(["a" * 15000] * 4, max_new_tokens=2)]
        assert sorted(order) == sorted([(i, "") for i in range(4)] + [(i, "length") for i in range(4)])
        first_of = {i: order.index((i, "")) for i in range(4)}
        assert min(first_of[2], first_of[3]) > order.index((0, "length"))  # the third waited for the first two
        engine.cache.check_integrity()
        assert engine.cache.host_resident_bytes() <= 2 * config.slack_blocks() * config.block_bytes
    finally:
        engine.shutdown()
