"""The Triton kernels of `matmul.linear` (imported only on a GPU: CPU installs may lack Triton).

Shapes are runtime arguments (only tiles are constexprs): one compilation a tile configuration serves
every projection of every model."""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

GROUP_M = 8  # row tiles per band of the dense products' tile order (`_tile`)


@triton.jit
def _dot_step(acc, x_ptr, rows, row_ok, ks, k_ok, stride_x, b, IEEE: tl.constexpr):
    """acc + x[rows, ks] @ b^T (b [BN, BK], the weights at those K): one step of a K loop."""
    a = tl.load(x_ptr + rows[:, None] * stride_x + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
    return _dot(a, b, acc, IEEE)


@triton.jit
def _dot(a, b, acc, IEEE: tl.constexpr):
    """acc + a @ b^T (a [BM, BK], b [BN, BK])."""
    if IEEE:
        out = tl.dot(a, tl.trans(b), acc, input_precision="ieee")
    else:
        out = tl.dot(a, tl.trans(b), acc)
    return out


@triton.jit
def _chunk_product_tma(x_desc, w_desc, m0, n0, k_start, KC: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                       BK: tl.constexpr, IEEE: tl.constexpr):
    """`_chunk_product` of the tile at (m0, n0) with its blocks moved by tensor descriptors (zeros past M, N, K)."""
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, KC, BK):
        acc = _dot(x_desc.load([m0, k_start + k0]), w_desc.load([n0, k_start + k0]), acc, IEEE)
    return acc


