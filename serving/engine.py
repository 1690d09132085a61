"""The engine: requests in, one batched model iteration per step(), tokens and text out.

Data flows one way: engine -> scheduler (what runs, preemption) -> KV cache (pages) ->
VMM backend; the model runner reads and writes KV only through an attention kernel.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch

from serving.detokenizer import IncrementalDetokenizer
from serving.model_runner import ModelRunner, load_model, model_shape
from serving.model_store import ensure_default_model
from serving.outputs import RequestOutput, StreamDelta
from serving.sampler import sample
from serving.sampling_params import SamplingParams
from serving.scheduler import Scheduler
from serving.sequence import Sequence, TokenLogprob
from vattn import KVCache, KVCacheConfig
from vattn.kernels import make_kernel

MiB = 1 << 20


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = None
    """A safetensors folder or .gguf file; None is the default model (fetched on first use)."""
    dtype: str = "float32"
    max_slots: int = 64
    """Requests running at once (KV slots)."""
    max_context: int = 2048
    """Prompt plus output tokens of one request (capped at the model's own limit)."""
    max_batched_tokens: int = 256
    """Tokens one iteration computes: prefill chunks plus decodes."""
    kv_budget: int = 1024 * MiB
    """Physical bytes the KV cache may map."""
    page_size: int = 64 * 1024
    backend: str = "host"
    kernel: str = "sdpa"
    seed: int = 0
    """Random stream of requests that give no seed of their own."""


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None) -> None:
        self.config = config = config or EngineConfig()
        if not isinstance(config.max_batched_tokens, int) or config.max_batched_tokens < 1:
            raise ValueError(f"max_batched_tokens must be a positive integer, got {config.max_batched_tokens!r}")
        dtype = getattr(torch, config.dtype, None)
        if dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {config.dtype!r}")
        model, self.tokenizer = load_model(config.model or ensure_default_model(), dtype)
        shape = model_shape(model)
        self.max_context = min(config.max_context, shape.max_position)
        cache_config = KVCacheConfig(
            num_layers=shape.num_layers,
            num_kv_heads=shape.num_kv_heads,
            head_dim=shape.head_dim,
            max_slots=config.max_slots,
            max_context=self.max_context,
            dtype=dtype,
            page_size=config.page_size,
            backend=config.backend,
            memory_budget=config.kv_budget,
        )
        full_request = cache_config.pages_for(self.max_context) * cache_config.num_buffers * config.page_size
        if config.kv_budget < full_request:
            raise ValueError(
                f"kv_budget {config.kv_budget} B cannot hold one request at the max context "
                f"({self.max_context} tokens need {full_request} B): raise it or lower max_context"
            )
        self.cache = KVCache(cache_config)
        self.runner = ModelRunner(model, make_kernel(config.kernel, self.cache, shape.num_query_heads))
        self.scheduler = Scheduler(self.cache, config.max_batched_tokens)
        self._requests: dict[str, Sequence] = {}
        self._ids = itertools.count()
        self._generator = torch.Generator().manual_seed(config.seed)
        eos = model.generation_config.eos_token_id if model.generation_config else None
        eos = eos if eos is not None else self.tokenizer.eos_token_id
        self.eos_token_ids = frozenset(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        self._changed: dict[Sequence, None] = {}
        """Requests that moved since the last step() returned (ordered, no repeats)."""
        self.iterations = 0

    # ------------------------------------------------------------------ requests

    def add_request(
        self, prompt: str | Seq[int], params: SamplingParams | None = None, request_id: str | None = None
    ) -> str:
        """Queues a prompt (text or token ids); returns its id. Bad input raises ValueError."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be SamplingParams, got {type(params).__name__}")
        text, ids = self._prompt_ids(prompt)
        if len(ids) >= self.max_context:
            raise ValueError(
                f"the prompt has {len(ids)} tokens but the max context is {self.max_context} "
                "(prompt plus at least one generated token)"
            )
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        seq = Sequence(
            request_id=request_id,
            prompt=text,
            prompt_ids=ids,
            params=params,
            detokenizer=IncrementalDetokenizer(self.tokenizer, ids),
            generator=None if params.seed is None else torch.Generator().manual_seed(params.seed),
        )
        self._requests[request_id] = seq
        self.scheduler.add(seq)
        return request_id

    def abort(self, request_id: str) -> None:
        """Ends a request now; its slot is free before the next iteration."""
        seq = self._requests.get(request_id)
        if seq is not None and not seq.finished:
            self._finish(seq, "abort")

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    def result(self, request_id: str) -> RequestOutput:
        """A finished request's output; the engine forgets it."""
        seq = self._requests[request_id]
        if not seq.finished:
            raise ValueError(f"request {request_id!r} has not finished")
        del self._requests[request_id]
        self._changed.pop(seq, None)
        return RequestOutput.of(seq)

    # ------------------------------------------------------------------ iterations

    def step(self) -> list[StreamDelta]:
        """Runs one iteration; returns what each request that moved (or ended) produced."""
        batch = self.scheduler.schedule()
        if batch is not None:
            self._run(batch.seqs, batch.new_tokens, [batch.samples(i) for i in range(len(batch.seqs))])
        deltas = [delta for seq in self._changed if (delta := self._delta(seq)) is not None]
        self._changed.clear()
        return deltas

    def _run(self, seqs: list[Sequence], new_tokens: list[int], samples: list[bool]) -> None:
        ids: list[int] = []
        positions: list[int] = []
        for seq, n in zip(seqs, new_tokens, strict=True):
            ids += seq.all_ids[seq.num_computed : seq.num_computed + n]
            positions += range(seq.num_computed, seq.num_computed + n)
        attention = self.runner.kernel.plan([seq.reqid for seq in seqs], new_tokens)
        device = self.cache.device
        hidden = self.runner.forward(
            torch.tensor(ids, device=device), torch.tensor(positions, device=device), attention
        )
        for seq, n in zip(seqs, new_tokens, strict=True):
            seq.num_computed += n
        self.iterations += 1
        rows = [attention.starts[i + 1] - 1 for i, sampled in enumerate(samples) if sampled]
        if not rows:
            return
        sampled_seqs = [seq for seq, sampled in zip(seqs, samples, strict=True) if sampled]
        logits = self.runner.logits(hidden[torch.tensor(rows, device=device)]).cpu()
        for seq, (token, logprob) in zip(sampled_seqs, sample(logits, sampled_seqs, self._generator), strict=True):
            self._append(seq, token, logprob)

    def _append(self, seq: Sequence, token: int, logprob: TokenLogprob | None) -> None:
        """Adds a sampled token, its text, and ends the request if a stop condition is met."""
        params = seq.params
        if seq.first_token_time is None:
            seq.first_token_time = time.monotonic()
        seq.output_ids.append(token)
        if logprob is not None:
            seq.logprobs.append(logprob)
        self._changed[seq] = None
        if (token in self.eos_token_ids and not params.ignore_eos) or token in params.stop_token_ids:
            self._finish(seq, "stop")
            return
        seq.detokenizer.add(token)
        cut = _stop_index(seq.text, params.stop)
        if cut is not None:
            seq.detokenizer.truncate(cut)
            self._finish(seq, "stop")
        elif len(seq.output_ids) >= params.max_tokens or seq.length >= self.max_context:
            self._finish(seq, "length")

    def _finish(self, seq: Sequence, reason: str) -> None:
        self.scheduler.finish(seq, reason)
        seq.finish_time = time.monotonic()
        self._changed[seq] = None

    def _delta(self, seq: Sequence) -> StreamDelta | None:
        """What `seq` produced since its last delta; text that may begin a stop string waits."""
        text = seq.text if seq.finished else seq.text[: len(seq.text) - _held_back(seq.text, seq.params.stop)]
        new_text, new_ids = text[seq.emitted_chars :], seq.output_ids[seq.emitted_tokens :]
        if not new_text and not new_ids and not (seq.finished and not seq.finish_reported):
            return None
        logprobs = seq.logprobs[seq.emitted_tokens :] if seq.params.logprobs is not None else None
        seq.emitted_chars, seq.emitted_tokens = len(text), len(seq.output_ids)
        seq.finish_reported = seq.finished
        return StreamDelta(seq.request_id, new_text, new_ids, logprobs, seq.finish_reason)

    def _prompt_ids(self, prompt: str | Seq[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("the prompt is empty")
            return prompt, self.tokenizer.encode(prompt, add_special_tokens=True)
        ids = list(prompt) if isinstance(prompt, list | tuple) else None
        if ids is None or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise ValueError(f"a prompt is a string or a list of token ids, got {type(prompt).__name__}")
        if not ids:
            raise ValueError("the prompt is empty")
        vocab = self.runner.shape.vocab_size
        if any(not 0 <= t < vocab for t in ids):
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        return None, ids

    def close(self) -> None:
        self.cache.close()


def _stop_index(text: str, stops: tuple[str, ...]) -> int | None:
    """Where the earliest stop string starts in `text`, or None."""
    found = [i for stop in stops if (i := text.find(stop)) >= 0]
    return min(found) if found else None


def _held_back(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest end of `text` that could still grow into a stop string."""
    return max(
        (n for stop in stops for n in range(min(len(stop) - 1, len(text)), 0, -1) if stop.startswith(text[-n:])),
        default=0,
    )
