"""Tensor parallelism over torch.distributed: each rank holds its share of the attention heads
and MLP columns, and its own vattn cache for its KV heads.

Rank 0 is the engine: it schedules, samples and serves. Every other rank is a follower
process (`python -m serving.executor`, serving.executor.follow) that holds no scheduler: before each model
iteration rank 0 broadcasts the KV-store calls it made since the last one and the
iteration's tokens, and the follower replays the calls on its own cache and runs its
shard of the same forward pass. The all-reduces after the attention output projection and
after the MLP's down projection join the ranks' partial sums (Megatron-LM's split, as vLLM's
ColumnParallel / RowParallel layers). Every rank maps synchronously (no background mapper), so
each allocator takes the same decisions from the same calls, which the followers check: the
same slot handed out, the same prefix matched.

Gloo carries the collectives on the CPU (NCCL on CUDA); ranks meet at `tp_init_method`
(torch's `tcp://host:port` rendezvous): on one machine rank 0 starts the others on a free
loopback port; across machines each follower is started by hand (README, "Scaling out").
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import socket
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from serving.config import EngineConfig
from serving.kv_store import IterationBatch, KVStore
from serving.model_loader import ModelShape
from vattn import CacheStats
from vattn.prefix_cache import CacheEvent

IDLE_TIMEOUT = datetime.timedelta(days=30)
"""How long a follower waits for rank 0's next iteration (torch's 30-minute default would end an
idle server's followers)."""
MIRRORED = ("admit", "reuse_prefix", "remember", "fork", "grow", "free", "reset_prefix_cache")
"""The KV-store calls that change a cache: rank 0's are replayed on every follower, in order."""


def check_divisible(shape: ModelShape, intermediate: int, size: int) -> None:
    """ValueError unless the heads and MLP columns split evenly over `size` ranks."""
    for name, count in (("KV heads", shape.num_kv_heads), ("query heads", shape.num_query_heads)):
        if count % size:
            raise ValueError(
                f"tensor_parallel_size {size} must divide the model's {count} {name} (each rank holds whole "
                f"heads; KV heads are not replicated): use a size that divides {shape.num_kv_heads} and "
                f"{shape.num_query_heads}, or 1"
            )
    if intermediate % size:
        raise ValueError(f"tensor_parallel_size {size} must divide the MLP's {intermediate} columns")


