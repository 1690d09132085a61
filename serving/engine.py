"""The engine: requests in, one batched model iteration per step(), tokens and text out.

Data flows one way: engine -> scheduler (what runs, preemption) -> KV store (slots and
pages) -> allocator -> VMM backend; each iteration's compute is the model executor's
(serving.executor), which beam search (serving.beam_search) drives as well.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from serving.config import EngineConfig
from serving.default_model import ensure_default_model
from serving.detokenizer import IncrementalDetokenizer
from serving.executor import ModelExecutor, make_executor
from serving.heap import keep_freed_blocks, return_freed_memory
from serving.kv_store import KVStore
from serving.model.loader import load_model, model_shape
from serving.outputs import RequestOutput, StreamDelta
from serving.request import (
    Request,
    RequestError,
    TokenLogprob,
    check_prompt_ids,
    generation_room,
    prompt_token_ids,
)
from serving.sampler import SamplingError, check_satisfiable, sample
from serving.sampling_params import SamplingParams
from serving.scheduler import Scheduler, assign_fork_parents
from serving.stop_strings import find_stop, held_back
from serving.structured_output import GrammarCompiler, GrammarError, advance
from vattn import CacheStats, PageBudget

if TYPE_CHECKING:
    from serving.kv_events import KVEventPublisher

log = logging.getLogger("vattn.engine")

WAKE_TAGS = ("weights", "kv_cache")
"""What `LLMEngine.wake_up` can wake, as vLLM's tags name it."""


