"""`vattn serve`: its options, its size arguments, and a real start that logs when ready."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from serving.config import EngineConfig
from serving.default_model import ensure_default_model
from serving.server.cli import main, parser
from serving.server.cli_args import size
from tests.live_server import read_until

VATTN = Path(sys.executable).parent / "vattn"


def test_help_lists_every_option() -> None:
    result = subprocess.run([str(VATTN), "serve", "--help"], capture_output=True, text=True, timeout=60, check=True)
    for option in (
        *("--model", "--dtype", "--host", "--port", "--page-size", "--max-slots", "--kv-budget", "--api-key"),
        *("--api-key-file", "--allowed-hosts", "--header-timeout", "--body-timeout", "--shutdown-timeout"),
        *("--prefix-caching", "--no-prefix-caching", "--prefix-cache-share"),
    ):
        assert option in result.stdout, option


def test_sizes_and_defaults() -> None:
    assert [size(s) for s in ("65536", "64K", "64KiB", "2M", "1G", "512MB")] == [
        65536,
        65536,
        65536,
        2 << 20,
        1 << 30,
        512 << 20,
    ]
    args = parser().parse_args(["serve"])
    assert args.host == "127.0.0.1" and args.port == 8000 and args.api_key is None


@pytest.mark.parametrize(
    "argv",
    [
        ["serve", "--kv-budget", "lots"],
        ["serve", "--max-slots", "0"],
        ["serve", "-x"],
        ["serve", "--body-timeout", "0"],
        ["serve", "--header-timeout", "inf"],
        ["serve", "--allowed-hosts", "api*.example"],
        ["serve", "--allowed-hosts", ","],
        ["serve", "--prefix-cache-share", "1.5"],
    ],
)
def test_bad_arguments_exit_with_a_message(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        parser().parse_args(argv)
    assert exit_info.value.code == 2 and "error:" in capsys.readouterr().err


def test_a_kernel_of_the_other_cache_exits_with_a_message(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--kv-cache", "paged", "--kernel", "ragged"])
    assert exit_info.value.code == 2 and "does not run on the paged KV cache" in capsys.readouterr().err


def test_prefix_caching_on_the_paged_cache_exits_with_a_message(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--kv-cache", "paged", "--prefix-caching"])
    assert exit_info.value.code == 2 and "the paged baseline has none" in capsys.readouterr().err


HEAVY = ("transformers", "fastapi", "uvicorn", "llguidance", "msgspec", "zmq", "tokenizers")
"""What `--help` must not import (the model's and the server's libraries): it answers at once."""


def test_help_shows_defaults_quickly() -> None:
    probe = "import sys\nfrom serving.server.cli import main\ntry:\n    main(['serve', '--help'])\n"
    probe += f"except SystemExit:\n    print(sorted(m for m in {HEAVY!r} if m in sys.modules), file=sys.stderr)"
    imported = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True)
    assert imported.stderr.strip() == "[]", imported.stderr
    result = subprocess.run([str(VATTN), "serve", "--help"], capture_output=True, text=True, timeout=60, check=True)
    text = " ".join(result.stdout.split())
    for default in ("(default: auto)", "(default: 8000)", "(default: 1G)", "(default: host)", "(default: 64)"):
        assert default in text, default


def test_a_model_that_is_not_there_exits_with_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "/no/such/model"])
    assert exit_info.value.code == 2 and "no such safetensors folder" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["serve", "/no/such/model", "--model", "/another"])
    assert "given twice" in capsys.readouterr().err


def test_a_model_that_fails_to_load_ends_the_server(tmp_path: Path) -> None:
    """A folder without a model: the server stops with one error line and exit status 1."""
    command = [str(VATTN), "serve", str(tmp_path), "--port", "0", "--log-level", "warning"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith("vattn serve: error: the model failed to load:")


@pytest.mark.parametrize(
    ("kv_cache", "announced"), [("virtual", "64 KiB pages, prefix caching on"), ("paged", "16-token blocks")]
)
def test_serve_logs_ready_and_answers_on_loopback(kv_cache: str, announced: str) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    small = ["--max-slots", "2", "--max-context", "128", "--kv-budget", "32M", "--kv-cache", kv_cache]
    model = [str(ensure_default_model())] if kv_cache == "paged" else []  # vLLM's positional form, once
    command = [str(VATTN), "serve", *model, "--port", str(port), *small]
    env = {**os.environ, "VATTN_API_KEY": "k"}
    server = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        log = read_until(server, "ready:")
        assert any(f"ready: SmolLM2-135M-Instruct on http://127.0.0.1:{port}/v1" in line for line in log), log
        assert any(f"2 slots, 32 MiB KV budget, {kv_cache} KV cache, {announced}" in line for line in log), log
        chosen = EngineConfig(kv_cache=kv_cache)  # dtype auto, as the server resolves it on this CPU
        kv = str(chosen.kv_torch_dtype).removeprefix("torch.")
        assert any(f"({chosen.dtype}, {kv} KV, projections {chosen.projections}," in line for line in log), log
        assert httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200
        assert httpx.get(f"http://127.0.0.1:{port}/v1/models").status_code == 401  # the key came from the env
        completion = httpx.post(
            f"http://127.0.0.1:{port}/v1/completions",
            json={
                "model": "SmolLM2-135M-Instruct",
                "prompt": "The capital of France is",
                "max_tokens": 8,
                "temperature": 0,
            },
            headers={"Authorization": "Bearer k"},
            timeout=60,
        )
        assert completion.status_code == 200 and "Paris" in completion.json()["choices"][0]["text"]
    finally:
        server.terminate()
        assert server.wait(60) in (0, -signal.SIGTERM)  # uvicorn shuts down, then re-raises the signal
    assert "Finished server process" in server.stdout.read()  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--model", "synthetic:tiny", "--model", "synthetic:paper", "--kv-cache", "paged"], "virtual KV cache only"),
        (["--model", "synthetic:tiny", *["--served-model-name", "a"] * 2], "2 --served-model-name"),
        (["--model", "synthetic:tiny", "--model", "no/such/folder"], "no such safetensors folder"),
        (["--model", "synthetic:tiny", "--model", "synthetic:tiny"], "two models are served under one name"),
        (["--model", "synthetic:tiny", "--model-config", "tiny={}"], "names 'tiny', which is not served"),
        (["--model", "synthetic:tiny", "--model-config", "synthetic:tiny=[1]"], "must be a JSON object"),
        (["--model", "synthetic:tiny", "--model-config", "synthetic:tiny={"], "not JSON"),
        (["--model", "synthetic:tiny", "--model-config", "{}"], "give NAME=JSON"),
        (["--model", "synthetic:tiny", "--model-config", 'synthetic:tiny={"kv_budget": 1}'], "the same for every"),
        (["--model", "synthetic:tiny", "--model-config", 'synthetic:tiny={"slots": 1}'], "no option slots"),
        (["--model", "synthetic:tiny", "--model-config", 'synthetic:tiny={"dtype": "x"}'], "dtype must be one of"),
    ],
)
def test_bad_sets_of_models_exit_with_a_message(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", *argv])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err
