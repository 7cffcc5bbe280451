"""engine.sleep() / wake(): give the KV pool's memory back while a trainer runs, then restore it.

The KV tensors stay the same Python objects (the forward, the compiled functions and the masks
keep referring to them); sleep resizes their storage to zero bytes, wake re-allocates and zeroes
it. The caching allocator gives no promise that the new storage lands at the old addresses, and a
CUDA graph replays raw addresses, so sleep also drops the captured decode graphs (their private
memory pool goes with them) and wake captures them again: wake costs one capture (the kernels are
already compiled, so no compilation), which engine.info["wake_seconds"] reports.
Model weights stay where they are.
"""

from __future__ import annotations

import time

import torch


def _pool_tensors(cache) -> list[torch.Tensor]:
    """Every KV tensor the pool owns (shared layers' entries point at their source's tensors)."""
    seen, out = set(), []
    for k, v in cache._kv.values():
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


def release(runner) -> dict:
    """Frees the KV pool's storage and the decode graphs; returns what it measured."""
    device = runner.device
    before = _reserved(device)
    pool = _pool_tensors(runner.cache)
    nbytes = sum(t.untyped_storage().nbytes() for t in pool)
    for t in pool:
        t.untyped_storage().resize_(0)
    graphs = runner.graphs
    runner.graphs = None
    buckets = list(graphs.buckets) if graphs is not None else None
    del graphs
    freed = before - _reserved(device) if device.type == "cuda" else nbytes
    return {"kv_pool_bytes": nbytes, "freed_bytes": freed, "graph_buckets": buckets}


def restore(runner, slept: dict) -> float:
    """Re-allocates the KV pool (zeroed) and re-captures the decode graphs; returns the seconds taken."""
    from flexgemma.engine.cuda_graphs import DecodeGraphs

    t0 = time.perf_counter()
    for t in _pool_tensors(runner.cache):
        t.untyped_storage().resize_(t.numel() * t.element_size())
        t.zero_()
    if slept["graph_buckets"] is not None:
        runner.graphs = DecodeGraphs(runner, slept["graph_buckets"])
        runner.graphs.capture(warmup=1)
    if runner.device.type == "cuda":
        torch.cuda.synchronize(runner.device)
    return time.perf_counter() - t0
