"""Which backend torch's SDPA picks on this GPU for a prefill and a decode at the paper's heads,
and what the first call at a new sequence length costs with cuDNN's backend allowed, excluded
(`vattn.attention.CUDA_SDPA_BACKENDS`, as the engine calls it) and alone.

A server sees a new prompt length with nearly every request, so the first call at each length
is the one that counts: cuDNN builds (and caches) a graph per shape. Every setting gets lengths
no other setting used, so no setting reuses another's graphs.

    python -m benchmarks.gpu_sdpa_backends --out sdpa_backends.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from vattn.attention import CUDA_SDPA_BACKENDS

SETTINGS: dict[str, list[SDPBackend] | None] = {
    "default": None,
    "without_cudnn": CUDA_SDPA_BACKENDS,
    "cudnn_only": [SDPBackend.CUDNN_ATTENTION],
}
HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128


def tensors(new: int, length: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [1, heads, new, dim], k and v [1, kv_heads, length, dim] in bfloat16 (the engine's layout)."""

    def rows(count: int, heads: int) -> torch.Tensor:
        return torch.randn(1, count, heads, HEAD_DIM, device="cuda", dtype=torch.bfloat16).transpose(1, 2)

    return rows(new, HEADS), rows(length, KV_HEADS), rows(length, KV_HEADS)


def chosen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> str:
    """The backend SDPA picks with every backend allowed (torch's own choice)."""
    try:
        return SDPBackend(torch._fused_sdp_choice(q, k, v, None, 0.0, causal, enable_gqa=True)).name
    except (RuntimeError, TypeError, ValueError) as error:
        return f"unknown: {error}"


def timed_ms(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> float:
    torch.cuda.synchronize()
    started = time.perf_counter()
    F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
    torch.cuda.synchronize()
    return (time.perf_counter() - started) * 1e3


def measure(lengths: list[int]) -> list[dict[str, Any]]:
    rows = []
    for offset, (setting, backends) in enumerate(SETTINGS.items()):
        for length in lengths:
            length += offset  # a length only this setting sees
            for phase, new in (("prefill", length), ("decode", 1)):
                q, k, v = tensors(new, length)
                causal = phase == "prefill"
                row = {"setting": setting, "phase": phase, "length": length, "torch_choice": chosen(q, k, v, causal)}
                try:
                    with sdpa_kernel(backends) if backends else contextlib.nullcontext():
                        first, second = timed_ms(q, k, v, causal), timed_ms(q, k, v, causal)
                    row |= {"first_ms": first, "second_ms": second}
                except RuntimeError as error:
                    row["error"] = str(error).splitlines()[0]
                print(json.dumps(row))
                rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1000, 2000, 4000, 8000])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("no GPU: this probe measures torch's CUDA SDPA backends")
    F.scaled_dot_product_attention(*tensors(16, 16), enable_gqa=True)  # CUDA's own start-up, outside every row
    facts = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "cudnn": torch.backends.cudnn.version()}
    args.out.write_text(json.dumps({"facts": facts, "rows": measure(args.lengths)}, indent=1))


if __name__ == "__main__":
    main()
