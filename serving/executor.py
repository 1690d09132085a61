"""The model executor: one batched model iteration over the KV store, for every driver.

It owns the KV store's compute side and the model runner. The continuous-batching engine
(serving.engine) and beam search (serving.beam_search) each decide what runs and drive it.
`make_executor` builds the KV store and the executor for a config; with tensor parallelism,
rank 0's executor, whose KV store logs the calls that change the cache (MirroredKVStore) for
the follower ranks (`follow`, this module run with `python -m`) to replay, and which its
`close` stops, so no driver knows that ranks exist. The ranks' mechanics (process group,
sharding, starting followers) are serving.model.tensor_parallel's.
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import Tensor

from serving.config import EngineConfig
from serving.heap import keep_freed_blocks, return_freed_memory
from serving.kv_store import IterationBatch, KVStore, make_kv_store
from serving.model import tensor_parallel
from serving.model.loader import ModelShape, load_model, model_shape
from serving.model.runner import ModelRunner, Reduce
from serving.model.tensor_parallel import Ranks
from vattn import CacheStats, PageBudget
from vattn.prefix_cache import CacheEvent


class KVSequence(Protocol):
    """What `ModelExecutor.compute` reads and advances: tokens whose KV a slot holds up to `num_computed`."""

    slot: int | None
    num_computed: int

    @property
    def all_ids(self) -> list[int]: ...


class ModelExecutor:
    """The model on the KV store's device, and the iterations it has run."""

    def __init__(
        self, model: Any, shape: ModelShape, kv: KVStore, quantization: str, reduce: Reduce | None = None
    ) -> None:
        # The weights (loaded on the CPU, in the engine's dtype) go where the KV cache is,
        # before the runner fuses copies of them there. Only the device changes: the rotary
        # table's float32 `inv_freq` keeps its precision.
        self.kv = kv
        self.shape, self.quantization, self.reduce = shape, quantization, reduce
        self.runner: ModelRunner | None = None
        """None while the weights are unloaded (sleep level 2)."""
        self.load(model)
        self.vocab_size = shape.vocab_size
        self.iterations = 0
        self.last_iteration_tokens = 0
        """Tokens the last iteration computed (its prompt chunks and decodes)."""

    def compute(self, sequences: Sequence[KVSequence], new_tokens: Sequence[int], rows: Sequence[int]) -> Tensor:
        """One model iteration: sequence i's next `new_tokens[i]` tokens go into its slot (which
        the caller grew), its `num_computed` advances and the prefix cache learns them. Returns
        float32 CPU logits `[sum(rows), vocab]` after each of the last `rows[i]` new tokens of
        sequence i (1: the next token's; 0: none), sequence by sequence."""
        ids: list[int] = []
        for sequence, n in zip(sequences, new_tokens, strict=True):
            ids += sequence.all_ids[sequence.num_computed : sequence.num_computed + n]
        hidden, attention = self.forward(ids, [s.slot for s in sequences], new_tokens)  # type: ignore[misc]
        device = self.kv.device
        for sequence, n in zip(sequences, new_tokens, strict=True):
            sequence.num_computed += n
            self.kv.remember(sequence.slot, sequence.all_ids[: sequence.num_computed])  # type: ignore[arg-type]
        self.iterations += 1
        self.last_iteration_tokens = len(ids)
        wanted = [
            row
            for i, count in enumerate(rows)
            for row in range(attention.starts[i + 1] - count, attention.starts[i + 1])
        ]
        if not wanted:
            return torch.empty(0, self.vocab_size)
        return self._to_host(self._loaded().logits(hidden[torch.tensor(wanted, device=device)]))

    def forward(self, ids: list[int], slots: Sequence[int], new_tokens: Sequence[int]) -> tuple[Tensor, IterationBatch]:
        """Plans the iteration's attention and runs the model: hidden states and the plan."""
        attention = self.kv.plan(slots, new_tokens)
        return self._loaded().forward(torch.tensor(ids, device=self.kv.device), attention), attention

    def load(self, model: Any) -> None:
        """Builds the runner on a loaded model, moved where the KV cache is."""
        model.to(device=self.kv.device)
        self.runner = ModelRunner(model, self.shape, self.kv.attend, self.quantization, self.reduce)

    def unload(self) -> None:
        """Drops the runner and with it the weights (sleep level 2), until `load`."""
        self.runner = None
        return_freed_memory()

    def _loaded(self) -> ModelRunner:
        if self.runner is None:
            raise RuntimeError("the model's weights are unloaded (asleep at level 2): wake the engine up first")
        return self.runner

    def close(self) -> None:
        """Closes the KV store (its pages and address space go back)."""
        self.kv.close()

    def _to_host(self, logits: Tensor) -> Tensor:
        """The iteration's one device-to-host transfer: the wanted rows' float32 logits, on the KV
        cache's device, copied to the CPU, where the sampler reads them. (the CUDA dry run's
        executor overrides it: its fake CUDA tensors hold no values to copy.)"""
        return logits.cpu()


