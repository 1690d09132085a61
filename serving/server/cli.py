"""`vattn serve`: the OpenAI-compatible server on the command line."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import threading
from collections.abc import Sequence
from dataclasses import fields, replace
from pathlib import Path

from serving.config import KV_CACHE_DTYPES, KV_CACHES, MODEL_DTYPES, QUANTIZATIONS, EngineConfig
from serving.model.synthetic import SYNTHETIC_MODELS, is_synthetic, synthetic_spec
from serving.server.cli_args import (
    DefaultsHelpFormatter,
    host_names,
    key_file,
    kv_events_config,
    model_config,
    positive,
    seconds,
    share,
    size,
)
from serving.server.replicas import ROUTERS, ReplicaPlan, parse_serve_args
from serving.server.replicas import run as run_replicas
from serving.server.settings import LOOPBACK_HOSTS, ServerSettings
from vattn.backends import BACKENDS
from vattn.kernels import KERNELS
from vattn.paged import PAGED_KERNELS
from vattn.sizes import size_label

log = logging.getLogger("vattn.serve")


def parser() -> argparse.ArgumentParser:
    defaults, server = EngineConfig(), ServerSettings()
    root = argparse.ArgumentParser(prog="vattn", description="vattn: LLM serving on a virtual-memory KV cache")
    commands = root.add_subparsers(dest="command", required=True)
    serve = commands.add_parser(
        "serve",
        help="serve a model over an OpenAI-compatible HTTP API",
        description="Serve a model over an OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, "
        "/v1/models, /health, /metrics, and /version and /get_load for routers).",
        formatter_class=DefaultsHelpFormatter,
    )
    serve.add_argument("model_tag", nargs="?", metavar="MODEL", help="the model, as --model (vLLM's positional form)")
    serve.add_argument(
        "--model",
        action="append",
        help="safetensors folder, .gguf file, or synthetic:NAME, a random-weight model built on the spot (NAME: "
        f"{', '.join(SYNTHETIC_MODELS)}) (default: SmolLM2-135M-Instruct). Repeated: several models in one "
        "server, each an engine with the other options, their KV caches sharing one --kv-budget",
    )
    serve.add_argument(
        "--served-model-name",
        action="append",
        help="the name clients send as `model` (default: the model's own); repeated, one per --model in order",
    )
    serve.add_argument(
        "--model-config",
        action="append",
        type=model_config,
        metavar="NAME=JSON",
        help="one served model's own engine options, where they differ from the command line's, as a JSON "
        'object of EngineConfig fields, e.g. tiny=\'{"dtype": "float32", "max_slots": 8}\' (repeated, one '
        "per model; model, kv_budget, backend, kv_cache and tensor_parallel_size are every model's alike)",
    )
    serve.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", *MODEL_DTYPES],
        help="weights and KV precision; auto: bfloat16 (the LM head in float32) where the CPU does bf16 "
        "natively (AVX512_BF16, AMX) and no --quantization is given, bfloat16 on a GPU, else float32 "
        "(over a float16 KV cache where the ragged kernel reads one and no --kv-cache-dtype is given); "
        "float32: exact, its KV too",
    )
    serve.add_argument("--host", default=server.host, help="address to bind; 0.0.0.0 exposes the server")
    serve.add_argument("--port", type=int, default=server.port, help="port to bind")
    serve.add_argument(
        "--kv-cache",
        default=defaults.kv_cache,
        choices=KV_CACHES,
        help="virtual: vattn's virtually contiguous cache; paged: the block-table baseline",
    )
    serve.add_argument(
        "--page-size",
        type=size,
        help="physical KV page size (virtual; default 2M on CUDA; on the host 64K, or larger where a "
        "--kv-budget of 64K pages would need more mappings than vm.max_map_count allows)",
    )
    serve.add_argument("--block-size", type=positive, default=defaults.block_size, help="tokens per KV block (paged)")
    serve.add_argument(
        "--prefix-caching",
        action=argparse.BooleanOptionalAction,
        help="map the KV pages of prompt prefixes seen before instead of computing them (default: on with "
        "the virtual cache; the paged one has none)",
    )
    serve.add_argument(
        "--prefix-cache-share",
        type=share,
        default=defaults.prefix_cache_share,
        help="the most of --kv-budget that cached prefixes no running request maps may hold; past it the "
        "least recently used go (1.0: kept until their pages are needed, as in vLLM)",
    )
    serve.add_argument(
        "--kv-events-endpoint",
        metavar="ZMQ_ENDPOINT",
        help="publish the prefix cache's stores and evictions as vLLM's KV events on this ZMQ PUB endpoint, e.g. "
        "tcp://*:5557 (bound; a host without wildcard is connected to)",
    )
    serve.add_argument(
        "--kv-events-replay-endpoint", metavar="ZMQ_ENDPOINT", help="a ZMQ ROUTER endpoint that replays missed batches"
    )
    serve.add_argument("--kv-events-topic", default="", help="the topic frame of every KV events message")
    serve.add_argument(
        "--kv-events-config",
        type=kv_events_config,
        metavar="JSON",
        help='vLLM\'s form of the three above, e.g. \'{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557"}\'',
    )
    serve.add_argument(
        "--tensor-parallel-size",
        type=positive,
        default=defaults.tensor_parallel_size,
        help="ranks that split each layer's heads and MLP columns (torch.distributed: gloo on the CPU, NCCL on "
        "CUDA); it must divide the model's KV heads; --kv-budget is each rank's",
    )
    serve.add_argument(
        "--tp-init-method",
        metavar="URL",
        help="where the ranks meet, tcp://HOST:PORT on rank 0's machine (default: this machine, the other ranks "
        "started here); then start each other rank by hand with the same options and --tp-rank",
    )
    serve.add_argument("--tp-rank", type=int, default=0, help="run as this follower rank of --tp-init-method (no HTTP)")
    serve.add_argument("--max-slots", type=positive, default=defaults.max_slots, help="requests running at once")
    serve.add_argument(
        "--max-context", type=positive, default=defaults.max_context, help="prompt + output tokens per request"
    )
    serve.add_argument(
        "--max-batched-tokens", type=positive, default=defaults.max_batched_tokens, help="tokens per iteration"
    )
    serve.add_argument(
        "--reserve-tokens",
        type=int,
        default=defaults.reserve_tokens,
        help="output tokens of every running request that admission keeps KV room for",
    )
    serve.add_argument(
        "--kv-budget", type=size, default=size_label(defaults.kv_budget), help="physical bytes for the KV cache"
    )
    serve.add_argument(
        "--kv-preallocate",
        action=argparse.BooleanOptionalAction,
        default=defaults.kv_preallocate,
        help="allocate the KV pages at start, as vLLM does (--no-kv-preallocate: as first mapped)",
    )
    serve.add_argument(
        "--backend", default=defaults.backend, choices=BACKENDS, help="where KV pages live: host memory or CUDA"
    )
    serve.add_argument(
        "--kernel",
        default=defaults.kernel,
        choices=["auto", *KERNELS, *PAGED_KERNELS],
        help="attention kernel (the paged ones with --kv-cache paged)",
    )
    serve.add_argument(
        "--quantization",
        default="auto",
        choices=["auto", *QUANTIZATIONS],
        help="weights: none (as --dtype), bf16, int8 (weights and activations), int8_weight_only (weights in "
        "groups of 32, activations in int16: the float model's answers), q8_0 (llama.cpp's Q8_0 arithmetic: weights "
        "and activations int8 in groups of 32, ~1.7x int8_weight_only's multiplies on AVX-512 VNNI), gguf (a GGUF "
        "file's own quantized weights); auto: gguf for a .gguf model, else none",
    )
    serve.add_argument(
        "--kv-cache-dtype",
        default="auto",  # resolved with --dtype auto (serving.config)
        choices=KV_CACHE_DTYPES,
        help="KV cache precision: auto (as --dtype), float16 or bfloat16 (half a float32 model's KV bytes), "
        "int8 (a quarter, plus a float32 scale and midpoint per token and KV head, as OpenVINO's u8); the "
        "ragged kernel only, with a float32 model (int8 also with a bfloat16 one)",
    )
    serve.add_argument(
        "--enable-sleep-mode",
        action="store_true",
        help="vLLM's sleep mode: POST /sleep?level=1 gives the KV cache's pages back to the system (level 2 the "
        "weights too), POST /wake_up brings the engine back, GET /is_sleeping says which; the virtual cache only",
    )
    serve.add_argument("--max-queue", type=int, default=server.max_queue, help="requests that may wait; more get 429")
    serve.add_argument(
        "--max-body-size", type=size, default=size_label(server.max_body_bytes), help="largest request body"
    )
    serve.add_argument(
        "--header-timeout",
        type=seconds,
        default=server.header_timeout,
        help="seconds a connection has to send a request's headers; then it is closed",
    )
    serve.add_argument(
        "--body-timeout",
        type=seconds,
        default=server.body_timeout,
        help="seconds a request has to send its body; then 408",
    )
    serve.add_argument(
        "--shutdown-timeout",
        type=positive,
        default=server.shutdown_timeout,
        help="seconds requests in progress get to finish on SIGTERM",
    )
    serve.add_argument(
        "--allowed-hosts",
        type=host_names,
        help="Host headers to accept, comma-separated ('*': any) (default: "
        f"{','.join(LOOPBACK_HOSTS)} on a loopback --host, else any)",
    )
    key = serve.add_mutually_exclusive_group()
    key.add_argument(
        "--api-key",
        help="require 'Authorization: Bearer <key>' on all but /health, /metrics, /version and /get_load; read "
        "from $VATTN_API_KEY "
        "when unset (which, unlike this option, `ps` does not show)",
    )
    key.add_argument("--api-key-file", type=key_file, metavar="PATH", help="read the API key from this file")
    serve.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"), help="log detail")
    add_replicas_parser(commands)
    return root


def add_replicas_parser(commands: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    replicas = commands.add_parser(
        "replicas",
        help="serve N replicas on this machine behind vllm-router or SMG",
        description="Start N `vattn serve` replicas on 127.0.0.1 (ports from --first-replica-port), wait until "
        "each is healthy, start the router in front of them, and stop them all on SIGINT/SIGTERM. The routing "
        "is the router's; `make router` installs both routers. Options after `--` go to every replica.",
        formatter_class=DefaultsHelpFormatter,
    )
    replicas.add_argument("--replicas", type=positive, default=2, help="vattn serve processes")
    replicas.add_argument("--router", default="vllm-router", choices=ROUTERS, help="the router in front")
    replicas.add_argument(
        "--policy",
        default="cache_aware",
        help="the router's policy: vllm-router has cache_aware, round_robin, power_of_two, consistent_hash, "
        "random; smg also prefix_hash and least_load",
    )
    replicas.add_argument("--host", default="127.0.0.1", help="the router's address")
    replicas.add_argument("--port", type=positive, default=8000, help="the router's port")
    replicas.add_argument("--first-replica-port", type=positive, default=8001, help="replica i listens on this + i")
    replicas.add_argument(
        "--cpus-per-replica", type=positive, help="pin each replica to this many CPUs of its own (default: share all)"
    )
    replicas.add_argument("--router-bin", metavar="PATH", help="the router executable (default: PATH, then .peers)")
    replicas.add_argument(
        "--router-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="one more argument for the router, e.g. --router-arg=--cache-threshold=0.3 (repeatable)",
    )
    replicas.add_argument(
        "serve_args", nargs=argparse.REMAINDER, help="-- then `vattn serve` options for every replica"
    )


def main(argv: Sequence[str] | None = None) -> None:
    cli = parser()
    args = cli.parse_args(argv)
    if args.command == "replicas":
        sys.exit(replicas_main(cli, args))
    names, more_models = _served_models(cli, args)
    _merge_kv_events_config(cli, args)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.api_key:
        log.warning("--api-key shows in `ps` to every user of this machine: use $VATTN_API_KEY or --api-key-file")
    import uvicorn

    from serving.server.app import build_app
    from serving.server.connections import uvicorn_options

    try:
        engine_config = EngineConfig(
            **{f.name: getattr(args, f.name) for f in fields(EngineConfig) if hasattr(args, f.name)}
        )
    except ValueError as exc:
        cli.error(str(exc))
    if args.tp_rank:
        from serving.default_model import ensure_default_model
        from serving.executor import follow

        follow(replace(engine_config, model=engine_config.model or str(ensure_default_model())), args.tp_rank)
        return
    settings = ServerSettings(
        engine_config=engine_config,
        model_name=names[0] if names else None,
        more_models=more_models,
        model_options=tuple(args.model_config or ()),
        # $VATTN_API_KEY is not a default: --help would print it
        api_key=args.api_key or args.api_key_file or os.environ.get("VATTN_API_KEY"),
        max_queue=args.max_queue,
        max_body_bytes=args.max_body_size,
        header_timeout=args.header_timeout,
        body_timeout=args.body_timeout,
        shutdown_timeout=args.shutdown_timeout,
        allowed_hosts=args.allowed_hosts,
        host=args.host,
        port=args.port,
    )
    try:
        app = build_app(settings)
    except ValueError as exc:
        cli.error(str(exc))
    server = uvicorn.Server(uvicorn.Config(app, log_level=args.log_level, **uvicorn_options(settings)))
    engine = app.state.engine

    def stop_if_the_model_fails() -> None:
        if not engine.wait_ready() and engine.load_error is not None:
            server.should_exit = True

    threading.Thread(target=stop_if_the_model_fails, daemon=True).start()
    server.run()
    if engine.load_error is not None:
        sys.exit(f"vattn serve: error: the model failed to load: {engine.load_error}")


def _merge_kv_events_config(cli: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """vLLM's --kv-events-config sets the --kv-events-* options it names (a usage error if one disagrees)."""
    for name, value in (args.kv_events_config or {}).items():
        if getattr(args, name) not in (None, "", value):
            cli.error(f"--kv-events-config and --{name.replace('_', '-')} disagree")
        setattr(args, name, value)


