"""The deployment configs in cluster_configs/, checked offline by the validators their consumers use.

- cluster.yaml: Ray's own launcher schema (prepare_config + validate_config); the AWS provider's
  prepare step only merges its defaults.yaml, so no boto3, credentials or network are needed.
- serve.yaml and the RayService's serveConfigV2: Ray Serve's ServeDeploySchema (pydantic); the
  application's import_path is checked for its form only, never imported.
- rayjob.yaml, rayservice.yaml: our JSON Schemas of the KubeRay ray.io/v1 subset we use
  (cluster_configs/schemas/), then the properties a one-GPU WriteScope pod needs.
- runtime_env.yaml: ray.runtime_env.RuntimeEnv, constructed without uploading anything.
- every YAML key has a comment on its line or on the line above, block scalars holding YAML included.
Each check also refuses a deliberately broken copy, so these tests can fail.
"""

from __future__ import annotations

import copy
import json
import pathlib
import re
import shlex
import sys
from fractions import Fraction

import jsonschema
import pytest
import yaml

ROOT = pathlib.Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "cluster_configs"
SCHEMAS = CONFIGS / "schemas"
YAML_NAMES = ["cluster.yaml", "rayjob.yaml", "rayservice.yaml", "runtime_env.yaml", "serve.yaml"]
SCHEMA_NAMES = ["rayjob.schema.json", "rayservice.schema.json"]
LOOPBACK = {"127.0.0.1", "localhost", "::1"}


def text(name: str) -> str:
    return (CONFIGS / name).read_text()


def load(name: str):
    return yaml.safe_load(text(name))


# --- "every key commented" -------------------------------------------------------------------------


def _has_comment(line: str) -> bool:
    """A YAML comment on this line: '#' at the start or after whitespace, outside a quoted scalar."""
    quote = None
    for i, ch in enumerate(line):
        if quote:
            if ch == quote:
                quote = None
        elif ch in "\"'" and (i == 0 or line[i - 1] in " \t[{,:-"):
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1] in " \t"):
            return True
    return False


def uncommented_keys(source: str, where: str = "") -> list[str]:
    """Key lines (found by YAML's own scanner) with no comment on them nor on the line just above.
    Block scalars whose content is itself a YAML mapping (runtimeEnvYAML, serveConfigV2) are checked
    the same way, on their own lines."""
    lines = source.splitlines()
    missing, seen = [], set()
    tokens = list(yaml.scan(source))
    for i, token in enumerate(tokens):
        if isinstance(token, yaml.KeyToken) and isinstance(tokens[i + 1], yaml.ScalarToken):
            n = tokens[i + 1].start_mark.line
            if n in seen:
                continue
            seen.add(n)
            above = lines[n - 1].strip() if n > 0 else ""
            if not (_has_comment(lines[n]) or above.startswith("#")):
                missing.append(f"{where}line {n + 1}: {lines[n].strip()}")
        elif isinstance(token, yaml.ScalarToken) and token.style == "|":
            try:
                inner = yaml.safe_load(token.value)
            except yaml.YAMLError:
                continue
            if isinstance(inner, dict):
                missing += uncommented_keys(token.value, f"{where}block at line {token.start_mark.line + 1}, ")
    return missing


def test_the_five_configs_and_two_schemas_exist():
    assert sorted(p.name for p in CONFIGS.glob("*.yaml")) == YAML_NAMES
    assert sorted(p.name for p in SCHEMAS.glob("*.json")) == SCHEMA_NAMES


@pytest.mark.parametrize("name", YAML_NAMES)
def test_parses_as_yaml_to_a_mapping(name):
    assert isinstance(load(name), dict)


@pytest.mark.parametrize("name", YAML_NAMES)
def test_every_key_is_commented(name):
    assert uncommented_keys(text(name)) == []


def test_comment_checker_finds_a_key_whose_comment_was_removed():
    source = text("serve.yaml")
    broken = source.replace("  # Loopback only: nothing off this host can connect.\n", "", 1)
    assert broken != source
    line = broken.splitlines().index("  host: 127.0.0.1") + 1
    assert uncommented_keys(broken) == [f"line {line}: host: 127.0.0.1"]
    inline = "# a comment\na: 1\nb: 2  # b's comment\nc: '# not a comment'\n"
    assert uncommented_keys(inline) == ["line 4: c: '# not a comment'"]