@triton.jit
def _chunk_product(x_ptr, w_ptr, rows, cols, row_ok, col_ok, k_start, K, stride_x,
                   KC: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, IEEE: tl.constexpr):
    """float32 [BM, BN]: x[rows, k_start:k_start+KC] @ w[cols, same K]^T, tl.dot steps in K order."""
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, KC, BK):
        ks = k_start + k0 + tl.arange(0, BK)
        k_ok = ks < K
        b = tl.load(w_ptr + cols[:, None] * K + ks[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        acc = _dot_step(acc, x_ptr, rows, row_ok, ks, k_ok, stride_x, b, IEEE)
    return acc


@triton.jit
def _chunks_in_one_loop(x_ptr, w_ptr, rows, cols, row_ok, col_ok, K, stride_x, CHUNKS,
                        KC: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, IEEE: tl.constexpr):
    """The chunk loop's arithmetic (each chunk's tl.dot steps from zero, added to the total in chunk order)
    as one loop over every K step: Triton pipelines a loop's loads, and a loop nested per chunk drains and
    refills that pipeline every KC / BK steps (at trainer sizes the products ran at half cuBLAS's speed)."""
    STEPS: tl.constexpr = KC // BK
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    total = tl.zeros((BM, BN), dtype=tl.float32)
    for s in range(0, CHUNKS * STEPS):
        ks = s * BK + tl.arange(0, BK)
        k_ok = ks < K
        b = tl.load(w_ptr + cols[:, None] * K + ks[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        acc = _dot_step(acc, x_ptr, rows, row_ok, ks, k_ok, stride_x, b, IEEE)
        if s % STEPS == STEPS - 1:
            total = total + acc
            acc = tl.zeros((BM, BN), dtype=tl.float32)
    return total


@triton.jit
def _tile(pid, M, N, BM: tl.constexpr, BN: tl.constexpr, GM: tl.constexpr):
    """(rows, cols) of output tile `pid`, tiles ordered in bands of GM row tiles, each band column by column:
    the programs running at once share GM row tiles of x and a few column tiles of w in the L2 cache (column
    by column over all rows, every column tile read all of x again: 70 MB at a 23k-token trainer step, more
    than the L2). The order moves only the speed, not a bit; at decode sizes (at most GM row tiles) it is
    column by column."""
    m0, n0 = _tile_origin(pid, M, N, BM, BN, GM)
    return m0 + tl.arange(0, BM), n0 + tl.arange(0, BN)


@triton.jit
def _tile_origin(pid, M, N, BM: tl.constexpr, BN: tl.constexpr, GM: tl.constexpr):
    """`_tile`'s first row and column."""
    num_m = tl.cdiv(M, BM)
    band = GM * tl.cdiv(N, BN)
    first = (pid // band) * GM
    height = tl.minimum(num_m - first, GM)
    return (first + (pid % band) % height) * BM, ((pid % band) // height) * BN


@triton.jit(do_not_specialize=["M"])
def _mm_fold(x_ptr, w_ptr, out_ptr, M, N, K, stride_x, CHUNKS,
             KC: tl.constexpr, BM: tl.constexpr,
             BN: tl.constexpr, BK: tl.constexpr, GM: tl.constexpr, IEEE: tl.constexpr, FLATTEN: tl.constexpr):
    """Program (tile): the output tile's K chunks one after another, each added to the total in order
    (FLATTEN: the chunk loop and its K steps as one loop, the same operations)."""
    rows, cols = _tile(tl.program_id(0), M, N, BM, BN, GM)
    row_ok, col_ok = rows < M, cols < N
    if FLATTEN:
        total = _chunks_in_one_loop(x_ptr, w_ptr, rows, cols, row_ok, col_ok, K, stride_x, CHUNKS, KC, BM, BN, BK,
                                    IEEE)
    else:
        total = tl.zeros((BM, BN), dtype=tl.float32)
        for c in range(0, CHUNKS):
            total = total + _chunk_product(x_ptr, w_ptr, rows, cols, row_ok, col_ok, c * KC, K, stride_x, KC, BM, BN,
                                           BK, IEEE)
    tl.store(out_ptr + rows[:, None] * N + cols[None, :], total.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


@triton.jit(do_not_specialize=["M"])
def _mm_fold_tma(x_desc, w_desc, out_desc, M, N, CHUNKS, KC: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                 BK: tl.constexpr, GM: tl.constexpr, IEEE: tl.constexpr):
    """`_mm_fold`'s one-loop arithmetic with its blocks moved by the tensor memory accelerator (descriptors:
    no per-element addresses or masks in the loop; past M, N or K a block reads zeros, as the masks do)."""
    m0, n0 = _tile_origin(tl.program_id(0), M, N, BM, BN, GM)
    STEPS: tl.constexpr = KC // BK
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    total = tl.zeros((BM, BN), dtype=tl.float32)
    for s in range(0, CHUNKS * STEPS):
        acc = _dot(x_desc.load([m0, s * BK]), w_desc.load([n0, s * BK]), acc, IEEE)
        if s % STEPS == STEPS - 1:
            total = total + acc
            acc = tl.zeros((BM, BN), dtype=tl.float32)
    out_desc.store([m0, n0], total.to(out_desc.dtype))


@triton.jit
def _stored_chunk(x_ptr, w_ptr, x_desc, w_desc, part_ptr, M, N, K, stride_x, KC: tl.constexpr, BM: tl.constexpr,
                  BN: tl.constexpr, BK: tl.constexpr, GM: tl.constexpr, IEEE: tl.constexpr, TMA: tl.constexpr):
    """Program (tile, chunk)'s float32 K-chunk product, stored at part[chunk, rows, cols]; (rows, cols, which
    of them are in the output). TMA: the blocks through the descriptors (the pointers unused), else the pointers."""
    c = tl.program_id(1)
    m0, n0 = _tile_origin(tl.program_id(0), M, N, BM, BN, GM)
    rows, cols = m0 + tl.arange(0, BM), n0 + tl.arange(0, BN)
    ok = (rows < M)[:, None] & (cols < N)[None, :]
    if TMA:
        acc = _chunk_product_tma(x_desc, w_desc, m0, n0, c * KC, KC, BM, BN, BK, IEEE)
    else:
        acc = _chunk_product(x_ptr, w_ptr, rows, cols, rows < M, cols < N, c * KC, K, stride_x, KC, BM, BN, BK, IEEE)
    tl.store(part_ptr + (c * M + rows[:, None]) * N + cols[None, :], acc, mask=ok)
    return rows, cols, ok


@triton.jit(do_not_specialize=["M"])
def _mm_split(x_ptr, w_ptr, x_desc, w_desc, part_ptr, M, N, K, stride_x, KC: tl.constexpr, BM: tl.constexpr,
              BN: tl.constexpr, BK: tl.constexpr, GM: tl.constexpr, IEEE: tl.constexpr, TMA: tl.constexpr):
    """Program (tile, chunk): one K chunk's float32 product, stored at part[chunk, rows, cols]."""
    _stored_chunk(x_ptr, w_ptr, x_desc, w_desc, part_ptr, M, N, K, stride_x, KC, BM, BN, BK, GM, IEEE, TMA)


@triton.jit(do_not_specialize=["M"])
def _mm_split_last_sums(x_ptr, w_ptr, x_desc, w_desc, part_ptr, out_ptr, count_ptr, M, N, K, stride_x, CHUNKS,
                        KC: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GM: tl.constexpr,
                        IEEE: tl.constexpr, TMA: tl.constexpr):
    """`_mm_split`'s program, then the tile's last program to finish (a counter per tile) adds the tile's
    chunks in order as `_sum_chunks` does and sets the counter back to 0 for the next launch."""
    rows, cols, ok = _stored_chunk(x_ptr, w_ptr, x_desc, w_desc, part_ptr, M, N, K, stride_x, KC, BM, BN, BK, GM, IEEE,
                                   TMA)
    tl.debug_barrier()  # every thread's partials stored before the count says so (the release below publishes them)
    done = tl.atomic_add(count_ptr + tl.program_id(0), 1, sem="acq_rel", scope="gpu")
    if done == CHUNKS - 1:
        total = tl.zeros((BM, BN), dtype=tl.float32)
        for j in range(0, CHUNKS):  # read past L1 (.cg): other SMs wrote these
            total = total + tl.load(part_ptr + (j * M + rows[:, None]) * N + cols[None, :], mask=ok, other=0.0,
                                    cache_modifier=".cg")
        tl.store(out_ptr + rows[:, None] * N + cols[None, :], total.to(out_ptr.dtype.element_ty), mask=ok)
        tl.atomic_xchg(count_ptr + tl.program_id(0), 0, sem="relaxed", scope="gpu")


@triton.jit(do_not_specialize=["M"])
def _sum_chunks(part_ptr, out_ptr, M, N, CHUNKS, BLOCK: tl.constexpr):
    """out = ((0 + part[0]) + part[1]) + ... in float32, then rounded: `_mm_fold`'s arithmetic."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < M * N
    total = tl.zeros((BLOCK,), dtype=tl.float32)
    for c in range(0, CHUNKS):
        total = total + tl.load(part_ptr + c * M * N + offs, mask=ok, other=0.0)
    tl.store(out_ptr + offs, total.to(out_ptr.dtype.element_ty), mask=ok)


def _launch_args(x, w, kc, cfg):
    m, k = x.shape
    n = w.shape[0]
    return m, n, k, triton.cdiv(m, cfg["BM"]) * triton.cdiv(n, cfg["BN"]), _dense_meta(x, kc, cfg)


def fold(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, kc: int, cfg: dict, flatten: bool = False,
         tma: bool = False) -> None:
    """tma: the blocks through tensor descriptors (`tma_ok`; `_mm_fold_tma`, the one-loop form), the same bits."""
    m, n, k, tiles, meta = _launch_args(x, w, kc, cfg)
    if tma:
        _mm_fold_tma[(tiles,)](*_descriptors(meta, x, w, out), m, n, triton.cdiv(k, kc), KC=kc, **meta)
    else:
        _mm_fold[(tiles,)](x, w, out, m, n, k, x.stride(0), triton.cdiv(k, kc), KC=kc, FLATTEN=flatten, **meta)


def _descriptors(meta: dict, x: torch.Tensor, w: torch.Tensor, out: Optional[torch.Tensor] = None) -> tuple:
    """Tensor descriptors of x's [BM, BK], w's [BN, BK] (and out's [BM, BN]) blocks."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    bm, bn, bk = meta["BM"], meta["BN"], meta["BK"]
    descs = (TensorDescriptor.from_tensor(x, [bm, bk]), TensorDescriptor.from_tensor(w, [bn, bk]))
    return descs if out is None else (*descs, TensorDescriptor.from_tensor(out, [bm, bn]))


def tma_ok(*tensors: torch.Tensor) -> bool:
    """Whether descriptors can address these 2-D tensors: 16-byte aligned bases and row strides."""
    return all(t.data_ptr() % 16 == 0 and (t.stride(0) * t.element_size()) % 16 == 0 and t.stride(1) == 1
               for t in tensors)


def split_then_sum(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, chunks: int, kc: int, cfg: dict,
                   tma: bool = False) -> None:
    """tma: the chunks' blocks through tensor descriptors (`tma_ok`), the same bits."""
    m, n, k, tiles, meta = _launch_args(x, w, kc, cfg)
    part = torch.empty(chunks, m, n, dtype=torch.float32, device=x.device)
    descs = _descriptors(meta, x, w) if tma else (None, None)
    _mm_split[(tiles, chunks)](x, w, *descs, part, m, n, k, x.stride(0), KC=kc, TMA=tma, **meta)
    block = 1024
    _sum_chunks[(triton.cdiv(m * n, block),)](part, out, m, n, chunks, BLOCK=block, num_warps=4)


_COUNTERS: dict = {}  # (device, stream) -> int32 tile counters, all 0 between launches (each launch resets its own)


def _tile_counters(device: torch.device, tiles: int) -> torch.Tensor:
    """Zeroed counters for `tiles` tiles, one buffer per stream (launches on one stream never overlap, those
    of two streams may), made at a stream's first product and regrown when a product needs more; a CUDA
    graph's capture stream gets its own, zeroed as part of the first graph captured on it."""
    key = (device, torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else None)
    counters = _COUNTERS.get(key)
    if counters is None or counters.numel() < tiles:
        counters = _COUNTERS[key] = torch.zeros(max(tiles, 4096), dtype=torch.int32, device=device)
    return counters


def split_last_sums(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, chunks: int, kc: int, cfg: dict,
                    tma: bool = False) -> None:
    """split_then_sum's result in one launch: each tile's last program sums its chunks."""
    m, n, k, tiles, meta = _launch_args(x, w, kc, cfg)
    part = torch.empty(chunks, m, n, dtype=torch.float32, device=x.device)
    counters = _tile_counters(x.device, tiles)
    descs = _descriptors(meta, x, w) if tma else (None, None)
    _mm_split_last_sums[(tiles, chunks)](x, w, *descs, part, out, counters, m, n, k, x.stride(0), chunks, KC=kc,
                                         TMA=tma, **meta)


@triton.jit
def _group_tile(tile_expert_ptr, tile_first_ptr, tile_end_ptr, E, N, BM: tl.constexpr, BN: tl.constexpr):
    """This program's (group, rows, cols, row_ok, col_ok) in a grouped product's tile schedule; a program
    past the schedule (group == E) gets the last group and no rows."""
    e = tl.load(tile_expert_ptr + tl.program_id(0))
    first = tl.load(tile_first_ptr + tl.program_id(0))
    end = tl.load(tile_end_ptr + tl.program_id(0))
    rows = first + tl.arange(0, BM)
    cols = tl.program_id(1) * BN + tl.arange(0, BN)
    # the bound a scalar select, not `(rows < end) & (e < E)`: Triton 3.9's interpreter refuses a mask
    # made by `&` of a block and a scalar
    row_ok = rows < tl.where(e < E, end, first)
    return tl.minimum(e, E - 1), rows, cols, row_ok, cols < N


@triton.jit(do_not_specialize=["M"])
def _grouped_fold(x_ptr, w_ptr, out_ptr, tile_expert_ptr, tile_first_ptr, tile_end_ptr, M, E, N,
                  K, stride_x, CHUNKS, KC: tl.constexpr, BM: tl.constexpr,
                  BN: tl.constexpr, BK: tl.constexpr, IEEE: tl.constexpr, FLATTEN: tl.constexpr):
    """Program (row tile, feature tile): rows [first, end) of one expert's group against that expert's
    [N, K] matrix, K chunks added in order as in `_mm_fold` (a row's bits do not depend on its group)."""
    e, rows, cols, row_ok, col_ok = _group_tile(tile_expert_ptr, tile_first_ptr, tile_end_ptr, E, N, BM, BN)
    w_e = w_ptr + e.to(tl.int64) * N * K
    if FLATTEN:
        total = _chunks_in_one_loop(x_ptr, w_e, rows, cols, row_ok, col_ok, K, stride_x, CHUNKS, KC, BM, BN, BK, IEEE)
    else:
        total = tl.zeros((BM, BN), dtype=tl.float32)
        for c in range(0, CHUNKS):
            total = total + _chunk_product(x_ptr, w_e, rows, cols, row_ok, col_ok, c * KC, K, stride_x, KC, BM, BN,
                                           BK, IEEE)
    tl.store(out_ptr + rows[:, None] * N + cols[None, :], total.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


def _schedule(counts: torch.Tensor, m: int, bm: int) -> tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The tile schedule of rows grouped by `counts` [E], on the device with a grid of fixed size
    (CUDA-graph safe): (programs, each one's group, first row, the group's end)."""
    e = counts.shape[0]
    counts = counts.to(torch.int32)
    ends = torch.cumsum(counts, 0, dtype=torch.int32)
    tiles = (counts + bm - 1) // bm
    tile_ends = torch.cumsum(tiles, 0, dtype=torch.int32)
    slots = triton.cdiv(m, bm) + e  # at most one partial tile per expert beyond full ones
    pid = torch.arange(slots, device=counts.device, dtype=torch.int32)
    expert = torch.searchsorted(tile_ends, pid, right=True).to(torch.int32)
    safe = expert.clamp_max(e - 1)
    local = pid - (tile_ends[safe] - tiles[safe])
    return slots, expert, ends[safe] - counts[safe] + local * bm, ends[safe]


def _meta(x: torch.Tensor, kc: int, cfg: dict) -> dict:
    """The launch's constexprs: a K step at most the chunk (the chunk loop's steps must stay inside the
    chunk: a longer one would read the next chunk's K too, which that chunk adds again)."""
    return dict(BM=cfg["BM"], BN=cfg["BN"], BK=min(cfg["BK"], kc), IEEE=x.dtype == torch.float32,
                num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])


def _dense_meta(x: torch.Tensor, kc: int, cfg: dict) -> dict:
    """`_meta` and the tile order's band height (GM 1: each row tile across all its column tiles in turn)."""
    return dict(_meta(x, kc, cfg), GM=cfg.get("GM", GROUP_M))


def grouped(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor, kc: int, cfg: dict,
            flatten: bool = False) -> torch.Tensor:
    """x [M, K] rows grouped by expert (`counts` [E] rows each, in expert order), w [E, N, K] -> [M, N]."""
    m, k = x.shape
    e, n = w.shape[0], w.shape[1]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    slots, expert, first, end = _schedule(counts, m, cfg["BM"])
    if m:
        _grouped_fold[(slots, triton.cdiv(n, cfg["BN"]))](x, w, out, expert, first, end, m, e, n, k,
                                                          x.stride(0), triton.cdiv(k, kc), KC=kc, FLATTEN=flatten,
                                                          **_meta(x, kc, cfg))
    return out
