"""The deployment configs in cluster_configs/, checked offline by the validators their consumers use.

- cluster.yaml: Ray's own launcher schema (prepare_config + validate_config); the AWS provider's
  prepare step only merges its defaults.yaml, so no boto3, credentials or network are needed.
- serve.yaml and the RayService's serveConfigV2: Ray Serve's ServeDeploySchema (pydantic); the
  application's import_path is checked for its form only, never imported.
- rayjob.yaml, rayservice.yaml: our JSON Schemas of the KubeRay ray.io/v1 subset we use
  (cluster_configs/schemas/), then the properties WriteScope's pods need: a CPU-only head and worker
  groups of one-GPU pods (one engine each), and the engine's flags and Serve replicas that match them.
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


def _start_command(config: dict, key: str) -> str:
    (start,) = [c for c in config[key] if "ray start" in c]
    return start


def _node_types(config: dict) -> tuple[dict, dict]:
    """The head's node type and the one worker node type (the GPU nodes)."""
    types = config["available_node_types"]
    (worker,) = [name for name in types if name != config["head_node_type"]]
    return types[config["head_node_type"]], types[worker]


def test_cluster_yaml_validates_with_rays_launcher_schema():
    config = load("cluster.yaml")
    prepared = validate_cluster(config)
    head, worker = _node_types(prepared)
    # The head advertises no CPU and has no GPU: no engine group (nor task) is ever placed there.
    assert head["resources"] == {"CPU": 0} and head["max_workers"] == 0
    assert "--num-cpus=0" in _start_command(prepared, "head_start_ray_commands").split()
    # The GPU nodes: one GPU each, some kept up for --engines auto, at most the cluster's max_workers.
    assert worker["resources"]["GPU"] == 1 and worker["resources"]["CPU"] >= 1
    assert 1 <= worker["min_workers"] <= worker["max_workers"] <= prepared["max_workers"]
    assert "--address=$RAY_HEAD_IP:6379" in _start_command(prepared, "worker_start_ray_commands").split()


def test_cluster_yaml_docker_shm_numa_and_auth():
    config = load("cluster.yaml")
    docker = config["docker"]
    run_options = docker["run_options"]
    worker_options = run_options + docker.get("worker_run_options", [])
    head_options = run_options + docker.get("head_run_options", [])
    assert _shm_bytes(run_options) >= 10 * 2**30  # on every node: the object store lives there
    assert "--cap-add=SYS_NICE" in worker_options  # the GPU nodes run the pinned CPU workers
    assert "--gpus=all" in worker_options and "--gpus=all" not in head_options  # the head has no GPU
    assert "--env=RAY_AUTH_MODE=token" in run_options
    # One token for the head and every GPU node: shipped by file_mounts from a file outside the checkout
    # (so never committed nor uploaded with a job) and named by RAY_AUTH_TOKEN_PATH in every container.
    (path_option,) = [o for o in run_options if o.startswith("--env=RAY_AUTH_TOKEN_PATH=")]
    token_path = path_option.split("=", 2)[2]
    assert config["file_mounts"][token_path].startswith("~/")  # not relative: `ray up` runs in the checkout
    for key in ("head_start_ray_commands", "worker_start_ray_commands"):
        assert "RAY_AUTH_MODE=token ray start --" in _start_command(config, key)
    assert "--head" in _start_command(config, "head_start_ray_commands")
    assert "--dashboard-host=127.0.0.1" in _start_command(config, "head_start_ray_commands")


def test_cluster_yaml_installs_the_pinned_torch_before_the_project():
    makefile_pin = re.search(r"torch==[0-9.]+", (ROOT / "Makefile").read_text()).group(0)
    prepared = validate_cluster(load("cluster.yaml"))
    for key in ("head_setup_commands", "worker_setup_commands"):  # the driver's node and the engines' nodes
        commands = prepared[key]
        torch_at = [i for i, c in enumerate(commands) if f"pip install --quiet {makefile_pin}" in c]
        project_at = [i for i, c in enumerate(commands) if c.endswith("pip install --quiet /home/ray/writescope")]
        assert torch_at and project_at and torch_at[0] < project_at[0], key
    assert "/home/ray/writescope" in load("cluster.yaml")["file_mounts"]


