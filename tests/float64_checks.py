"""The ragged kernel's checks against float64 attention, shared by its tests: each a script run
in a process of its own (under a capability or oneDNN cap where a test asks)."""

from __future__ import annotations

import os
import subprocess
import sys

from vattn.ops import vattn_ops

# The ragged kernel's call on requests' lengths and new rows, checked against float64
# attention: the prefix of the tests' scripts (tests/test_kernels.py, tests/test_brgemm_attention.py).
AGAINST_FLOAT64 = """
import torch
from vattn.ops import vattn_ops
ops, generator = vattn_ops(), torch.Generator().manual_seed(0)
def int8_cache(raw):  # K and V rows, each shifted off zero by its own amount, as an int8 cache keeps them
    rows, pairs = [], []
    for x in raw:
        x = x + torch.randn(*x.shape[:-1], 1, generator=generator) / 4
        lowest, highest = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)
        scale, midpoint = (highest - lowest) / 254, (highest + lowest) / 2
        rows.append(torch.round((x - midpoint) / scale).to(torch.int8))
        pairs.append(torch.cat((scale, midpoint), -1))
    return *rows, pairs
def check(q, k, v, lengths, news, tolerance, scales=None):  # qparams: an int8 cache's (scale, midpoint) pairs
    dim, kv_heads = q.shape[-1], k.shape[2]
    group = q.shape[1] // kv_heads
    out, starts = torch.empty_like(q), torch.tensor([0, *news[:-1]]).cumsum(0)
    slots = torch.arange(len(lengths))
    calls = (None, None, *scales) if scales else ()
    ops.ragged_attention(out, q, k, v, slots, starts, torch.tensor(news), torch.tensor(lengths), dim**-0.5, *calls)
    if scales:
        k, v = (x.double() * s[..., :1].double() + s[..., 1:].double() for x, s in zip((k, v), scales))
    for b, (length, new) in enumerate(zip(lengths, news)):
        rows = slice(starts[b], starts[b] + new)
        keys, values = (x[b, :length].double().repeat_interleave(group, 1).transpose(0, 1) for x in (k, v))
        scores = q[rows].double().transpose(0, 1) @ keys.transpose(1, 2) * dim**-0.5
        seen = torch.arange(length) <= torch.arange(length - new, length)[:, None]
        expected = (scores.masked_fill(~seen, float("-inf")).softmax(-1) @ values).transpose(0, 1)
        torch.testing.assert_close(out[rows].double(), expected, rtol=tolerance, atol=tolerance)
"""
WIDEST = vattn_ops().attention_simd(64)


def printed_under_cap(script: str, onednn_cap: str) -> list[str]:
    """What `script` prints, word by word, in a process of its own under ONEDNN_MAX_CPU_ISA
    `onednn_cap` ("": none, whatever this process runs under)."""
    env = {k: v for k, v in os.environ.items() if k != "ONEDNN_MAX_CPU_ISA"}
    env |= {"ONEDNN_MAX_CPU_ISA": onednn_cap} if onednn_cap else {}
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    return result.stdout.split()
