"""The engine with the real default model: parity with HF generate, preemption, sampling, bad input."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from serving import LLM, SamplingParams
from serving.default_model import ensure_default_model
from serving.detokenizer import IncrementalDetokenizer
from serving.model.cpu_features import int8_activations_fast
from serving.structured_output import StructuredOutput

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
    "List three primary colors:",
    "The quick brown fox",
    "Water boils at a temperature of",
    "Translate to French: good morning ->",
    # Longer than a 48-token iteration budget: its prefill runs in chunks beside decodes.
    "Here is a long story about a lighthouse keeper who lived alone on a rocky island far "
    "from the coast. Every night he climbed the stairs, lit the lamp and watched the ships. "
    "One stormy evening, a small boat appeared on the horizon, and",
]
GREEDY = SamplingParams(max_tokens=32, temperature=0)
ENGINE: dict[str, Any] = {
    "dtype": "float32",
    "max_slots": 8,
    "max_context": 512,
    "max_batched_tokens": 48,
    "kv_budget": 64 << 20,
}


@pytest.fixture(scope="module")
def llm() -> Iterator[LLM]:
    model = LLM(**ENGINE)
    yield model
    model.close()


@pytest.fixture(scope="module")
def hf_greedy() -> list[list[int]]:
    """HF generate's greedy tokens for PROMPTS, fp32, each row cut after its end-of-sequence
    token: one left-padded batch (on these prompts, the tokens each gives alone; 4x faster)."""
    model = AutoModelForCausalLM.from_pretrained(ensure_default_model(), dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(ensure_default_model(), padding_side="left")
    eos = model.generation_config.eos_token_id
    batch = tokenizer(PROMPTS, return_tensors="pt", padding=True)
    with torch.inference_mode():
        generated = model.generate(**batch, max_new_tokens=32, do_sample=False, pad_token_id=eos)
    rows = generated[:, batch.input_ids.shape[1] :].tolist()
    return [row[: row.index(eos) + 1] if eos in row else row for row in rows]


def run_staggered(llm: LLM, prompts: list[str], params: SamplingParams) -> list[list[int]]:
    """Two requests first, then one more every second iteration: continuous batching."""
    engine = llm.engine
    queue, ids = list(prompts), []
    ids += [engine.add_request(queue.pop(0), params) for _ in range(2)]
    iteration = 0
    while engine.has_unfinished() or queue:
        if queue and iteration % 2 == 1:
            ids.append(engine.add_request(queue.pop(0), params))
        engine.step()
        iteration += 1
    return [engine.result(request_id).token_ids for request_id in ids]


def test_greedy_matches_hf_generate_under_continuous_batching(llm: LLM, hf_greedy: list[list[int]]) -> None:
    chunked_before = llm.engine.stats().iterations
    assert run_staggered(llm, PROMPTS, GREEDY) == hf_greedy
    assert llm.engine.stats().iterations > chunked_before
    assert len(llm.tokenizer(PROMPTS[-1]).input_ids) > ENGINE["max_batched_tokens"]  # chunked prefill ran


def test_preemption_keeps_outputs_and_returns_every_page(hf_greedy: list[list[int]]) -> None:
    # 16 KiB pages hold 21 tokens per layer tensor; 8 MiB is 8 page groups over 60 tensors, for
    # 8 requests of 40-100 tokens: they outgrow it as they decode, and some are preempted
    # (admission reserves no room for output here: by default it would hold requests back).
    small = LLM(**{**ENGINE, "kv_budget": 8 << 20, "max_context": 160, "page_size": 16 << 10, "reserve_tokens": 0})
    try:
        assert run_staggered(small, PROMPTS, GREEDY) == hf_greedy
        assert small.engine.stats().preemptions > 0
        cache = small.engine.kv.cache
        assert cache.stats().pinned_slots == 0  # every iteration dropped its attention batch
        assert cache.num_free_slots() == ENGINE["max_slots"] and cache.stats().active_bytes == 0
        cache.wait_for_background()
        cache.release_idle()
        cache.evict_prefix_cache()  # 64-token units: the prefix cache kept some
        assert cache.num_free_pages() == cache.stats().pool_pages
    finally:
        small.close()


def test_admission_keeps_room_for_output_so_a_tight_budget_does_not_preempt(hf_greedy: list[list[int]]) -> None:
    """The budget above with the default admission (each request's prompt and output reserved):
    requests wait for room instead of evicting each other (admitting on the first chunk, as
    before, preempted here)."""
    small = LLM(**{**ENGINE, "kv_budget": 8 << 20, "max_context": 160, "page_size": 16 << 10})
    try:
        assert run_staggered(small, PROMPTS, GREEDY) == hf_greedy
        assert small.engine.stats().preemptions == 0
    finally:
        small.close()


def test_the_kv_pages_are_made_at_start_unless_asked_not_to(llm: LLM, hf_greedy: list[list[int]]) -> None:
    """By default (kv_preallocate) every page the pool may hold exists when the engine starts and
    requests take those; with kv_preallocate=False pages are made as mapped, the same tokens."""
    started = llm.engine.stats().kv
    assert started.pages_created == started.pool_pages and started.fresh_pages_taken == 0
    lazy = LLM(**ENGINE, kv_preallocate=False)
    try:
        assert lazy.engine.stats().kv.pages_created < started.pool_pages
        assert [o.token_ids for o in lazy.generate(PROMPTS[:2], GREEDY, use_tqdm=False)] == hf_greedy[:2]
        assert lazy.engine.stats().kv.fresh_pages_taken > 0
    finally:
        lazy.close()


def test_the_paged_cache_gives_the_same_greedy_tokens(llm: LLM, hf_greedy: list[list[int]]) -> None:
    """The A/B the paper needs: the engine on the block-table baseline, unchanged otherwise,
    with blocks of 7 tokens (not a divisor of anything) and a budget small enough to preempt
    (with no output reserved at admission)."""
    assert run_staggered(llm, PROMPTS, GREEDY) == hf_greedy
    tight = {"kv_budget": 8 << 20, "max_context": 160, "reserve_tokens": 0}
    paged = LLM(**{**ENGINE, "kv_cache": "paged", "block_size": 7, **tight})
    try:
        assert run_staggered(paged, PROMPTS, GREEDY) == hf_greedy
        assert paged.engine.stats().preemptions > 0
        cache = paged.engine.kv.cache
        assert cache.num_free_blocks == cache.config.num_blocks and cache.stats().active_slots == 0
    finally:
        paged.close()


def test_a_bfloat16_model_has_a_bfloat16_cache_and_answers() -> None:
    small = {"max_slots": 2, "max_context": 128, "kv_budget": 16 << 20}
    half = LLM(dtype="bfloat16", **small)
    try:
        assert half.engine.kv.cache.config.dtype == torch.bfloat16
        (out,) = half.generate(PROMPTS[0], SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)
        assert "Paris" in out.text
    finally:
        half.close()


@pytest.mark.parametrize(
    "quantization",
    [
        "bf16",
        "int8_weight_only",
        "q8_0",
        pytest.param("int8", marks=pytest.mark.skipif(not int8_activations_fast(), reason="needs AVX-512 VNNI")),
    ],
)
def test_quantized_weights_still_answer(quantization: str) -> None:
    """Weights in bf16 or int8 (serving.model.linear): the answer survives; model_speed measures how close."""
    small = LLM(quantization=quantization, max_slots=2, max_context=128, kv_budget=16 << 20)
    try:
        (out,) = small.generate(PROMPTS[0], SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)
        assert "Paris" in out.text
    finally:
        small.close()


NARROW_KV = {"float16": (0.05, 0.01), "bfloat16": (0.3, 0.05), "int8": (1.0, 0.1)}
"""Each narrower KV precision and the largest and mean changes it may make to a prompt token's
logprob (int8's per-token scales move the odd token by up to ~0.5, the whole text's perplexity
by ~0.03%: benchmarks.quality)."""


@pytest.mark.parametrize("kv_cache_dtype", list(NARROW_KV))
def test_a_narrower_kv_cache_cuts_the_bytes_and_keeps_the_scores(llm: LLM, kv_cache_dtype: str) -> None:
    """kv_cache_dtype float16/bfloat16/int8 under a float32 model: half the bytes per token (int8:
    a quarter, plus a float32 scale per kv head), and the prompt's log-probabilities within
    rounding of the float32 cache's (KV rounded or quantized as stored)."""
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0)
    narrower = LLM(**ENGINE, kv_cache_dtype=kv_cache_dtype)
    try:
        (narrow,) = narrower.generate("\n".join(PROMPTS), params, use_tqdm=False)
        cfg, wide_cfg = narrower.engine.executor.kv.cache.config, llm.engine.executor.kv.cache.config
        assert cfg.dtype == getattr(torch, kv_cache_dtype)
        scales = 8 * cfg.num_kv_heads * cfg.num_layers if kv_cache_dtype == "int8" else 0  # per_layer: one layer's
        assert cfg.bytes_per_token == wide_cfg.bytes_per_token * cfg.dtype.itemsize // 4 + scales // cfg.num_layers
    finally:
        narrower.close()
    (wide,) = llm.generate("\n".join(PROMPTS), params, use_tqdm=False)
    pairs = list(zip(wide.prompt_logprobs or [], narrow.prompt_logprobs or [], strict=True))[1:]
    differences = [abs(a.logprob - b.logprob) for a, b in pairs if a is not None and b is not None]
    assert len(differences) == len(pairs) > 20
    largest, mean = NARROW_KV[kv_cache_dtype]
    assert max(differences) < largest and sum(differences) / len(differences) < mean


