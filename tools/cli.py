"""The `writescope` command line.

    writescope generate --model tiny-qwen3-moe --prompt "Hello" --max-new-tokens 32
    writescope bench e2e --contexts 8192 --batches 1        (cpu | gpu | e2e | orchestration | split; the
                                                             tool's flags follow)
    writescope bench split --contexts 4096 16384 --batches 1 4
    writescope calibrate --model tiny-qwen3-moe
    writescope simulate --profiles a100-pcie-gen4
    writescope serve --model tiny-qwen3-moe --port 8000
    writescope batch --model tiny-qwen3-moe --input prompts.jsonl --output results.jsonl
    writescope numa-scaling --workers 1 2

`writescope COMMAND --help` lists every flag of a command.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import signal
import sys
import time

from writescope.config import EngineConfig

BENCHES = {"cpu": "writescope.tools.bench_cpu_attention", "gpu": "writescope.tools.bench_gpu_attention",
           "e2e": "writescope.tools.bench_e2e", "orchestration": "writescope.tools.bench_orchestration",
           "split": "writescope.tools.bench_split", "contention": "writescope.tools.bench_contention"}
# Commands that are whole tools: their own parser takes the rest of the command line.
DELEGATED = {"simulate": "writescope.tools.simulate_policies", "numa-scaling": "writescope.tools.numa_scaling",
             "batch": "writescope.actors.batch_job", "demo": "writescope.tools.demo"}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="writescope", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    generate = commands.add_parser("generate", help="generate from one prompt, printing tokens as they come")
    EngineConfig.add_arguments(generate)
    generate.add_argument("--prompt", required=True, help="prompt text, or @FILE to read it from a file")
    generate.add_argument("--max-new-tokens", type=int, default=32, help="tokens to generate")
    generate.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    generate.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    generate.add_argument("--seed", type=int, default=None, help="sampling seed")
    generate.add_argument("--executor", default="local", choices=["local", "ray"],
                          help="local: this process; ray: the engine's actors on an embedded local Ray")

    calibrate = commands.add_parser("calibrate", help="measure A, B and the fixed costs of this machine (cached)")
    EngineConfig.add_arguments(calibrate, exclude=("policy",))  # calibration times the engine's own sides
    calibrate.add_argument("--force", action="store_true", help="measure again even if cached")

    serve_cmd = commands.add_parser("serve", help="run the OpenAI-compatible Serve app until Ctrl-C")
    EngineConfig.add_arguments(serve_cmd)
    serve_cmd.add_argument("--host", default="127.0.0.1", help="HTTP host (beyond loopback needs an API key)")
    serve_cmd.add_argument("--port", type=int, default=8000, help="HTTP port")
    serve_cmd.add_argument("--max-queue", type=int, default=64, help="requests waiting for KV capacity before 429")
    serve_cmd.add_argument("--api-key-env", default="WRITESCOPE_API_KEY",
                           help="environment variable holding the API key (required beyond loopback)")
    serve_cmd.add_argument("--address", default=None, help="a Ray cluster to use (default: an embedded local Ray)")
    serve_cmd.add_argument("--max-body-bytes", type=int, default=None,
                           help="largest request body accepted (default: 64 KiB + 32 bytes per max_seq_len token)")
    serve_cmd.add_argument("--chat-template", default=None,
                           help="a Jinja chat template (a file, or its text) replacing the checkpoint's")
    serve_cmd.add_argument("--served-model-name", default=None,
                           help="the model name clients send (default: the checkpoint directory's name)")

    bench = commands.add_parser("bench", help="a benchmark (cpu | gpu | e2e | orchestration | split | contention), "
                                "then its own flags")
    bench.add_argument("which", choices=list(BENCHES), help="which benchmark")
    bench.add_argument("rest", nargs=argparse.REMAINDER, help="the benchmark's flags (see `writescope bench X -h`)")

    for name, module in DELEGATED.items():
        sub = commands.add_parser(name, help=f"{module.rsplit('.', 1)[-1]}: its own flags follow",
                                  add_help=False)
        sub.add_argument("rest", nargs=argparse.REMAINDER, help="the tool's flags (`-h` for them)")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    # Whole tools take the rest of the line with their own parser (so `-h` shows their flags).
    if argv and argv[0] in DELEGATED:
        return _delegate(DELEGATED[argv[0]], argv[1:])
    if len(argv) > 1 and argv[0] == "bench" and argv[1] in BENCHES:
        return _delegate(BENCHES[argv[1]], argv[2:])
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return {"generate": _generate, "calibrate": _calibrate, "serve": _serve}[args.command](args)
    except ValueError as error:  # bad input (a model, a prompt, a flag's value): said plainly, no traceback
        parser.exit(2, f"writescope {args.command}: error: {error}\n")


def _delegate(module: str, argv: list[str]) -> int:
    result = importlib.import_module(module).main(argv)
    return result if isinstance(result, int) else 0


def _generate(args) -> int:
    from writescope.engine import Engine

    prompt = args.prompt
    if prompt.startswith("@"):
        with open(prompt[1:]) as f:
            prompt = f.read()
    # executor ray: the running cluster of RAY_ADDRESS, or an embedded local one (Engine.from_pretrained finds it)
    engine = Engine.from_pretrained(config=EngineConfig.from_args(args, max_batch_size=1), executor=args.executor)
    try:
        for event in engine.generate_stream(prompt, max_new_tokens=args.max_new_tokens,
                                            temperature=args.temperature, top_p=args.top_p, seed=args.seed):
            sys.stdout.write(event.text)
            sys.stdout.flush()
        sys.stdout.write("\n")
    finally:
        engine.shutdown()
    return 0


def _calibrate(args) -> int:
    from writescope.engine import Engine

    config = EngineConfig.from_args(args, policy="all_cpu")  # any fixed policy: calibrate() times both sides
    engine = Engine.from_config(config)
    try:
        model = engine.calibrate(force=args.force)
    finally:
        engine.shutdown()
    print(json.dumps({"model": args.model, "device": args.device, "batch": args.max_batch_size, **vars(model),
                      "r_star_at_32k": model.optimal_share(32768)}, indent=2))
    return 0


def _serve(args) -> int:
    from writescope.actors.local_ray import start_local_ray

    if args.address:
        import ray

        ray.init(address=args.address)
    else:
        start_local_ray()  # before Ray is imported: the embedded cluster then binds loopback only
    import ray
    from ray import serve

    from writescope.actors.serve_app import build_app

    serve.start(http_options={"host": args.host, "port": args.port})
    app_args = {**EngineConfig.from_args(args).to_dict(), "max_queue": args.max_queue,
                "api_key_env": args.api_key_env, "max_body_bytes": args.max_body_bytes,
                "chat_template": args.chat_template, "served_model_name": args.served_model_name}
    serve.run(build_app(app_args), name="writescope", route_prefix="/")
    logging.getLogger("writescope.serve").info("serving on http://%s:%d/v1 (Ctrl-C stops)", args.host, args.port)
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(True))
    try:
        while not stop:
            time.sleep(1)
    except KeyboardInterrupt:
        pass
    finally:
        serve.shutdown()
        ray.shutdown()  # the embedded cluster goes: its actors' processes (and their shared memory) with it
    return 0


if __name__ == "__main__":
    sys.exit(main())
