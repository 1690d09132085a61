"""Tensor parallelism over torch.distributed: each rank holds its share of the attention heads
and MLP columns, and its own vattn cache for its KV heads.

Rank 0 is the engine: it schedules, samples and serves. Every other rank is a follower
process (`python -m serving.tensor_parallel`) that holds no scheduler: before each model
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
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from serving.config import EngineConfig
from serving.executor import ModelExecutor
from serving.kv_store import IterationBatch, KVStore, make_kv_store
from serving.model_loader import ModelShape, load_model, model_shape, return_freed_memory

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


class MirroredKVStore:
    """Rank 0's KV store: every call that changes the cache runs here and is logged for the
    followers, who replay the log before the next iteration (`take_log`)."""

    def __init__(self, store: KVStore) -> None:
        self._store = store
        self._log: list[tuple[str, tuple[Any, ...], Any]] = []

    def __getattr__(self, name: str) -> Any:
        method = getattr(self._store, name)
        if name not in MIRRORED:
            return method

        def logged(*args: Any) -> Any:
            result = method(*args)  # raises before logging: a call that failed changed nothing
            self._log.append((name, args, result))
            return result

        return logged

    def take_log(self) -> list[tuple[str, tuple[Any, ...], Any]]:
        log, self._log = self._log, []
        return log


def replay(store: KVStore, log: Sequence[tuple[str, tuple[Any, ...], Any]]) -> None:
    """A follower's cache takes rank 0's calls; each must give rank 0's result."""
    for name, args, result in log:
        if name == "admit" and result is None:  # rank 0 found no room and took nothing
            continue
        # admit: rank 0 checked the room; the follower, in the same state, takes the slot
        mine = store.cache.alloc_reqid() if name == "admit" else getattr(store, name)(*args)  # type: ignore[attr-defined]
        if mine != result:
            raise RuntimeError(f"tensor-parallel ranks diverged: {name}{args} gave {mine} here, {result} on rank 0")


class TensorParallelExecutor(ModelExecutor):
    """Rank 0's executor: before each iteration it sends the followers the KV-store calls since
    the last one and the iteration's tokens; its projections' partial sums are all-reduced."""

    def __init__(self, model: Any, shape: ModelShape, kv: MirroredKVStore, quantization: str, group: Group) -> None:
        super().__init__(model, shape, kv, quantization, reduce=group.all_reduce)  # type: ignore[arg-type]
        self.group, self.mirrored = group, kv

    def forward(self, ids: list[int], slots: Sequence[int], new_tokens: Sequence[int]) -> tuple[Tensor, IterationBatch]:
        self.group.broadcast(("iterate", self.mirrored.take_log(), ids, list(slots), list(new_tokens)))
        return super().forward(ids, slots, new_tokens)

    def stop_followers(self) -> None:
        self.group.broadcast(("stop", self.mirrored.take_log(), [], [], []))
        dist.destroy_process_group()


def rank_zero(
    config: EngineConfig, model: Any, shape: ModelShape, max_context: int
) -> tuple[MirroredKVStore, TensorParallelExecutor, list[subprocess.Popen[bytes]]]:
    """Rank 0's KV store and executor, with the followers started here when no
    `tp_init_method` says they are started elsewhere."""
    check_divisible(shape, model.config.intermediate_size, config.tensor_parallel_size)  # before any rank starts
    local = config.tp_init_method is None
    if local:
        config = replace(config, tp_init_method=f"tcp://127.0.0.1:{free_port()}")
    followers = start_followers(config) if local else []
    try:
        group = join(config, 0)
        shard = shard_model(model, shape, 0, group.size)
        kv = MirroredKVStore(make_kv_store(config, shard, max_context))
        return kv, TensorParallelExecutor(model, shard, kv, config.quantization, group), followers
    except BaseException:
        for follower in followers:
            follower.kill()
        raise


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def start_followers(config: EngineConfig) -> list[subprocess.Popen[bytes]]:
    """Ranks 1.. of a tensor-parallel engine as processes on this machine, each with its share of
    the CPUs' threads (rank 0 takes its own share too)."""
    fields = json.dumps(dataclasses.asdict(config))
    threads = max(1, len(os.sched_getaffinity(0)) // config.tensor_parallel_size)
    torch.set_num_threads(threads)
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    return [
        subprocess.Popen(
            [sys.executable, "-m", "serving.tensor_parallel", "--rank", str(rank), "--config", fields], env=env
        )
        for rank in range(1, config.tensor_parallel_size)
    ]


def follow(config: EngineConfig, rank: int) -> None:
    """A follower rank: its shard of the model and its own cache, driven by rank 0 until it stops."""
    group = join(config, rank)
    model, _ = load_model(str(config.model), config.torch_dtype)
    shape = model_shape(model)
    max_context = min(config.max_context, shape.max_position)
    shard = shard_model(model, shape, rank, group.size)
    kv = make_kv_store(config, shard, max_context)
    executor = ModelExecutor(model, shard, kv, config.quantization, reduce=group.all_reduce)
    del model
    return_freed_memory()
    try:
        while True:
            command, log, ids, slots, new_tokens = group.broadcast(None)
            replay(kv, log)
            if command == "stop":
                return
            executor.forward(ids, slots, new_tokens)
    finally:
        kv.close()
        if dist.is_initialized():
            dist.destroy_process_group()


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="A follower rank of a tensor-parallel vattn engine")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--config", required=True, help="the engine's EngineConfig as JSON")
    args = parser.parse_args(argv)
    follow(EngineConfig(**json.loads(args.config)), args.rank)


if __name__ == "__main__":
    main()
