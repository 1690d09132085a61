"""The server against hostile or careless clients: text that is not Unicode, too many or too
long stop strings, requests sent too slowly, and what the API key and the Host header guard."""

from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st

from serving.sampling_params import MAX_STOP_LENGTH, MAX_STOP_STRINGS, SamplingParams
from serving.server.cli import parser
from serving.server.settings import ServerSettings
from serving.stop_strings import find_stop, held_back
from tests.live_server import MODEL, LiveServer, live_server, read_until

KEY = "hardening-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
HEADER_TIMEOUT, BODY_TIMEOUT = 1.0, 3.0
"""The deadlines of this module's server, lowered from their defaults; a second from each step of
a test that must fall between them, so a loaded machine's late wake-ups cannot move it across one."""
LATE = 3.0
"""How long after its deadline a loaded machine may close a connection (the lower bounds are exact)."""
COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
VATTN = Path(sys.executable).parent / "vattn"


@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    with live_server(api_key=KEY, header_timeout=HEADER_TIMEOUT, body_timeout=BODY_TIMEOUT) as running:
        yield running


def post(server: LiveServer, path: str, **fields: Any) -> httpx.Response:
    body = {"model": MODEL, "max_tokens": 2, **fields}
    return httpx.post(f"{server.url}{path}", json=body, headers=AUTH, timeout=60)


def post_json_text(server: LiveServer, path: str, fields: str) -> httpx.Response:
    """Posts a body written as JSON text, for escapes that json.dumps would never write."""
    body = f'{{"model": "{MODEL}", "max_tokens": 2, {fields}}}'
    return httpx.post(f"{server.url}{path}", content=body, headers={**AUTH, "content-type": "application/json"})


def assert_error(response: httpx.Response, status: int, param: str) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error: dict[str, Any] = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["param"] == param, error
    assert param in error["message"], error
    return error


# ------------------------------------------------------------------ text that is not Unicode

LONE_SURROGATES = [
    # (case, path, JSON fields with a `\ud800`-style escape, the field the error names)
    ("prompt", COMPLETIONS, r'"prompt": "a\ud800"', "prompt"),
    ("one of several prompts", COMPLETIONS, r'"prompt": ["fine", "a\udfff b"]', "prompt[1]"),
    ("stop", COMPLETIONS, r'"prompt": "Hi", "stop": "\ud800"', "stop"),
    ("one of several stops", COMPLETIONS, r'"prompt": "Hi", "stop": ["x", "\udc00"]', "stop[1]"),
    ("chat message", CHAT, r'"messages": [{"role": "user", "content": "a\ud800"}]', "messages[0].content"),
    (
        "chat content part",
        CHAT,
        r'"messages": [{"role": "user", "content": [{"type": "text", "text": "\udbff"}]}]',
        "messages[0].content[0].text",
    ),
]


@pytest.mark.parametrize(
    ("path", "fields", "param"), [c[1:] for c in LONE_SURROGATES], ids=[c[0] for c in LONE_SURROGATES]
)
def test_lone_surrogates_are_400_naming_the_field(server: LiveServer, path: str, fields: str, param: str) -> None:
    assert "surrogate" in assert_error(post_json_text(server, path, fields), 400, param)["message"]


def test_surrogate_pairs_are_text(server: LiveServer) -> None:
    response = post_json_text(server, COMPLETIONS, r'"prompt": "a \ud83d\ude00", "stop": "\ud83d\ude00"')
    assert response.status_code == 200, response.text


# ------------------------------------------------------------------ stop strings


def test_stop_strings_are_bounded(server: LiveServer) -> None:
    five = [str(i) for i in range(MAX_STOP_STRINGS + 1)]
    many = assert_error(post(server, COMPLETIONS, prompt="Hi", stop=five), 400, "stop")
    assert f"at most {MAX_STOP_STRINGS}" in many["message"]
    chat = [{"role": "user", "content": "Hi"}]
    long = assert_error(post(server, CHAT, messages=chat, stop="x" * (MAX_STOP_LENGTH + 1)), 400, "stop")
    assert f"at most {MAX_STOP_LENGTH} characters" in long["message"]
    most = post(server, COMPLETIONS, prompt="Hi", stop=["y" * MAX_STOP_LENGTH] * MAX_STOP_STRINGS)
    assert most.status_code == 200, most.text
    with pytest.raises(ValueError, match="stop"):  # the offline API has the same bounds
        SamplingParams(stop=["a"] * (MAX_STOP_STRINGS + 1))