def shard_model(model: Any, shape: ModelShape, rank: int, size: int) -> ModelShape:
    """Keeps this rank's share of every layer's projections, in place: query and KV heads and
    gate/up rows split by rank, the output and down projections' inputs likewise (their biases
    only on rank 0, since the ranks' outputs are summed); the shape of this rank's share."""
    check_divisible(shape, model.config.intermediate_size, size)

    def rows(linear: torch.nn.Linear, parts: int) -> None:
        share = linear.out_features // parts
        linear.weight = torch.nn.Parameter(linear.weight.data[rank * share : (rank + 1) * share].clone())
        if linear.bias is not None:
            linear.bias = torch.nn.Parameter(linear.bias.data[rank * share : (rank + 1) * share].clone())
        linear.out_features = share

    def columns(linear: torch.nn.Linear, parts: int) -> None:
        share = linear.in_features // parts
        linear.weight = torch.nn.Parameter(linear.weight.data[:, rank * share : (rank + 1) * share].clone())
        if linear.bias is not None and rank:
            linear.bias = torch.nn.Parameter(torch.zeros_like(linear.bias.data))
        linear.in_features = share

    for layer in model.model.layers:
        attention, mlp = layer.self_attn, layer.mlp
        for projection in (attention.q_proj, attention.k_proj, attention.v_proj, mlp.gate_proj, mlp.up_proj):
            rows(projection, size)
        columns(attention.o_proj, size)
        columns(mlp.down_proj, size)
    return replace(shape, num_query_heads=shape.num_query_heads // size, num_kv_heads=shape.num_kv_heads // size)


@dataclass
class Group:
    """This process's place among the ranks."""

    rank: int
    size: int

    def all_reduce(self, tensor: Tensor) -> Tensor:
        dist.all_reduce(tensor)
        return tensor

    def broadcast(self, message: Any) -> Any:
        """Rank 0's `message`, on every rank."""
        box = [message]
        dist.broadcast_object_list(box, src=0)
        return box[0]


def join(config: EngineConfig, rank: int) -> Group:
    backend = "nccl" if config.backend == "cuda" else "gloo"
    dist.init_process_group(
        backend,
        init_method=config.tp_init_method,
        rank=rank,
        world_size=config.tensor_parallel_size,
        timeout=IDLE_TIMEOUT,
    )
    return Group(rank, config.tensor_parallel_size)


class MirroredKVStore(KVStore):
    """Rank 0's KV store: every call that changes the cache (MIRRORED) runs here and is logged
    for the followers, who replay the log before the next iteration (`take_log`)."""

    def __init__(self, store: KVStore) -> None:
        self._store = store
        self.device = store.device
        self._log: list[tuple[str, tuple[Any, ...], Any]] = []

    def take_log(self) -> list[tuple[str, tuple[Any, ...], Any]]:
        log, self._log = self._log, []
        return log

    def _logged(self, name: str, call: Callable[..., Any], *args: Any) -> Any:
        result = call(*args)  # raises before logging: a call that failed changed nothing
        self._log.append((name, args, result))
        return result

    def admit(self, num_tokens: int, growing: Mapping[int, int] | None = None) -> int | None:
        return self._logged("admit", self._store.admit, num_tokens, growing)

    def reuse_prefix(self, slot: int, token_ids: Sequence[int], salt: str | None = None) -> int:
        return self._logged("reuse_prefix", self._store.reuse_prefix, slot, token_ids, salt)

    def remember(self, slot: int, token_ids: Sequence[int]) -> None:
        self._logged("remember", self._store.remember, slot, token_ids)

    def fork(self, slot: int) -> int | None:
        return self._logged("fork", self._store.fork, slot)

    def grow(self, lengths: Mapping[int, int]) -> None:
        self._logged("grow", self._store.grow, lengths)

    def free(self, slot: int) -> None:
        self._logged("free", self._store.free, slot)

    def reset_prefix_cache(self) -> None:
        self._logged("reset_prefix_cache", self._store.reset_prefix_cache)

    def fork_min_tokens(self) -> int | None:
        return self._store.fork_min_tokens()

    def slot_bytes(self, num_tokens: int) -> int:
        return self._store.slot_bytes(num_tokens)

    def plan(self, slots: Sequence[int], new_tokens: Sequence[int]) -> IterationBatch:
        return self._store.plan(slots, new_tokens)

    def attend(self, layer: int, batch: IterationBatch, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return self._store.attend(layer, batch, q, k, v)

    def stats(self) -> CacheStats:
        return self._store.stats()

    def take_events(self) -> list[CacheEvent]:
        return self._store.take_events()

    def release_memory(self) -> int:
        return self._store.release_memory()

    def close(self) -> None:
        self._store.close()


def replay(store: KVStore, log: Sequence[tuple[str, tuple[Any, ...], Any]]) -> None:
    """A follower's cache takes rank 0's calls; each must give rank 0's result (a follower's
    cache holds 1/size of rank 0's bytes per token under the same budget, so it has room
    wherever rank 0 had)."""
    for name, args, result in log:
        if name == "admit" and result is None:  # rank 0 found no room and took nothing
            continue
        mine = getattr(store, name)(*args)
        if mine != result:
            raise RuntimeError(f"tensor-parallel ranks diverged: {name}{args} gave {mine} here, {result} on rank 0")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def start_followers(config: EngineConfig, module: str) -> list[subprocess.Popen[bytes]]:
    """Ranks 1.. of a tensor-parallel engine as processes on this machine (`python -m module
    --rank R --config JSON`, read by `follower_arguments`), each with its share of the CPUs'
    threads (rank 0 takes its own share too)."""
    fields = json.dumps(dataclasses.asdict(config))
    threads = max(1, len(os.sched_getaffinity(0)) // config.tensor_parallel_size)
    torch.set_num_threads(threads)
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    return [
        subprocess.Popen([sys.executable, "-m", module, "--rank", str(rank), "--config", fields], env=env)
        for rank in range(1, config.tensor_parallel_size)
    ]


def follower_arguments(argv: Sequence[str] | None = None) -> tuple[EngineConfig, int]:
    """A follower process's command line: the engine's config and this rank."""
    parser = argparse.ArgumentParser(description="A follower rank of a tensor-parallel vattn engine")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--config", required=True, help="the engine's EngineConfig as JSON")
    args = parser.parse_args(argv)
    return EngineConfig(**json.loads(args.config)), args.rank
