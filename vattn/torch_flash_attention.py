"""FlashAttention 2 as torch ships it: `aten::_flash_attention_forward`, the varlen entry point
in every CUDA build of torch (nothing to install), as both caches call it: the virtual cache's
`torch_flash_attn` (keys read at each slot's rows, `token_rows`) and the paged baseline's
`paged_torch_flash_attn` (through a block table)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from vattn.errors import ConfigurationError, UnavailableError

FLASH_ATTENTION_HEAD_DIMS = range(8, 257, 8)
"""Head sizes torch's FlashAttention 2 runs: multiples of 8 up to 256."""
VARLEN_ARGUMENTS = ("cum_seq_q", "cum_seq_k", "max_q", "max_k", "is_causal", "scale", "seqused_k")
"""What `aten::_flash_attention_forward` must take to read a request's keys where they lie:
`cum_seq_k` its first row, `seqused_k` how many rows."""
PAGED_ARGUMENTS = (*VARLEN_ARGUMENTS, "block_table")


@dataclass(frozen=True)
class VarlenPlan:
    """One iteration as FlashAttention 2's varlen forward reads it, on the device: request i's
    queries are rows `[cum_q[i], cum_q[i + 1])`, its keys `used_k[i]` rows from `cum_k[i]` (of
    the flattened key rows, or of its block table's row i)."""

    cum_q: Tensor
    cum_k: Tensor
    used_k: Tensor
    max_q: int
    max_k: int
    block_table: Tensor | None = None


class TorchFlashAttention:
    """FlashAttention 2 as torch ships it: `aten::_flash_attention_forward`, varlen.

    One call per layer for a whole iteration, decodes and prefill chunks together: queries
    packed ragged, each request's keys read in place (`cum_seq_k` its first row and
    `seqused_k` its length, or a block table), causal aligned to the end of each request's
    keys. The virtual cache and the paged baseline call exactly this, so they differ only in
    how a request's keys are found. Refuses at construction a torch without FlashAttention,
    a GPU before sm80, a head size FA2 has no kernel for, or an entry point that lacks an
    argument the caller needs (`block_table` came in torch 2.5's update of it)."""

    def __init__(self, kernel: str, device: torch.device, head_dim: int, arguments: tuple[str, ...]) -> None:
        op = torch.ops.aten._flash_attention_forward.default
        taken = {argument.name for argument in op._schema.arguments}
        if missing := [name for name in arguments if name not in taken]:
            raise UnavailableError(
                f"the {kernel} kernel needs torch's aten::_flash_attention_forward to take "
                f"{', '.join(missing)}; torch {torch.__version__}'s takes {', '.join(sorted(taken))}"
            )
        if not torch.backends.cuda.is_flash_attention_available():
            raise UnavailableError(
                f"the {kernel} kernel needs a torch built with FlashAttention (torch {torch.__version__})"
            )
        if torch.cuda.is_available() and torch.cuda.get_device_capability(device) < (8, 0):
            raise UnavailableError(
                f"the {kernel} kernel needs an sm80 GPU or newer (FlashAttention 2); {device} is older"
            )
        if head_dim not in FLASH_ATTENTION_HEAD_DIMS:
            raise ConfigurationError(
                f"the {kernel} kernel runs head sizes that are multiples of 8 up to 256, not {head_dim}"
            )
        self._forward = op
        self._device = device

    def plan(
        self,
        starts: Sequence[int],
        key_starts: Sequence[int],
        lengths: Sequence[int],
        new_tokens: Sequence[int],
        block_table: Tensor | None = None,
    ) -> VarlenPlan:
        """The iteration's index tensors: `starts` its first query rows and the total, `key_starts`
        each request's first key row, `lengths` its keys (new ones included)."""

        def on_device(values: Sequence[int]) -> Tensor:
            return torch.tensor(values, dtype=torch.int32, device=self._device)

        return VarlenPlan(
            cum_q=on_device(starts),
            cum_k=on_device(key_starts),
            used_k=on_device(lengths),
            max_q=max(new_tokens),
            max_k=max(lengths),
            block_table=block_table,
        )

    def __call__(self, plan: VarlenPlan, q: Tensor, keys: Tensor, values: Tensor, scale: float) -> Tensor:
        """Attention of `q` `[tokens, heads, dim]` over `keys`/`values`: `[rows, kv_heads, dim]`,
        or `[blocks, block_size, kv_heads, dim]` with the plan's block table."""
        paged = {} if plan.block_table is None else {"block_table": plan.block_table}  # a torch may lack it
        return self._forward(
            q,
            keys,
            values,
            plan.cum_q,
            plan.cum_k,
            plan.max_q,
            plan.max_k,
            0.0,
            True,
            False,
            scale=scale,
            seqused_k=plan.used_k,
            **paged,
        )[0]


def token_rows(keys: Tensor) -> tuple[Tensor, int]:
    """A `[slots, context, heads, dim]` virtual tensor seen as one column of token rows (no
    copy): `[rows, heads, dim]` where slot s's token t is row `s * rows_per_slot + t`. Returns
    the view and `rows_per_slot`. ValueError when the slot stride is not a whole number of
    rows, or FlashAttention's 32-bit row offsets cannot reach the last slot."""
    slot_stride, token_stride, head_stride, _ = keys.stride()
    if slot_stride % token_stride:
        raise ValueError(
            f"a slot's stride ({slot_stride} elements) is not a whole number of token rows ({token_stride})"
        )
    rows_per_slot = slot_stride // token_stride
    rows = keys.shape[0] * rows_per_slot
    if rows >= 2**31:
        raise ValueError(
            f"FlashAttention's key offsets are 32-bit and {keys.shape[0]} slots span {rows} token rows: "
            "use fewer slots or a shorter max_context"
        )
    view = keys.as_strided((rows, keys.shape[2], keys.shape[3]), (token_stride, head_stride, 1))
    return view, rows_per_slot