def test_a_stop_string_split_over_tokens_is_found() -> None:
    text, cuts = "", []
    for piece in (" The capital is Pa", "ris", ". It is"):  # each token's new text
        text += piece
        cuts.append(find_stop(text, len(piece), ("Paris.",)))
    assert cuts == [None, None, text.index("Paris.")]


@given(
    pieces=st.lists(st.text("ab", max_size=6), max_size=12),
    stops=st.lists(st.text("ab", min_size=1, max_size=5), min_size=1, max_size=MAX_STOP_STRINGS),
)
def test_the_windowed_search_finds_what_a_whole_text_search_does(pieces: list[str], stops: list[str]) -> None:
    """Text grows a token's piece at a time and is searched after each; the search stops at the first find."""
    text = ""
    for piece in pieces:
        text += piece
        whole = min((i for stop in stops if (i := text.find(stop)) >= 0), default=None)
        assert find_stop(text, len(piece), tuple(stops)) == whole
        may_begin_a_stop = max(
            (n for stop in stops for n in range(1, min(len(stop) - 1, len(text)) + 1) if text.endswith(stop[:n])),
            default=0,
        )
        assert held_back(text, tuple(stops)) == may_begin_a_stop
        if whole is not None:
            break


# ------------------------------------------------------------------ slow clients


def server_port(server: LiveServer) -> int:
    return int(server.url.rsplit(":", 1)[1])


def raw_connection(server: LiveServer) -> socket.socket:
    return socket.create_connection(("127.0.0.1", server_port(server)), timeout=BODY_TIMEOUT + 5)


def request_head(port: int, length: int) -> bytes:
    return (
        f"POST {COMPLETIONS} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nAuthorization: Bearer {KEY}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {length}\r\n\r\n"
    ).encode()


def read_response(sock: socket.socket) -> tuple[bytes, bytes]:
    """One response's head and body (of its Content-Length)."""
    data = b""
    while True:
        head, end, body = data.partition(b"\r\n\r\n")
        if end and len(body) >= int(re.search(rb"content-length: (\d+)", head, re.IGNORECASE)[1]):  # type: ignore[index]
            return head, body
        chunk = sock.recv(65536)
        assert chunk, f"the server closed the connection after {data!r}"
        data += chunk


def test_a_half_sent_body_gets_408(server: LiveServer) -> None:
    with raw_connection(server) as sock:
        sock.sendall(request_head(server_port(server), 100) + b'{"model": ')
        start = time.monotonic()
        head, body = read_response(sock)
        elapsed = time.monotonic() - start
        assert sock.recv(65536) == b""  # closed
    assert head.startswith(b"HTTP/1.1 408") and b"connection: close" in head.lower(), head
    assert json.loads(body)["error"]["type"] == "timeout" and BODY_TIMEOUT - 0.2 < elapsed < BODY_TIMEOUT + LATE


def seconds_until_closed(sock: socket.socket, drip: bytes) -> float:
    """Sends `drip` a byte every 0.1 s (then nothing) until the server closes the connection."""
    start, rest = time.monotonic(), iter(drip)
    sock.settimeout(0.1)
    while time.monotonic() - start < HEADER_TIMEOUT + LATE + 2:
        try:
            if (byte := next(rest, None)) is not None:
                sock.sendall(bytes([byte]))
            if sock.recv(65536) == b"":
                return time.monotonic() - start
        except TimeoutError:
            continue
        except ConnectionError:
            return time.monotonic() - start
    raise AssertionError("the server kept the connection open")


