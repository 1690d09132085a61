"""Tensor parallelism over torch.distributed (gloo): two ranks as separate processes on loopback
give the greedy tokens of one, on a small random-weight Llama whose heads divide by two."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from measure.workloads import small_llama
from serving import LLM, SamplingParams
from serving.config import EngineConfig
from serving.model.tensor_parallel import free_port

VATTN = Path(sys.executable).parent / "vattn"

pytestmark = pytest.mark.needs_model  # the test model borrows the default model's tokenizer


@pytest.fixture(scope="module")
def small_llama_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return small_llama(tmp_path_factory.mktemp("small-llama"))


def greedy(
    model: Path, tensor_parallel_size: int, prompts: list[list[int]], tp_init_method: str | None = None
) -> list[list[int]]:
    llm = LLM(
        model=str(model),
        tensor_parallel_size=tensor_parallel_size,
        tp_init_method=tp_init_method,
        dtype="float32",
        max_slots=4,
        max_context=512,
        kv_budget=64 << 20,
        page_size=16 << 10,
    )
    try:
        outputs = llm.generate(prompts, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True), use_tqdm=False)
        again = llm.generate(prompts[:1], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True), use_tqdm=False)
        assert again[0].cached_tokens > 0  # the second time, the prefix cache served the prompt on every rank
        # its tokens, returned with the others: each rank's partial sums come from its own cached
        # KV, so a rank whose prefix cache mapped the wrong pages changes them
        return [output.token_ids for output in [*outputs, *again]]
    finally:
        llm.close()


def prompts() -> list[list[int]]:
    """Three prompts sharing 150 tokens (the prefix cache serves them on every rank) and one other."""
    generator = torch.Generator().manual_seed(1)
    shared = torch.randint(100, 40_000, (150,), generator=generator).tolist()
    chosen = [shared + torch.randint(100, 40_000, (n,), generator=generator).tolist() for n in (5, 40, 90)]
    return [*chosen, torch.randint(100, 40_000, (30,), generator=generator).tolist()]


def test_two_ranks_give_the_tokens_of_one(small_llama_folder: Path) -> None:
    one_rank = greedy(small_llama_folder, 1, prompts())
    assert one_rank[-1] == one_rank[0]  # the prompt again, from the prefix cache: the same tokens
    assert greedy(small_llama_folder, 2, prompts()) == one_rank


def test_a_rank_started_by_hand_joins_at_the_init_method(small_llama_folder: Path) -> None:
    """The multi-machine path, on loopback: rank 1 is `vattn serve --tp-rank 1` with rank 0's
    --tp-init-method and the same options, and rank 0 (this process) starts no rank itself."""
    init = f"tcp://127.0.0.1:{free_port()}"
    options = ["--model", str(small_llama_folder), "--tensor-parallel-size", "2", "--tp-init-method", init]
    options += ["--max-slots", "4", "--max-context", "512", "--kv-budget", "64M", "--page-size", "16K"]
    follower = subprocess.Popen([str(VATTN), "serve", *options, "--tp-rank", "1"])
    try:
        tokens = greedy(small_llama_folder, 2, prompts(), tp_init_method=init)
    finally:
        code = follower.wait(120)
    assert code == 0  # rank 0's close stopped it
    assert tokens == greedy(small_llama_folder, 1, prompts())


def test_heads_that_do_not_divide_fail_at_start_with_the_fix() -> None:
    with pytest.raises(ValueError, match=r"tensor_parallel_size 2 must divide the model's 3 KV heads"):
        LLM(tensor_parallel_size=2, max_slots=2, max_context=256, kv_budget=64 << 20)


def test_gguf_weights_are_refused() -> None:
    with pytest.raises(ValueError, match="not a GGUF file's blocks"):
        EngineConfig(model="/models/x.gguf", tensor_parallel_size=2)
