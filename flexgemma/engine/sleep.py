"""engine.sleep() / wake(): give the KV pool's memory back while a trainer runs, then restore it.

The KV tensors stay the same Python objects (the forward, the compiled functions and the masks
keep referring to them); sleep resizes their storage to zero bytes, wake re-allocates (in the
original order) and zeroes it. A CUDA graph replays raw addresses, and the caching allocator gives
no promise that the new storage lands at the old addresses (it often does when nothing else took
the memory meanwhile: the driver hands back the same range). So wake compares every pool tensor's
address with the one it had: all equal, the captured decode graphs stay valid and are kept (wake
costs the allocation and a memset); any moved, the graphs are dropped and captured again (the
kernels are compiled already, so one capture pass, seconds for E2B). wake() reports which.
With engine.sleep_mode=true the pool lives in CUDA virtual memory (engine/vmm.py): sleep unmaps
its physical memory, wake maps new memory at the same addresses, and the graphs always stay.
Freed by sleep: the KV pool. Kept: the weights, and the decode graphs' private memory pool.
"""

from __future__ import annotations

import time

import torch


def _pool_tensors(cache) -> list[torch.Tensor]:
    """Every KV tensor the pool owns (shared layers' entries point at their source's tensors)."""
    seen, out = set(), []
    for k, v in cache.pools._kv.values():
        for t in (k, v):
            if id(t) not in seen:
                seen.add(id(t))
                out.append(t)
    return out


def _reserved(device: torch.device) -> int:
    if device.type != "cuda":
        return 0
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    return torch.cuda.memory_reserved(device)


def _driver_free(device: torch.device) -> int:
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    return torch.cuda.mem_get_info(device)[0]


def release(runner) -> dict:
    """Frees the KV pool's storage; returns what it measured and the addresses it had."""
    device = runner.device
    virtual = runner.cache.virtual
    if virtual is not None:  # sleep_mode: the pool's addresses stay reserved, its memory goes back
        before = _driver_free(device)
        virtual.unmap()
        return {"kv_pool_bytes": runner.cache.pools.nbytes, "freed_bytes": _driver_free(device) - before,
                "addresses": None}
    before = _reserved(device)
    pool = _pool_tensors(runner.cache)
    nbytes = sum(t.untyped_storage().nbytes() for t in pool)
    addresses = [t.data_ptr() for t in pool]
    for t in pool:
        t.untyped_storage().resize_(0)
    freed = before - _reserved(device) if device.type == "cuda" else nbytes
    return {"kv_pool_bytes": nbytes, "freed_bytes": freed, "addresses": addresses}


def restore(runner, slept: dict) -> dict:
    """Re-allocates the KV pool (zeroed); re-captures the decode graphs when an address moved.
    Returns {"seconds", "recaptured"}."""
    from flexgemma.engine.cuda_graphs import DecodeGraphs

    t0 = time.perf_counter()
    pool = _pool_tensors(runner.cache)
    if runner.cache.virtual is not None:
        runner.cache.virtual.remap()
    else:
        for t in pool:
            t.untyped_storage().resize_(t.numel() * t.element_size())
    for t in pool:
        t.zero_()
    moved = slept["addresses"] is not None and [t.data_ptr() for t in pool] != slept["addresses"]
    recaptured = runner.graphs is not None and moved
    if recaptured:
        buckets = list(runner.graphs.buckets)
        runner.graphs = None  # its graphs point at the old addresses: never replay them
        torch.cuda.synchronize(runner.device)
        torch.cuda.empty_cache()
        runner.graphs = DecodeGraphs(runner, buckets)
        runner.graphs.capture(warmup=1)
    if runner.device.type == "cuda":
        torch.cuda.synchronize(runner.device)
    return {"seconds": time.perf_counter() - t0, "recaptured": recaptured}
