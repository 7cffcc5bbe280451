"""`kernels.invariant_tiles=measured`: each invariant product's kernel and tiles, picked by timing them.

A row's bits do not depend on the kernel (fold or split) or the tiles of `matmul.linear` (its GPU tests and
experiments/bench_invariant_linear.py check every option), so the choice may follow the GPU, the shape and
the row count. The table in matmul.py picks by the row count alone; the fastest option differs by shape
(on an H100 at 64 rows, E2B's fused gate/up product: 29.0 us from the table's split, 19.9 from a fold of
64 x 128 tiles). Here the first product of each (rows bucket, N, K) times the candidates on its own
operands, the L2 cache flushed before each run as a decode step's weights arrive cold, and keeps the
fastest for every later product of that bucket. Products of more rows than `MEASURED_MAX_ROWS` (prefill,
the trainer) and products inside a CUDA graph capture (timing cannot run there; the engine's warm-up
runs each graph's step eagerly first) take the table's plan.
"""

from __future__ import annotations

import logging
import statistics
import time

import torch

from flexgemma.model.invariant.matmul import run_plan, table_plan

log = logging.getLogger(__name__)

MEASURED_MAX_ROWS = 512
_CANDIDATE_TILES = (dict(BM=16, BN=64, BK=128, num_warps=4, num_stages=4),
                    dict(BM=64, BN=64, BK=128, num_warps=4, num_stages=4),
                    dict(BM=64, BN=128, BK=64, num_warps=4, num_stages=4),
                    dict(BM=128, BN=128, BK=64, num_warps=8, num_stages=3))
_FLUSH_BYTES = 64 << 20  # over the H100's 50 MB and the H200's 60 MB of L2
_REPS = 3
_PLANS: dict = {}  # (device, dtype, rows bucket, n, k, k_chunk, flatten, split_sum) -> (form, tiles)
_SPENT = [0.0]  # seconds this process spent timing plans (compiling tile options included)


def rows_bucket(m: int) -> int:
    """The row counts that share a measurement: multiples of 16 to 64, then powers of two."""
    return 16 * -(-m // 16) if m <= 64 else 1 << (m - 1).bit_length()


def candidates(bucket: int, chunks: int) -> list[tuple[str, dict]]:
    """The plans timed for a bucket: tiles of more than an eighth of its rows and at most its rows (or 64),
    each as a fold and, where K has more than one chunk, as a split."""
    tiles = [t for t in _CANDIDATE_TILES if bucket // 8 < t["BM"] <= max(bucket, 64)]
    forms = ("fold", "split") if chunks > 1 else ("fold",)
    return [(form, t) for t in tiles for form in forms]


def measured_plan(x: torch.Tensor, w: torch.Tensor, k_chunk: int, flatten: bool, split_sum: str,
                  split_below_tiles: int) -> tuple[str, dict]:
    m, k = x.shape
    n = w.shape[0]
    key = (x.device, x.dtype, rows_bucket(m), n, k, k_chunk, flatten, split_sum)
    plan = _PLANS.get(key)
    if plan is None:
        if m > MEASURED_MAX_ROWS or torch.cuda.is_current_stream_capturing():
            return table_plan(m, n, k, x.dtype, k_chunk, split_below_tiles)
        t0 = time.perf_counter()
        plan = _PLANS[key] = _fastest(x, w, k_chunk, flatten, split_sum)
        _SPENT[0] += time.perf_counter() - t0
    return plan


def metrics() -> dict:
    """What this process measured: how many shapes and buckets, the share that runs split, the seconds spent."""
    forms = [form for form, _ in _PLANS.values()]
    return {"kernels/invariant_plans_measured": len(forms),
            "kernels/invariant_plans_split_share": forms.count("split") / len(forms) if forms else float("nan"),
            "kernels/invariant_plans_seconds": _SPENT[0]}


def _fastest(x: torch.Tensor, w: torch.Tensor, k_chunk: int, flatten: bool, split_sum: str) -> tuple[str, dict]:
    m, k = x.shape
    n = w.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    flush = torch.empty(_FLUSH_BYTES, dtype=torch.uint8, device=x.device)
    times = []
    for plan in candidates(rows_bucket(m), -(-k // k_chunk)):
        run_plan(plan, x, w, out, k_chunk, flatten, split_sum)  # compiles the tiles on first use
        events = []
        for _ in range(_REPS):
            flush.zero_()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run_plan(plan, x, w, out, k_chunk, flatten, split_sum)
            end.record()
            events.append((start, end))
        torch.cuda.synchronize(x.device)
        times.append((statistics.median(s.elapsed_time(e) for s, e in events), plan))
    best_ms, best = min(times, key=lambda t: t[0])
    log.debug("invariant product %d x %d x %d: %s %s (%.1f us)", m, n, k, best[0],
              "x".join(str(best[1][d]) for d in ("BM", "BN", "BK")), best_ms * 1e3)
    return best
