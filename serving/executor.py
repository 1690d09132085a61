"""The model executor: one batched model iteration over the KV store, for every driver.

It owns the KV store's compute side and the model runner. The continuous-batching engine
(serving.engine) and beam search (serving.beam_search) each decide what runs and drive it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch
from torch import Tensor

from serving.kv_store import IterationBatch, KVStore
from serving.model_loader import ModelShape, return_freed_memory
from serving.model_runner import ModelRunner, Reduce


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

    def _to_host(self, logits: Tensor) -> Tensor:
        """The iteration's one device-to-host transfer: the wanted rows' float32 logits, on the KV
        cache's device, copied to the CPU, where the sampler reads them. (the CUDA dry run's
        executor overrides it: its fake CUDA tensors hold no values to copy.)"""
        return logits.cpu()
