"""Batch-invariant attention over the paged KV pools: decode and prefill compute a query the same way.

A query at position p attends to the positions of its own sequence in [p - window + 1, p] (causal
layers: [0, p]). Its KV is cut at fixed positions into chunks of `split_tokens`; within a chunk,
tiles of `block_n` positions (a tile never spans two pages) are taken in position order through an
online softmax; the chunks' (max, sum, weighted values) are then folded left to right. Masked
positions and whole tiles or chunks outside a query's range change nothing (a masked score is -inf,
its weight exactly 0), so a prefill tile of several queries, which visits the union of their ranges,
gives each query the bits a decode step gives it alone.

`RowTable` is what a step hands the kernel instead of flex_attention's BlockMask: where each query's
pages are (its row of a page table by logical page) and where it is. The model knows nothing of how
pages are handed out; the engine fills these tables.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from flexgemma.model.invariant.rows import pad_rows, padded_row_count, serial


@dataclass
class RowTable:
    """One layer type's view of a step for `paged_attention`.

    table [R, W] int32: page ids by logical page index, -1 where none; q_row [T] / q_pos [T] int32:
    each query's row of `table` and logical position. decode: one query per sequence (its chunks run
    in parallel programs); else `segments` lists (first query, count) of each run of consecutive
    queries of one sequence (a prefill chunk, or padding), which the kernel cuts into its row tiles.
    max_len: the longest sequence the engine allows (sizes the decode kernel's chunk grid).
    tiles: the prefill kernel's row tiles of `segments` (rows per tile -> device tensors), built once for
    all the layers that read this table (building them copies to the GPU, which waits for it)."""

    table: torch.Tensor
    q_row: torch.Tensor
    q_pos: torch.Tensor
    window: Optional[int]
    decode: bool
    max_len: int
    segments: Optional[list[tuple[int, int]]] = None
    tiles: dict = field(default_factory=dict, repr=False, compare=False)


@dataclass(frozen=True)
class InvariantAttentionOptions:
    """Options that fix a query's summation order (so they are part of its result) and kernel tiles.
    split_tokens: the fixed chunk of positions a decode program takes and prefill folds in; block_n:
    positions of one tile (a divisor of the page size). The row tile (block_m) and warps only set speed;
    flatten (kernels.invariant_flatten): prefill's loop over chunks flattened by Triton, the same bits."""

    split_tokens: int = 256
    block_n: int = 64
    flatten: bool = False


def paged_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, rows: RowTable, page_size: int,
                    opts: InvariantAttentionOptions = InvariantAttentionOptions()) -> torch.Tensor:
    """q [T, H, D] -> [T, H, D]; k_pool / v_pool [1, Hkv, slots, D]."""
    block_n = min(opts.block_n, page_size)
    if opts.split_tokens % block_n or page_size % block_n:
        raise ValueError(f"attention tiles of {block_n} positions must divide the page ({page_size}) and the "
                         f"split of {opts.split_tokens}")
    if q.is_cuda:
        from flexgemma.model.invariant import triton_attention

        return triton_attention.paged_attention(q, k_pool, v_pool, rows, page_size, opts.split_tokens, block_n,
                                                opts.flatten)
    t = q.shape[0]
    n = padded_row_count(t)  # whole vector steps in every elementwise loop (rows.py)
    padded = RowTable(rows.table, pad_rows(rows.q_row[:t], n), pad_rows(rows.q_pos[:t], n), rows.window, rows.decode,
                      rows.max_len)
    with serial():
        return _paged_attention_cpu(pad_rows(q, n), k_pool, v_pool, padded, page_size, opts.split_tokens, block_n)[:t]


def _row_bounds(rows: RowTable, t: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each query's first and last visible position (first > last: it sees nothing)."""
    pos = rows.q_pos[:t].long()
    lo = pos - rows.window + 1 if rows.window is not None else torch.zeros_like(pos)
    return lo.clamp_min(0), pos


def _gather_tile(pool: torch.Tensor, rows: RowTable, t: int, start: int, block_n: int, page_size: int):
    """[T, Hkv, block_n, D] of each query's positions [start, start + block_n), and which are paged."""
    page = rows.table[rows.q_row[:t].long(), start // page_size].long()  # [T]
    ok = page >= 0
    slots = (page.clamp_min(0) * page_size + start % page_size)[:, None] + torch.arange(block_n)
    return pool[0][:, slots].permute(1, 0, 2, 3), ok  # [T, Hkv, N, D]


def _tile_step(state, q, k, v, live):
    """One online-softmax step over a tile; masked scores are -inf and add exactly nothing."""
    m, l, acc = state
    t, hkv, g, d = q.shape
    s = (q[:, :, :, None, :] * k[:, :, None, :, :]).sum(-1)  # [T, Hkv, G, N]: a reduction over D alone
    s = torch.where(live[:, None, None, :], s, float("-inf"))
    m_new = torch.maximum(m, s.amax(-1))
    m_safe = torch.where(m_new == float("-inf"), 0.0, m_new)
    p = torch.exp(s - m_safe[..., None])
    alpha = torch.exp(m - m_safe)
    v = torch.where(live[:, None, :, None], v.to(p.dtype), 0.0)  # unwritten slots never meet a 0 weight
    pv = (p[..., None] * v[:, :, None, :, :]).sum(-2)  # a reduction over the tile alone
    return m_new, l * alpha + p.sum(-1), acc * alpha[..., None] + pv


def fold(state, part):
    """Folds a chunk's (max, sum, values) into the running ones (the decode kernel's combine)."""
    m, l, acc = state
    mc, lc, accc = part
    m_new = torch.maximum(m, mc)
    m_safe = torch.where(m_new == float("-inf"), 0.0, m_new)
    a, b = torch.exp(m - m_safe), torch.exp(mc - m_safe)
    return m_new, l * a + lc * b, acc * a[..., None] + accc * b[..., None]


def _paged_attention_cpu(q, k_pool, v_pool, rows: RowTable, page_size: int, split: int, block_n: int):
    """Every query of the step at once, tile by tile over the union of their ranges (exact no-ops outside
    a query's own range), chunks folded in order."""
    t, h, d = q.shape
    hkv = k_pool.shape[1]
    qg = q.float().view(t, hkv, h // hkv, d)
    lo, hi = _row_bounds(rows, t)
    empty = lambda: (torch.full((t, hkv, h // hkv), float("-inf")), torch.zeros(t, hkv, h // hkv),  # noqa: E731
                     torch.zeros(t, hkv, h // hkv, d))
    state = empty()
    if t:
        first, last = int(lo.min()), int(hi.max())
        for c0 in range(first // split * split, last + 1, split):
            part = empty()
            for start in range(max(c0, first // block_n * block_n), min(c0 + split, last + 1), block_n):
                k, ok = _gather_tile(k_pool, rows, t, start, block_n, page_size)
                v, _ = _gather_tile(v_pool, rows, t, start, block_n, page_size)
                kv_pos = start + torch.arange(block_n)
                live = ok[:, None] & (kv_pos[None, :] >= lo[:, None]) & (kv_pos[None, :] <= hi[:, None])
                part = _tile_step(part, qg, k.float(), v, live)
            state = fold(state, part)
    _, l, acc = state
    out = torch.where(l[..., None] > 0, acc / l[..., None], 0.0)
    return out.view(t, h, d).to(q.dtype)
