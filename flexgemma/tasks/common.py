"""Metrics shared by the tasks."""

from __future__ import annotations

import resource
import sys

import numpy as np
import torch

GIB = float(2**30)


def round_metrics(outputs, stats, wall: float) -> tuple[dict, dict]:
    """(scalar metrics of one round, per-request latency arrays in ms)."""
    gen = sum(len(o.token_ids) for o in outputs if o.finish_reason != "error")
    ttft = np.array([o.first_token_time * 1e3 for o in outputs if o.first_token_time is not None])
    tpot = np.array([
        (o.finish_time - o.first_token_time) * 1e3 / (len(o.token_ids) - 1)
        for o in outputs if o.finish_time is not None and len(o.token_ids) > 1
    ])
    bs = stats.decode_batch_sizes
    return {
        "bench/round_seconds": wall,
        "bench/generated_tokens": gen,
        "throughput/total_tok_s": gen / wall,
        "throughput/decode_tok_s": stats.decode_tokens / stats.decode_time if stats.decode_time else 0.0,
        "throughput/prefill_tok_s": stats.prefill_tokens / stats.prefill_time if stats.prefill_time else 0.0,
        "scheduler/prefill_steps": stats.prefill_steps,
        "scheduler/decode_steps": stats.decode_steps,
        "scheduler/preemptions": stats.preemptions,
        "scheduler/decode_batch_mean": float(np.mean(bs)) if bs else 0.0,
    }, {"latency/ttft_ms": ttft, "latency/tpot_ms": tpot}


def memory_metrics(engine) -> dict:
    out = {
        "memory/weights_gib": sum(p.numel() * p.element_size() for p in engine.model.parameters()) / GIB,
        "memory/kv_pool_gib": engine.info.get("kv_pool_bytes", 0) / GIB,
    }
    if getattr(engine, "lora", None) is not None:  # pristine copies are not parameters of the model
        out["memory/lora_pristine_gib"] = engine.info.get("lora_pristine_bytes", 0) / GIB
    if torch.cuda.is_available() and engine.info.get("device", "").startswith("cuda"):
        out["memory/peak_allocated_gib"] = torch.cuda.max_memory_allocated() / GIB
        out["memory/peak_reserved_gib"] = torch.cuda.max_memory_reserved() / GIB
    else:
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
        out["memory/peak_rss_gib"] = rss / (GIB if sys.platform == "darwin" else GIB / 1024)
    return out
