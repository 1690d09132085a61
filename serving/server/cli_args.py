"""The argument types and help formatter of `vattn serve` and `vattn replicas`: each turns one
option's text into its value or an argparse error that says what was expected."""

from __future__ import annotations

import argparse
import json
import math
from typing import Any

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


def share(text: str) -> float:
    value = float(text)
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"must be a share from 0 to 1, got {text}")
    return value


def seconds(text: str) -> float:
    value = float(text)
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"must be a number of seconds > 0, got {text}")
    return value


def host_names(text: str) -> tuple[str, ...]:
    """'a.example, *.b.example, [::1]' -> ('a.example', '*.b.example', '[::1]'); '*' is any host."""
    names = tuple(name.strip() for name in text.split(",") if name.strip())
    if not names or any(name != "*" and "*" in name.removeprefix("*.") for name in names):
        raise argparse.ArgumentTypeError(f"expected names like 'a.example', '*.a.example' or '*', got {text!r}")
    return names


KV_EVENTS_KEYS = {
    "endpoint": "kv_events_endpoint",
    "replay_endpoint": "kv_events_replay_endpoint",
    "topic": "kv_events_topic",
}


def kv_events_config(text: str) -> dict[str, str | None]:
    """vLLM's --kv-events-config JSON -> the EngineConfig fields it sets (none when not enabled)."""
    try:
        config = json.loads(text)
    except json.JSONDecodeError as error:
        raise argparse.ArgumentTypeError(f"not JSON: {error}") from error
    if not isinstance(config, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    unsupported = sorted(set(config) - {*KV_EVENTS_KEYS, "enable_kv_cache_events", "publisher"})
    if unsupported:
        raise argparse.ArgumentTypeError(f"unsupported keys {unsupported}; vattn reads {sorted(KV_EVENTS_KEYS)}")
    enabled = config.get("enable_kv_cache_events", False) and config.get("publisher", "zmq") == "zmq"
    if not enabled:
        return {}
    return {"kv_events_endpoint": "tcp://*:5557"} | {
        KV_EVENTS_KEYS[k]: v for k, v in config.items() if k in KV_EVENTS_KEYS
    }


def model_config(text: str) -> tuple[str, dict[str, Any]]:
    """NAME=JSON -> (served name, EngineConfig fields): one model's own settings."""
    name, equals, options = text.partition("=")
    if not equals or not name:
        raise argparse.ArgumentTypeError('give NAME=JSON, e.g. tiny=\'{"dtype": "float32", "max_slots": 8}\'')
    try:
        parsed = json.loads(options)
    except json.JSONDecodeError as error:
        raise argparse.ArgumentTypeError(f"{name}: not JSON: {error}") from error
    if not isinstance(parsed, dict):
        raise argparse.ArgumentTypeError(f"{name}: must be a JSON object of engine options")
    return name, parsed


def key_file(path: str) -> str:
    """The API key in a file (its trailing newline dropped)."""
    try:
        with open(path, encoding="utf-8") as file:
            key = file.read().rstrip("\r\n")
    except (OSError, UnicodeDecodeError) as error:
        raise argparse.ArgumentTypeError(f"cannot read the API key: {error}") from error
    if not key:
        raise argparse.ArgumentTypeError(f"{path} is empty")
    return key


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """Appends "(default: X)" to an option's help unless the default is None (the help says it) or
    the help names its default itself."""

    def _get_help_string(self, action: argparse.Action) -> str:
        help_text = action.help or ""
        if action.default in (None, argparse.SUPPRESS) or "default" in help_text or not action.option_strings:
            return help_text
        return f"{help_text} (default: %(default)s)"
