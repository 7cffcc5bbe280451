"""The Triton kernels of `attention.paged_attention` (imported only on a GPU).

One kernel serves both phases (`SPLIT`): a program takes a row tile (`block_m` rows: a few consecutive
queries of one sequence times the query heads of one KV head) and either folds every chunk of its range
(prefill) or computes one chunk and stores its (max, sum, values) for `_combine` (decode). The tile
step and the fold are shared @triton.jit helpers, and FMA contraction is off in both kernels, so the
two phases run the same float32 operations on a query's scores.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

NEG_INF = tl.constexpr(float("-inf"))


@triton.jit
def _tile_step(m, l, acc, q, k_ptr, v_ptr, table_ptr, seq_row, table_width, start, pos, lo, t_hi, row_ok, scale,
               P: tl.constexpr, BN: tl.constexpr, D: tl.constexpr, IEEE: tl.constexpr):
    """Positions [start, start + BN) of the tile's sequence through one online-softmax step."""
    lp = start // P
    page = tl.load(table_ptr + seq_row * table_width + lp, mask=lp < table_width, other=-1)
    kpos = start + tl.arange(0, BN)
    slot = page * P + start % P + tl.arange(0, BN)
    dd = tl.arange(0, D)
    # a scalar select, not `(page >= 0) & (kpos <= t_hi)`: Triton 3.9's interpreter refuses `&` of a scalar and a block
    paged = kpos <= tl.where(page >= 0, t_hi, -1)
    k = tl.load(k_ptr + slot[:, None] * D + dd[None, :], mask=paged[:, None], other=0.0)
    v = tl.load(v_ptr + slot[:, None] * D + dd[None, :], mask=paged[:, None], other=0.0)
    if IEEE:
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
    else:
        s = tl.dot(q, tl.trans(k)) * scale
    live = row_ok[:, None] & paged[None, :] & (kpos[None, :] <= pos[:, None]) & (kpos[None, :] >= lo[:, None])
    s = tl.where(live, s, NEG_INF)
    m_new = tl.maximum(m, tl.max(s, 1))
    m_safe = tl.where(m_new == NEG_INF, 0.0, m_new)
    p = tl.exp(s - m_safe[:, None])
    alpha = tl.exp(m - m_safe)
    l = l * alpha + tl.sum(p, 1)
    if IEEE:
        acc = tl.dot(p, v, acc * alpha[:, None], input_precision="ieee")
    else:
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
    return m_new, l, acc


