"""A fake of the CUDA driver calls vattn makes, faithful to the documented contract, over host memory.

It stands in for `cuda.bindings.driver` (the real module imports without a GPU): its types and
enums are the real ones, each call returns the same tuple shape as cuda-bindings ((CUresult,)
or (CUresult, value), with None as the value on an error) and returns the error the CUDA
driver's virtual-memory documentation names when a precondition fails:

- sizes, addresses and offsets must be multiples of the allocation granularity;
- cuMemMap only onto a reserved range with nothing mapped in it, within the allocation;
- cuMemSetAccess only over a fully mapped range; until then a mapped page cannot be touched
  (it is PROT_NONE host memory: a CPU access faults, as a GPU access would);
- cuMemUnmap only of whole mappings; cuMemAddressFree only of a whole reservation, with
  nothing mapped in it (the docs are silent there; refusing is the strict guess);
- a current context in the calling thread for every memory call (strict mode; the docs list
  CUDA_ERROR_INVALID_CONTEXT only for some calls, so strict is a choice that finds threads
  which never made the context current);
- after fork() every call returns CUDA_ERROR_NOT_INITIALIZED in the child.

It also counts what a test may want to check: live handles, mappings, reservations, events and
context retains (`leaks()`), injects failures (`fail("cuMemMap", at=3)`), and models queued GPU
work so unmapping under a running kernel is caught: `launch(addr, size, stream)` queues a
kernel that completes when an event recorded after it on its stream is synchronized
(cuEventRecord captures the stream's work so far; an event never recorded captures none), or
at cuCtxSynchronize. Its streams are independent of each other, stream 0 too (CUDA's legacy
default stream would also wait for the other blocking streams): stricter than the driver.
Memory: each allocation is a memfd, mapped MAP_SHARED|MAP_FIXED over a PROT_NONE reservation.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from cuda.bindings import driver as real

LIBC = ctypes.CDLL(None, use_errno=True)
LIBC.mmap.restype = ctypes.c_void_p
LIBC.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
LIBC.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
LIBC.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
MAP_FAILED = ctypes.c_void_p(-1).value
RESERVED = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | 0x4000  # MAP_NORESERVE
MAP_FIXED = 0x10
PROT_NONE = 0

R = real.CUresult
PROTECTION = {
    real.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_NONE: PROT_NONE,
    real.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READ: mmap.PROT_READ,
    real.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE: mmap.PROT_READ | mmap.PROT_WRITE,
}


class DriverViolation(AssertionError):
    """Something the driver cannot report as an error code but a GPU would punish (a fault)."""


def _host(addr: int, size: int, prot: int, flags: int, fd: int = -1, offset: int = 0) -> int:
    got = LIBC.mmap(addr or None, size, prot, flags, fd, offset)
    if got in (None, MAP_FAILED):
        raise OSError(ctypes.get_errno(), f"fake driver: host mmap failed: {os.strerror(ctypes.get_errno())}")
    return int(got)


@dataclass
class Allocation:
    size: int
    fd: int
    released: bool = False
    mappings: int = 0


@dataclass
class Mapping:
    size: int
    handle: int
    accessible: bool = False


@dataclass(eq=False)
class Kernel:
    """Queued GPU work reading [start, end) (compared by identity: two launches are two kernels)."""

    stream: int
    start: int
    end: int


@dataclass
class Injection:
    call: str
    at: int
    error: R
    seen: int = 0


@dataclass
class FakeDriver:
    """One fake GPU (device 0) behind the driver calls. Attributes that are not calls are the
    real cuda-bindings module's (types, enums), so a misspelt field or enum fails as it would."""

    granularity: int = 2 << 20
    memory: int = 1 << 30
    strict: bool = True
    devices: int = 1
    calls: Counter[str] = field(default_factory=Counter)
    violations: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._lock = threading.RLock()
        self._current = threading.local()
        self._initialised = False
        self._poisoned = False
        self._retains = [0] * self.devices
        self._allocations: dict[int, Allocation] = {}
        self._reservations: dict[int, int] = {}
        self._mappings: dict[int, Mapping] = {}
        self._queued: list[Kernel] = []
        self._streams = {0}
        self._events: dict[int, list[Kernel]] = {}
        """Each live event's captured work (what synchronizing it completes)."""
        self._next_event = 0xE7E0_0001
        self._injections: list[Injection] = []
        self._next_handle = 0x7E57_0000_0001
        self._created_bytes = 0
        os.register_at_fork(after_in_child=self._poison)

    def __getattr__(self, name: str) -> Any:
        value = getattr(real, name)
        if name.startswith("cu") and callable(value) and not isinstance(value, type):
            raise AttributeError(f"the fake driver does not implement {name}")
        return value

    # ------------------------------------------------------------------ what tests use

    def fail(self, call: str, at: int = 1, error: R = R.CUDA_ERROR_INVALID_VALUE) -> None:
        """The `at`-th call of `call` from now returns `error` (and does nothing)."""
        self._injections.append(Injection(call, at, error))

    def new_stream(self) -> int:
        """Another stream's handle (a test's cuStreamCreate: vattn never creates streams)."""
        with self._lock:
            stream = 0x5E_0000 + len(self._streams)
            self._streams.add(stream)
        return stream

    def launch(self, addr: int, size: int, stream: int = 0) -> None:
        """Queues a 'kernel' on `stream` that reads [addr, addr + size) until it completes."""
        if stream not in self._streams:
            raise ValueError(f"the fake has no stream {stream:#x}")
        with self._lock:
            self._queued.append(Kernel(stream, addr, addr + size))

    def queued(self, addr: int) -> bool:
        """Whether a kernel still queued reads `addr`."""
        with self._lock:
            return any(kernel.start <= addr < kernel.end for kernel in self._queued)

    def leaks(self) -> dict[str, int]:
        """What is still held: allocations not released, mappings, reservations, context retains."""
        with self._lock:
            held = {
                "handles": sum(not a.released for a in self._allocations.values()),
                "mappings": len(self._mappings),
                "reservations": len(self._reservations),
                "events": len(self._events),
                "context_retains": sum(self._retains),
            }
        return {what: count for what, count in held.items() if count}

    def accessible(self, addr: int) -> bool:
        """Whether `addr` lies in a mapping whose access was set (what torch's pointer check asks)."""
        with self._lock:
            mapping = self._mapping_at(addr)
            return mapping is not None and mapping[1].accessible

    @property
    def context(self) -> int:
        return 0xC0_0000 + 0  # device 0's primary context

    # ------------------------------------------------------------------ bookkeeping

    def _poison(self) -> None:
        self._poisoned = True
        self._lock = threading.RLock()

    def _enter(self, call: str, needs_context: bool = True) -> R | None:
        """The error the call returns before doing anything, or None to go on."""
        self.calls[call] += 1
        if self._poisoned:
            return R.CUDA_ERROR_NOT_INITIALIZED
        if call != "cuInit" and not self._initialised:
            return R.CUDA_ERROR_NOT_INITIALIZED
        for injection in self._injections:
            if injection.call == call:
                injection.seen += 1
                if injection.seen == injection.at:
                    self._injections.remove(injection)
                    return injection.error
        if needs_context and self.strict and getattr(self._current, "context", 0) == 0:
            return R.CUDA_ERROR_INVALID_CONTEXT
        return None

    def _aligned(self, *values: int) -> bool:
        return all(v >= 0 and v % self.granularity == 0 for v in values)

    def _reservation_of(self, addr: int, size: int) -> int | None:
        for base, length in self._reservations.items():
            if base <= addr and addr + size <= base + length:
                return base
        return None

    def _mapping_at(self, addr: int) -> tuple[int, Mapping] | None:
        for start, mapping in self._mappings.items():
            if start <= addr < start + mapping.size:
                return start, mapping
        return None

    def _overlaps_mapping(self, addr: int, size: int) -> bool:
        return any(start < addr + size and addr < start + m.size for start, m in self._mappings.items())

    def _covering(self, addr: int, size: int) -> list[int] | None:
        """The mappings that exactly tile [addr, addr + size), or None."""
        starts, at = [], addr
        while at < addr + size:
            mapping = self._mappings.get(at)
            if mapping is None:
                return None
            starts.append(at)
            at += mapping.size
        return starts if at == addr + size else None

    def _check_not_queued(self, addr: int, size: int, what: str) -> None:
        for kernel in self._queued:
            if kernel.start < addr + size and addr < kernel.end:
                self.violations.append(f"{what} of [{addr:#x}, {addr + size:#x}) while queued GPU work reads it")

    @staticmethod
    def _int(value: Any, kind: type) -> int:
        if value is None:
            return 0
        if isinstance(value, (int, kind)):
            return int(value)
        raise TypeError(f"Argument is not instance of type (expected <class 'int'>, or {kind})")

    # ------------------------------------------------------------------ context and device

    def cuInit(self, flags: int) -> tuple[R]:
        if (err := self._enter("cuInit", needs_context=False)) is not None:
            return (err,)
        if flags != 0:
            return (R.CUDA_ERROR_INVALID_VALUE,)
        self._initialised = True
        return (R.CUDA_SUCCESS,)

    def cuDeviceGet(self, ordinal: int) -> tuple[R, Any]:
        if (err := self._enter("cuDeviceGet", needs_context=False)) is not None:
            return err, None
        if not 0 <= ordinal < self.devices:
            return R.CUDA_ERROR_INVALID_DEVICE, None
        return R.CUDA_SUCCESS, real.CUdevice(ordinal)

    def _device(self, dev: Any) -> int | None:
        if not isinstance(dev, (int, real.CUdevice)):
            raise TypeError(f"Argument 'dev' is not instance of type (expected <class 'int'>, or {real.CUdevice})")
        index = int(dev)
        return index if 0 <= index < self.devices else None

    def cuDevicePrimaryCtxRetain(self, dev: Any) -> tuple[R, Any]:
        if (err := self._enter("cuDevicePrimaryCtxRetain", needs_context=False)) is not None:
            return err, None
        index = self._device(dev)
        if index is None:
            return R.CUDA_ERROR_INVALID_DEVICE, None
        with self._lock:
            self._retains[index] += 1
        return R.CUDA_SUCCESS, real.CUcontext(0xC0_0000 + index)

    def cuDevicePrimaryCtxRelease(self, dev: Any) -> tuple[R]:
        if (err := self._enter("cuDevicePrimaryCtxRelease", needs_context=False)) is not None:
            return (err,)
        index = self._device(dev)
        if index is None:
            return (R.CUDA_ERROR_INVALID_DEVICE,)
        with self._lock:
            if self._retains[index] == 0:
                return (R.CUDA_ERROR_INVALID_CONTEXT,)
            self._retains[index] -= 1
        return (R.CUDA_SUCCESS,)

    def cuCtxSetCurrent(self, ctx: Any) -> tuple[R]:
        if (err := self._enter("cuCtxSetCurrent", needs_context=False)) is not None:
            return (err,)
        handle = self._int(ctx, real.CUcontext)
        index = handle - 0xC0_0000
        if handle and not (0 <= index < self.devices and self._retains[index] > 0):
            return (R.CUDA_ERROR_INVALID_CONTEXT,)  # not a context, or a primary context nobody retains
        self._current.context = handle
        return (R.CUDA_SUCCESS,)

    def cuCtxSynchronize(self) -> tuple[R]:
        if (err := self._enter("cuCtxSynchronize")) is not None:
            return (err,)
        with self._lock:
            self._queued.clear()
        return (R.CUDA_SUCCESS,)

    # ------------------------------------------------------------------ events

    def cuEventCreate(self, Flags: int) -> tuple[R, Any]:
        if not isinstance(Flags, int):
            raise TypeError(f"an integer is required, not {type(Flags).__name__}")
        if (err := self._enter("cuEventCreate")) is not None:
            return err, None
        flags = real.CUevent_flags
        valid = flags.CU_EVENT_BLOCKING_SYNC | flags.CU_EVENT_DISABLE_TIMING | flags.CU_EVENT_INTERPROCESS
        if Flags & ~valid or (Flags & flags.CU_EVENT_INTERPROCESS and not Flags & flags.CU_EVENT_DISABLE_TIMING):
            return R.CUDA_ERROR_INVALID_VALUE, None
        with self._lock:
            handle = self._next_event
            self._next_event += 0x10
            self._events[handle] = []  # "before the first call to cuEventRecord, an empty set of work"
        return R.CUDA_SUCCESS, real.CUevent(handle)

    def cuEventRecord(self, hEvent: Any, hStream: Any) -> tuple[R]:
        if (err := self._enter("cuEventRecord")) is not None:
            return (err,)
        event, stream = self._int(hEvent, real.CUevent), self._int(hStream, real.CUstream)
        with self._lock:
            if event not in self._events or stream not in self._streams:
                return (R.CUDA_ERROR_INVALID_HANDLE,)
            self._events[event] = [kernel for kernel in self._queued if kernel.stream == stream]
        return (R.CUDA_SUCCESS,)

    def cuEventSynchronize(self, hEvent: Any) -> tuple[R]:
        if (err := self._enter("cuEventSynchronize")) is not None:
            return (err,)
        event = self._int(hEvent, real.CUevent)
        with self._lock:
            captured = self._events.get(event)
            if captured is None:
                return (R.CUDA_ERROR_INVALID_HANDLE,)
            self._queued = [kernel for kernel in self._queued if kernel not in captured]
        return (R.CUDA_SUCCESS,)

    def cuEventDestroy(self, hEvent: Any) -> tuple[R]:
        if (err := self._enter("cuEventDestroy")) is not None:
            return (err,)
        with self._lock:
            if self._events.pop(self._int(hEvent, real.CUevent), None) is None:
                return (R.CUDA_ERROR_INVALID_HANDLE,)
        return (R.CUDA_SUCCESS,)

    def cuMemGetInfo(self) -> tuple[R, Any, Any]:
        if (err := self._enter("cuMemGetInfo")) is not None:
            return err, None, None
        return R.CUDA_SUCCESS, self.memory - self._created_bytes, self.memory

    def _valid_prop(self, prop: Any) -> bool:
        if not isinstance(prop, real.CUmemAllocationProp):
            raise TypeError(f"Argument 'prop' is not instance of type (expected {real.CUmemAllocationProp})")
        return (
            prop.type == real.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
            and prop.location.type == real.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
            and 0 <= prop.location.id < self.devices
        )

    def cuMemGetAllocationGranularity(self, prop: Any, option: Any) -> tuple[R, Any]:
        if (err := self._enter("cuMemGetAllocationGranularity")) is not None:
            return err, None
        if not self._valid_prop(prop) or not isinstance(option, real.CUmemAllocationGranularity_flags):
            return R.CUDA_ERROR_INVALID_VALUE, None
        return R.CUDA_SUCCESS, self.granularity

    # ------------------------------------------------------------------ address space

    def cuMemAddressReserve(self, size: int, alignment: int, addr: Any, flags: int) -> tuple[R, Any]:
        if (err := self._enter("cuMemAddressReserve")) is not None:
            return err, None
        self._int(addr, real.CUdeviceptr)
        if size <= 0 or not self._aligned(size) or flags != 0 or (alignment & (alignment - 1)):
            return R.CUDA_ERROR_INVALID_VALUE, None
        align = max(alignment, self.granularity)
        raw = _host(0, size + align, PROT_NONE, RESERVED)
        base = -(-raw // align) * align
        if base > raw:
            LIBC.munmap(raw, base - raw)
        if raw + size + align > base + size:
            LIBC.munmap(base + size, raw + size + align - base - size)
        with self._lock:
            self._reservations[base] = size
        return R.CUDA_SUCCESS, real.CUdeviceptr(base)

    def cuMemAddressFree(self, ptr: Any, size: int) -> tuple[R]:
        if (err := self._enter("cuMemAddressFree")) is not None:
            return (err,)
        base = self._int(ptr, real.CUdeviceptr)
        with self._lock:
            if self._reservations.get(base) != size or self._overlaps_mapping(base, size):
                return (R.CUDA_ERROR_INVALID_VALUE,)
            del self._reservations[base]
            LIBC.munmap(base, size)
        return (R.CUDA_SUCCESS,)

    # ------------------------------------------------------------------ physical memory

    def cuMemCreate(self, size: int, prop: Any, flags: int) -> tuple[R, Any]:
        if (err := self._enter("cuMemCreate")) is not None:
            return err, None
        if size <= 0 or not self._aligned(size) or flags != 0 or not self._valid_prop(prop):
            return R.CUDA_ERROR_INVALID_VALUE, None
        with self._lock:
            if self._created_bytes + size > self.memory:
                return R.CUDA_ERROR_OUT_OF_MEMORY, None
            fd = os.memfd_create("fake-cuda-allocation", os.MFD_CLOEXEC)
            os.ftruncate(fd, size)
            handle = self._next_handle
            self._next_handle += 0x1_0000
            self._allocations[handle] = Allocation(size, fd)
            self._created_bytes += size
        return R.CUDA_SUCCESS, real.CUmemGenericAllocationHandle(handle)

    def cuMemRelease(self, handle: Any) -> tuple[R]:
        if (err := self._enter("cuMemRelease")) is not None:
            return (err,)
        key = self._int(handle, real.CUmemGenericAllocationHandle)
        with self._lock:
            allocation = self._allocations.get(key)
            if allocation is None or allocation.released:
                return (R.CUDA_ERROR_INVALID_VALUE,)
            allocation.released = True  # its memory goes once the last mapping of it is unmapped
            self._free_if_unused(key)
        return (R.CUDA_SUCCESS,)

    def _free_if_unused(self, handle: int) -> None:
        allocation = self._allocations[handle]
        if allocation.released and allocation.mappings == 0:
            os.close(allocation.fd)
            self._created_bytes -= allocation.size
            del self._allocations[handle]

    # ------------------------------------------------------------------ mappings

    def cuMemMap(self, ptr: Any, size: int, offset: int, handle: Any, flags: int) -> tuple[R]:
        if (err := self._enter("cuMemMap")) is not None:
            return (err,)
        addr = self._int(ptr, real.CUdeviceptr)
        key = self._int(handle, real.CUmemGenericAllocationHandle)
        with self._lock:
            allocation = self._allocations.get(key)
            if (
                size <= 0
                or flags != 0
                or not self._aligned(addr, size, offset)
                or allocation is None
                or allocation.released
                or offset + size > allocation.size
                or self._reservation_of(addr, size) is None
                or self._overlaps_mapping(addr, size)
            ):
                return (R.CUDA_ERROR_INVALID_VALUE,)
            _host(addr, size, PROT_NONE, mmap.MAP_SHARED | MAP_FIXED, allocation.fd, offset)
            allocation.mappings += 1
            self._mappings[addr] = Mapping(size, key)
        return (R.CUDA_SUCCESS,)

    def cuMemSetAccess(self, ptr: Any, size: int, desc: Any, count: int) -> tuple[R]:
        if (err := self._enter("cuMemSetAccess")) is not None:
            return (err,)
        addr = self._int(ptr, real.CUdeviceptr)
        if not isinstance(desc, (list, tuple)) or not all(isinstance(d, real.CUmemAccessDesc) for d in desc):
            raise TypeError(f"Argument 'desc' is not instance of type (expected tuple[{real.CUmemAccessDesc}] or list)")
        if count != len(desc) or count < 1:
            return (R.CUDA_ERROR_INVALID_VALUE,)
        for d in desc:
            if d.location.type != real.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE:
                return (R.CUDA_ERROR_INVALID_VALUE,)
            if not 0 <= d.location.id < self.devices:
                return (R.CUDA_ERROR_INVALID_DEVICE,)
            if d.flags not in PROTECTION:
                return (R.CUDA_ERROR_INVALID_VALUE,)
        with self._lock:
            starts = self._covering(addr, size) if self._aligned(addr, size) and size > 0 else None
            if starts is None:
                return (R.CUDA_ERROR_INVALID_VALUE,)  # "must be a fully mapped address range"
            LIBC.mprotect(addr, size, PROTECTION[desc[0].flags])
            for start in starts:
                self._mappings[start].accessible = desc[0].flags != real.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_NONE
        return (R.CUDA_SUCCESS,)

    def cuMemUnmap(self, ptr: Any, size: int) -> tuple[R]:
        if (err := self._enter("cuMemUnmap")) is not None:
            return (err,)
        addr = self._int(ptr, real.CUdeviceptr)
        with self._lock:
            starts = self._covering(addr, size) if self._aligned(addr, size) and size > 0 else None
            if starts is None:
                return (R.CUDA_ERROR_INVALID_VALUE,)  # "cannot unmap a sub-range" nor an unmapped one
            self._check_not_queued(addr, size, "cuMemUnmap")
            _host(addr, size, PROT_NONE, RESERVED | MAP_FIXED)
            for start in starts:
                mapping = self._mappings.pop(start)
                self._allocations[mapping.handle].mappings -= 1
                self._free_if_unused(mapping.handle)
        return (R.CUDA_SUCCESS,)