class SleepingError(ValueError):
    """A request for an engine that sleeps (the server answers 503 with Retry-After)."""


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of the engine between iterations."""

    running: int
    waiting: int
    preemptions: int
    iterations: int
    last_iteration_tokens: int
    """Tokens the last iteration computed (its prompt chunks and decodes)."""
    kv: CacheStats


class LLMEngine:
    """Continuous batching over the model executor (beam search is the other driver of one)."""

    executor_type: type[ModelExecutor] = ModelExecutor
    """The compute path; a subclass may stand in its own."""

    def __init__(self, config: EngineConfig | None = None, page_budget: PageBudget | None = None) -> None:
        """`page_budget`: one bound shared with other engines' KV caches (several models under
        one KV budget); each engine's own `kv_budget` still bounds it alone."""
        self.config = config = config or EngineConfig()
        if config.kv_events_endpoint is not None:  # msgspec and pyzmq: imported only when asked for, before the model
            from serving.kv_events import kv_event_publisher
        self._path = path = config.model or ensure_default_model()
        model, self.tokenizer = load_model(path, config.torch_dtype, gguf_weights=config.quantization == "gguf")
        shape = model_shape(model)
        self.max_context = min(config.max_context, shape.max_position)
        self.vocab_size = shape.vocab_size
        self.grammars = GrammarCompiler(self.tokenizer, shape.vocab_size)
        """Callers may compile grammars ahead on other threads (`compile`), so admission finds them ready."""
        self.executor = make_executor(
            replace(config, model=str(path)), model, shape, self.max_context, page_budget, self.executor_type
        )
        self.kv: KVStore = self.executor.kv
        """Slots and pages; callers read it through `stats()`, tests inspect the allocator behind it."""
        self._scheduler = Scheduler(self.kv, config.max_batched_tokens, self.max_context, config.reserve_tokens)
        self._requests: dict[str, Request] = {}
        self._ids = itertools.count()
        self._generator = torch.Generator().manual_seed(config.seed)
        eos = self.tokenizer.eos_token_id
        self.eos_token_ids = frozenset(model.config.eos_token_ids or ([] if eos is None else [eos]))
        del model  # the runner holds what it uses: the rest of the loaded model goes
        return_freed_memory()
        keep_freed_blocks()  # from here on, each step's activations reuse the last step's pages
        self._changed: dict[Request, None] = {}
        """Requests that moved since the last step() returned (ordered, no repeats)."""
        self.sleep_level: int | None = None
        """The level the engine sleeps at (`sleep`), None while it is awake."""
        self._asleep: frozenset[str] = frozenset()
        """What still sleeps of WAKE_TAGS."""
        self._kv_events: KVEventPublisher | None = (
            kv_event_publisher(config) if config.kv_events_endpoint is not None else None
        )
        """Publishes the prefix cache's changes after each step (vLLM's KV events), if configured."""

    # ------------------------------------------------------------------ requests

    def add_request(
        self, prompt: str | Sequence[int], params: SamplingParams | None = None, request_id: str | None = None
    ) -> str:
        """Queues a prompt (text or token ids); returns its id. Bad input raises ValueError."""
        params = params or SamplingParams()
        if self.sleep_level is not None:
            raise SleepingError(f"the engine sleeps (level {self.sleep_level}): wake it up first")
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be SamplingParams, got {type(params).__name__}")
        text, ids = self.encode(prompt)
        params.check_token_ids(self.vocab_size)
        matcher = None if params.structured_output is None else self.grammars.matcher(params.structured_output)
        check_satisfiable(params, matcher, self.eos_token_ids, self.vocab_size)
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        request = Request(
            request_id=request_id,
            prompt=text,
            prompt_ids=ids,
            params=params,
            detokenizer=IncrementalDetokenizer(self.tokenizer, ids),
            generator=None if params.seed is None else torch.Generator().manual_seed(params.seed),
            matcher=matcher,
        )
        self._requests[request_id] = request
        self._scheduler.add(request)
        return request_id

    def encode(self, prompt: str | Sequence[int]) -> tuple[str | None, list[int]]:
        """A prompt's text (None when given as ids) and token ids; ValueError unless it is
        non-empty, in the vocabulary and leaves room to generate."""
        text, ids = prompt_token_ids(self.tokenizer, prompt)
        check_prompt_ids(ids, self.vocab_size)
        generation_room(len(ids), self.max_context)
        return text, ids

    def add_requests(
        self, prompts: Sequence[str | Sequence[int]], params: Sequence[SamplingParams | None]
    ) -> list[str]:
        """Queues prompt i with params i, all or none: a bad one withdraws those queued before it.
        A prompt that begins like an earlier one of the batch (the `n` choices of one, or a
        shared system prompt) forks that one's KV instead of computing the shared part again."""
        ids: list[str] = []
        try:
            for prompt, p in zip(prompts, params, strict=True):
                ids.append(self.add_request(prompt, p))
        except ValueError:
            for request_id in ids:
                self.abort(request_id)
            raise
        if (min_tokens := self.kv.fork_min_tokens()) is not None:
            assign_fork_parents([self._requests[request_id] for request_id in ids], min_tokens)
        return ids

    def abort(self, request_id: str) -> None:
        """Ends a request now and forgets it (no delta or result follows); its slot is free
        before the next iteration. Unknown ids are ignored: the request may have been collected."""
        request = self._requests.pop(request_id, None)
        if request is None:
            return
        if not request.finished:
            self._scheduler.finish(request, "abort")
        self._changed.pop(request, None)

    def has_unfinished(self) -> bool:
        return self._scheduler.has_work()

    def result(self, request_id: str) -> RequestOutput:
        """A finished request's output; the engine forgets it."""
        request = self._requests[request_id]
        if not request.finished:
            raise ValueError(f"request {request_id!r} has not finished")
        del self._requests[request_id]
        self._changed.pop(request, None)
        return RequestOutput.of(request)

    def stats(self) -> EngineStats:
        scheduler = self._scheduler
        return EngineStats(
            running=len(scheduler.running),
            waiting=len(scheduler.waiting),
            preemptions=scheduler.preemptions,
            iterations=self.executor.iterations,
            last_iteration_tokens=self.executor.last_iteration_tokens,
            kv=self.kv.stats(),
        )

    # ------------------------------------------------------------------ iterations

    def step(self) -> list[StreamDelta]:
        """Runs one iteration; returns what each request that moved (or ended) produced."""
        batch = self._scheduler.schedule()
        if batch is not None:
            samples = [batch.samples(i) for i in range(len(batch.requests))]
            self._run(batch.requests, batch.new_tokens, samples)
        deltas = [delta for request in list(self._changed) if (delta := self._safe_delta(request)) is not None]
        self._changed.clear()
        if self._kv_events is not None:
            self._kv_events.publish(self.kv.take_events())
        return deltas

    def _run(self, requests: list[Request], new_tokens: list[int], samples: list[bool]) -> None:
        starts = [request.num_computed for request in requests]
        rows = [n if r.wants_prompt_logprobs else int(s) for r, n, s in zip(requests, new_tokens, samples, strict=True)]
        logits = self.executor.compute(requests, new_tokens, rows)
        sampled, sample_rows, first = [], [], 0
        for request, start, count, wanted in zip(requests, starts, rows, samples, strict=True):
            if request.wants_prompt_logprobs:
                with self._alone(request):
                    self._record_prompt_logprobs(request, start, logits[first : first + count])
            if wanted and not request.finished:
                sampled.append(request)
                sample_rows.append(first + count - 1)
            first += count
        every_row = sample_rows == list(range(logits.shape[0]))  # decodes only: no copy of the logits
        choices = sample(logits if every_row else logits[sample_rows], sampled, self.eos_token_ids, self._generator)
        for request, choice in zip(sampled, choices, strict=True):
            if isinstance(choice, SamplingError):
                self._fail(request, RequestError(str(choice)))
                continue
            with self._alone(request):
                self._append(request, *choice)

    @contextmanager
    def _alone(self, request: Request) -> Iterator[None]:
        """One request's own processing: whatever it raises ends that request alone."""
        try:
            yield
        except GrammarError as error:
            self._fail(request, RequestError(str(error)))
        except Exception as error:
            log.exception("request %s failed; the others go on", request.request_id)
            self._fail(request, RequestError(f"processing the request failed: {error!r}", internal=True))

    def _fail(self, request: Request, error: RequestError) -> None:
        if not request.finished:
            request.error = error
            self._finish(request, "error")

    def _record_prompt_logprobs(self, request: Request, start: int, logits: Tensor) -> None:
        """Logits of rows `start, start + 1, ...` predict prompt tokens `start + 1, ...`."""
        if not request.prompt_logprobs:
            request.prompt_logprobs.append(None)  # nothing predicts the first token
        log_probs = torch.log_softmax(logits, dim=-1)
        top_n = request.params.prompt_logprobs or 0
        for row, position in zip(log_probs, range(start + 1, len(request.prompt_ids)), strict=False):
            if position != len(request.prompt_logprobs):
                continue  # known before a preemption made the request compute its prompt again
            token = request.prompt_ids[position]
            top = row.topk(top_n) if top_n else None
            alternatives = tuple(zip(top.indices.tolist(), top.values.tolist(), strict=True)) if top else ()
            request.prompt_logprobs.append(TokenLogprob(token, float(row[token]), alternatives))

    def _append(self, request: Request, token: int, logprob: TokenLogprob | None) -> None:
        """Adds a sampled token, its text, and ends the request if a stop condition is met."""
        params = request.params
        if request.first_token_time is None:
            request.first_token_time = time.monotonic()
        request.output_ids.append(token)
        if logprob is not None:
            request.logprobs.append(logprob)
        self._changed[request] = None
        if request.matcher is not None:
            advance(request.matcher, token)
        if (token in self.eos_token_ids and not params.ignore_eos) or token in params.stop_token_ids:
            self._finish(request, "stop")
            return
        new_text = request.detokenizer.add(token)
        may_stop = len(request.output_ids) >= params.min_tokens
        cut = find_stop(request.text, len(new_text), params.stop) if may_stop else None
        if request.matcher is not None and request.matcher.is_stopped():
            self._finish(request, "stop")  # the grammar is complete and allows nothing more
        elif cut is not None:
            request.detokenizer.truncate(cut)
            self._finish(request, "stop")
        elif len(request.output_ids) >= params.max_tokens or request.length >= self.max_context:
            self._finish(request, "length")

    def _finish(self, request: Request, reason: str) -> None:
        self._scheduler.finish(request, reason)
        request.finish_time = time.monotonic()
        self._changed[request] = None

    def _safe_delta(self, request: Request) -> StreamDelta | None:
        """The request's delta; if making it raises, the request ends alone with its error."""
        with self._alone(request):
            return self._delta(request)
        request.finish_reported = True
        return StreamDelta(request.request_id, "", [], None, "error", request.cached_tokens or 0, None, request.error)

    def _delta(self, request: Request) -> StreamDelta | None:
        """What `request` produced since its last delta; text that may begin a stop string waits."""
        text = request.text
        end = len(text) if request.finished else len(text) - held_back(text, request.params.stop)
        new_text, new_ids = text[request.emitted_chars : end], request.output_ids[request.emitted_tokens :]
        if not new_text and not new_ids and not (request.finished and not request.finish_reported):
            return None
        logprobs = request.logprobs[request.emitted_tokens :] if request.params.logprobs is not None else None
        first = request.emitted_tokens == 0 and request.params.prompt_logprobs is not None
        request.emitted_chars, request.emitted_tokens = end, len(request.output_ids)
        request.finish_reported = request.finished
        return StreamDelta(
            request.request_id,
            new_text,
            new_ids,
            logprobs,
            request.finish_reason,
            request.cached_tokens or 0,
            list(request.prompt_logprobs) if first else None,
            request.error,
        )

    def reset_prefix_cache(self) -> None:
        """Drops every prefix-cache entry (vLLM's reset_prefix_cache), announced at once."""
        self.kv.reset_prefix_cache()
        if self._kv_events is not None:
            self._kv_events.publish(self.kv.take_events())

    # ------------------------------------------------------------------ sleep mode

    def sleep(self, level: int = 1) -> int:
        """vLLM's sleep mode. Level 1 gives every KV page back to the system (the weights stay in
        host memory, from where they serve at once); level 2 also drops the weights, reloaded from
        the model's files on waking. The KV cache's address space stays reserved: on waking it
        maps pages on demand again. The requests must have finished (the server drains them
        first). Returns the bytes the KV cache gave back."""
        if not self.config.enable_sleep_mode:
            raise ValueError("sleep mode is off: build the engine with enable_sleep_mode=True (--enable-sleep-mode)")
        if type(level) is not int or level not in (1, 2):
            raise ValueError(f"the sleep level must be 1 (KV cache) or 2 (KV cache and weights), got {level!r}")
        if self.sleep_level is not None:
            raise ValueError(f"the engine already sleeps (level {self.sleep_level}): wake it up first")
        if self.has_unfinished():
            raise ValueError("requests are running: sleep once they have finished, or abort them")
        self.reset_prefix_cache()
        released = self.kv.release_memory()
        if level == 2:
            self.executor.unload()
        self.sleep_level, self._asleep = level, frozenset(WAKE_TAGS)
        return released

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """Wakes the sleeping engine (vLLM's tags: `weights`, `kv_cache`; None: both). The KV
        cache needs nothing to wake (its pages map as requests come); `weights` reloads them after
        level 2. The engine serves again once both are awake."""
        tags = list(WAKE_TAGS if tags is None else tags)
        if unknown := [tag for tag in tags if tag not in WAKE_TAGS]:
            raise ValueError(f"unknown wake_up tags {unknown}: choose from {', '.join(WAKE_TAGS)}")
        if self.sleep_level is None:
            raise ValueError("the engine is awake: there is nothing to wake up")
        if "weights" in tags and self.executor.runner is None:
            model, _ = load_model(self._path, self.config.torch_dtype, gguf_weights=self.config.quantization == "gguf")
            self.executor.load(model)
            del model
            return_freed_memory()
        self._asleep -= set(tags)
        if not self._asleep:
            self.sleep_level = None

    def close(self) -> None:
        if self._kv_events is not None:
            self._kv_events.close()
        self.executor.close()
