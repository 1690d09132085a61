"""The engine on a thread of its own, so that the event loop only submits and awaits.

The engine thread owns the LLMEngine: it loads the model, then loops: run the commands
the event loop posted (add a request group, abort one), step once, and hand each delta to
its request's asyncio queue. The event loop never waits on a model iteration, and an
abort posted before an iteration starts takes effect before it.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Collection, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from serving.config import EngineConfig
from serving.engine import LLMEngine, SleepingError
from serving.invalid_field import STRUCTURED_OUTPUT, InvalidField
from serving.outputs import StreamDelta
from serving.sampling_params import SamplingParams
from serving.server.errors import NotReadyError, OverloadedError, request_failed
from serving.server.metrics import ModelMetrics
from vattn import PageBudget

log = logging.getLogger("vattn.serve")
T = TypeVar("T")
GRAMMAR_SECONDS = 10.0
"""Longest a request's grammar may take to compile (llguidance's own limits usually stop it first)."""


@dataclass
class _Subscriber:
    """Where the engine thread delivers one request's deltas: its choice index in its group's queue."""

    index: int
    group: asyncio.Queue[tuple[int, StreamDelta] | BaseException]
    loop: asyncio.AbstractEventLoop
    arrival: float
    last_token: float | None = None


class RequestGroup:
    """Requests submitted together (a prompt's n choices, or several prompts), as one stream.

    `close()` (also at the end of `deltas()`, however it ends) aborts what is unfinished
    and gives the group's places in the queue back; calling it again does nothing.
    """

    def __init__(
        self, engine: AsyncEngine, request_ids: list[str], queue: asyncio.Queue[tuple[int, StreamDelta] | BaseException]
    ) -> None:
        self._engine = engine
        self._queue = queue
        self._size = len(request_ids)
        self.unfinished = set(request_ids)
        self.closed = False

    async def deltas(self) -> AsyncIterator[tuple[int, StreamDelta]]:
        """(choice index, delta) as the engine produces them, until every request has finished."""
        try:
            while self.unfinished:
                item = await self._queue.get()
                if isinstance(item, BaseException):
                    raise item
                index, delta = item
                if delta.finished:
                    self.unfinished.discard(delta.request_id)
                if delta.error is not None:  # it ended alone; the group's other choices are aborted
                    raise request_failed(delta.error)
                yield index, delta
        finally:
            self.close()

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self._engine.release_pending(self._size)
        if self.unfinished:
            self._engine.abort(set(self.unfinished))


class AsyncEngine:
    """LLMEngine behind a thread. `max_pending` bounds accepted, unfinished requests."""

    def __init__(
        self, config: EngineConfig, max_pending: int, metrics: ModelMetrics, page_budget: PageBudget | None = None
    ) -> None:
        self.config = config
        self.page_budget = page_budget
        self.max_pending = max_pending
        self.metrics = metrics
        self._engine: LLMEngine | None = None
        """Owned by the engine thread once loaded; the event loop only checks that it exists."""
        self.tokenizer: Any = None
        """The event loop's own copy, so that tokenizing never shares state with the engine thread."""
        self.load_error: BaseException | None = None
        self.num_pending = 0
        """Requests accepted and not finished (changed only on the event loop)."""
        self._loaded = threading.Event()
        """Set once loading has ended, well or not."""
        self._stopping = False
        self.sleep_level: int | None = None
        """The engine's sleep level as the event loop knows it: set before the engine sleeps (new
        requests get 503 from then on), cleared once it is awake."""
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._subscribers: dict[str, _Subscriber] = {}
        """Owned by the engine thread."""
        self._thread = threading.Thread(target=self._run, name="vattn-engine", daemon=True)
        self._compiler = ThreadPoolExecutor(2, thread_name_prefix="vattn-grammar")

    @property
    def ready(self) -> bool:
        """Loaded, awake and not stopping: what /health and every request check."""
        return self._engine is not None and not self._stopping and self._thread.is_alive() and self.sleep_level is None

    @property
    def vocab_size(self) -> int:
        """The model's vocabulary (once loaded: routes check readiness first)."""
        assert self._engine is not None
        return self._engine.vocab_size

    @property
    def max_context(self) -> int:
        """Prompt plus output tokens of one request: the model's limit once loaded, else the configured one."""
        return self._engine.max_context if self._engine else self.config.max_context

    def start(self) -> None:
        self._thread.start()

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Waits for the model to load; False if it failed, or did not load in time."""
        self._loaded.wait(timeout)
        return self.ready

    def stop(self) -> None:
        self._stopping = True
        self._wakeup.set()
        if self._thread.is_alive():
            self._thread.join()
        self._loaded.set()
        self._compiler.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------- event loop side

    async def submit(self, prompts: Sequence[list[int]], params: Sequence[SamplingParams]) -> RequestGroup:
        """Queues prompt i with params i, all or none (bad input raises ValueError, as the engine does)."""
        if not self.ready:
            raise NotReadyError(self.not_ready_reason())
        if self.num_pending + len(prompts) > self.max_pending:
            raise OverloadedError(f"the server has {self.num_pending} requests in progress (limit {self.max_pending})")
        loop = asyncio.get_running_loop()
        group: asyncio.Queue[tuple[int, StreamDelta] | BaseException] = asyncio.Queue()
        arrival = time.monotonic()
        self.num_pending += len(prompts)
        try:
            await self._compile_grammars(params)
            ids = await asyncio.wrap_future(
                self.call(lambda engine: self._add_group(engine, prompts, params, group, loop, arrival))
            )
        except SleepingError as error:  # it fell asleep while the grammars compiled
            self.num_pending -= len(prompts)
            raise NotReadyError(str(error)) from None
        except BaseException:
            self.num_pending -= len(prompts)
            raise
        return RequestGroup(self, ids, group)

    async def _compile_grammars(self, params: Sequence[SamplingParams]) -> None:
        """Compiles the requests' grammars on the compiler threads, never the engine's, within
        GRAMMAR_SECONDS each (ValueError past it): admission then finds them compiled."""
        assert self._engine is not None
        grammars, loop = self._engine.grammars, asyncio.get_running_loop()
        for output in {p.structured_output for p in params if p.structured_output is not None}:
            work = loop.run_in_executor(self._compiler, grammars.compile, output)
            try:
                await asyncio.wait_for(work, GRAMMAR_SECONDS)
            except asyncio.TimeoutError:
                raise InvalidField(
                    STRUCTURED_OUTPUT, f"structured output: compiling it took over {GRAMMAR_SECONDS:g} s"
                ) from None

    async def sleep(self, level: int) -> int:
        """Refuses new requests from now (503), lets those in progress finish, then puts the
        engine to sleep; returns the bytes the KV cache gave back. ValueError: sleep mode is
        off or the engine sleeps already (checked before draining), or the engine's own refusal
        (a level other than 1 or 2)."""
        if not self.config.enable_sleep_mode:
            raise ValueError("sleep mode is off: start the server with --enable-sleep-mode")
        if self.sleep_level is not None:
            raise ValueError(f"the engine already sleeps (level {self.sleep_level}): POST /wake_up first")
        if not self.ready:
            raise NotReadyError(self.not_ready_reason())
        self.sleep_level = level
        try:
            while self.num_pending:  # in-flight requests finish first (new ones get 503 meanwhile)
                await asyncio.sleep(0.01)
            return await asyncio.wrap_future(self.call(lambda engine: engine.sleep(level)))
        except BaseException:
            self.sleep_level = None
            raise

    async def wake_up(self, tags: Sequence[str] | None) -> None:
        """Wakes what `tags` names (None: all); serves again once nothing sleeps. ValueError: the
        engine is awake, or a tag is unknown."""
        if self.sleep_level is None or self._engine is None:
            raise ValueError("the engine is awake: there is nothing to wake up")
        self.sleep_level = await asyncio.wrap_future(self.call(lambda engine: _wake(engine, tags)))

    def release_pending(self, count: int) -> None:
        """Gives back the places of `count` requests that have finished or been aborted."""
        self.num_pending -= count

    def abort(self, request_ids: set[str]) -> None:
        """Ends requests before the engine's next iteration and frees their slots."""
        self._post(lambda engine: self._abort(engine, request_ids))

    def call(self, fn: Callable[[LLMEngine], T]) -> Future[T]:
        """Runs fn(engine) on the engine thread before its next iteration."""
        future: Future[T] = Future()

        def command(engine: LLMEngine) -> None:
            try:
                future.set_result(fn(engine))
            except BaseException as error:
                future.set_exception(error)

        self._post(command)
        return future

    def _post(self, command: Callable[[LLMEngine], None]) -> None:
        self._commands.put(lambda: command(self._engine))  # type: ignore[arg-type]
        self._wakeup.set()

    def not_ready_reason(self) -> str:
        if self.sleep_level is not None and self._engine is not None and not self._stopping:
            return f"the engine sleeps (level {self.sleep_level}): POST /wake_up first"
        if self.load_error is not None:
            return f"the model failed to load: {self.load_error}"
        return "the server is stopping" if self._stopping else "the model is still loading"

    # ------------------------------------------------------------- engine thread side

    def _add_group(
        self,
        engine: LLMEngine,
        prompts: Sequence[list[int]],
        params: Sequence[SamplingParams],
        group: asyncio.Queue[tuple[int, StreamDelta] | BaseException],
        loop: asyncio.AbstractEventLoop,
        arrival: float,
    ) -> list[str]:
        ids = engine.add_requests(prompts, params)
        for index, request_id in enumerate(ids):
            self._subscribers[request_id] = _Subscriber(index, group, loop, arrival)
        self.metrics.observe_prompts(sum(map(len, prompts)))
        return ids

    def _abort(self, engine: LLMEngine, request_ids: Collection[str]) -> None:
        for request_id in request_ids:
            subscriber = self._subscribers.pop(request_id, None)
            if subscriber is None:
                continue  # finished in the iteration before the abort arrived, or never added
            engine.abort(request_id)
            self.metrics.observe_finish(subscriber.arrival, time.monotonic(), "abort", None)

    def _run(self) -> None:
        try:
            engine = LLMEngine(self.config, self.page_budget)
            self.tokenizer = copy.deepcopy(engine.tokenizer)
            self.metrics.update(engine.stats())
            self._engine = engine
            self._compiler.submit(engine.grammars.prepare)
        except BaseException as error:
            self.load_error = error
            log.error("the model failed to load: %s", error)
            log.debug("the model failed to load", exc_info=True)
            return
        finally:
            self._loaded.set()
        try:
            while not self._stopping:
                self._wakeup.clear()
                self._run_commands()
                if not engine.has_unfinished():
                    self.metrics.update(engine.stats())
                    self._wakeup.wait()
                    continue
                try:
                    deltas = engine.step()
                except Exception as error:  # a bug, not bad input: fail what runs, keep serving
                    log.exception("an engine iteration failed; aborting its requests")
                    self._fail_all(engine, error)
                    continue
                self._deliver(engine, deltas)
                self.metrics.update(engine.stats())
        finally:
            self._fail_all(engine, NotReadyError("the server is stopping"))
            engine.close()
            self._engine = None  # the model goes now, whoever still holds this object (FastAPI caches routes)

    def _run_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            command()

    def _deliver(self, engine: LLMEngine, deltas: list[StreamDelta]) -> None:
        now = time.monotonic()
        for delta in deltas:
            subscriber = self._subscribers.get(delta.request_id)
            if subscriber is None:
                continue
            if delta.token_ids:
                self.metrics.observe_tokens(subscriber.arrival, subscriber.last_token, now, len(delta.token_ids))
                subscriber.last_token = now
            if delta.finished:
                del self._subscribers[delta.request_id]
                output = engine.result(delta.request_id)
                self.metrics.observe_finish(subscriber.arrival, now, delta.finish_reason, output)
            _send(subscriber, (subscriber.index, delta))

    def _fail_all(self, engine: LLMEngine, error: BaseException) -> None:
        subscribers, self._subscribers = self._subscribers, {}
        for request_id, subscriber in subscribers.items():
            engine.abort(request_id)
            _send(subscriber, error)


def _wake(engine: LLMEngine, tags: Sequence[str] | None) -> int | None:
    engine.wake_up(tags)
    return engine.sleep_level


def _send(subscriber: _Subscriber, item: tuple[int, StreamDelta] | BaseException) -> None:
    """Hands an item to the subscriber's event loop; a loop already closed has no one to tell."""
    with contextlib.suppress(RuntimeError):
        subscriber.loop.call_soon_threadsafe(subscriber.group.put_nowait, item)