def test_stop_strings_cut_the_text(llm: LLM) -> None:
    (plain,) = llm.generate(PROMPTS[1], GREEDY, use_tqdm=False)
    (stopped,) = llm.generate(PROMPTS[1], SamplingParams(max_tokens=32, temperature=0, stop=["return"]), use_tqdm=False)
    assert "return" in plain.text
    assert stopped.text == plain.text[: plain.text.index("return")]
    assert stopped.finish_reason == "stop" and plain.finish_reason == "length"


def test_stop_token_ids_and_max_tokens(llm: LLM) -> None:
    (plain,) = llm.generate(PROMPTS[0], GREEDY, use_tqdm=False)
    third = plain.token_ids[2]
    (stopped,) = llm.generate(
        PROMPTS[0], SamplingParams(max_tokens=32, temperature=0, stop_token_ids=[third]), use_tqdm=False
    )
    assert stopped.token_ids == plain.token_ids[:3] and stopped.finish_reason == "stop"
    (short,) = llm.generate(PROMPTS[0], SamplingParams(max_tokens=5, temperature=0), use_tqdm=False)
    assert short.token_ids == plain.token_ids[:5] and short.finish_reason == "length"


def test_seeded_sampling_is_reproducible_whatever_runs_beside_it(llm: LLM) -> None:
    params = SamplingParams(max_tokens=24, temperature=0.9, top_p=0.95, top_k=50, seed=1234)
    (alone,) = llm.generate(PROMPTS[2], params, use_tqdm=False)
    crowd = llm.generate([PROMPTS[0], PROMPTS[2], PROMPTS[3]], [GREEDY, params, GREEDY], use_tqdm=False)
    other = llm.generate(PROMPTS[2], SamplingParams(max_tokens=24, temperature=0.9, seed=99), use_tqdm=False)
    assert crowd[1].token_ids == alone.token_ids
    assert other[0].token_ids != alone.token_ids