MIRRORED = ("admit", "reuse_prefix", "remember", "fork", "grow", "free", "reset_prefix_cache")
"""The KV-store calls that change a cache: rank 0's are replayed on every follower, in order."""


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


class TensorParallelExecutor(ModelExecutor):
    """Rank 0's executor: before each iteration it sends the followers the KV-store calls since
    the last one and the iteration's tokens; its projections' partial sums are all-reduced.
    Closing it stops the followers (and waits for those it started)."""

    def __init__(
        self,
        model: Any,
        shape: ModelShape,
        kv: MirroredKVStore,
        quantization: str,
        ranks: Ranks,
        followers: list[subprocess.Popen[bytes]],
    ) -> None:
        super().__init__(model, shape, kv, quantization, reduce=ranks.all_reduce)
        self.ranks, self.mirrored, self.followers = ranks, kv, followers

    def forward(self, ids: list[int], slots: Sequence[int], new_tokens: Sequence[int]) -> tuple[Tensor, IterationBatch]:
        self.ranks.broadcast(("iterate", self.mirrored.take_log(), ids, list(slots), list(new_tokens)))
        return super().forward(ids, slots, new_tokens)

    def close(self) -> None:
        """Stops the followers; the process group and this rank's cache go even if a follower
        is gone already (a broken broadcast is raised after)."""
        try:
            self.ranks.broadcast(("stop", self.mirrored.take_log(), [], [], []))
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
            for follower in self.followers:
                try:
                    follower.wait(60)
                except subprocess.TimeoutExpired:
                    follower.kill()
            super().close()


def make_executor(
    config: EngineConfig,
    model: Any,
    shape: ModelShape,
    max_context: int,
    page_budget: PageBudget | None = None,
    executor_type: type[ModelExecutor] = ModelExecutor,
) -> ModelExecutor:
    """The KV store and the executor over it for `config` (`config.model` a path: tensor
    parallelism's followers load the same files); the executor owns both (`close`)."""
    if config.tensor_parallel_size > 1:
        if page_budget is not None:
            raise ValueError("several models on one KV budget run without tensor parallelism")
        return _rank_zero(config, model, shape, max_context)
    kv = make_kv_store(config, shape, max_context, page_budget)
    try:
        return executor_type(model, shape, kv, config.quantization)
    except BaseException:
        kv.close()
        raise


def _rank_zero(config: EngineConfig, model: Any, shape: ModelShape, max_context: int) -> TensorParallelExecutor:
    """Rank 0's executor, with the followers started here when no `tp_init_method` says they
    are started elsewhere."""
    tensor_parallel.check_divisible(shape, model.config.intermediate_size, config.tensor_parallel_size)
    local = config.tp_init_method is None
    if local:
        config = replace(config, tp_init_method=f"tcp://127.0.0.1:{tensor_parallel.free_port()}")
    followers = tensor_parallel.start_followers(config, "serving.executor") if local else []
    try:
        ranks = tensor_parallel.join(config, 0)
        shard = tensor_parallel.shard_model(model, shape, 0, ranks.size)
        kv = MirroredKVStore(make_kv_store(config, shard, max_context))
        return TensorParallelExecutor(model, shard, kv, config.quantization, ranks, followers)
    except BaseException:
        for follower in followers:
            follower.kill()
        raise


def follow(config: EngineConfig, rank: int) -> None:
    """A follower rank: its shard of the model and its own cache, driven by rank 0 until it stops."""
    ranks = tensor_parallel.join(config, rank)
    model, _ = load_model(str(config.model), config.torch_dtype)
    shape = model_shape(model)
    shard = tensor_parallel.shard_model(model, shape, rank, ranks.size)
    kv = make_kv_store(config, shard, min(config.max_context, shape.max_position))
    executor = ModelExecutor(model, shard, kv, config.quantization, reduce=ranks.all_reduce)
    del model
    return_freed_memory()
    keep_freed_blocks()
    try:
        while True:
            command, log, ids, slots, new_tokens = ranks.broadcast(None)
            replay(kv, log)
            if command == "stop":
                return
            executor.forward(ids, slots, new_tokens)
    finally:
        kv.close()
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    follow(*tensor_parallel.follower_arguments())
