"""The offline Python API, vLLM's shape: `LLM(...).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from tqdm import tqdm

from serving.beam_search import BeamSearch
from serving.chat_template import chat_prompt_ids
from serving.config import EngineConfig
from serving.engine import LLMEngine
from serving.outputs import BeamSearchOutput, RequestOutput, StreamDelta
from serving.sampling_params import BeamSearchParams, SamplingParams
from vattn import PageBudget
from vattn.validate import is_int

Prompt = str | list[int]


class LLM:
    """A model on the vattn engine. Keyword arguments are EngineConfig fields; `page_budget`, one
    `vattn.PageBudget` for several LLMs, bounds their KV caches' pages together."""

    def __init__(
        self, model: str | None = None, dtype: str = "auto", page_budget: PageBudget | None = None, **engine: Any
    ) -> None:
        self.engine = LLMEngine(EngineConfig(model=model, dtype=dtype, **engine), page_budget)
        self.tokenizer = self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Runs every prompt to completion in one continuous batch; outputs in prompt order."""
        batch = _prompt_list(prompts, "generate")
        per_prompt = list(params) if isinstance(params, list | tuple) else [params] * len(batch)
        if len(per_prompt) != len(batch):
            raise ValueError(f"got {len(per_prompt)} SamplingParams for {len(batch)} prompts")
        ids = self.engine.add_requests(batch, per_prompt)
        with tqdm(total=len(ids), desc="generating", unit="req", disable=not use_tqdm) as bar:
            while self.engine.has_unfinished():
                bar.update(sum(delta.finished for delta in self.engine.step()))
        return [self.engine.result(request_id) for request_id in ids]

    def beam_search(
        self,
        prompts: Prompt | Sequence[Prompt],
        beam_width: int,
        max_tokens: int,
        length_penalty: float = 1.0,
        ignore_eos: bool = False,
        use_tqdm: bool = True,
    ) -> list[BeamSearchOutput]:
        """Each prompt's `beam_width` best continuations by beam search (HF generate's with
        num_beams=beam_width), best first; beams share their KV pages (serving.beam_search)."""
        batch = _prompt_list(prompts, "beam_search")
        search = BeamSearch(self.engine, BeamSearchParams(beam_width, max_tokens, length_penalty, ignore_eos))
        with tqdm(total=len(batch), desc="beam search", unit="prompt", disable=not use_tqdm) as bar:
            return search.run(batch, on_done=lambda: bar.update(1))

    def stream(self, prompt: Prompt, params: SamplingParams | None = None) -> Iterator[StreamDelta]:
        """Yields one request's text as it is generated; closing the iterator aborts it."""
        request_id = self.engine.add_request(prompt, params)
        try:
            finished = False
            while not finished:
                for delta in self.engine.step():
                    if delta.request_id == request_id:
                        finished = delta.finished
                        yield delta
        finally:  # forgets a finished request; frees the slot of an abandoned one
            self.engine.abort(request_id)

    def chat(
        self, messages: Sequence[Mapping[str, str]], params: SamplingParams | None = None, use_tqdm: bool = False
    ) -> RequestOutput:
        """Answers a conversation through the model's chat template."""
        return self.generate([self.chat_prompt(messages)], params, use_tqdm)[0]

    def chat_prompt(self, messages: Sequence[Mapping[str, str]]) -> list[int]:
        """Token ids of a conversation with the assistant's turn opened."""
        return chat_prompt_ids(self.tokenizer, messages)

    def sleep(self, level: int = 1) -> None:
        """vLLM's `LLM.sleep` (needs `enable_sleep_mode=True`): level 1 gives the KV cache's pages
        back to the system, level 2 the weights too (see LLMEngine.sleep)."""
        self.engine.sleep(level)

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """vLLM's `LLM.wake_up`: `weights`, `kv_cache`, or both (None)."""
        self.engine.wake_up(tags)

    def is_sleeping(self) -> bool:
        return self.engine.sleep_level is not None

    def close(self) -> None:
        self.engine.close()


def _prompt_list(prompts: Prompt | Sequence[Prompt], caller: str) -> list[Prompt]:
    """One prompt or several, as a non-empty list."""
    batch = [prompts] if isinstance(prompts, str) or _is_token_ids(prompts) else list(prompts)
    if not batch:
        raise ValueError(f"{caller} needs at least one prompt")
    return batch  # type: ignore[return-value]


def _is_token_ids(prompt: object) -> bool:
    return isinstance(prompt, list) and bool(prompt) and all(is_int(t) for t in prompt)