def test_logprobs_of_sampled_and_top_tokens(llm: LLM) -> None:
    (out,) = llm.generate(PROMPTS[0], SamplingParams(max_tokens=6, temperature=0, logprobs=3), use_tqdm=False)
    assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids) == 6
    for token, entry in zip(out.token_ids, out.logprobs, strict=True):
        assert entry.token_id == token and entry.logprob <= 0
        assert entry.top[0][0] == token  # greedy picks the most likely token
        assert [lp for _, lp in entry.top] == sorted((lp for _, lp in entry.top), reverse=True)
        assert len(entry.top) == 3
    model = AutoModelForCausalLM.from_pretrained(ensure_default_model(), dtype=torch.float32).eval()
    ids = llm.tokenizer(PROMPTS[0], return_tensors="pt").input_ids
    with torch.inference_mode():
        first = model(ids).logits[0, -1].log_softmax(-1)
    assert abs(float(first[out.token_ids[0]]) - out.logprobs[0].logprob) < 1e-4


def test_streaming_concatenates_to_the_full_text(llm: LLM) -> None:
    (whole,) = llm.generate(PROMPTS[3], GREEDY, use_tqdm=False)
    deltas = list(llm.stream(PROMPTS[3], GREEDY))
    assert "".join(d.text for d in deltas) == whole.text
    assert [t for d in deltas for t in d.token_ids] == whole.token_ids
    assert deltas[-1].finished and not any(d.finished for d in deltas[:-1])