def _served_models(
    cli: argparse.ArgumentParser, args: argparse.Namespace
) -> tuple[list[str], tuple[tuple[str, str | None], ...]]:
    """The served names given, and the models after the first with their names; sets
    `args.model` to the first model (None: the default model). Usage errors exit."""
    models: list[str] = args.model or []
    if args.model_tag is not None:
        if models and models[0] != args.model_tag:
            cli.error(f"the model is given twice, as {args.model_tag!r} and --model {models[0]!r}")
        models = models or [args.model_tag]
    names: list[str] = args.served_model_name or []
    if len(names) > max(len(models), 1):
        cli.error(f"{len(names)} --served-model-name for {len(models)} --model: give one per model, in order")
    for model in models:
        if problem := _model_problem(model):
            cli.error(problem)
    if len(models) > 1 and args.kv_cache != "virtual":
        cli.error("several models share one --kv-budget on the virtual KV cache only: drop --kv-cache paged")
    if len(models) > 1 and args.tensor_parallel_size > 1:
        cli.error("several models in one server run without tensor parallelism: drop --tensor-parallel-size")
    args.model = models[0] if models else None
    return names, tuple(zip(models[1:], names[1:] + [None] * len(models), strict=False))


def replicas_main(cli: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    logging.basicConfig(level="INFO", format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    serve_args = args.serve_args[1:] if args.serve_args[:1] == ["--"] else args.serve_args
    try:
        plan = ReplicaPlan(
            replicas=args.replicas,
            router=args.router,
            policy=args.policy,
            host=args.host,
            port=args.port,
            first_port=args.first_replica_port,
            serve_args=parse_serve_args(serve_args),
            cpus_per_replica=args.cpus_per_replica,
            router_bin=args.router_bin,
            router_args=tuple(args.router_arg),
        )
        return run_replicas(plan)
    except (ValueError, FileNotFoundError) as exc:
        cli.error(str(exc))
    except (RuntimeError, TimeoutError) as exc:
        sys.exit(f"vattn replicas: error: {exc}")


def _model_problem(model: str) -> str | None:
    """Why `model` cannot be served (None: it can be loaded)."""
    if is_synthetic(model):
        try:
            synthetic_spec(model)
        except ValueError as error:
            return str(error)
        return None
    path = Path(model)
    if path.is_dir() or (path.suffix == ".gguf" and path.is_file()):
        return None
    return f"model {model!r}: no such safetensors folder or .gguf file"


if __name__ == "__main__":
    main()
