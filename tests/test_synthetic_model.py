"""The synthetic models: deterministic builds, a tokenizer made in code, the engine's greedy tokens on
every CPU kernel of both caches against transformers' own, the GPU check's CPU smoke run, and
`vattn serve` on one."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from benchmarks import gpu_model_check
from benchmarks.gpu_model_check import LONG_TOKENS, Run, engine_config, run_workload, workload
from measure.results import free_port
from serving.chat_template import chat_prompt_ids
from serving.model.llama import CausalLM
from serving.model.loader import load_model, model_shape
from serving.model.synthetic import SYNTHETIC_MODELS, build_tokenizer, load_synthetic, model_config
from serving.server.cli import main
from tests.live_server import read_until

VATTN = Path(sys.executable).parent / "vattn"
TINY = SYNTHETIC_MODELS["tiny"]
MAX_TOKENS = 12
COMBINATIONS = [("virtual", "ragged"), ("virtual", "sdpa"), ("paged", "paged"), ("paged", "paged_gather")]
PREFILLS = ("chunked", "whole")


def test_two_builds_are_equal_to_the_bit_in_every_dtype() -> None:
    (first, first_tokenizer), (second, second_tokenizer) = (
        load_synthetic("synthetic:tiny", torch.float32) for _ in "ab"
    )
    half, _ = load_synthetic("synthetic:tiny", torch.bfloat16)
    weights, again, rounded = first.state_dict(), second.state_dict(), half.state_dict()
    assert weights.keys() == again.keys() == rounded.keys()
    for name, tensor in weights.items():
        assert torch.equal(tensor, again[name]), name
        assert torch.equal(tensor, rounded[name].float()), name  # bfloat16-representable: the same numbers
    assert first_tokenizer.backend_tokenizer.to_str() == second_tokenizer.backend_tokenizer.to_str()
    assert first.model.rotary_emb.inv_freq.dtype == half.model.rotary_emb.inv_freq.dtype == torch.float32


def test_text_round_trips_through_the_tokenizer() -> None:
    tokenizer = build_tokenizer(TINY.vocab_size)
    assert len(tokenizer) == TINY.vocab_size
    for text in ("The quick brown fox jumps over the lazy dog.", "  tabs\tand\nnewlines  ", "héllo wörld — 你好 🙂"):
        ids = tokenizer.encode(text)
        assert ids[0] == tokenizer.bos_token_id and max(ids) < TINY.vocab_size
        assert tokenizer.decode(ids, skip_special_tokens=True) == text
    assert len(tokenizer.encode("the quick brown fox", add_special_tokens=False)) < len("the quick brown fox")  # merges
    ids = chat_prompt_ids(tokenizer, [{"role": "user", "content": "hi"}])
    assert tokenizer.decode(ids) == "<|begin_of_text|><|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_an_unknown_name_is_refused_with_the_names() -> None:
    with pytest.raises(ValueError, match="choose one of synthetic:tiny, synthetic:paper"):
        load_model("synthetic:huge", torch.float32)


def test_the_paper_model_has_the_papers_heads() -> None:
    """8 KV heads of 128 under 32 query heads (GQA); built on the meta device, no weights drawn."""
    model = CausalLM(model_config(SYNTHETIC_MODELS["paper"]))
    shape = model_shape(model)
    assert (shape.num_query_heads, shape.num_kv_heads, shape.head_dim) == (32, 8, 128)
    assert sum(p.numel() for p in model.parameters()) * 2 < 600e6  # bytes in bfloat16


def transformers_llama(model: CausalLM) -> LlamaForCausalLM:
    """transformers' own Llama holding `model`'s weights."""
    ours_only = ("model_type", "qkv_bias", "output_bias", "mlp_bias", "eos_token_ids")
    fields = {name: value for name, value in dataclasses.asdict(model.config).items() if name not in ours_only}
    reference = LlamaForCausalLM(LlamaConfig(**fields)).eval()
    reference.load_state_dict(model.state_dict())
    return reference


@pytest.fixture(scope="module")
def runs() -> dict[tuple[str, str, str], Run]:
    """The GPU check's workload on each CPU kernel of both caches, float32, prefill chunked and whole."""
    return {
        (prefill, cache, kernel): run_workload(
            engine_config("tiny", "cpu", "float32", cache, kernel, prefill), MAX_TOKENS
        )
        for prefill in PREFILLS
        for cache, kernel in COMBINATIONS
    }


