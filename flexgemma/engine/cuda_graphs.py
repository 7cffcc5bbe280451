"""CUDA graphs for decode: two graphs per batch bucket of a ladder (all-greedy, and sampling),
sharing one memory pool.

A batch of n runs in the smallest bucket >= n; its padding rows read token 0, write their KV to
the sink page and see no page. Every graph reads the runner's persistent DecodeInputs and the
BlockMasks built over them, so a replay only needs new values copied into those buffers.
"""

from __future__ import annotations

import bisect
import time
from collections import Counter

import torch


class DecodeGraphs:
    def __init__(self, runner, buckets: list[int]):
        self.runner = runner
        self.buckets = sorted(int(b) for b in buckets if b <= runner.max_batch)
        if not self.buckets or self.buckets[-1] < runner.max_batch:
            self.buckets.append(runner.max_batch)
        # (rows, greedy_only) -> graph: an all-greedy batch skips the sampler's noise over the vocabulary
        self.graphs: dict[tuple[int, bool], torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple[int, bool], tuple] = {}
        self.pool = None
        self.hits: Counter = Counter()
        self.padded_rows = 0
        self.real_rows = 0
        self.capture_seconds = 0.0
        self.pool_bytes = 0

    def bucket_for(self, n: int) -> int:
        return self.buckets[bisect.bisect_left(self.buckets, n)]

    @torch.inference_mode()
    def capture(self, warmup: int = 2) -> None:
        r = self.runner
        t0 = time.perf_counter()
        # cached free blocks released on both sides, so the difference is the graphs' private pool
        # (and the outputs they keep), not what warm-up or the caller happened to leave cached
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        before = torch.cuda.memory_reserved()
        for rows in reversed(self.buckets):  # largest first: the shared pool is sized by it
            for greedy_only in (False, True):
                r.fill_decode([], rows)  # all padding: a harmless step to record
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    for _ in range(warmup):  # compiles on first use and settles allocations
                        r.decode_step(rows, greedy_only)
                torch.cuda.current_stream().wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool):
                    out = r.decode_step(rows, greedy_only)
                if self.pool is None:
                    self.pool = graph.pool()
                self.graphs[rows, greedy_only], self.outputs[rows, greedy_only] = graph, out
        torch.cuda.synchronize()
        self.capture_seconds = time.perf_counter() - t0
        torch.cuda.empty_cache()
        self.pool_bytes = torch.cuda.memory_reserved() - before

    def replay(self, rows: int, n: int, greedy_only: bool = False):
        self.graphs[rows, greedy_only].replay()
        self.hits[rows] += 1
        self.padded_rows += rows - n
        self.real_rows += n
        return self.outputs[rows, greedy_only]

    def metrics(self) -> dict:
        total = self.padded_rows + self.real_rows
        return {
            "cudagraph/num_graphs": len(self.graphs),
            "cudagraph/buckets": list(self.buckets),
            "cudagraph/capture_seconds": self.capture_seconds,
            "cudagraph/bucket_hits": {str(k): v for k, v in sorted(self.hits.items())},
            "cudagraph/padding_waste": self.padded_rows / total if total else 0.0,
            "memory/graph_pool_gib": self.pool_bytes / 2**30,
        }
