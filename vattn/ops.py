"""vattn's torch operators on the CPU (native/*.cpp, built by `make native`): ragged
attention, the int8 and grouped (weight-only) linears, RMSNorm, the rotary embedding and
SiLU-and-mul. Loaded into torch.ops.vattn on first use."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import torch

from vattn.errors import UnavailableError

LIBRARY = Path(__file__).with_name("libvattn_ops.so")
_lock = threading.Lock()


def vattn_ops() -> Any:
    """`torch.ops.vattn`, with the library loaded; UnavailableError if it was never built."""
    with _lock:
        if not hasattr(torch.ops.vattn, "ragged_attention"):
            if not LIBRARY.is_file():
                raise UnavailableError(f"vattn's CPU operators need {LIBRARY.name}: run `make native`")
            torch.ops.load_library(LIBRARY)
    return torch.ops.vattn
