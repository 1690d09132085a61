"""The GPU kernels' CPU-side logic: slot pages for FlashInfer, its page tables, the refusals."""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from vattn import ConfigurationError, KVCache
from vattn.gpu_kernels import (
    FlashInferPlans,
    decode_uses_tensor_cores,
    page_table,
    require_half_precision,
    slot_pages,
)


@pytest.mark.parametrize("layout", ["per_layer", "mega"])
def test_slot_pages_are_views_of_each_slots_tokens(make_cache: Callable[..., KVCache], layout: str) -> None:
    cache = make_cache(layout=layout, max_context=256)
    reqids = [cache.alloc_reqid() for _ in range(3)]
    cache.step(dict.fromkeys(reqids, 100))
    for reqid in reqids:
        keys, _ = cache.kv(1, reqid)
        keys.copy_(torch.arange(keys.numel(), dtype=torch.float32).reshape(keys.shape) + 1000 * reqid)
    whole, _ = cache.layer_tensors(1)
    pages, per_slot = slot_pages(whole, 16)
    assert pages.data_ptr() == whole.data_ptr() and per_slot >= 256 // 16
    indptr, indices, last = page_table(tuple(reqids), (100, 100, 100), per_slot, 16)
    assert indptr == [0, 7, 14, 21] and last == [4, 4, 4]
    tokens = torch.arange(100)
    for i, reqid in enumerate(reqids):  # token by token: past a request's length may be unmapped
        mine = torch.tensor(indices[indptr[i] : indptr[i + 1]])
        assert torch.equal(pages[mine[tokens // 16], tokens % 16], cache.kv(1, reqid)[0])


def test_slot_pages_refuse_what_flashinfer_cannot_address() -> None:
    odd = torch.empty_strided((2, 40, 2, 16), (40 * 32, 32, 16, 1), device="meta")
    with pytest.raises(ValueError, match="multiple of 16"):
        slot_pages(odd, 16)
    huge = torch.empty_strided((2, 32, 2, 16), (2**40, 2**28, 16, 1), device="meta")
    with pytest.raises(ValueError, match="page stride is 32-bit"):
        slot_pages(huge, 16)


def test_decode_groups_outside_the_cuda_core_kernels_take_tensor_cores() -> None:
    assert [decode_uses_tensor_cores(q, 8) for q in (8, 32, 48, 56, 64, 128)] == [
        False,
        False,
        False,
        True,
        False,
        True,
    ]


def test_a_gpu_kernel_refuses_a_precision_it_cannot_run() -> None:
    require_half_precision(torch.bfloat16, "flash_attn")
    with pytest.raises(ConfigurationError, match=r"not torch.float32: use dtype='bfloat16' \(vattn serve --dtype"):
        require_half_precision(torch.float32, "flash_attn")


class RecordingWrapper:
    """FlashInfer's wrapper interface (plan, run); records what it ran."""

    def __init__(self, workspace: torch.Tensor, layout: str, **options: Any) -> None:
        assert not workspace.any(), "FlashInfer asks for a zeroed workspace"
        self.runs = 0

    def run(self, q: torch.Tensor, kv: Any) -> torch.Tensor:
        self.runs += 1
        return q


def test_a_batch_planned_before_the_latest_plan_is_refused() -> None:
    flashinfer = SimpleNamespace(
        BatchDecodeWithPagedKVCacheWrapper=RecordingWrapper, BatchPrefillWithPagedKVCacheWrapper=RecordingWrapper
    )
    plans = FlashInferPlans(flashinfer, torch.device("cpu"), use_tensor_cores=False)
    first = plans.planned(plans.decode)
    plans.run(first, torch.zeros(1), None)
    second = plans.planned(plans.prefill)
    with pytest.raises(RuntimeError, match="planned before the kernel's latest plan"):
        plans.run(first, torch.zeros(1), None)
    plans.run(second, torch.zeros(1), None)
    assert (plans.decode.runs, plans.prefill.runs) == (1, 1)
