"""Scenarios on a real multi-node Ray cluster on this machine, each run in a child process of the
test (`python -m tests.actors.multinode SCENARIO WORKDIR`), which writes its findings as JSON to
WORKDIR/result.json for the test to check.

The cluster is `ray.cluster_utils.Cluster`: a head (1 CPU, for the driver, Serve's controller and
proxy) and two worker nodes, each its own raylet with 2 CPUs and a resource naming it, with token
authentication on. Engines reserve engine_cpus=2, a whole worker node, so two engines land on the
two worker nodes. Removing a node kills its raylet and every process of it, as losing the machine
would."""

import json
import os
import secrets
import subprocess
import sys
import threading
import time

MODEL_ARGS = {"model": "tiny-qwen3-moe", "policy": "all_cpu", "max_seq_len": 1024, "max_batch_size": 4,
              "engine_cpus": 2}
WORKER_CPUS = 2
STREAM_TOKENS = 900  # long enough to be in flight when its node goes
IN_FLIGHT_MARGIN = 100  # tokens a stream must still have to come to count as in flight at the loss


def start_cluster():
    """(the cluster, its two worker nodes). Only in the scenario's own process: see main()."""
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    workers = [cluster.add_node(num_cpus=WORKER_CPUS, resources={f"worker{i}": 1}) for i in range(2)]
    cluster.wait_for_nodes()
    return cluster, workers


def write_json(path: str, data) -> None:
    with open(path, "w") as f:
        json.dump(data, f)


def read_records(path: str) -> list[dict]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.endswith("\n") and line.strip()]


# ---------------------------------------------------------------------------------------- batch
def batch(workdir: str, remove_at: int | None) -> dict:
    """The batch job over `--engines auto` (one per worker node); with remove_at, the node of one
    engine is removed once remove_at records are written."""
    cluster, workers = start_cluster()
    try:
        output = os.path.join(workdir, "results.jsonl")
        flags = [f"--{k.replace('_', '-')}={v}" for k, v in MODEL_ARGS.items()]
        command = [sys.executable, "-m", "writescope.actors.batch_job", *flags, "--engines", "auto",
                   "--max-in-flight", "4", "--input", os.path.join(workdir, "prompts.jsonl"), "--output", output,
                   "--progress-every-s", "2"]
        log = open(os.path.join(workdir, "batch.log"), "w")  # noqa: SIM115 - the job's log, read after
        job = subprocess.Popen(command, env={**os.environ, "RAY_ADDRESS": cluster.address}, stdout=log,
                               stderr=subprocess.STDOUT)
        removed = None
        while job.poll() is None:
            if remove_at is not None and removed is None and len(read_records(output)) >= remove_at:
                removed = workers[1].node_id
                cluster.remove_node(workers[1])
            time.sleep(0.2)
        log.close()
        with open(os.path.join(workdir, "batch.log")) as f:
            text = f.read()
        summary = next((json.loads(line.split("summary: ", 1)[1]) for line in text.splitlines()
                        if "summary: " in line), None)
        engine_nodes = [line.rsplit("on node ", 1)[1].strip() for line in text.splitlines()
                        if " on node " in line and "engine " in line]
        return {"returncode": job.returncode, "summary": summary, "engine_nodes": engine_nodes,
                "worker_nodes": [w.node_id for w in workers], "removed": removed, "log_tail": text[-4000:]}
    finally:
        cluster.shutdown()


# ---------------------------------------------------------------------------------------- serve
def serve_app(workdir: str) -> dict:
    """Two replicas of the Serve app, one per worker node; then one node is removed while streams
    run on it, and the other replica keeps answering."""
    import ray
    import requests
    from ray import serve

    from writescope.actors.serve_app import NODE_HEADER, ingress_deployment
    from writescope.config import EngineConfig
    from writescope.tools.local_serve import free_port, wait_healthy

    cluster, workers = start_cluster()
    ray.init(address=cluster.address)
    try:
        port = free_port()
        serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})
        config = EngineConfig.from_mapping(MODEL_ARGS)
        serve.run(ingress_deployment(config, num_replicas=2, health_check_period_s=2).bind(**config.to_dict()),
                  name="writescope", route_prefix="/", blocking=False)
        base = f"http://127.0.0.1:{port}"
        wait_healthy(base, timeout_s=600)
        wait_for_running_replicas(serve, "writescope", 2, timeout_s=300)  # the first healthy one may be alone
        result = {"worker_nodes": [w.node_id for w in workers]}
        result["before"] = [complete(requests, base, i, NODE_HEADER) for i in range(12)]

        streams = [Stream(requests, base, i, NODE_HEADER) for i in range(6)]
        for stream in streams:
            stream.started.wait(timeout=120)
        # The node lost is that of the stream furthest from its end: a stream that began first may have
        # finished while the last one waited for its first token (seen once on a slow 2-vCPU host).
        # Streams with a margin of tokens left are the ones in flight at the loss.
        tokens_at_loss = {id(s): s.tokens for s in streams}
        in_flight = [s for s in streams if s.is_alive() and tokens_at_loss[id(s)] <= STREAM_TOKENS - IN_FLIGHT_MARGIN]
        if not in_flight:
            raise RuntimeError("no stream in flight to lose a node under: tokens so far "
                               f"{sorted(tokens_at_loss.values())}")
        furthest = min(in_flight, key=lambda s: tokens_at_loss[id(s)])
        doomed = next(w for w in workers if w.node_id == furthest.node)
        removed_at = time.monotonic()
        cluster.remove_node(doomed, allow_graceful=False)  # lost: killed at once (a graceful stop let its stream end)
        result["removed"] = doomed.node_id
        result["after"] = answers_after_loss(requests, base, NODE_HEADER, removed_at)  # while the streams run
        for stream in streams:
            stream.join(timeout=180)
        result["streams"] = [{"node": s.node, "ended": not s.is_alive(), "outcome": s.outcome, "tokens": s.tokens,
                              "in_flight_at_loss": s in in_flight, "tokens_at_loss": tokens_at_loss[id(s)]}
                             for s in streams]
        returned = cluster.add_node(num_cpus=WORKER_CPUS)  # capacity comes back: Serve places a new replica
        result["returned"] = returned.node_id
        kept = next(w for w in workers if w is not doomed)
        result["replaced"] = answers_until_nodes(requests, base, NODE_HEADER, {kept.node_id, returned.node_id})
        return result
    finally:
        serve.shutdown()
        ray.shutdown()
        cluster.shutdown()


