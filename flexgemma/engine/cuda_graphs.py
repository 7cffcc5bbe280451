"""CUDA graphs for decode: two graphs per batch bucket of a ladder (all-greedy, and sampling),
sharing one memory pool.

A batch of n runs in the smallest bucket >= n; its padding rows read token 0, write their KV to
the sink page and see no page. Every graph reads the runner's persistent DecodeInputs and the
BlockMasks built over them, so a replay only needs new values copied into those buffers. Graphs
of one pool may reuse each other's freed blocks, outputs included: a step's outputs are read (or
copied) before the next replay, whichever graph that is.
"""

from __future__ import annotations

import bisect
import time
from collections import Counter
import torch

# cudagraph=auto: the ladder from engine.max_batch_size. Dense where a step's time grows with its
# rows (small batches, where one padding row is a large share), coarser above: past 64 rows a decode
# step is bound by reading the weights, so a padding row costs only its KV and sampler share, while
# every bucket costs two captures and graph memory. 1, 2, 4, 8, then +8 to 32, +16 to 64, +32 to
# 256, +64 to 512, +128 beyond, and max_batch_size itself: from 17 rows on, at most a third of a
# bucket is padding (a fifth from 257 on), and batch 512 captures 19 buckets, not 512.
_AUTO_STEPS = ((32, 8), (64, 16), (256, 32), (512, 64), (None, 128))  # (up to, step)


def auto_buckets(max_batch: int) -> list[int]:
    """The cudagraph=auto ladder for engine.max_batch_size=max_batch (it always ends at max_batch)."""
    if max_batch < 1:
        raise ValueError(f"engine.max_batch_size={max_batch}: at least 1")
    ladder, b = [1, 2, 4, 8], 8
    for limit, step in _AUTO_STEPS:
        while b + step <= (limit or max_batch):
            b += step
            ladder.append(b)
    return sorted({x for x in ladder if x < max_batch} | {max_batch})


def resolve_buckets(buckets, max_batch: int) -> list[int]:
    """cudagraph.buckets as given, or the auto ladder when it is null."""
    return auto_buckets(max_batch) if buckets is None else [int(b) for b in buckets]


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
                if greedy_only:  # nothing reads an all-greedy step's head output (only top-k/top-p rows do)
                    out = (None, *out[1:])  # so its [rows, vocab] block goes back to the pool
                self.graphs[rows, greedy_only], self.outputs[rows, greedy_only] = graph, out
                del out
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