def test_cluster_docs_batch_command_takes_one_engine_per_gpu_node():
    """docs/cluster_configs.md's `ray job submit` for the launcher's cluster, parsed by batch_job's own parser:
    one engine per GPU node (auto, with engine_cpus a GPU node's CPU count), on the GPU."""
    from writescope.actors.batch_job import build_parser

    docs = (ROOT / "docs" / "cluster_configs.md").read_text().replace("\\\n", " ")
    (line,) = [line for line in docs.splitlines() if "ray job submit" in line and "writescope.actors.batch_job" in line]
    argv = shlex.split(line.split("writescope.actors.batch_job", 1)[1].split("#", 1)[0])
    args = build_parser().parse_args(argv)
    _, worker = _node_types(load("cluster.yaml"))
    assert (args.engines, args.engine_cpus, args.device) == ("auto", worker["resources"]["CPU"], "cuda")


def test_rays_launcher_schema_refuses_a_broken_cluster_yaml():
    config = load("cluster.yaml")
    head_type, worker_type = config["head_node_type"], next(
        name for name in config["available_node_types"] if name != config["head_node_type"])
    worker = config["available_node_types"][worker_type]
    for broken in (
        {**config, "max_worker": 0},  # unknown top-level key
        {**config, "max_workers": "none"},
        {**config, "docker": {**config["docker"], "shm_size": "64g"}},  # not a docker option of the launcher
        {**config, "available_node_types": {  # a GPU node type without its EC2 launch parameters
            head_type: config["available_node_types"][head_type],
            worker_type: {k: v for k, v in worker.items() if k != "node_config"}}},
        {**config, "available_node_types": {  # a fractional GPU: Ray's resources are whole numbers here
            **config["available_node_types"], worker_type: {**worker, "resources": {"CPU": 32, "GPU": 0.5}}}},
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


def worker_groups(manifest: dict) -> list[dict]:
    return cluster_spec(manifest).get("workerGroupSpecs", [])


def _containers(group: dict) -> list[dict]:
    return group["template"]["spec"]["containers"]


def _limit(container: dict, resource: str) -> Fraction:
    return parse_quantity(container["resources"]["limits"].get(resource, 0))


def pod_problems(where: str, group: dict, gpus_per_pod: int, engine: bool) -> list[str]:
    """What one group's pods need beyond the schema: gpus_per_pod GPUs, Guaranteed QoS with integer CPUs,
    a sized memory-backed /dev/shm that the object store fits in; where engine is set (its CPU workers pin
    threads and bind memory to NUMA nodes), SYS_NICE. [] when the group has it all."""
    problems = []
    pod = group["template"]["spec"]
    containers = pod["containers"]
    gpus = sum(_limit(c, "nvidia.com/gpu") for c in containers)
    if gpus != gpus_per_pod:
        problems.append(f"{where}: a pod holds {gpus} GPUs, not {gpus_per_pod}")
    for c in containers:
        requests, limits = c["resources"]["requests"], c["resources"]["limits"]
        for resource in ("cpu", "memory", "nvidia.com/gpu"):
            if resource in requests or resource in limits or resource != "nvidia.com/gpu":
                if resource not in requests or resource not in limits:
                    problems.append(f"{where}: {c['name']}: {resource} needs both a request and a limit "
                                    f"(Guaranteed QoS)")
                elif parse_quantity(requests[resource]) != parse_quantity(limits[resource]):
                    problems.append(f"{where}: {c['name']}: {resource} request != limit (not Guaranteed QoS)")
        cpu = limits.get("cpu")
        if cpu is not None and parse_quantity(cpu).denominator != 1:
            problems.append(
                f"{where}: {c['name']}: cpu {cpu} is not an integer (no exclusive cores from the static CPU manager)"
            )
        if engine and "SYS_NICE" not in c.get("securityContext", {}).get("capabilities", {}).get("add", []):
            problems.append(f"{where}: {c['name']}: no SYS_NICE capability (NUMA binding needs it)")
    volumes = {v["name"]: v for v in pod.get("volumes", [])}
    shm = [m for c in containers for m in c.get("volumeMounts", []) if m["mountPath"] == "/dev/shm"]
    if not shm:
        problems.append(f"{where}: nothing mounted at /dev/shm (the runtime's default is 64 MiB)")
    for mount in shm:
        empty_dir = volumes.get(mount["name"], {}).get("emptyDir")
        if not empty_dir or empty_dir.get("medium") != "Memory" or "sizeLimit" not in empty_dir:
            problems.append(f"{where}: /dev/shm is not a sized emptyDir with medium Memory")
            continue
        shm_bytes = parse_quantity(empty_dir["sizeLimit"])
        if shm_bytes >= sum(_limit(c, "memory") for c in containers):
            problems.append(f"{where}: /dev/shm sizeLimit >= the memory limit it is charged to")
        if parse_quantity(group["rayStartParams"].get("object-store-memory", 0)) >= shm_bytes:
            problems.append(f"{where}: Ray's object store would fill /dev/shm")
    return problems


def manifest_problems(manifest: dict) -> list[str]:
    """What WriteScope's KubeRay cluster needs beyond the schema; [] when it has it all: token auth; a head
    without GPU that advertises no CPU (no engine lands there); worker groups of one-GPU engine pods."""
    problems = []
    cluster = cluster_spec(manifest)
    if cluster.get("authOptions", {}).get("mode") != "token":
        problems.append("token authentication is not on (authOptions.mode)")
    head = cluster["headGroupSpec"]
    if head["rayStartParams"].get("num-cpus") != "0":
        problems.append("head: it advertises CPUs to Ray (num-cpus is not \"0\"): engines or tasks could land there")
    problems += pod_problems("head", head, gpus_per_pod=0, engine=False)
    groups = worker_groups(manifest)
    if not groups:
        problems.append("no worker group: the engines have no GPU node to run on")
    names = [group["groupName"] for group in groups]
    if len(set(names)) != len(names):
        problems.append(f"worker group names repeat: {names}")
    for group in groups:
        where = f"worker group {group['groupName']}"
        if not group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]:
            problems.append(f"{where}: replicas {group['replicas']} outside [minReplicas, maxReplicas] = "
                            f"[{group['minReplicas']}, {group['maxReplicas']}]")
        problems += pod_problems(where, group, gpus_per_pod=1, engine=True)
    return problems