@pytest.mark.parametrize(
    ("sent", "drip"),
    [
        (b"", b""),
        (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0", b""),
        (b"GET /health HTTP/1.1\r\n", b"X: " * 100),
        (b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\nGET /health HTTP/1.1\r\n", b""),
    ],
    ids=["nothing", "half a header line", "a byte every 0.1 s", "the next request on a kept-alive connection"],
)
def test_headers_sent_too_slowly_close_the_connection(server: LiveServer, sent: bytes, drip: bytes) -> None:
    with raw_connection(server) as sock:
        sock.sendall(sent)
        assert HEADER_TIMEOUT - 0.2 < seconds_until_closed(sock, drip) < HEADER_TIMEOUT + LATE


def test_slow_but_timely_requests_are_served(server: LiveServer) -> None:
    """The header deadline runs for each request on a connection, and stops once its headers are in."""
    with raw_connection(server) as sock:
        for _ in range(5):  # one kept-alive connection, for longer than one deadline
            time.sleep(HEADER_TIMEOUT / 4)
            sock.sendall(f"GET /health HTTP/1.1\r\nHost: 127.0.0.1:{server_port(server)}\r\n\r\n".encode())
            assert read_response(sock)[0].startswith(b"HTTP/1.1 200")
        body = json.dumps({"model": MODEL, "prompt": "Hi", "max_tokens": 1}).encode()
        sock.sendall(request_head(server_port(server), len(body)) + body[:10])
        time.sleep((HEADER_TIMEOUT + BODY_TIMEOUT) / 2)  # past the header deadline, within the body's
        sock.sendall(body[10:])
        assert read_response(sock)[0].startswith(b"HTTP/1.1 200")


def test_sigterm_does_not_wait_for_half_sent_requests() -> None:
    """With the default deadlines: shutdown drops requests still sending their headers or body."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    small = ["--max-slots", "2", "--max-context", "128", "--kv-budget", "32M"]
    command = [str(VATTN), "serve", "--port", str(port), *small, "--api-key", KEY]
    server = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        log = read_until(server, "ready:")
        assert any("--api-key" in line and "VATTN_API_KEY" in line and "WARNING" in line for line in log), log
        address = ("127.0.0.1", port)
        with socket.create_connection(address) as half_body, socket.create_connection(address) as half_head:
            half_body.sendall(request_head(port, 100) + b'{"model": ')
            half_head.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.")
            time.sleep(0.5)
            start = time.monotonic()
            server.send_signal(signal.SIGTERM)
            assert server.wait(15) in (0, -signal.SIGTERM)
            assert time.monotonic() - start < 5
    finally:
        server.kill()
        server.wait()


# ------------------------------------------------------------------ the API key and the Host header


@pytest.mark.parametrize("path", ["/openapi.json", "/docs", "/redoc", "/v1/models"])
def test_everything_but_health_and_metrics_needs_the_key(server: LiveServer, path: str) -> None:
    refused = httpx.get(f"{server.url}{path}")
    assert refused.status_code == 401 and refused.json()["error"]["type"] == "invalid_api_key"
    assert httpx.get(f"{server.url}{path}", headers=AUTH).status_code == 200
    for open_path in ("/health", "/metrics"):
        assert httpx.get(f"{server.url}{open_path}").status_code == 200


def test_a_loopback_server_refuses_other_host_names(server: LiveServer) -> None:
    port = server_port(server)
    for host in ("evil.example", f"evil.example:{port}", f"127.0.0.1.evil.example:{port}"):
        assert httpx.get(f"{server.url}/health", headers={"Host": host}).status_code == 400, host
    for host in (f"localhost:{port}", "127.0.0.1", f"[::1]:{port}", "LOCALHOST"):
        assert httpx.get(f"{server.url}/health", headers={"Host": host}).status_code == 200, host


def test_allowed_hosts_defaults_and_option() -> None:
    loopback = ("localhost", "127.0.0.1", "[::1]")
    assert ServerSettings().trusted_hosts == ServerSettings(host="::1").trusted_hosts == loopback
    assert ServerSettings(host="0.0.0.0").trusted_hosts == ("*",)
    assert ServerSettings(host="0.0.0.0", allowed_hosts=("api.example",)).trusted_hosts == ("api.example",)
    args = parser().parse_args(["serve", "--allowed-hosts", "api.example, *.internal.example,[::1]"])
    assert args.allowed_hosts == ("api.example", "*.internal.example", "[::1]")


def test_api_key_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    key_file = tmp_path / "key"
    key_file.write_text("s3cret\n")
    assert parser().parse_args(["serve", "--api-key-file", str(key_file)]).api_key_file == "s3cret"
    with pytest.raises(SystemExit) as exit_info:  # one way to give the key, not two
        parser().parse_args(["serve", "--api-key", "a", "--api-key-file", str(key_file)])
    assert exit_info.value.code == 2 and "not allowed with" in capsys.readouterr().err
    key_file.write_text("\n")
    for path, words in ((key_file, "is empty"), (tmp_path / "missing", "cannot read")):
        with pytest.raises(SystemExit) as exit_info:
            parser().parse_args(["serve", "--api-key-file", str(path)])
        error = capsys.readouterr().err
        assert exit_info.value.code == 2 and "--api-key-file" in error and words in error, error
