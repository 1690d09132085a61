"""vLLM's KV events over ZMQ: the prefix cache's stores and evictions, for cache-aware routers.

The wire format is vLLM's (`vllm/distributed/kv_events.py`, as its documented subscriber
example decodes it): each engine step that changed the cache sends one msgpack `EventBatch`
`[ts, [event, ...], data_parallel_rank]` (rank 0, as vLLM fills it in) as the ZMQ multipart message (topic, 8-byte
big-endian sequence number, payload) on a PUB socket, every event a tagged array:
`["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium,
lora_name]`, `["BlockRemoved", block_hashes, medium]`, `["AllBlocksCleared"]`. The array
form is the one every consumer reads (llm-d's decoder reads no other). A block is a
prefix-cache unit (`KVCacheConfig.unit_tokens` tokens) and its hash the low 64 bits of the
unit's digest, as vLLM sends its hashes by default. An optional ROUTER socket replays
buffered batches from a sequence number on, ending with sequence -1 and an empty payload.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

try:
    import msgspec
    import zmq
except ImportError as missing:
    package = "pyzmq" if missing.name == "zmq" else missing.name
    raise ModuleNotFoundError(
        f"KV events (kv_events_endpoint) need the {package} package, which is not installed here: "
        "pip install msgspec pyzmq",
        name=missing.name,
    ) from missing

from serving.config import EngineConfig
from vattn.prefix_cache import CacheCleared, CacheEvent, UnitsRemoved, UnitsStored

log = logging.getLogger("vattn.kv_events")

END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """The base of the events: each encodes as an array led by its class name."""


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


def block_hash(digest: bytes) -> int:
    """A unit's digest as vLLM's default external block hash: its low 64 bits, unsigned."""
    return int.from_bytes(digest[-8:], "big")


def wire_event(event: CacheEvent, medium: str) -> BlockStored | BlockRemoved | AllBlocksCleared:
    if isinstance(event, UnitsStored):
        parent = None if event.parent is None else block_hash(event.parent)
        hashes = [block_hash(digest) for digest in event.digests]
        return BlockStored(hashes, parent, list(event.tokens), event.unit_tokens, None, medium, None)
    if isinstance(event, UnitsRemoved):
        return BlockRemoved([block_hash(digest) for digest in event.digests], medium)
    assert isinstance(event, CacheCleared)
    return AllBlocksCleared()


@dataclass(frozen=True)
class KVEventsConfig:
    """vLLM's KVEventsConfig fields that a publisher uses."""

    endpoint: str = "tcp://*:5557"
    """Bound if it has a wildcard host (`*`, `::`) or is ipc:// or inproc://, else connected to
    (one consumer, which binds: batches wait for its subscription instead of being dropped)."""
    replay_endpoint: str | None = None
    topic: str = ""
    buffer_steps: int = 10_000
    """Batches kept for replay."""
    hwm: int = 100_000


class KVEventPublisher:
    """Sends event batches from a thread of its own, which also answers replay requests."""

    def __init__(self, config: KVEventsConfig, medium: str) -> None:
        self.config, self.medium = config, medium
        self._context = zmq.Context()
        self._queue: queue.Queue[KVEventBatch | None] = queue.Queue()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._sequence = itertools.count()
        self._binds = _binds(config.endpoint)
        # Connected, an XPUB: it sees the consumer's subscription, which a bound SUB sends only
        # once its owner first polls it, and batches are held until then (a PUB drops them).
        self._pub = self._context.socket(zmq.PUB if self._binds else zmq.XPUB)
        self._pub.set_hwm(config.hwm)
        self._held: list[tuple[int, bytes]] | None = None if self._binds else []
        """Batches sent before a connected publisher's consumer subscribed (bounded by buffer_steps)."""
        self._replay = self._context.socket(zmq.ROUTER) if config.replay_endpoint else None
        try:
            (self._pub.bind if self._binds else self._pub.connect)(config.endpoint)
            if self._replay is not None:
                self._replay.bind(str(config.replay_endpoint))
        except zmq.ZMQError as error:
            self._close_sockets()
            raise ValueError(f"cannot open the KV events endpoint: {error}") from error
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()

    def publish(self, events: list[CacheEvent]) -> None:
        """Queues one batch of the step's events (nothing when there are none)."""
        if events:
            wire = [wire_event(event, self.medium) for event in events]
            self._queue.put(KVEventBatch(ts=time.time(), events=wire, data_parallel_rank=0))  # type: ignore[arg-type]

    def close(self, timeout: float = 5.0) -> None:
        """Sends what is queued, then closes the sockets."""
        self._queue.put(None)
        self._thread.join(timeout)
        self._close_sockets()

    def _run(self) -> None:
        encoder = msgspec.msgpack.Encoder()
        topic = self.config.topic.encode()
        while True:
            if self._replay is not None and self._replay.poll(0):
                self._answer_replay(topic)
            if self._held is not None and self._pub.poll(0):
                self._pub.recv()  # the consumer's subscription: what was held goes now
                for sequence, payload in self._held:
                    self._pub.send_multipart((topic, sequence.to_bytes(8, "big"), payload))
                self._held = None
            try:
                batch = self._queue.get(timeout=0.05)
            except queue.Empty:
                continue
            if batch is None:
                return
            sequence, payload = next(self._sequence), encoder.encode(batch)
            if self._held is not None:
                self._held = [*self._held, (sequence, payload)][-self.config.buffer_steps :]
            else:
                self._pub.send_multipart((topic, sequence.to_bytes(8, "big"), payload))
            self._buffer.append((sequence, payload))

    def _answer_replay(self, topic: bytes) -> None:
        """A request [client, b"", start sequence] gets every buffered batch from that sequence on."""
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) != 3:
            log.warning("a KV events replay request had %d frames, not 3; ignored", len(frames))
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for sequence, payload in list(self._buffer):
            if sequence >= first:
                self._replay.send_multipart((client, b"", topic, sequence.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", b"", END_OF_REPLAY, b""))

    def _close_sockets(self) -> None:
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=1000)
        self._context.term()


def _binds(endpoint: str) -> bool:
    """Whether the publisher binds `endpoint` (a wildcard host, ipc://, inproc://) or connects to it, as vLLM's."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def kv_event_publisher(config: EngineConfig) -> KVEventPublisher:
    """The engine's publisher to `kv_events_endpoint` (set)."""
    assert config.kv_events_endpoint is not None
    events = KVEventsConfig(config.kv_events_endpoint, config.kv_events_replay_endpoint, config.kv_events_topic)
    return KVEventPublisher(events, medium="GPU" if config.backend == "cuda" else "CPU")