def gpu_pod_cpus(manifest: dict) -> int:
    """The one CPU count of every GPU pod (its Ray container's cpu limit), which engine_cpus must equal."""
    (cpus,) = {_limit(c, "cpu") for group in worker_groups(manifest) for c in _containers(group)[:1]}
    assert cpus.denominator == 1
    return int(cpus)


@pytest.mark.parametrize("name", ["rayjob", "rayservice"])
def test_kuberay_manifest_validates_against_its_schema(name):
    manifest = load(f"{name}.yaml")
    schema_validator(f"{name}.schema.json").validate(manifest)
    assert manifest["apiVersion"] == "ray.io/v1"
    assert manifest_problems(manifest) == []


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
        "--device": "cuda",  # the GPU pods' GPUs: batch_job's default device is cpu
        "--engines": "auto", "--engine-cpus": str(gpu_pod_cpus(manifest)),  # one engine per GPU pod
    }
    # batch_job's own parser accepts the command line (names and choices; it touches no file and starts no Ray).
    from writescope.actors.batch_job import build_parser

    args = build_parser().parse_args(argv[3:])
    assert (args.executor, args.device, args.max_batch_size, args.max_seq_len) == ("ray", "cuda", 8, 32768)
    # auto: one engine per node whose resources hold an engine group of engine_cpus CPUs and a GPU. With
    # engine_cpus the GPU pod's whole CPU count that is exactly one per GPU pod (the head has no GPU).
    assert args.engines == "auto" and args.engine_cpus == gpu_pod_cpus(manifest)

    def mounts(group: dict) -> list[dict]:
        return [m for c in _containers(group) for m in c.get("volumeMounts", [])]

    def mount_of(path: str, group: dict) -> dict:
        (mount,) = [m for m in mounts(group) if path.startswith(m["mountPath"].rstrip("/") + "/")]
        return mount

    head = cluster_spec(manifest)["headGroupSpec"]
    # The driver on the head loads the tokenizer from --model, reads --input and writes --output (writable).
    for flag in ("--model", "--input", "--output"):
        mount = mount_of(flags[flag], head)
        assert flag != "--output" or not mount.get("readOnly", False)
    # Every engine loads the weights from --model, at the same path, on its GPU pod.
    for group in worker_groups(manifest):
        mount_of(flags["--model"], group)
    assert yaml.safe_load(spec["runtimeEnvYAML"]) == load("runtime_env.yaml")
    assert spec["shutdownAfterJobFinishes"] is True
    # A local working_dir is uploaded only by `ray job submit`, i.e. by the submitter Job of K8sJobMode.
    assert spec["submissionMode"] == "K8sJobMode"