def test_closing_a_stream_aborts_it_and_frees_its_slot(llm: LLM) -> None:
    stream = llm.stream(PROMPTS[4], SamplingParams(max_tokens=200, temperature=0))
    next(stream)
    stream.close()
    assert not llm.engine.has_unfinished()
    assert llm.engine.kv.cache.num_free_slots() == ENGINE["max_slots"]


def test_incremental_detokenization_of_multibyte_text(llm: LLM) -> None:
    text = "Café 世界 🙂 naïve — ok"
    ids = llm.tokenizer.encode(text, add_special_tokens=False)
    detokenizer = IncrementalDetokenizer(llm.tokenizer, [])
    deltas = [detokenizer.add(token) for token in ids]
    assert "".join(deltas) == text and not any("\ufffd" in d for d in deltas)
    assert "" in deltas  # some characters spanned several tokens and were held back


def test_chat_uses_the_model_template(llm: LLM) -> None:
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = llm.tokenizer.decode(llm.chat_prompt(messages))
    assert prompt.startswith("<|im_start|>system") and prompt.endswith("<|im_start|>assistant\n")
    answer = llm.chat(messages, SamplingParams(max_tokens=24, temperature=0))
    assert "Paris" in answer.text and answer.finish_reason in ("stop", "length")


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda llm: llm.generate("", GREEDY), "the prompt is empty"),
        (lambda llm: llm.generate([[]], GREEDY), "the prompt is empty"),
        (lambda llm: llm.generate("word " * 600, GREEDY), r"the prompt has \d+ tokens but the max context is 512"),
        (lambda llm: llm.generate([[1, 2, 10**9]], GREEDY), r"prompt token ids must be in \[0, 49152\)"),
        (lambda llm: SamplingParams(max_tokens=0), "max_tokens must be an integer >= 1"),
        (lambda llm: SamplingParams(top_p=0.0), r"top_p must be in \(0, 1\]"),
        (lambda llm: SamplingParams(top_p=1.5), r"top_p must be in \(0, 1\]"),
        (lambda llm: SamplingParams(temperature=-0.5), "temperature must be a number >= 0"),
        (lambda llm: SamplingParams(top_k=-1), "top_k must be an integer >= 0"),
        (lambda llm: SamplingParams(stop=[""]), "stop must be a non-empty string"),
        (lambda llm: SamplingParams(logprobs=50), r"logprobs must be an integer in \[0, 20\]"),
        (lambda llm: llm.chat([{"role": "robot", "content": "hi"}]), "each message needs a role"),
        (lambda llm: llm.generate(["fine", ""], GREEDY), "the prompt is empty"),
    ],
)
def test_bad_input_raises_value_error_and_queues_nothing(llm: LLM, make: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make(llm)
    assert not llm.engine.has_unfinished() and llm.engine.kv.cache.num_free_slots() == ENGINE["max_slots"]


def test_the_prefix_cache_changes_no_token_across_eviction() -> None:
    """Prompts behind a shared ~150-token system prompt and a unit of their own, 16 KiB pages
    (a unit is 64 tokens, 3 page groups), a budget of 21 page groups: a request needs 11 and the
    distinct units 18, so units are hit and evicted, and every greedy token equals the
    engine's without a prefix cache: with the cache kept until its pages are needed, and with
    none of it kept once no slot maps it (the freed slot still maps the system prompt's units
    for the next request)."""
    system = "You are a careful assistant for a lighthouse museum. " * 15
    prompts = [system + prompt + " " + PROMPTS[-1] for prompt in PROMPTS[:4]] * 2  # a unit of their own
    sizes = {**ENGINE, "max_slots": 1, "max_context": 256, "page_size": 16 << 10, "kv_budget": 20 << 20}
    params = SamplingParams(max_tokens=8, temperature=0)
    outputs = {}
    for caching, share in ((False, 1.0), (True, 1.0), (True, 0.0)):
        llm = LLM(**sizes, prefix_caching=caching, prefix_cache_share=share)
        try:
            outputs[caching, share] = run_staggered(llm, prompts, params)
            stats = llm.engine.stats().kv
            assert (stats.prefix.hits >= 2 * 64 * (len(prompts) - 2)) == caching  # the system prompt, mostly
            assert (stats.prefix.evictions > 0) == caching
            assert stats.cached_bytes <= share * stats.pool_pages * stats.page_size
            cache = llm.engine.kv.cache
            cache.wait_for_background()
            cache.release_idle()
            cache.evict_prefix_cache()
            assert cache.num_free_pages() == cache.stats().pool_pages
        finally:
            llm.close()
    assert outputs[True, 1.0] == outputs[True, 0.0] == outputs[False, 1.0]


def test_the_choices_of_a_prompt_fork_its_kv_and_sample_as_if_alone(llm: LLM) -> None:
    """n = 4 choices of a prompt longer than an iteration's budget: the first computes all
    but the last prompt token, the others map its pages (the partial one copied) and each
    samples as it would alone."""
    prompt, engine = PROMPTS[-1], llm.engine
    engine.kv.cache.evict_prefix_cache()  # earlier tests' requests cached this prompt's tokens
    params = [SamplingParams(max_tokens=12, temperature=0.8, seed=seed) for seed in range(4)]
    ids = engine.add_requests([prompt] * 4, params)
    while engine.has_unfinished():
        engine.step()
    forked = [engine.result(request_id) for request_id in ids]
    alone = [llm.generate([prompt], p, use_tqdm=False)[0] for p in params]
    assert [o.token_ids for o in forked] == [o.token_ids for o in alone]
    prompt_tokens = len(forked[0].prompt_token_ids)
    assert [o.cached_tokens for o in forked] == [0] + [prompt_tokens - 1] * 3


def test_prompts_sharing_a_prefix_fork_it_instead_of_computing_it_each() -> None:
    """A system prompt longer than a page before three questions, submitted together: the first
    computes it, the others fork it at their common prefix and answer as they would alone."""
    system = PROMPTS[-1] * 3  # ~180 tokens: two whole 64 KiB pages of the default model
    questions = [system + " Question: who is the keeper?", system + " Question: what is the boat?", system]
    llm = LLM(**ENGINE)
    try:
        engine = llm.engine
        ids = engine.add_requests(questions, [GREEDY] * 3)
        while engine.has_unfinished():
            engine.step()
        together = [engine.result(request_id) for request_id in ids]
        forks = engine.kv.stats().counters.forks
        engine.kv.cache.evict_prefix_cache()
        alone = [llm.generate([q], GREEDY, use_tqdm=False)[0] for q in questions]
    finally:
        llm.close()
    assert [o.token_ids for o in together] == [o.token_ids for o in alone]
    first, second, third = (o.prompt_token_ids for o in together)
    shared = next(i for i, (x, y) in enumerate(zip(first, second, strict=False)) if x != y)
    assert forks == 2
    assert [o.cached_tokens for o in together] == [0, shared, len(third) - 1]  # third is a prefix of first


def test_prompt_logprobs_equal_hf_across_prefill_chunks(llm: LLM) -> None:
    """The longest prompt is prefilled in 48-token chunks; every prompt token's logprob (and top
    alternatives) equals HF's forward pass, though the same prompt was cached before."""
    prompt = PROMPTS[-1]
    llm.generate([prompt], GREEDY, use_tqdm=False)  # its prefix is cached: prompt logprobs must not use it
    [out] = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=3), use_tqdm=False)
    ids = out.prompt_token_ids
    model = AutoModelForCausalLM.from_pretrained(ensure_default_model(), dtype=torch.float32).eval()
    with torch.inference_mode():
        reference = torch.log_softmax(model(torch.tensor([ids])).logits[0], dim=-1)
    assert out.cached_tokens == 0 and out.prompt_logprobs is not None and out.prompt_logprobs[0] is None
    for position, entry in enumerate(out.prompt_logprobs[1:], start=1):
        assert entry is not None and entry.token_id == ids[position]
        assert entry.logprob == pytest.approx(float(reference[position - 1, ids[position]]), abs=1e-4)
        assert [t for t, _ in entry.top] == reference[position - 1].topk(3).indices.tolist()