@triton.jit
def _chunk(q, k_ptr, v_ptr, table_ptr, seq_row, table_width, c_start, t_lo, t_hi, pos, lo, row_ok, scale,
           P: tl.constexpr, S: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, D: tl.constexpr,
           IEEE: tl.constexpr):
    """(max, sum, values) of the tile's queries over the chunk [c_start, c_start + S), from nothing."""
    m = tl.full((BM,), NEG_INF, tl.float32)
    l = tl.zeros((BM,), tl.float32)
    acc = tl.zeros((BM, D), tl.float32)
    first = tl.maximum(c_start, t_lo // BN * BN)
    last = tl.minimum(c_start + S, t_hi + 1)
    for start in range(first, last, BN):
        m, l, acc = _tile_step(m, l, acc, q, k_ptr, v_ptr, table_ptr, seq_row, table_width, start, pos, lo, t_hi,
                               row_ok, scale, P, BN, D, IEEE)
    return m, l, acc


@triton.jit
def _fold(m, l, acc, mc, lc, accc):
    m_new = tl.maximum(m, mc)
    m_safe = tl.where(m_new == NEG_INF, 0.0, m_new)
    a = tl.exp(m - m_safe)
    b = tl.exp(mc - m_safe)
    return m_new, l * a + lc * b, acc * a[:, None] + accc * b[:, None]


@triton.jit
def _finish(l, acc):
    return tl.where(l[:, None] > 0, acc / l[:, None], 0.0)


@triton.jit(do_not_specialize=["window"])
def _attention_kernel(q_ptr, k_ptr, v_ptr, out_ptr, pm_ptr, pl_ptr, pacc_ptr, table_ptr, q_row_ptr, q_pos_ptr,
                      tile_start_ptr, tile_len_ptr, table_width, stride_qt, stride_kh, window, max_chunks, scale,
                      H: tl.constexpr, G: tl.constexpr, P: tl.constexpr, S: tl.constexpr, BM: tl.constexpr,
                      BN: tl.constexpr, D: tl.constexpr, HAS_WINDOW: tl.constexpr, SPLIT: tl.constexpr,
                      IEEE: tl.constexpr, FLATTEN: tl.constexpr):
    """Program (tile, kv head[, chunk]): rows m = (query m // G of the tile, head kv_head * G + m % G)."""
    ti = tl.program_id(0)
    kvh = tl.program_id(1)
    t0 = tl.load(tile_start_ptr + ti)
    n = tl.load(tile_len_ptr + ti)
    mi = tl.arange(0, BM)
    row_ok = mi // G < n
    qi = t0 + mi // G
    head = kvh * G + mi % G
    dd = tl.arange(0, D)
    pos = tl.load(q_pos_ptr + qi, mask=row_ok, other=0)
    if HAS_WINDOW:
        lo = tl.maximum(pos - window + 1, 0)
    else:
        lo = tl.zeros_like(pos)
    t_hi = tl.max(tl.where(row_ok, pos, -1), 0)
    t_lo = tl.min(tl.where(row_ok, lo, 1 << 30), 0)
    seq_row = tl.load(q_row_ptr + t0)
    q = tl.load(q_ptr + qi[:, None] * stride_qt + head[:, None] * D + dd[None, :], mask=row_ok[:, None], other=0.0)
    k_ptr += kvh * stride_kh
    v_ptr += kvh * stride_kh
    if SPLIT:  # decode: one query, one chunk; `_combine` folds the chunks
        c = tl.program_id(2)
        if (c >= t_lo // S) & (c * S <= t_hi):
            mc, lc, accc = _chunk(q, k_ptr, v_ptr, table_ptr, seq_row, table_width, c * S, t_lo, t_hi, pos, lo,
                                  row_ok, scale, P, S, BM, BN, D, IEEE)
            at = (qi * H + head) * max_chunks + c
            tl.store(pm_ptr + at, mc, mask=row_ok)
            tl.store(pl_ptr + at, lc, mask=row_ok)
            tl.store(pacc_ptr + at[:, None] * D + dd[None, :], accc, mask=row_ok[:, None])
    else:
        m = tl.full((BM,), NEG_INF, tl.float32)
        l = tl.zeros((BM,), tl.float32)
        acc = tl.zeros((BM, D), tl.float32)
        for c_start in tl.range(t_lo // S * S, t_hi + 1, S, flatten=FLATTEN):
            mc, lc, accc = _chunk(q, k_ptr, v_ptr, table_ptr, seq_row, table_width, c_start, t_lo, t_hi, pos, lo,
                                  row_ok, scale, P, S, BM, BN, D, IEEE)
            m, l, acc = _fold(m, l, acc, mc, lc, accc)
        out = _finish(l, acc)
        tl.store(out_ptr + qi[:, None] * stride_qt + head[:, None] * D + dd[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


@triton.jit(do_not_specialize=["window"])
def _combine(out_ptr, pm_ptr, pl_ptr, pacc_ptr, q_pos_ptr, window, max_chunks, stride_qt, H: tl.constexpr,
             BH: tl.constexpr, D: tl.constexpr, S: tl.constexpr, HAS_WINDOW: tl.constexpr):
    """Program (query): its chunks folded left to right, as the prefill program folds them."""
    t = tl.program_id(0)
    heads = tl.arange(0, BH)
    ok = heads < H
    dd = tl.arange(0, D)
    pos = tl.load(q_pos_ptr + t)
    if HAS_WINDOW:
        lo = tl.maximum(pos - window + 1, 0)
    else:
        lo = pos * 0
    m = tl.full((BH,), NEG_INF, tl.float32)
    l = tl.zeros((BH,), tl.float32)
    acc = tl.zeros((BH, D), tl.float32)
    for c in range(lo // S, pos // S + 1):
        at = (t * H + heads) * max_chunks + c
        mc = tl.load(pm_ptr + at, mask=ok, other=NEG_INF)
        lc = tl.load(pl_ptr + at, mask=ok, other=0.0)
        accc = tl.load(pacc_ptr + at[:, None] * D + dd[None, :], mask=ok[:, None], other=0.0)
        m, l, acc = _fold(m, l, acc, mc, lc, accc)
    out = _finish(l, acc)
    tl.store(out_ptr + t * stride_qt + heads[:, None] * D + dd[None, :], out.to(out_ptr.dtype.element_ty),
             mask=ok[:, None])


def _config(head_dim: int, dtype: torch.dtype, block_n: int) -> dict:
    """Row tile and warps by head_dim and dtype (speed only: a query's bits do not depend on them,
    but decode and prefill must use the same ones, since the tile's row reductions follow its layout)."""
    wide = dtype == torch.float32
    if head_dim >= 512:
        bm, bn, warps = (16, min(block_n, 16), 4) if wide else (32, min(block_n, 32), 8)
    elif head_dim >= 256:
        bm, bn, warps = (32, min(block_n, 32), 4) if wide else (64, block_n, 8)
    else:
        bm, bn, warps = 32, block_n, 4
    return dict(BM=bm, BN=bn, num_warps=warps)


def row_tiles(rows, per_tile: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(first query, queries) of each row tile of rows.segments, `per_tile` queries at most, memoised on
    `rows` (every layer of a step reads the same table; each build is a host-to-device copy)."""
    if per_tile not in rows.tiles:
        starts, lens = [], []
        for first, count in rows.segments:
            for s in range(first, first + count, per_tile):
                starts.append(s)
                lens.append(min(per_tile, first + count - s))
        rows.tiles[per_tile] = (torch.tensor(starts, dtype=torch.int32, device=device),
                                torch.tensor(lens, dtype=torch.int32, device=device))
    return rows.tiles[per_tile]


def paged_attention(q, k_pool, v_pool, rows, page_size: int, split: int, block_n: int,
                    flatten: bool = False) -> torch.Tensor:
    t, h, d = q.shape
    hkv = k_pool.shape[1]
    g = h // hkv
    q = q.contiguous()
    out = torch.empty_like(q)
    cfg = _config(d, q.dtype, block_n)
    bm = max(cfg["BM"], g)
    if split % cfg["BN"]:
        raise ValueError(f"attention split of {split} positions is not a multiple of the tile ({cfg['BN']})")
    chunks = -(-rows.max_len // split)
    meta = dict(H=h, G=g, P=page_size, S=split, BM=bm, BN=cfg["BN"], D=d, HAS_WINDOW=rows.window is not None,
                IEEE=q.dtype == torch.float32, FLATTEN=flatten, num_warps=cfg["num_warps"], enable_fp_fusion=False)
    window = rows.window or 0
    table = rows.table
    if rows.decode:
        starts = torch.arange(t, dtype=torch.int32, device=q.device)
        lens = torch.ones(t, dtype=torch.int32, device=q.device)
        pm = torch.empty(t, h, chunks, dtype=torch.float32, device=q.device)
        pl = torch.empty_like(pm)
        pacc = torch.empty(t, h, chunks, d, dtype=torch.float32, device=q.device)
        _attention_kernel[(t, hkv, chunks)](q, k_pool, v_pool, out, pm, pl, pacc, table, rows.q_row, rows.q_pos,
                                            starts, lens, table.shape[1], q.stride(0), k_pool.stride(1), window,
                                            chunks, 1.0, SPLIT=True, **meta)
        _combine[(t,)](out, pm, pl, pacc, rows.q_pos, window, chunks, q.stride(0), H=h,
                       BH=triton.next_power_of_2(h), D=d, S=split, HAS_WINDOW=rows.window is not None,
                       num_warps=4, enable_fp_fusion=False)
        return out
    starts, lens = row_tiles(rows, bm // g, q.device)
    _attention_kernel[(starts.numel(), hkv)](q, k_pool, v_pool, out, out, out, out, table, rows.q_row, rows.q_pos,
                                             starts, lens, table.shape[1], q.stride(0), k_pool.stride(1), window,
                                             chunks, 1.0, SPLIT=False, **meta)
    return out