def test_comment_checker_looks_inside_embedded_yaml():
    source = text("rayservice.yaml")
    broken = source.replace("            # As in serve.yaml (see the note on admission there).\n", "", 1)
    assert broken != source
    (problem,) = uncommented_keys(broken)
    assert problem.startswith("block at line") and problem.endswith("max_ongoing_requests: 256")


# --- Ray Serve -------------------------------------------------------------------------------------


def validate_serve(config: dict):
    """Ray Serve's own parsing of a `serve run` / `serve deploy` file (pydantic 2, or 1 in older Rays)."""
    from ray.serve.schema import ServeDeploySchema

    validate = getattr(ServeDeploySchema, "model_validate", None) or ServeDeploySchema.parse_obj
    return validate(config)


def _known_keys(model) -> set[str]:
    fields = getattr(model, "model_fields", None) or model.__fields__
    return set(fields) | {f.alias for f in fields.values() if getattr(f, "alias", None)}


def unknown_serve_keys(config: dict) -> list[str]:
    """ServeDeploySchema ignores unknown keys (forward compatibility), so a typo would pass it: refuse them."""
    from ray.serve.schema import DeploymentSchema, HTTPOptionsSchema, ServeApplicationSchema, ServeDeploySchema

    unknown = [f"top: {k}" for k in set(config) - _known_keys(ServeDeploySchema)]
    unknown += [f"http_options: {k}" for k in set(config.get("http_options", {})) - _known_keys(HTTPOptionsSchema)]
    for app in config.get("applications", []):
        unknown += [f"application: {k}" for k in set(app) - _known_keys(ServeApplicationSchema)]
        for deployment in app.get("deployments", []):
            unknown += [f"deployment: {k}" for k in set(deployment) - _known_keys(DeploymentSchema)]
    return sorted(unknown)


def test_serve_yaml_validates_with_serve_deploy_schema(monkeypatch):
    config = load("serve.yaml")
    # Importing the application would raise now: validation must not import it (nor need it to exist).
    monkeypatch.setitem(sys.modules, "writescope.actors.serve_app", None)
    schema = validate_serve(config)
    assert unknown_serve_keys(config) == []
    assert schema.http_options.host == "127.0.0.1" and schema.http_options.port == 8000
    (app,) = schema.applications
    assert (app.name, app.route_prefix, app.import_path) == ("writescope", "/", "writescope.actors.serve_app:build_app")
    assert app.args == {
        "model": "tiny-qwen3-moe", "policy": "writescope", "max_batch_size": 8, "max_seq_len": 32768,
        "dtype": "bfloat16", "max_queue": 64, "api_key_env": "WRITESCOPE_API_KEY",
    }
    (deployment,) = app.deployments
    assert (deployment.name, deployment.num_replicas, deployment.max_ongoing_requests) == ("OpenAIIngress", 1, 256)
    # The same process settings as runtime_env.yaml; no working_dir (Serve takes only remote URIs there).
    assert app.runtime_env == {"env_vars": load("runtime_env.yaml")["env_vars"]}


def test_serve_schema_refuses_a_broken_serve_yaml():
    config = load("serve.yaml")
    broken = copy.deepcopy(config)
    broken["applications"][0]["deployments"][0]["num_replicas"] = "many"
    with pytest.raises(ValueError, match="num_replicas"):
        validate_serve(broken)
    broken = copy.deepcopy(config)
    broken["applications"][0]["runtime_env"]["working_dir"] = "."  # a local path: Serve wants a URI
    with pytest.raises(ValueError, match="runtime_env"):
        validate_serve(broken)
    broken = copy.deepcopy(config)
    broken["applications"][0]["deployments"][0]["num_replica"] = 1  # a typo Serve itself would ignore
    validate_serve(broken)
    assert unknown_serve_keys(broken) == ["deployment: num_replica"]


# --- runtime env -----------------------------------------------------------------------------------


def test_runtime_env_constructs_and_ships_no_virtualenv():
    from ray.runtime_env import RuntimeEnv

    from writescope import env

    config = load("runtime_env.yaml")
    runtime_env = RuntimeEnv(**config)  # validates types; uploads nothing
    assert runtime_env["working_dir"] == "."
    assert {".venv", ".git", "bench_results"} <= set(runtime_env["excludes"])
    env_vars = runtime_env["env_vars"]
    assert env_vars["OMP_NUM_THREADS"] == "1"
    # Authentication is cluster-wide (set before Ray loads), and secrets never go in a runtime env.
    assert not [k for k in env_vars if k.startswith("RAY_AUTH") or re.search("KEY|TOKEN|SECRET|PASSWORD", k)]
    declared = {v.name for v in env.ALL}
    assert not [k for k in env_vars if k.startswith("WRITESCOPE_") and k not in declared]


