"""The C library (native/vattn_native.c) that maps a whole batch of pages in one GIL-free call.

Both backends load it the same way: `native=True` needs it, `False` never uses it, and
`None` uses it when it is built (`make native`, part of the set-up).
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from pathlib import Path

NATIVE_LIBRARY = Path(__file__).resolve().parent.parent / "libvattn_native.so"


def native_available() -> bool:
    return NATIVE_LIBRARY.is_file()


def load_native(native: bool | None) -> ctypes.CDLL | None:
    """The C library when asked for (True) or built (None); None means use the Python fallback."""
    if native is False:
        return None
    if native_available():
        return ctypes.CDLL(str(NATIVE_LIBRARY))
    if native:
        raise RuntimeError(f"native mapping library not built at {NATIVE_LIBRARY}: run `make native`")
    return None


def u64_array(values: Sequence[int]) -> ctypes.Array[ctypes.c_uint64]:
    return (ctypes.c_uint64 * len(values))(*values)
