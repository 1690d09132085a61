"""The engine without the server's and the optional features' libraries, as on the GPU image
(torch and transformers, but no msgspec, pyzmq, fastapi, pydantic, llguidance or uvicorn):
they are imported only when what needs them is asked for."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BLOCKED = ("msgspec", "zmq", "fastapi", "pydantic", "llguidance", "uvicorn")

SCRIPT = """
import json, sys

BLOCKED = {blocked!r}
for name in BLOCKED:  # as if not installed: `import name` raises ModuleNotFoundError
    sys.modules[name] = None

import serving
from serving import EngineConfig, LLMEngine, SamplingParams

small = dict(max_slots=2, max_context=128, max_batched_tokens=32, kv_budget=16 << 20)
engine = LLMEngine(EngineConfig(**small))
request = engine.add_request("The capital of France is", SamplingParams(max_tokens=4, temperature=0))
while engine.has_unfinished():
    engine.step()
output = engine.result(request)
engine.close()

refusals = []
try:
    LLMEngine(EngineConfig(**small, kv_events_endpoint="inproc://kv-events"))
except ImportError as error:
    refusals.append(str(error))
del sys.modules["msgspec"]  # msgspec back: pyzmq is still missing
try:
    import serving.kv_events
except ImportError as error:
    refusals.append(str(error))

result = dict(tokens=output.token_ids, text=output.text, error=output.error, refusals=refusals)
print(json.dumps(result))
"""


@pytest.mark.needs_model
def test_the_engine_runs_without_optional_libraries_and_events_name_what_is_missing() -> None:
    """In a fresh interpreter (a clean import state): `serving` imports, an engine is built and
    generates greedy tokens; asking for KV events names the missing package."""
    run = subprocess.run(
        [sys.executable, "-c", SCRIPT.format(blocked=BLOCKED)],
        cwd=Path(__file__).resolve().parents[1],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert run.returncode == 0, run.stderr
    result = json.loads(run.stdout.splitlines()[-1])
    assert result["error"] is None and len(result["tokens"]) == 4
    assert result["text"].startswith(" Paris")
    events_msgspec, events_pyzmq = result["refusals"]
    assert "KV events (kv_events_endpoint) need the msgspec package" in events_msgspec
    assert "KV events (kv_events_endpoint) need the pyzmq package" in events_pyzmq
    assert "pip install msgspec pyzmq" in events_pyzmq