def test_runtime_env_refuses_wrong_types():
    from ray.runtime_env import RuntimeEnv

    config = load("runtime_env.yaml")
    with pytest.raises(TypeError, match="env_vars"):
        RuntimeEnv(**{**config, "env_vars": {"OMP_NUM_THREADS": 1}})
    with pytest.raises(TypeError, match="excludes"):
        RuntimeEnv(**{**config, "excludes": ".venv"})


# --- Ray cluster launcher --------------------------------------------------------------------------


def validate_cluster(config: dict) -> dict:
    """What `ray up` does before touching the cloud: merge the provider's defaults.yaml and the setup
    commands (prepare_config), then check Ray's ray-schema.json (validate_config). For provider aws,
    prepare_config reads only Ray's bundled defaults: no boto3, credentials or network."""
    from ray.autoscaler._private.util import prepare_config, validate_config

    prepared = prepare_config(copy.deepcopy(config))
    validate_config(prepared)
    return prepared


def _shm_bytes(run_options: list[str]) -> int:
    (option,) = [o for o in run_options if o.startswith("--shm-size")]
    size = option.split("=", 1)[1].lower().rstrip("b")
    return parse_quantity(size if size.isdigit() else size.upper() + "i")  # Docker's k/m/g are binary


def test_cluster_yaml_validates_with_rays_launcher_schema():
    config = load("cluster.yaml")
    prepared = validate_cluster(config)
    assert prepared["max_workers"] == 0
    assert list(prepared["available_node_types"]) == [prepared["head_node_type"]]
    assert prepared["available_node_types"][prepared["head_node_type"]]["max_workers"] == 0
    assert prepared["worker_start_ray_commands"] == []


def test_cluster_yaml_docker_shm_numa_and_auth():
    config = load("cluster.yaml")
    run_options = config["docker"]["run_options"]
    assert _shm_bytes(run_options) >= 10 * 2**30
    assert "--cap-add=SYS_NICE" in run_options
    assert "--env=RAY_AUTH_MODE=token" in run_options
    (start,) = [c for c in config["head_start_ray_commands"] if "ray start" in c]
    assert "RAY_AUTH_MODE=token ray start --head" in start
    assert "--dashboard-host=127.0.0.1" in start
    assert "ray get-auth-token --generate" in " ".join(config["head_start_ray_commands"])


def test_cluster_yaml_installs_the_pinned_torch_before_the_project():
    makefile_pin = re.search(r"torch==[0-9.]+", (ROOT / "Makefile").read_text()).group(0)
    commands = validate_cluster(load("cluster.yaml"))["head_setup_commands"]
    torch_at = [i for i, c in enumerate(commands) if f"pip install --quiet {makefile_pin}" in c]
    project_at = [i for i, c in enumerate(commands) if c.endswith("pip install --quiet /home/ray/writescope")]
    assert torch_at and project_at and torch_at[0] < project_at[0]
    assert "/home/ray/writescope" in load("cluster.yaml")["file_mounts"]


def test_rays_launcher_schema_refuses_a_broken_cluster_yaml():
    config = load("cluster.yaml")
    for broken in (
        {**config, "max_worker": 0},  # unknown top-level key
        {**config, "max_workers": "none"},
        {**config, "docker": {**config["docker"], "shm_size": "64g"}},  # not a docker option of the launcher
    ):
        with pytest.raises(jsonschema.ValidationError):
            validate_cluster(broken)


# --- KubeRay manifests -----------------------------------------------------------------------------

_QUANTITY = re.compile(r"^([0-9]+(?:\.[0-9]+)?)([a-zA-Z]*)$")
_SUFFIX = {
    "": 1, "m": Fraction(1, 1000), "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18,
    "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60,
}


def parse_quantity(value) -> Fraction:
    """A Kubernetes quantity ("16", "500m", "192Gi", 1) as an exact number."""
    match = _QUANTITY.match(str(value))
    if not match or match.group(2) not in _SUFFIX:
        raise ValueError(f"not a quantity we use: {value!r}")
    return Fraction(match.group(1)) * _SUFFIX[match.group(2)]