def _embedded_serve_config(manifest: dict) -> dict:
    return yaml.safe_load(manifest["spec"]["serveConfigV2"])


def test_rayservice_runs_one_replica_and_engine_per_gpu_pod():
    manifest = load("rayservice.yaml")
    (app,) = _embedded_serve_config(manifest)["applications"]
    (deployment,) = app["deployments"]
    # Each replica starts its own engine group (one bundle with the GPU and engine_cpus CPUs): one per GPU pod.
    assert deployment["num_replicas"] == sum(group["replicas"] for group in worker_groups(manifest))
    assert app["args"]["engine_cpus"] == gpu_pod_cpus(manifest)
    assert app["args"]["device"] == "cuda"
    from writescope.config import FIELD_NAMES, EngineConfig

    config = EngineConfig.from_mapping({k: v for k, v in app["args"].items() if k in FIELD_NAMES})
    assert (config.engine_cpus, config.device) == (gpu_pod_cpus(manifest), "cuda")


def test_rayservice_serves_serve_yamls_applications_scaled_out():
    manifest = load("rayservice.yaml")
    serve = load("serve.yaml")
    embedded = _embedded_serve_config(manifest)
    schema = validate_serve(embedded)
    assert unknown_serve_keys(embedded) == []
    # serve.yaml's applications except what a cluster of GPU pods changes (serve.yaml also runs on one machine
    # without a GPU): the device, each engine's CPUs, and the replicas (checked against the pods above).
    (app,) = copy.deepcopy(embedded["applications"])
    assert app["args"].pop("device") == "cuda"
    assert app["args"].pop("engine_cpus") > 1
    (deployment,) = app["deployments"]
    (serve_deployment,) = serve["applications"][0]["deployments"]
    assert deployment["num_replicas"] > serve_deployment["num_replicas"] == 1
    deployment["num_replicas"] = serve_deployment["num_replicas"]
    assert [app] == serve["applications"]
    assert len(schema.applications) == 1 and schema.applications[0].import_path == app["import_path"]
    assert embedded["proxy_location"] == serve["proxy_location"]
    assert embedded["http_options"]["port"] == serve["http_options"]["port"]
    (head_container,) = _containers(cluster_spec(manifest)["headGroupSpec"])
    if embedded["http_options"]["host"] not in LOOPBACK:  # wider than loopback: the API key must be required
        # The proxy runs on the head (HeadOnly) and the serve Service targets its port there.
        assert embedded["proxy_location"] == "HeadOnly"
        assert {"containerPort": serve["http_options"]["port"], "name": "serve"} in head_container["ports"]
        # The replicas, which check the key, run on the GPU pods: the key is in their environment, from a Secret.
        key_env = embedded["applications"][0]["args"]["api_key_env"]
        for group in worker_groups(manifest):
            for container in _containers(group)[:1]:
                (var,) = [v for v in container.get("env", []) if v["name"] == key_env]
                assert "secretKeyRef" in var["valueFrom"] and "value" not in var


def test_ray_versions_agree_and_support_token_auth():
    versions = {cluster_spec(load(n))["rayVersion"] for n in ("rayjob.yaml", "rayservice.yaml")}
    (version,) = versions
    assert tuple(int(p) for p in version.split(".")) >= (2, 52, 0)
    assert load("cluster.yaml")["docker"]["image"].startswith(f"rayproject/ray:{version}-")


def _groups(manifest: dict) -> list[dict]:
    """The head group and every worker group."""
    return [cluster_spec(manifest)["headGroupSpec"], *worker_groups(manifest)]


