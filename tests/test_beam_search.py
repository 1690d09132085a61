"""Offline beam search: HF generate(num_beams)'s beams, forked and pruned by remapping pages."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from serving import LLM, SamplingParams
from serving.default_model import ensure_default_model

WIDTH, MAX_TOKENS = 3, 24
ENGINE: dict[str, Any] = {
    "dtype": "float32",
    "max_slots": 8,
    "max_context": 256,
    "max_batched_tokens": 48,
    "kv_budget": 64 << 20,
}
PAGE = 16 << 10
"""21 1/3 tokens of the default model per page: the prompts span several whole pages, which forks share."""
QUESTIONS = [
    "Say hello.",  # no beam ends before max_tokens
    "What is 2+2? Answer with one number.",  # every beam ends with EOS
    "Here is a long story about a lighthouse keeper who lived alone on a rocky island far from the "
    "coast. Every night he climbed the stairs, lit the lamp and watched the ships. Name the keeper in one word.",
]


@pytest.fixture(scope="module")
def llm() -> Iterator[LLM]:
    model = LLM(**ENGINE, page_size=PAGE)
    yield model
    model.close()


@pytest.fixture(scope="module")
def prompts(llm: LLM) -> list[list[int]]:
    return [llm.chat_prompt([{"role": "user", "content": question}]) for question in QUESTIONS]


@pytest.fixture(scope="module")
def hf_beams(prompts: list[list[int]]) -> list[tuple[list[list[int]], list[float]]]:
    """HF generate's `WIDTH` best beams (up to and with their EOS) and scores per prompt, fp32."""
    model = AutoModelForCausalLM.from_pretrained(ensure_default_model(), dtype=torch.float32).eval()
    eos = model.generation_config.eos_token_id
    results = []
    for prompt in prompts:
        with torch.inference_mode():
            out = model.generate(
                torch.tensor([prompt]),
                num_beams=WIDTH,
                num_return_sequences=WIDTH,
                max_new_tokens=MAX_TOKENS,
                do_sample=False,
                output_scores=True,
                return_dict_in_generate=True,
            )
        beams = [row[: row.index(eos) + 1] if eos in row else row for row in out.sequences[:, len(prompt) :].tolist()]
        results.append((beams, out.sequences_scores.tolist()))
    return results


def test_beams_equal_hf_generate_and_share_pages(
    llm: LLM, prompts: list[list[int]], hf_beams: list[tuple[list[list[int]], list[float]]]
) -> None:
    before = llm.engine.kv.stats().counters
    outputs = llm.beam_search(prompts, beam_width=WIDTH, max_tokens=MAX_TOKENS, use_tqdm=False)
    for output, (beams, scores) in zip(outputs, hf_beams, strict=True):
        assert [s.token_ids for s in output.sequences] == beams
        assert [s.score for s in output.sequences] == pytest.approx(scores, abs=1e-4)
    reasons = [{s.finish_reason for s in output.sequences} for output in outputs]
    assert reasons[0] == {"length"} and reasons[1] == {"stop"}  # both ways for a beam to end are covered
    assert outputs[1].sequences[0].text.strip() == "2 + 2 = 4"

    stats = llm.engine.kv.stats()
    forks = stats.counters.forks - before.forks
    copied = stats.counters.fork_copied_bytes - before.fork_copied_bytes
    assert forks > 0 and stats.counters.fork_shared_pages > before.fork_shared_pages
    buffers = llm.engine.kv.cache.config.num_buffers
    assert copied < forks * PAGE * buffers  # each fork copied less than a page per tensor: no full page
    assert stats.active_slots == 0  # every beam's slot was freed
    assert stats.mapped_bytes + stats.cached_bytes + stats.free_bytes == stats.pool_pages * PAGE


def test_the_paged_store_computes_forks_again_with_the_same_beams(
    prompts: list[list[int]], hf_beams: list[tuple[list[list[int]], list[float]]]
) -> None:
    llm = LLM(**ENGINE, kv_cache="paged")
    try:
        [output] = llm.beam_search(prompts[1], beam_width=WIDTH, max_tokens=MAX_TOKENS, use_tqdm=False)
        assert [s.token_ids for s in output.sequences] == hf_beams[1][0]
    finally:
        llm.close()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"beam_width": 0, "max_tokens": 4}, "beam_width must be"),
        ({"beam_width": 2, "max_tokens": 0}, "max_tokens must be"),
        ({"beam_width": 2, "max_tokens": 4, "length_penalty": float("nan")}, "length_penalty"),
        ({"beam_width": 9, "max_tokens": 4}, "max_slots is 8"),
        ({"beam_width": 2, "max_tokens": 300}, "max context"),
    ],
)
def test_bad_beam_search_arguments_are_refused(llm: LLM, kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        llm.beam_search("The capital of France is", **kwargs)
    assert llm.engine.kv.stats().active_slots == 0


def test_beam_search_waits_for_an_idle_engine(llm: LLM) -> None:
    request_id = llm.engine.add_request("The capital of France is", SamplingParams(max_tokens=2))
    try:
        with pytest.raises(ValueError, match="engine to itself"):
            llm.beam_search("Hello", beam_width=2, max_tokens=2)
    finally:
        llm.engine.abort(request_id)
