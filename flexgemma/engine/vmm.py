"""GPU memory whose physical pages can be given back and mapped again at the same virtual address.

Why: a CUDA graph replays raw addresses. If sleep() frees the KV pool through torch's caching
allocator, wake() gets new addresses and every decode graph must be captured again (seconds for
E2B). With CUDA's virtual memory management (driver API: reserve an address range once, map and
unmap physical memory into it) the pool keeps its addresses, so the graphs stay valid and wake()
costs a map and a memset. vLLM's sleep mode rests on the same driver calls; this is our own
ctypes binding (no compiled extension to ship). Memory mapped here is outside torch's caching
allocator: torch.cuda.memory_allocated() does not count it, `VirtualBuffer.nbytes` does.
"""

from __future__ import annotations

import ctypes

import torch

_MAPPED = 0  # bytes mapped by every VirtualBuffer of this process, for memory reports


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _AllocFlags(ctypes.Structure):
    _fields_ = [("compressionType", ctypes.c_ubyte), ("gpuDirectRDMACapable", ctypes.c_ubyte),
                ("usage", ctypes.c_ushort), ("reserved", ctypes.c_ubyte * 4)]


class _AllocationProp(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("requestedHandleTypes", ctypes.c_int), ("location", _Location),
                ("win32HandleMetaData", ctypes.c_void_p), ("allocFlags", _AllocFlags)]


class _AccessDesc(ctypes.Structure):
    _fields_ = [("location", _Location), ("flags", ctypes.c_int)]


_PINNED, _ON_DEVICE, _READ_WRITE = 1, 1, 3  # CU_MEM_ALLOCATION_TYPE_PINNED, CU_MEM_LOCATION_TYPE_DEVICE, PROT_READWRITE
_driver = None


def _cuda():
    global _driver
    if _driver is None:
        _driver = ctypes.CDLL("libcuda.so.1")
    return _driver


def _check(result: int, call: str) -> None:
    if result != 0:
        name = ctypes.c_char_p()
        _cuda().cuGetErrorName(result, ctypes.byref(name))
        raise RuntimeError(f"CUDA driver call {call} failed: {(name.value or b'?').decode()} ({result})")


class _ArrayInterface:
    """What torch.as_tensor needs to wrap `nbytes` at `ptr` without copying or owning it."""

    def __init__(self, ptr: int, nbytes: int):
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False),
                                         "version": 3, "strides": None}


class VirtualBuffer:
    """`nbytes` of device memory at a fixed virtual address; `unmap()` gives the physical memory
    back to the driver, `remap()` maps fresh (zeroed by the caller) memory at the same address."""

    def __init__(self, nbytes: int, device: torch.device):
        torch.zeros(1, device=device)  # the primary context exists and is current
        self.device = device
        self._prop = _AllocationProp(type=_PINNED, location=_Location(_ON_DEVICE, device.index or 0))
        granularity = ctypes.c_size_t()
        _check(_cuda().cuMemGetAllocationGranularity(ctypes.byref(granularity), ctypes.byref(self._prop), 0),
               "cuMemGetAllocationGranularity")
        g = granularity.value
        self.nbytes = (nbytes + g - 1) // g * g
        self.ptr = ctypes.c_uint64()
        _check(_cuda().cuMemAddressReserve(ctypes.byref(self.ptr), ctypes.c_size_t(self.nbytes), ctypes.c_size_t(0),
                                           ctypes.c_uint64(0), ctypes.c_ulonglong(0)), "cuMemAddressReserve")
        self._handle = None
        self._offset = 0
        self.remap()

    @property
    def mapped(self) -> bool:
        return self._handle is not None

    def remap(self) -> None:
        global _MAPPED
        if self.mapped:
            return
        handle = ctypes.c_uint64()
        _check(_cuda().cuMemCreate(ctypes.byref(handle), ctypes.c_size_t(self.nbytes), ctypes.byref(self._prop),
                                   ctypes.c_ulonglong(0)), "cuMemCreate (out of GPU memory?)")
        try:
            _check(_cuda().cuMemMap(self.ptr, ctypes.c_size_t(self.nbytes), ctypes.c_size_t(0), handle,
                                    ctypes.c_ulonglong(0)), "cuMemMap")
        except RuntimeError:
            _cuda().cuMemRelease(handle)
            raise
        access = _AccessDesc(location=self._prop.location, flags=_READ_WRITE)
        _check(_cuda().cuMemSetAccess(self.ptr, ctypes.c_size_t(self.nbytes), ctypes.byref(access),
                                      ctypes.c_size_t(1)), "cuMemSetAccess")
        self._handle = handle
        _MAPPED += self.nbytes

    def unmap(self) -> None:
        """Gives the physical memory back; tensors over it must not be touched until remap()."""
        global _MAPPED
        if not self.mapped:
            return
        torch.cuda.synchronize(self.device)
        _check(_cuda().cuMemUnmap(self.ptr, ctypes.c_size_t(self.nbytes)), "cuMemUnmap")
        _check(_cuda().cuMemRelease(self._handle), "cuMemRelease")
        self._handle = None
        _MAPPED -= self.nbytes

    def tensor(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """The next free bytes of the buffer as a tensor of its own (its own storage, not a view of
        a shared base: inductor copies a write into a view of a shared base)."""
        size = torch.Size(shape).numel() * dtype.itemsize
        align = 256
        start = (self._offset + align - 1) // align * align
        if start + size > self.nbytes:
            raise ValueError(f"VirtualBuffer: {size} bytes do not fit ({self.nbytes - start} left)")
        self._offset = start + size
        raw = torch.as_tensor(_ArrayInterface(self.ptr.value + start, size))
        return raw.view(dtype).view(shape)


def mapped_bytes() -> int:
    """Bytes currently mapped by VirtualBuffers (outside torch's caching allocator)."""
    return _MAPPED
