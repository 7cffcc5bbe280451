"""`linear(x, w)` = x @ w.T whose rows never depend on the other rows of x.

GPU: K is cut into chunks of `K_CHUNK` elements at fixed positions; a row's output is the sum of its
chunk products added in chunk order, each chunk a run of tl.dot steps in K order, accumulated in
float32. Two kernels compute exactly that: `_mm_fold` (a program per output tile, adding its chunks
as it finishes them) and `_mm_split` + `_sum_chunks` (a program per tile and chunk, then the chunks
summed in order): the split gives small row counts the parallelism that cuBLAS gets from a split of
K chosen by the row count, without letting the row count change a row's bits. Tile sizes follow the
row count freely: a row's bits do not depend on the tile it sits in (experiments/probe_invariance.py
on the H200: rows equal across BLOCK_M 16-128, 4 or 8 warps, BLOCK_K 32 or 64).

CPU: rows in tiles of `CPU_ROW_TILE` through one batched product per step; a row gets the same bits
at any position of any tile (tests/test_invariant.py), which a plain GEMM does not give in float32
(MKL picks its kernel by the row count).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

K_CHUNK = 512  # kernels.invariant_k_chunk's default: fixes a row's summation order, so it is part of the result
CPU_ROW_TILE = 16
# kernels.invariant_split_below_tiles' default: below this many output tiles the split kernel runs (a
# program per tile and K chunk)
SPLIT_BELOW_TILES = 48


def linear(x: torch.Tensor, w: torch.Tensor, k_chunk: int = K_CHUNK,
           split_below_tiles: int = SPLIT_BELOW_TILES, flatten: bool = False, split_sum: str = "kernel",
           loads: str = "pointers") -> torch.Tensor:
    """x [..., K] @ w [N, K].T -> [..., N] in x's dtype, each row independent of the others; k_chunk
    (kernels.invariant_k_chunk): the K elements summed before the next chunk is added (GPU);
    split_below_tiles (kernels.invariant_split_below_tiles): which of two kernels, the same bits;
    flatten (kernels.invariant_flatten): the fold kernel's chunk loop as one loop over K, the same bits;
    split_sum (kernels.invariant_split_sum): the split's chunks summed by a second kernel or by each tile's
    last program, the same bits; loads (kernels.invariant_loads): the products' blocks through per-element
    pointers or tensor descriptors (tma; the fold in its one-loop form, 128 x 256 tiles past 256 rows), the same
    bits (a hand-built Kernels' auto takes the pointers: config.resolve decides auto for a device)."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    out = _linear_gpu(x2, w, k_chunk, split_below_tiles, flatten, split_sum, loads) if x2.is_cuda \
        else _linear_cpu(x2, w)
    return out.reshape(*lead, w.shape[0])


def _linear_cpu(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    t, k = x.shape
    if t == 0:
        return x.new_empty(0, w.shape[0])
    tiles = -(-t // CPU_ROW_TILE)
    xp = F.pad(x, (0, 0, 0, tiles * CPU_ROW_TILE - t)).view(tiles, CPU_ROW_TILE, k)
    out = torch.bmm(xp, w.t().unsqueeze(0).expand(tiles, -1, -1))
    return out.reshape(tiles * CPU_ROW_TILE, -1)[:t]


# (most rows, tiles): the first entry whose row count holds the step; float32 (tests) takes smaller
# tiles to fit shared memory. Measured choices, free to change: they do not change a row's bits.
_TILES_16BIT = ((16, dict(BM=16, BN=64, BK=128, num_warps=4, num_stages=4)),
                (64, dict(BM=64, BN=64, BK=128, num_warps=4, num_stages=4)),
                (256, dict(BM=64, BN=128, BK=64, num_warps=4, num_stages=4)),
                (None, dict(BM=128, BN=128, BK=64, num_warps=8, num_stages=3)))
# up to 256 rows, products of at most this many columns keep the 64-row entry's 64 x 64 tiles: more
# programs for narrow products (E2B at 256 rows on an H100: 64 x 64 the fastest tile of every product of
# N <= 2,048, 64 x 128 past it; bench_inv_linear)
_NARROW_N = 2048
_TILE_32BIT = dict(BM=32, BN=64, BK=32, num_warps=4, num_stages=2)
# kernels.invariant_loads=tma past 256 rows: 128 x 256 tiles (their pointer loads spill registers)
_TILE_TMA_MANY_ROWS = dict(BM=128, BN=256, BK=64, num_warps=8, num_stages=3)


def _tiles(m: int, n: int, dtype: torch.dtype, tma: bool = False) -> dict:
    if dtype == torch.float32:
        return _TILE_32BIT
    if m > 256:
        return _TILE_TMA_MANY_ROWS if tma else _TILES_16BIT[-1][1]
    if m > 64 and n <= _NARROW_N:
        m = 64
    return next(t for most, t in _TILES_16BIT if most is None or m <= most)


def _linear_gpu(x: torch.Tensor, w: torch.Tensor, k_chunk: int, split_below_tiles: int, flatten: bool,
                split_sum: str, loads: str) -> torch.Tensor:
    from flexgemma.model.invariant import triton_matmul as tm

    if w.stride(-1) != 1:
        w = w.contiguous()
    if x.stride(-1) != 1:
        x = x.contiguous()
    m, k = x.shape
    n = w.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    tma = loads == "tma" and tm.tma_ok(x, w, out)
    cfg = dict(_tiles(m, n, x.dtype, tma))
    tiles = -(-m // cfg["BM"]) * -(-n // cfg["BN"])
    chunks = -(-k // k_chunk)
    if chunks > 1 and tiles < split_below_tiles:
        split = tm.split_last_sums if split_sum == "last_program" else tm.split_then_sum
        split(x, w, out, chunks, k_chunk, cfg, tma=tma)
    else:
        tm.fold(x, w, out, k_chunk, cfg, flatten, tma=tma)
    return out