def test_shared_memory_and_object_store_sizes_agree_across_files():
    cluster = load("cluster.yaml")
    object_store = re.search(r"--object-store-memory=([0-9]+)", _start_command(cluster, "head_start_ray_commands"))
    assert re.search(r"--object-store-memory=([0-9]+)", _start_command(cluster, "worker_start_ray_commands")
                     ).group(1) == object_store.group(1)
    for name in ("rayjob.yaml", "rayservice.yaml"):
        for group in _groups(load(name)):
            assert group["rayStartParams"]["object-store-memory"] == object_store.group(1)
            (shm,) = [v for v in group["template"]["spec"]["volumes"] if v["name"] == "dshm"]
            assert parse_quantity(shm["emptyDir"]["sizeLimit"]) == _shm_bytes(cluster["docker"]["run_options"])


def test_memory_fits_the_documented_example_with_the_engines_own_sizing():
    """docs/cluster_configs.md's example (Qwen3-30B-A3B, bf16, batch 8 x 32K) sized by the engine itself:
    the capped object store fits the configs' /dev/shm, and the most memory the host KV can take (every
    sequence's KV placed, plus the segments being filled or kept; memfds, charged to the pod's memory)
    plus that /dev/shm fit the memory limit of the GPU pods, where the engines and their KV run, with room
    for weights and processes."""
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
    object_store = int(re.search(r"--object-store-memory=([0-9]+)",
                                 _start_command(cluster, "worker_start_ray_commands")).group(1))
    shm = _shm_bytes(cluster["docker"]["run_options"])
    assert object_store < shm
    for name in ("rayjob.yaml", "rayservice.yaml"):
        groups = worker_groups(load(name))
        assert groups
        for group in groups:
            memory = sum(_limit(c, "memory") for c in _containers(group))
            assert placed + slack + shm + 64 * 2**30 < memory  # 64 GiB left for the weights and the processes
    docs = (ROOT / "docs" / "cluster_configs.md").read_text()
    assert "so 24 GiB (and 64 MiB of segments" in docs


def _worker_container(manifest: dict) -> dict:
    return _containers(worker_groups(manifest)[0])[0]


def _head_container(manifest: dict) -> dict:
    return _containers(cluster_spec(manifest)["headGroupSpec"])[0]