def complete(requests, base: str, index: int, header: str) -> dict:
    body = {"model": "tiny-qwen3-moe", "prompt": f"request {index}: " + "context " * 20, "max_tokens": 4,
            "temperature": 0}
    try:
        response = requests.post(f"{base}/v1/completions", json=body, timeout=120)
        return {"status": response.status_code, "node": response.headers.get(header),
                "text": response.json()["choices"][0]["text"] if response.ok else response.text[:300]}
    except requests.RequestException as error:
        return {"status": None, "node": None, "text": type(error).__name__}


def answers_after_loss(requests, base: str, header: str, since: float, want: int = 10) -> list[dict]:
    """Requests one after another until `want` in a row succeed (or 180 s pass), with when each came."""
    answers, in_a_row = [], 0
    while in_a_row < want and time.monotonic() - since < 180:
        answer = complete(requests, base, len(answers), header)
        answer["seconds_after_loss"] = round(time.monotonic() - since, 2)
        answers.append(answer)
        in_a_row = in_a_row + 1 if answer["status"] == 200 else 0
    return answers


def answers_until_nodes(requests, base: str, header: str, nodes: set, timeout_s: float = 300) -> list[dict]:
    """Requests until every node of `nodes` has answered one (or timeout_s pass)."""
    answers, began = [], time.monotonic()
    while not nodes <= {a["node"] for a in answers} and time.monotonic() - began < timeout_s:
        answer = complete(requests, base, len(answers), header)
        answer["seconds"] = round(time.monotonic() - began, 2)
        answers.append(answer)
        time.sleep(0.5)
    return answers


class Stream(threading.Thread):
    """One streamed completion long enough to be in flight when its node goes."""

    def __init__(self, requests, base: str, index: int, header: str):
        super().__init__(daemon=True)
        self.requests, self.base, self.index, self.header = requests, base, index, header
        self.started = threading.Event()
        self.node, self.outcome, self.tokens = None, None, 0
        self.start()

    def run(self):
        body = {"model": "tiny-qwen3-moe", "prompt": f"stream {self.index}: " + "context " * 5,
                "max_tokens": STREAM_TOKENS, "temperature": 0, "stream": True, "ignore_eos": True}
        try:
            with self.requests.post(f"{self.base}/v1/completions", json=body, timeout=120, stream=True) as response:
                self.node = response.headers.get(self.header)
                self.outcome = f"status {response.status_code}"
                for line in response.iter_lines(decode_unicode=True):
                    if line.startswith("data: {"):
                        payload = json.loads(line[len("data: "):])
                        if "error" in payload:
                            self.outcome = "error event: " + payload["error"].get("message", "")
                            continue
                        self.tokens += 1
                        self.started.set()
                    elif line == "data: [DONE]":
                        self.outcome = self.outcome if self.outcome.startswith("error") else "done"
        except self.requests.RequestException as error:
            self.outcome = f"connection: {type(error).__name__}"
        finally:
            self.started.set()


SCENARIOS = {"batch": lambda d: batch(d, None), "batch_node_loss": lambda d: batch(d, 12), "serve": serve_app}

def main(scenario: str, workdir: str) -> None:
    # Before Ray is imported, in this process only (a test that imports MODEL_ARGS must not change its
    # own session's environment): every node of the cluster, and the batch job, inherit these.
    os.environ["RAY_AUTH_MODE"] = "token"
    os.environ.setdefault("RAY_AUTH_TOKEN", secrets.token_hex(32))
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    write_json(os.path.join(workdir, "result.json"), SCENARIOS[scenario](workdir))


def wait_for_running_replicas(serve, app: str, count: int, timeout_s: float) -> None:
    """Until the app's replicas that are up (RUNNING: constructed, their engines loaded) are count: the
    health check answers as soon as one is, and until the other is, every request goes to the first."""
    deadline = time.monotonic() + timeout_s
    while True:
        status = serve.status().applications.get(app)
        running = 0 if status is None else sum(d.replica_states.get("RUNNING", 0) for d in status.deployments.values())
        if running >= count:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"{app}: {running} of {count} replicas running after {timeout_s} s")
        time.sleep(0.5)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])