def schema_validator(name: str) -> jsonschema.Draft202012Validator:
    schema = json.loads((SCHEMAS / name).read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


def cluster_spec(manifest: dict) -> dict:
    spec = manifest["spec"]
    return spec["rayClusterSpec"] if manifest["kind"] == "RayJob" else spec["rayClusterConfig"]


def head_pod_problems(manifest: dict) -> list[str]:
    """What a one-GPU WriteScope head pod needs beyond the schema; [] when it has it all."""
    problems = []
    cluster = cluster_spec(manifest)
    if cluster.get("authOptions", {}).get("mode") != "token":
        problems.append("token authentication is not on (authOptions.mode)")
    head = cluster["headGroupSpec"]
    pod = head["template"]["spec"]
    containers = pod["containers"]
    gpus = sum(parse_quantity(c["resources"]["limits"].get("nvidia.com/gpu", 0)) for c in containers)
    if gpus != 1:
        problems.append(f"the head group holds {gpus} GPUs, not 1")
    for c in containers:
        requests, limits = c["resources"]["requests"], c["resources"]["limits"]
        for resource in ("cpu", "memory", "nvidia.com/gpu"):
            if resource in requests or resource in limits or resource != "nvidia.com/gpu":
                if resource not in requests or resource not in limits:
                    problems.append(f"{c['name']}: {resource} needs both a request and a limit (Guaranteed QoS)")
                elif parse_quantity(requests[resource]) != parse_quantity(limits[resource]):
                    problems.append(f"{c['name']}: {resource} request != limit (not Guaranteed QoS)")
        cpu = limits.get("cpu")
        if cpu is not None and parse_quantity(cpu).denominator != 1:
            problems.append(
                f"{c['name']}: cpu {cpu} is not an integer (no exclusive cores from the static CPU manager)"
            )
        if "SYS_NICE" not in c.get("securityContext", {}).get("capabilities", {}).get("add", []):
            problems.append(f"{c['name']}: no SYS_NICE capability (NUMA binding needs it)")
    volumes = {v["name"]: v for v in pod.get("volumes", [])}
    shm = [m for c in containers for m in c.get("volumeMounts", []) if m["mountPath"] == "/dev/shm"]
    if not shm:
        problems.append("nothing mounted at /dev/shm (the runtime's default is 64 MiB)")
    for mount in shm:
        empty_dir = volumes.get(mount["name"], {}).get("emptyDir")
        if not empty_dir or empty_dir.get("medium") != "Memory" or "sizeLimit" not in empty_dir:
            problems.append("/dev/shm is not a sized emptyDir with medium Memory")
            continue
        shm_bytes = parse_quantity(empty_dir["sizeLimit"])
        memory = sum(parse_quantity(c["resources"]["limits"].get("memory", 0)) for c in containers)
        if shm_bytes >= memory:
            problems.append("/dev/shm sizeLimit >= the memory limit it is charged to")
        object_store = parse_quantity(head["rayStartParams"].get("object-store-memory", 0))
        if object_store >= shm_bytes:
            problems.append("Ray's object store would fill /dev/shm")
    return problems


@pytest.mark.parametrize("name", ["rayjob", "rayservice"])
def test_kuberay_manifest_validates_against_its_schema(name):
    manifest = load(f"{name}.yaml")
    schema_validator(f"{name}.schema.json").validate(manifest)
    assert manifest["apiVersion"] == "ray.io/v1"
    assert head_pod_problems(manifest) == []


def test_the_two_schemas_share_identical_definitions():
    rayjob, rayservice = (json.loads((SCHEMAS / n).read_text()) for n in SCHEMA_NAMES)
    assert rayjob["$defs"] == rayservice["$defs"]


def test_rayjob_runs_the_batch_entry_with_the_runtime_env_inline():
    manifest = load("rayjob.yaml")
    spec = manifest["spec"]
    argv = shlex.split(spec["entrypoint"])
    assert argv[:3] == ["python", "-m", "writescope.actors.batch_job"]
    flags = dict(zip(argv[3::2], argv[4::2], strict=True))
    assert flags == {
        "--model": "/models/qwen3-moe", "--input": "/data/prompts.jsonl", "--output": "/data/results.jsonl",
        "--device": "cuda",  # the head group's GPU: batch_job's default device is cpu
    }
    # batch_job's own parser accepts the command line (names and choices; it touches no file and starts no Ray).
    from writescope.actors.batch_job import build_parser

    args = build_parser().parse_args(argv[3:])
    assert (args.executor, args.device, args.max_batch_size, args.max_seq_len) == ("ray", "cuda", 8, 32768)
    mounts = [m for c in cluster_spec(manifest)["headGroupSpec"]["template"]["spec"]["containers"]
              for m in c.get("volumeMounts", [])]
    for flag in ("--model", "--input", "--output"):  # every path on a mounted volume, outputs on a writable one
        (mount,) = [m for m in mounts if flags[flag].startswith(m["mountPath"].rstrip("/") + "/")]
        assert flag != "--output" or not mount.get("readOnly", False)
    assert yaml.safe_load(spec["runtimeEnvYAML"]) == load("runtime_env.yaml")
    assert spec["shutdownAfterJobFinishes"] is True
    # A local working_dir is uploaded only by `ray job submit`, i.e. by the submitter Job of K8sJobMode.
    assert spec["submissionMode"] == "K8sJobMode"


def test_rayservice_serves_the_same_applications_as_serve_yaml():
    manifest = load("rayservice.yaml")
    serve = load("serve.yaml")
    embedded = yaml.safe_load(manifest["spec"]["serveConfigV2"])
    schema = validate_serve(embedded)
    assert unknown_serve_keys(embedded) == []
    # serve.yaml's applications, plus the one arg a GPU pod needs (serve.yaml also runs without a GPU).
    (app,) = copy.deepcopy(embedded["applications"])
    assert app["args"].pop("device") == "cuda"
    assert [app] == serve["applications"]
    assert len(schema.applications) == 1 and schema.applications[0].import_path == app["import_path"]
    assert embedded["proxy_location"] == serve["proxy_location"]
    assert embedded["http_options"]["port"] == serve["http_options"]["port"]
    if embedded["http_options"]["host"] not in LOOPBACK:  # wider than loopback: the API key must be required
        key_env = embedded["applications"][0]["args"]["api_key_env"]
        (container,) = cluster_spec(manifest)["headGroupSpec"]["template"]["spec"]["containers"]
        (var,) = [v for v in container.get("env", []) if v["name"] == key_env]
        assert "secretKeyRef" in var["valueFrom"] and "value" not in var
        assert {"containerPort": serve["http_options"]["port"], "name": "serve"} in container["ports"]


def test_ray_versions_agree_and_support_token_auth():
    versions = {cluster_spec(load(n))["rayVersion"] for n in ("rayjob.yaml", "rayservice.yaml")}
    (version,) = versions
    assert tuple(int(p) for p in version.split(".")) >= (2, 52, 0)
    assert load("cluster.yaml")["docker"]["image"].startswith(f"rayproject/ray:{version}-")


def test_shared_memory_and_object_store_sizes_agree_across_files():
    cluster = load("cluster.yaml")
    (start,) = [c for c in cluster["head_start_ray_commands"] if "ray start" in c]
    object_store = re.search(r"--object-store-memory=([0-9]+)", start).group(1)
    for name in ("rayjob.yaml", "rayservice.yaml"):
        head = cluster_spec(load(name))["headGroupSpec"]
        assert head["rayStartParams"]["object-store-memory"] == object_store
        (shm,) = [v for v in head["template"]["spec"]["volumes"] if v["name"] == "dshm"]
        assert parse_quantity(shm["emptyDir"]["sizeLimit"]) == _shm_bytes(cluster["docker"]["run_options"])


def test_memory_fits_the_documented_example_with_the_engines_own_sizing():
    """docs/cluster_configs.md's example (Qwen3-30B-A3B, bf16, batch 8 x 32K) sized by the engine itself:
    the capped object store fits the configs' /dev/shm, and the most memory the host KV can take (every
    sequence's KV placed, plus the segments being filled or kept; memfds, charged to the pod's memory)
    plus that /dev/shm fit the pods' memory limit with room for weights and processes."""
    import torch

    from writescope.loading import engine_cache_config
    from writescope.models.config import ModelConfig
    from writescope.models.presets import PRESETS

    qwen3_30b_a3b = ModelConfig.from_hf(dict(
        PRESETS["tiny-qwen3-moe"], num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
        hidden_size=2048,
    ))
    cache = engine_cache_config(qwen3_30b_a3b, torch.bfloat16, block_size=16, max_batch_size=8, max_seq_len=32768,
                                num_shards=1, window_tokens=64, pingpong_blocks=4, device="cpu")
    placed = cache.max_seqs * cache.max_blocks_per_seq * cache.block_bytes
    assert placed == 24 * 2**30  # the number the docs and the configs' comments give
    slack = cache.slack_blocks() * cache.block_bytes
    assert 60 * 2**20 <= slack <= 64 * 2**20  # two segments of about 16 MiB per region, as the docs say
    cluster = load("cluster.yaml")
    (start,) = [c for c in cluster["head_start_ray_commands"] if "ray start" in c]
    object_store = int(re.search(r"--object-store-memory=([0-9]+)", start).group(1))
    shm = _shm_bytes(cluster["docker"]["run_options"])
    assert object_store < shm
    for name in ("rayjob.yaml", "rayservice.yaml"):
        memory = parse_quantity(_head_container(load(name))["resources"]["limits"]["memory"])
        assert placed + slack + shm + 64 * 2**30 < memory  # 64 GiB left for the weights and the processes
    docs = (ROOT / "docs" / "cluster_configs.md").read_text()
    assert "so 24 GiB (and 64 MiB of segments" in docs


def _head_container(manifest: dict) -> dict:
    return cluster_spec(manifest)["headGroupSpec"]["template"]["spec"]["containers"][0]


def test_kuberay_schema_refuses_broken_manifests():
    rayjob = load("rayjob.yaml")
    validator = schema_validator("rayjob.schema.json")
    breakages = []
    broken = copy.deepcopy(rayjob)
    broken["spec"]["shutdownAfterJobFinish"] = True  # typo of a spec key
    breakages.append(broken)
    broken = copy.deepcopy(rayjob)
    broken["spec"]["rayClusterSpec"]["workerGroupSpecs"] = []  # one node only
    breakages.append(broken)
    broken = copy.deepcopy(rayjob)
    cluster_spec(broken)["headGroupSpec"]["template"]["spec"]["volumes"][0]["emptyDir"]["medium"] = "memory"
    breakages.append(broken)
    broken = copy.deepcopy(rayjob)
    broken["apiVersion"] = "ray.io/v1alpha1"
    breakages.append(broken)
    broken = copy.deepcopy(rayjob)
    del _head_container(broken)["resources"]["limits"]
    breakages.append(broken)
    for broken in breakages:
        assert not validator.is_valid(broken)
    rayservice = copy.deepcopy(load("rayservice.yaml"))
    rayservice["spec"]["rayClusterSpec"] = rayservice["spec"].pop("rayClusterConfig")  # RayJob's name for it
    assert not schema_validator("rayservice.schema.json").is_valid(rayservice)


def test_head_pod_checks_refuse_a_rayjob_without_gpu_qos_or_shm():
    rayjob = load("rayjob.yaml")

    def broken_by(edit) -> list[str]:
        manifest = copy.deepcopy(rayjob)
        edit(_head_container(manifest), cluster_spec(manifest))
        schema_validator("rayjob.schema.json").validate(manifest)  # still valid: only these checks see it
        return head_pod_problems(manifest)

    def no_gpu(container, _):
        del container["resources"]["requests"]["nvidia.com/gpu"]
        del container["resources"]["limits"]["nvidia.com/gpu"]

    def burstable(container, _):
        container["resources"]["requests"]["memory"] = "96Gi"

    def fractional_cpu(container, _):
        container["resources"]["requests"]["cpu"] = container["resources"]["limits"]["cpu"] = "15500m"

    def disk_shm(_, cluster):
        del cluster["headGroupSpec"]["template"]["spec"]["volumes"][0]["emptyDir"]["medium"]

    def no_shm(container, _):
        container["volumeMounts"] = [m for m in container["volumeMounts"] if m["mountPath"] != "/dev/shm"]

    def no_auth(_, cluster):
        del cluster["authOptions"]

    assert broken_by(no_gpu) == ["the head group holds 0 GPUs, not 1"]
    assert broken_by(burstable) == ["ray-head: memory request != limit (not Guaranteed QoS)"]
    assert broken_by(fractional_cpu) == [
        "ray-head: cpu 15500m is not an integer (no exclusive cores from the static CPU manager)"
    ]
    assert broken_by(disk_shm) == ["/dev/shm is not a sized emptyDir with medium Memory"]
    assert broken_by(no_shm) == ["nothing mounted at /dev/shm (the runtime's default is 64 MiB)"]
    assert broken_by(no_auth) == ["token authentication is not on (authOptions.mode)"]