@pytest.fixture(scope="module")
def transformers_greedy() -> dict[str, list[int]]:
    """transformers' own generate(do_sample=False) on the same weights, one prompt at a time."""
    built, tokenizer = load_synthetic("synthetic:tiny", torch.float32)
    model = transformers_llama(built)
    model.generation_config.eos_token_id = None  # the engine's requests ignore eos
    greedy = {}
    for wave in workload("tiny"):
        for name, prompt in wave:
            ids = torch.tensor([prompt])
            tokens = LONG_TOKENS if name == "long" else MAX_TOKENS
            with torch.inference_mode():
                out = model.generate(ids, max_new_tokens=tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id)
            greedy[name] = out[0, ids.shape[1] :].tolist()
    return greedy


def test_every_kernel_and_prefill_gives_transformers_greedy_tokens(
    runs: dict[tuple[str, str, str], Run], transformers_greedy: dict[str, list[int]]
) -> None:
    for combination, run in runs.items():
        assert run.tokens == transformers_greedy, combination


def test_the_workload_forks_hits_the_prefix_cache_and_mixes_prefills_with_decodes(
    runs: dict[tuple[str, str, str], Run],
) -> None:
    prompt_tokens = {name: len(ids) for wave in workload("tiny") for name, ids in wave}
    for (prefill, cache, kernel), run in runs.items():
        virtual = cache == "virtual"
        assert run.forks == virtual, kernel
        assert run.cached_tokens["fork-1"] == (prompt_tokens["fork-1"] - 1 if virtual else 0), kernel
        assert run.cached_tokens["prefix-hit"] == (prompt_tokens["prefix-hit"] - 1 if virtual else 0), kernel
        assert run.mixed_iterations >= (10 if prefill == "chunked" else 1), (prefill, kernel)


def test_greedy_decoding_is_not_degenerate(transformers_greedy: dict[str, list[int]]) -> None:
    """Each prompt's continuation varies (not one token repeated) and differs from the other prompts'."""
    continuations = [transformers_greedy[name] for name in ("short", "medium", "fork-0", "prefix-hit", "late")]
    assert all(len(set(tokens)) > MAX_TOKENS // 2 for tokens in continuations)
    assert len({tuple(tokens) for tokens in continuations}) == len(continuations)


def test_the_gpu_check_smoke_runs_on_the_cpu(tmp_path: Path) -> None:
    out = tmp_path / "check.json"
    argv = ["--device", "cpu", "--models", "tiny", "--prefills", "chunked", "--max-tokens", "4", "--out", str(out)]
    assert gpu_model_check.main(argv) == 0
    report = json.loads(out.read_text())
    assert report["ok"] and not report["failures"] and report["torch"] == torch.__version__
    combinations = report["models"]["tiny"]["combinations"]
    kernels = gpu_model_check.KERNELS_TRIED["cpu"]
    assert [(c["cache"], c["kernel"]) for c in combinations] == [(k, n) for k, names in kernels.items() for n in names]
    bound = report["bounds"]["relative_logit_diff"]["float32"]
    for entry in combinations:
        assert entry["status"] == "ok" and entry["dtype"] == "float32"
        assert entry["vs_cpu_float32"]["fully_equal"] == 1.0
        assert entry["vs_cpu_float32"]["max_relative_logit_diff"] <= bound
        for agreement in [entry.get("vs_first", {}), *entry.get("vs_same_cache", {}).values()]:
            assert agreement.get("fully_equal", 1.0) == 1.0


def test_the_gpu_check_records_a_kernel_that_cannot_run_here_as_unavailable() -> None:
    entry, run = gpu_model_check._one("tiny", "cpu", "float32", "virtual", "flash_attn", "whole", 2)
    assert entry["status"] == "unavailable" and "GPU" in entry["reason"] and run is None


def test_vattn_serve_answers_a_completion_on_the_tiny_model() -> None:
    port = free_port()
    command = [str(VATTN), "serve", "--model", "synthetic:tiny", "--port", str(port)]
    command += ["--max-slots", "2", "--max-context", "256", "--kv-budget", "32M"]
    server = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        log = read_until(server, "ready:")
        assert any(f"ready: synthetic:tiny on http://127.0.0.1:{port}/v1" in line for line in log), log
        body = {"model": "synthetic:tiny", "prompt": "Once upon a time", "max_tokens": 8, "temperature": 0}
        response = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=60)
        assert response.status_code == 200, response.text
        completion = response.json()
        assert completion["choices"][0]["text"] and completion["usage"]["completion_tokens"] == 8
    finally:
        server.terminate()
        server.wait(60)


def test_vattn_serve_refuses_an_unknown_synthetic_model(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--model", "synthetic:huge"])
    assert exit_info.value.code == 2 and "choose one of synthetic:tiny, synthetic:paper" in capsys.readouterr().err