class ExplodingDetokenizer(IncrementalDetokenizer):
    """A request whose processing raises (as a bug in its own text handling would)."""

    def add(self, token: int) -> str:
        raise RuntimeError("boom")


def test_a_request_whose_processing_raises_ends_alone(llm: LLM) -> None:
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    alone = llm.generate(PROMPTS[:3], params, use_tqdm=False)
    engine = llm.engine
    ids = [engine.add_request(prompt, params) for prompt in PROMPTS[:3]]
    bad = engine.add_request(PROMPTS[3], params)
    engine._requests[bad].detokenizer = ExplodingDetokenizer(llm.tokenizer, [])
    deltas = []
    while engine.has_unfinished():
        deltas += engine.step()
    assert [engine.result(i).token_ids for i in ids] == [out.token_ids for out in alone]
    failed = engine.result(bad)
    assert failed.finish_reason == "error" and failed.error is not None and failed.error.internal
    assert "boom" in failed.error.message
    assert [d.error for d in deltas if d.request_id == bad and d.finished] == [failed.error]
    assert engine.kv.cache.num_free_slots() == ENGINE["max_slots"]


def test_constraints_that_leave_no_token_are_refused_or_end_the_request_alone(llm: LLM) -> None:
    no_token = [
        SamplingParams(allowed_token_ids=[2], min_tokens=3, max_tokens=4),  # 2 is EOS
        SamplingParams(allowed_token_ids=[7], stop_token_ids=[7], min_tokens=2, max_tokens=4),
        SamplingParams(allowed_token_ids=[5], structured_output=StructuredOutput.choice(["hello"])),
    ]
    for params in no_token:
        with pytest.raises(ValueError, match="allowed_token_ids"):
            llm.generate(PROMPTS[0], params, use_tqdm=False)
    # 'hi' (6004) starts the regex; after it the grammar wants EOS or 'x', and min_tokens bans EOS
    later = SamplingParams(
        allowed_token_ids=[6004, 2], min_tokens=3, max_tokens=6, structured_output=StructuredOutput("regex", "hi(x)*")
    )
    greedy = SamplingParams(max_tokens=8, temperature=0)
    dead, fine = llm.generate([PROMPTS[0], PROMPTS[1]], [later, greedy], use_tqdm=False)
    assert dead.finish_reason == "error" and dead.token_ids == [6004]
    assert dead.error is not None and not dead.error.internal and "no token satisfies" in dead.error.message
    assert fine.token_ids == llm.generate(PROMPTS[1], greedy, use_tqdm=False)[0].token_ids
