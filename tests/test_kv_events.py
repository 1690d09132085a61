"""vLLM's KV events: the prefix cache's stores and evictions, decoded the way vLLM's documented
subscriber decodes them, follow the cache exactly."""

from __future__ import annotations

import argparse
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq

from serving.config import EngineConfig
from serving.kv_events import END_OF_REPLAY, AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch, block_hash
from serving.server.cli_args import kv_events_config
from tests.live_server import MODEL, LiveServer, live_server, openai_client
from vattn import KVCache, KVCacheConfig
from vattn.prefix_cache import CacheCleared, UnitsStored


class Subscriber:
    """vLLM's example consumer: a SUB socket on the topic, batches decoded as KVEventBatch, and
    the set of block hashes the events say are cached."""

    def __init__(self, context: zmq.Context[Any], endpoint: str, topic: str, bind: bool = False) -> None:
        """Connects to the publisher's `endpoint`, or with `bind` binds it (a loopback address
        with no port: `endpoint` is then the one bound, where the publisher connects)."""
        self.sub = context.socket(zmq.SUB)
        self.sub.setsockopt_string(zmq.SUBSCRIBE, topic)
        if bind:
            self.endpoint = f"{endpoint}:{self.sub.bind_to_random_port(endpoint)}"
        else:
            self.endpoint = endpoint
            self.sub.connect(endpoint)
        self.decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        self.cached: set[int] = set()
        self.sequence = -1
        self.stored: list[BlockStored] = []

    def drain(self, timeout_ms: int = 2000) -> list[Any]:
        """Every batch that arrives until none has for `timeout_ms`; applies its events."""
        events = []
        while self.sub.poll(timeout_ms):
            topic, sequence, payload = self.sub.recv_multipart()
            assert topic == b"kv@test"
            assert int.from_bytes(sequence, "big") == self.sequence + 1  # none lost, in order
            self.sequence += 1
            batch = self.decoder.decode(payload)
            assert batch.ts > 0 and batch.data_parallel_rank == 0  # vLLM's, with one rank
            events += batch.events
            timeout_ms = 300
        for event in events:
            if isinstance(event, BlockStored):
                self.stored.append(event)
                self.cached.update(event.block_hashes)
            elif isinstance(event, BlockRemoved):
                assert set(event.block_hashes) <= self.cached
                self.cached.difference_update(event.block_hashes)
            else:
                self.cached.clear()
        return events


def cached_hashes(server: LiveServer) -> set[int]:
    return {block_hash(d) for d in server.on_engine(lambda engine: engine.kv.cache.prefix_digests())}


@pytest.fixture(params=["publisher binds", "publisher connects"])
def events_server(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[LiveServer, Subscriber, str]]:
    """The server publishing to a subscriber: on an ipc:// endpoint it binds, or connecting to
    a tcp:// loopback port the subscriber bound (vLLM's two ways; no wildcard host: connect)."""
    replay = f"ipc://{tmp_path}/replay"
    context: zmq.Context[Any] = zmq.Context()
    connects = request.param == "publisher connects"
    subscriber = Subscriber(context, "tcp://127.0.0.1", "kv@test", bind=True) if connects else None
    endpoint = subscriber.endpoint if subscriber else f"ipc://{tmp_path}/events"
    overrides = {"kv_events_endpoint": endpoint, "kv_events_replay_endpoint": replay, "kv_events_topic": "kv@test"}
    # 16 KiB pages: a unit is 64 tokens; with two slots and no share for the cache alone, a unit
    # is evicted as soon as both slots have moved on
    with live_server(page_size=16 << 10, max_slots=2, prefix_cache_share=0.0, **overrides) as server:
        if subscriber is None:
            subscriber = Subscriber(context, endpoint, "kv@test")
            time.sleep(0.5)  # a SUB socket that connects receives only what is sent after it has joined
        yield server, subscriber, replay
        subscriber.sub.close(linger=0)
    context.term()


