"""`vattn serve`: the OpenAI-compatible server on the command line."""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Sequence
from dataclasses import fields

from serving.config import EngineConfig
from serving.server.settings import ServerSettings
from vattn.backends import BACKENDS
from vattn.config import DTYPES
from vattn.kernels import KERNELS
from vattn.sizes import parse_size


def size(text: str) -> int:
    """Bytes from '65536', '64K', '64KiB', '1G', '512MB' (binary units), for argparse."""
    try:
        return parse_size(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from error


def positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def parser() -> argparse.ArgumentParser:
    defaults, server = EngineConfig(), ServerSettings()
    root = argparse.ArgumentParser(prog="vattn", description="vattn: LLM serving on a virtual-memory KV cache")
    commands = root.add_subparsers(dest="command", required=True)
    serve = commands.add_parser(
        "serve",
        help="serve a model over an OpenAI-compatible HTTP API",
        description="Serve a model over an OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, "
        "/v1/models, /health, /metrics).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    serve.add_argument("--model", help="safetensors folder or .gguf file; None: SmolLM2-135M-Instruct")
    serve.add_argument("--served-model-name", help="the name clients send as `model`; None: the model's own")
    serve.add_argument("--dtype", default=defaults.dtype, choices=list(DTYPES))
    serve.add_argument("--host", default=server.host, help="address to bind; 0.0.0.0 exposes the server")
    serve.add_argument("--port", type=int, default=server.port)
    serve.add_argument("--page-size", type=size, default=defaults.page_size, help="physical KV page size")
    serve.add_argument("--max-slots", type=positive, default=defaults.max_slots, help="requests running at once")
    serve.add_argument(
        "--max-context", type=positive, default=defaults.max_context, help="prompt + output tokens per request"
    )
    serve.add_argument(
        "--max-batched-tokens", type=positive, default=defaults.max_batched_tokens, help="tokens per iteration"
    )
    serve.add_argument("--kv-budget", type=size, default=defaults.kv_budget, help="physical bytes for the KV cache")
    serve.add_argument("--backend", default=defaults.backend, choices=BACKENDS)
    serve.add_argument("--kernel", default=defaults.kernel, choices=list(KERNELS), help="attention kernel")
    serve.add_argument("--max-queue", type=int, default=server.max_queue, help="requests that may wait; more get 429")
    serve.add_argument("--max-body-size", type=size, default=server.max_body_bytes, help="largest request body")
    serve.add_argument(
        "--api-key",
        help="require 'Authorization: Bearer <key>' on /v1/*; read from $VATTN_API_KEY when unset",
    )
    serve.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    return root


def main(argv: Sequence[str] | None = None) -> None:
    args = parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    import uvicorn

    from serving.server.app import build_app

    settings = ServerSettings(
        engine_config=EngineConfig(
            **{f.name: getattr(args, f.name) for f in fields(EngineConfig) if hasattr(args, f.name)}
        ),
        model_name=args.served_model_name,
        api_key=args.api_key or os.environ.get("VATTN_API_KEY"),  # not a default: --help would print it
        max_queue=args.max_queue,
        max_body_bytes=args.max_body_size,
        host=args.host,
        port=args.port,
    )
    uvicorn.run(build_app(settings), host=args.host, port=args.port, log_level=args.log_level)


if __name__ == "__main__":
    main()
