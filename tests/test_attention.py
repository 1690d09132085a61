"""torch SDPA runs on the virtual tensors unchanged and matches attention on ordinary tensors."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from checks import reference_attention

from vattn import KVCache

pytestmark = pytest.mark.usefixtures("several_threads")  # the operators split work between threads

MakeCache = Callable[..., KVCache]
QUERY_HEADS = 8  # 4 query heads per KV head (grouped-query attention)


def fill(cache: KVCache, lengths: dict[int, int], generator: torch.Generator) -> None:
    cache.step(lengths)
    for layer in range(cache.config.num_layers):
        for reqid in lengths:
            keys, values = cache.kv(layer, reqid)
            keys.copy_(torch.randn(keys.shape, generator=generator))
            values.copy_(torch.randn(values.shape, generator=generator))


@pytest.mark.parametrize("layout", ["per_layer", "mega"])
def test_causal_prefill_on_virtual_tensors(make_cache: MakeCache, layout: str) -> None:
    cache = make_cache(layout=layout)
    generator = torch.Generator().manual_seed(0)
    reqid = cache.alloc_reqid()
    fill(cache, {reqid: 150}, generator)  # five 4 KiB pages per tensor
    for layer in range(cache.config.num_layers):
        keys, values = cache.kv(layer, reqid)
        q = torch.randn(1, QUERY_HEADS, 150, 16, generator=generator)
        out = F.scaled_dot_product_attention(
            q, keys.transpose(0, 1)[None], values.transpose(0, 1)[None], is_causal=True, enable_gqa=True
        )
        expected = reference_attention(q[0], keys.clone(), values.clone(), causal=True)
        torch.testing.assert_close(out[0].double(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("consecutive", [True, False], ids=["view", "gather"])
def test_batched_decode_with_grouped_kv_heads(make_cache: MakeCache, consecutive: bool) -> None:
    cache = make_cache()
    generator = torch.Generator().manual_seed(1)
    reqids = [cache.alloc_reqid() for _ in range(6)]
    lengths = dict(zip(reqids, [57, 64, 33, 60, 41, 50], strict=True))  # all within two 32-token pages
    fill(cache, lengths, generator)
    batch = reqids[1:5] if consecutive else [reqids[4], reqids[0], reqids[2]]
    lens = torch.tensor([lengths[r] for r in batch])
    for layer in range(cache.config.num_layers):
        keys, values = cache.kv_batch(layer, batch)  # [B, max_len, Hkv, D], padding is mapped memory
        assert (keys.data_ptr() == cache.kv(layer, batch[0])[0].data_ptr()) == consecutive
        q = torch.randn(len(batch), QUERY_HEADS, 1, 16, generator=generator)
        mask = (torch.arange(keys.shape[1]) < lens[:, None])[:, None, None, :]
        out = F.scaled_dot_product_attention(
            q, keys.transpose(1, 2), values.transpose(1, 2), attn_mask=mask, enable_gqa=True
        )
        for i, reqid in enumerate(batch):
            k, v = cache.kv(layer, reqid)
            expected = reference_attention(q[i], k.clone(), v.clone(), causal=False)
            torch.testing.assert_close(out[i].double(), expected, rtol=1e-5, atol=1e-5)