def test_events_follow_the_cache_through_matching_eviction_and_reset(
    events_server: tuple[LiveServer, Subscriber, str],
) -> None:
    server, subscriber, _ = events_server
    unit = server.on_engine(lambda engine: engine.kv.cache.config.unit_tokens)
    prompt = list(range(1000, 1000 + 3 * unit + 10))
    generate(server, prompt)
    [stored] = [e for e in subscriber.drain() if isinstance(e, BlockStored)]
    assert stored.parent_block_hash is None and stored.block_size == unit and stored.medium == "CPU"
    assert len(stored.block_hashes) == 3 and stored.token_ids == prompt[: 3 * unit]
    assert subscriber.cached == cached_hashes(server)

    generate(server, [*prompt[: unit + 5], *range(7, 7 + 2 * unit)])  # shares the first unit
    new = [e for e in subscriber.drain() if isinstance(e, BlockStored)]
    assert [e.parent_block_hash for e in new] == [stored.block_hashes[0]]  # chained after the shared one
    assert subscriber.cached == cached_hashes(server)

    for start in (20_000, 30_000, 40_000):  # other prompts take the slots: nothing keeps the old units
        generate(server, list(range(start, start + 2 * unit)))
    events = subscriber.drain()
    assert any(isinstance(e, BlockRemoved) for e in events)
    assert subscriber.cached == cached_hashes(server)

    server.on_engine(lambda engine: engine.reset_prefix_cache())
    assert isinstance(subscriber.drain()[-1], AllBlocksCleared) and subscriber.cached == cached_hashes(server) == set()


def test_a_late_subscriber_replays_what_it_missed(events_server: tuple[LiveServer, Subscriber, str]) -> None:
    server, subscriber, replay_endpoint = events_server
    generate(server, list(range(500, 700)))
    subscriber.drain()
    replay = zmq.Context.instance().socket(zmq.DEALER)  # a REQ socket would take one reply only
    replay.connect(replay_endpoint)
    replay.send_multipart((b"", (0).to_bytes(8, "big")))
    replayed = []
    while True:
        _, topic, sequence, payload = replay.recv_multipart()
        if sequence == END_OF_REPLAY:
            assert payload == b""
            break
        assert topic == b"kv@test"
        replayed.append(msgspec.msgpack.decode(payload, type=KVEventBatch))
    replay.close(linger=0)
    assert len(replayed) == subscriber.sequence + 1
    assert [e for batch in replayed for e in batch.events if isinstance(e, BlockStored)] == subscriber.stored


def test_the_wire_form_is_vllm_array_form() -> None:
    """Each event a tagged array in field order, as vLLM's subscriber example declares them."""
    payload = msgspec.msgpack.encode(
        KVEventBatch(
            ts=1.5,
            events=[BlockStored([7], None, [1, 2], 2, None, "CPU", None), BlockRemoved([7], "CPU")],
            data_parallel_rank=0,
        )
    )
    assert msgspec.msgpack.decode(payload) == [
        1.5,
        [["BlockStored", [7], None, [1, 2], 2, None, "CPU", None], ["BlockRemoved", [7], "CPU"]],
        0,
    ]
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(AllBlocksCleared())) == ["AllBlocksCleared"]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"kv_events_endpoint": "tcp://*:5557", "kv_cache": "paged"}, "they need prefix caching"),
        ({"kv_events_endpoint": "tcp://*:5557", "prefix_caching": False}, "they need prefix caching"),
        ({"kv_events_replay_endpoint": "tcp://*:5558"}, "needs kv_events_endpoint too"),
    ],
)
def test_events_without_a_prefix_cache_are_refused(overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EngineConfig(**overrides)


def test_vllm_kv_events_config_sets_the_same_fields() -> None:
    assert kv_events_config('{"enable_kv_cache_events": true, "topic": "kv"}') == {
        "kv_events_endpoint": "tcp://*:5557",
        "kv_events_topic": "kv",
    }
    assert kv_events_config('{"enable_kv_cache_events": true, "publisher": "null"}') == {}
    assert kv_events_config('{"enable_kv_cache_events": false, "endpoint": "tcp://*:1"}') == {}
    for text, message in (('{"hwm": 5}', "unsupported keys"), ("[1]", "a JSON object"), ("{", "not JSON")):
        with pytest.raises(argparse.ArgumentTypeError, match=message):
            kv_events_config(text)


def test_the_cache_records_events_only_when_asked() -> None:
    shape = {"num_layers": 2, "num_kv_heads": 2, "head_dim": 16, "max_slots": 2, "max_context": 256}
    for record in (False, True):
        with KVCache(KVCacheConfig(**shape, page_size=4096, background=False, record_events=record)) as cache:
            unit = cache.config.unit_tokens
            reqid = cache.alloc_reqid()
            cache.step({reqid: 3 * unit})
            cache.cache_prefix(reqid, list(range(3 * unit)))
            cache.evict_prefix_cache()
            events = cache.take_events()
            if not record:
                assert events == []
                continue
            assert [type(e) for e in events] == [UnitsStored, CacheCleared]
            assert len(events[0].digests) == 3 and events[0].parent is None
            assert cache.take_events() == []
            cache.free_reqid(reqid)


def generate(server: LiveServer, prompt: list[int]) -> None:
    """A completion of token ids through the HTTP API."""
    openai_client(server).completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