def test_kuberay_schema_refuses_broken_manifests():
    rayjob = load("rayjob.yaml")
    validator = schema_validator("rayjob.schema.json")
    breakages = []
    broken = copy.deepcopy(rayjob)
    broken["spec"]["shutdownAfterJobFinish"] = True  # typo of a spec key
    breakages.append(broken)
    broken = copy.deepcopy(rayjob)
    del broken["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["groupName"]  # KubeRay names pods after it
    breakages.append(broken)
    broken = copy.deepcopy(rayjob)
    broken["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["replicas"] = "2"  # a string, not a count
    breakages.append(broken)
    broken = copy.deepcopy(rayjob)
    broken["spec"]["rayClusterSpec"]["workerGroupSpecs"] = []  # no GPU node: the head has none
    breakages.append(broken)
    broken = copy.deepcopy(rayjob)
    worker_groups(broken)[0]["rayStartParams"]["num-gpus"] = 1  # rayStartParams values are strings
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
    broken = copy.deepcopy(rayjob)
    del _worker_container(broken)["resources"]["requests"]
    breakages.append(broken)
    for broken in breakages:
        assert not validator.is_valid(broken)
    rayservice = copy.deepcopy(load("rayservice.yaml"))
    rayservice["spec"]["rayClusterSpec"] = rayservice["spec"].pop("rayClusterConfig")  # RayJob's name for it
    assert not schema_validator("rayservice.schema.json").is_valid(rayservice)


def test_pod_checks_refuse_a_rayjob_without_gpu_qos_shm_or_a_cpu_only_head():
    rayjob = load("rayjob.yaml")

    def broken_by(edit) -> list[str]:
        manifest = copy.deepcopy(rayjob)
        edit(manifest)
        schema_validator("rayjob.schema.json").validate(manifest)  # still valid: only these checks see it
        return manifest_problems(manifest)

    def worker_without_gpu(manifest):
        del _worker_container(manifest)["resources"]["requests"]["nvidia.com/gpu"]
        del _worker_container(manifest)["resources"]["limits"]["nvidia.com/gpu"]

    def two_gpus_per_worker(manifest):
        _worker_container(manifest)["resources"]["requests"]["nvidia.com/gpu"] = 2
        _worker_container(manifest)["resources"]["limits"]["nvidia.com/gpu"] = 2

    def head_with_gpu(manifest):
        _head_container(manifest)["resources"]["requests"]["nvidia.com/gpu"] = 1
        _head_container(manifest)["resources"]["limits"]["nvidia.com/gpu"] = 1

    def head_with_cpus(manifest):
        del cluster_spec(manifest)["headGroupSpec"]["rayStartParams"]["num-cpus"]

    def burstable_worker(manifest):
        _worker_container(manifest)["resources"]["requests"]["memory"] = "96Gi"

    def burstable_head(manifest):
        _head_container(manifest)["resources"]["requests"]["cpu"] = "2"

    def fractional_cpu(manifest):
        _worker_container(manifest)["resources"]["requests"]["cpu"] = "15500m"
        _worker_container(manifest)["resources"]["limits"]["cpu"] = "15500m"

    def no_sys_nice(manifest):
        del _worker_container(manifest)["securityContext"]

    def disk_shm(manifest):
        del worker_groups(manifest)[0]["template"]["spec"]["volumes"][0]["emptyDir"]["medium"]

    def no_shm(manifest):
        container = _worker_container(manifest)
        container["volumeMounts"] = [m for m in container["volumeMounts"] if m["mountPath"] != "/dev/shm"]

    def object_store_fills_shm(manifest):
        worker_groups(manifest)[0]["rayStartParams"]["object-store-memory"] = str(12 * 2**30)

    def shm_as_large_as_head_memory(manifest):
        cluster_spec(manifest)["headGroupSpec"]["template"]["spec"]["volumes"][0]["emptyDir"]["sizeLimit"] = "32Gi"
        cluster_spec(manifest)["headGroupSpec"]["rayStartParams"]["object-store-memory"] = str(8 * 2**30)

    def replicas_above_max(manifest):
        worker_groups(manifest)[0]["replicas"] = 5

    def no_auth(manifest):
        del cluster_spec(manifest)["authOptions"]

    gpu = "worker group gpu"
    assert broken_by(worker_without_gpu) == [f"{gpu}: a pod holds 0 GPUs, not 1"]
    assert broken_by(two_gpus_per_worker) == [f"{gpu}: a pod holds 2 GPUs, not 1"]
    assert broken_by(head_with_gpu) == ["head: a pod holds 1 GPUs, not 0"]
    assert broken_by(head_with_cpus) == [
        'head: it advertises CPUs to Ray (num-cpus is not "0"): engines or tasks could land there'
    ]
    assert broken_by(burstable_worker) == [f"{gpu}: ray-worker: memory request != limit (not Guaranteed QoS)"]
    assert broken_by(burstable_head) == ["head: ray-head: cpu request != limit (not Guaranteed QoS)"]
    assert broken_by(fractional_cpu) == [
        f"{gpu}: ray-worker: cpu 15500m is not an integer (no exclusive cores from the static CPU manager)"
    ]
    assert broken_by(no_sys_nice) == [f"{gpu}: ray-worker: no SYS_NICE capability (NUMA binding needs it)"]
    assert broken_by(disk_shm) == [f"{gpu}: /dev/shm is not a sized emptyDir with medium Memory"]
    assert broken_by(no_shm) == [f"{gpu}: nothing mounted at /dev/shm (the runtime's default is 64 MiB)"]
    assert broken_by(object_store_fills_shm) == [f"{gpu}: Ray's object store would fill /dev/shm"]
    assert broken_by(shm_as_large_as_head_memory) == ["head: /dev/shm sizeLimit >= the memory limit it is charged to"]
    assert broken_by(replicas_above_max) == [f"{gpu}: replicas 5 outside [minReplicas, maxReplicas] = [1, 4]"]
    assert broken_by(no_auth) == ["token authentication is not on (authOptions.mode)"]
