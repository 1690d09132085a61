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
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from serving.config import EngineConfig
from serving.model.loader import ModelShape

IDLE_TIMEOUT = datetime.timedelta(days=30)
"""How long a follower waits for rank 0's next iteration (torch's 30-minute default would end an
idle server's followers)."""


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
class Ranks:
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


def join(config: EngineConfig, rank: int) -> Ranks:
    backend = "nccl" if config.backend == "cuda" else "gloo"
    dist.init_process_group(
        backend,
        init_method=config.tp_init_method,
        rank=rank,
        world_size=config.tensor_parallel_size,
        timeout=IDLE_TIMEOUT,
    )
    return Ranks(rank, config.tensor_parallel_size)


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
