"""Triton kernels for 26B-A4B's routed experts at decode (`kernels.moe=triton`).

At decode, rows spread thin: bs 8 routes 64 (token, choice) entries to ~52 of 128 experts, one or
two each. torch's path sorts rows by expert (argsort, counts, cumsum, a gather), runs two grouped
GEMMs whose tiles are sized for many rows per expert, and adds the results back (index_add): a dozen
kernels per layer around two GEMMs that read the weights at 1.6-2.7 TB/s on the H200
(experiments/bench_moe_kernel.py). Here a decode step is two kernels and a sum:

- up: program (e, j) finds the entries routed to expert e in the step's routing (all of it, read
  from L2: a few hundred ints), streams features [j*BLOCK_N, (j+1)*BLOCK_N) of e's gate and up
  weights once, multiplies every such entry's token row against them (16 rows per tensor-core tile)
  and writes act(gate) * up at the entry's flat row;
- down: the same over the down projection, times the entry's router weight, in float32;
- the K choices of each token summed and cast (one small kernel).

Experts with no entries exit at once. Weights are read in their stored [E, N, K] layout. Steps of
more than `kernels.moe_sort_above` entries (RL batches past 64 rows) sort their entries by expert
first, so a program reads only its own; prefill-sized steps (many rows per expert) stay on torch's
grouped GEMM.

4-bit experts (`quant.PackedExpertWeight`) are read as packed bytes by the same two kernels: a K step
is one quantisation block, whose bytes meet the rows' even and odd elements (high and low nibbles)
in two products, the block's scale applied to the products: on the H200, 466 / 756 us a layer at
bs 8 / 32, 1.9-2.8x faster than torch's dequantise + grouped GEMM (a 4-bit value decoded by a table
load beat a tree of selects). A form that addressed the bytes through a division (hiding their
contiguity from Triton's analysis) and scaled every weight ran at 0.05 TB/s (our reading, not
profiled). Where a row is not whole blocks, the
experts a step routes to are dequantised into slots by a third kernel and the bf16 kernels read
them through an expert -> slot map.

Imported only when selected: Triton is a GPU dependency (the CPU runs it only through Triton's
interpreter, TRITON_INTERPRET=1, which the tests use).
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
import triton
import triton.language as tl

from flexgemma.config.kernels import Kernels
from flexgemma.model.moe import route as torch_route, routed_experts
from flexgemma.model.ptx_lookup import check_lookup_device, lookup_constexpr
from flexgemma.model.triton4bit import (block_bytes, code4, dequant_blocks, halves_order, nibble_codes,
                                        nibble_products, row_pairs, scaled_code_halves, sum_rows)

BLOCK_M = 16  # entries of one expert per tile: tl.dot's smallest M (the default at up to 64 rows)


@triton.jit
def _dequant_kernel(packed_ptr, absmax_ptr, code4_ptr, ncode_ptr, nabsmax_ptr, noffset_ptr, ids_ptr, out_ptr,
                    BYTES: tl.constexpr, stride_pe, stride_ae, stride_ne, QBLOCK: tl.constexpr,
                    NESTED: tl.constexpr, DOUBLE_QUANT: tl.constexpr, BLOCKS: tl.constexpr,
                    HALVES: tl.constexpr = False):
    """Program (s, j): quantisation blocks [j*BLOCKS, (j+1)*BLOCKS) of 4-bit expert ids[s] (QBLOCK/2
    bytes each) -> their weights at slot s of out (code[nibble] x the block's scale, each block's
    scale decoded once; bitsandbytes packs the first of a pair in the high nibble), or with HALVES each
    block's even then odd weights, code x scale in the table's dtype (triton4bit.scaled_code_halves).
    Slots with id < 0 are padding."""
    slot = tl.program_id(0)
    expert = tl.load(ids_ptr + slot)
    # a padding slot has no blocks; the bound is a scalar select, not `live & (blk < n)`: Triton's
    # interpreter (3.9) rejects a mask made by `&` of a scalar and a block of booleans
    nblocks = tl.where(expert >= 0, BYTES // (QBLOCK // 2), 0)  # an expert is whole blocks (PackedExpertWeight.pack)
    expert = tl.maximum(expert, 0)
    blk = tl.program_id(1) * BLOCKS + tl.arange(0, BLOCKS)
    ok = blk < nblocks
    scale = _block_scales(absmax_ptr, ncode_ptr, nabsmax_ptr, noffset_ptr, expert, blk, ok, stride_ae, stride_ne,
                          NESTED, DOUBLE_QUANT)
    if HALVES:
        scaled_code_halves(packed_ptr + expert * stride_pe, code4_ptr, out_ptr + slot * (2 * BYTES), blk, ok, scale,
                           QBLOCK, BLOCKS)
    else:
        dequant_blocks(packed_ptr + expert * stride_pe, code4_ptr, out_ptr + slot * (2 * BYTES), blk, ok, scale,
                       QBLOCK, BLOCKS)


@triton.jit
def _gelu_tanh(g):
    """0.5 g (1 + tanh(z)) written as g * sigmoid(2z), z = sqrt(2/pi) (g + 0.044715 g^3): transformers'
    gelu_pytorch_tanh, Gemma-4's expert activation."""
    z = 0.7978845608028654 * (g + 0.044715 * g * g * g)
    return g * tl.sigmoid(2.0 * z)


@triton.jit
def _expert_matches(index_ptr, n_flat, expert, NFLAT: tl.constexpr):
    """The (token, choice) entries routed to `expert`: a 0/1 flag per flat entry, each match's rank
    among them, and their count. The routing of a decode step is at most a few hundred entries, so
    every program reads all of it (from L2) instead of the step sorting rows by expert."""
    offs = tl.arange(0, NFLAT)
    match = (tl.load(index_ptr + offs, mask=offs < n_flat, other=-1) == expert).to(tl.int32)
    return offs, match, tl.cumsum(match, 0) - 1, tl.sum(match, 0)


@triton.jit
def _match_tile(offs, match, rank, m0, count, BLOCK_M: tl.constexpr):
    """Flat entries of matches m0 .. m0+BLOCK_M-1 (a [BLOCK_M, NFLAT] compare), and which exist."""
    want = m0 + tl.arange(0, BLOCK_M)
    hit = (match[None, :] > 0) & (rank[None, :] == want[:, None])
    return tl.sum(tl.where(hit, offs[None, :], 0), 1), want < count


@triton.jit
def _expert_entries(index_ptr, order_ptr, starts_ptr, n_flat, expert, SORTED: tl.constexpr, NFLAT: tl.constexpr):
    """(offs, match, rank, start, count) of the entries routed to `expert`: matched in the program
    (_expert_matches), or with SORTED a range [start, start + count) of `order` (entries sorted by
    expert outside, for steps too big to read whole in every program)."""
    if SORTED:
        start = tl.load(starts_ptr + expert)
        offs = tl.arange(0, NFLAT)  # unused in this mode
        return offs, offs, offs, start, tl.load(starts_ptr + expert + 1) - start
    else:
        offs, match, rank, count = _expert_matches(index_ptr, n_flat, expert, NFLAT)
        return offs, match, rank, 0, count


@triton.jit
def _entry_tile(offs, match, rank, order_ptr, start, m0, count, SORTED: tl.constexpr, BLOCK_M: tl.constexpr):
    """Flat entries of matches m0 .. m0+BLOCK_M-1 of the expert, and which exist; both modes list an
    expert's entries in ascending flat order, so their tiles (and results) are the same."""
    if SORTED:
        want = m0 + tl.arange(0, BLOCK_M)
        valid = want < count
        return tl.load(order_ptr + start + want, mask=valid, other=0), valid
    else:
        return _match_tile(offs, match, rank, m0, count, BLOCK_M)


@triton.jit
def _weight_index(slots_ptr, expert, HAS_SLOTS: tl.constexpr):
    """Where expert's matrix sits in the weights the kernel reads: its own id, or its slot among the
    dequantised 4-bit experts."""
    if HAS_SLOTS:
        return tl.load(slots_ptr + expert)
    else:
        return expert


@triton.jit
def _block_scales(absmax_ptr, ncode_ptr, nabsmax_ptr, noffset_ptr, widx, blk, ok, stride_ae, stride_ne,
                  NESTED: tl.constexpr, DOUBLE_QUANT: tl.constexpr):
    """float32 scales of quantisation blocks `blk` of 4-bit expert widx (double quantised: an 8-bit
    code times its 256-block's scale plus the expert's offset, as bitsandbytes decodes it)."""
    if DOUBLE_QUANT:
        code8 = tl.load(absmax_ptr + widx * stride_ae + blk, mask=ok, other=0).to(tl.int32)
        nested = tl.load(nabsmax_ptr + widx * stride_ne + blk // NESTED, mask=ok, other=0.0)
        return tl.load(ncode_ptr + code8) * nested + tl.load(noffset_ptr + widx)
    else:
        return tl.load(absmax_ptr + widx * stride_ae + blk, mask=ok, other=0.0)


@triton.jit
def _block_load(w_ptr, widx, rows, ok, k0, K: tl.constexpr, stride_we, absmax_ptr, ncode_ptr, nabsmax_ptr,
                noffset_ptr, stride_ae, stride_ne, QBLOCK: tl.constexpr, NESTED: tl.constexpr,
                DOUBLE_QUANT: tl.constexpr):
    """Block k0 of rows `rows` of 4-bit expert widx as loaded: its bytes and its float32 scale per row."""
    scale = _block_scales(absmax_ptr, ncode_ptr, nabsmax_ptr, noffset_ptr, widx, rows * (K // QBLOCK) + k0 // QBLOCK,
                          ok, stride_ae, stride_ne, NESTED, DOUBLE_QUANT)
    return block_bytes(w_ptr + widx * stride_we, rows, ok, k0, K, QBLOCK), scale


@triton.jit
def _nibble_block(w_ptr, widx, rows, ok, k0, K: tl.constexpr, stride_we, absmax_ptr, code_ptr, ncode_ptr,
                  nabsmax_ptr, noffset_ptr, stride_ae, stride_ne, QBLOCK: tl.constexpr, NESTED: tl.constexpr,
                  DOUBLE_QUANT: tl.constexpr, LOOKUP: tl.constexpr):
    """Block k0 of rows `rows` of 4-bit expert widx, decoded: its high and low nibbles' code values and
    its float32 scale per row."""
    byte, scale = _block_load(w_ptr, widx, rows, ok, k0, K, stride_we, absmax_ptr, ncode_ptr, nabsmax_ptr,
                              noffset_ptr, stride_ae, stride_ne, QBLOCK, NESTED, DOUBLE_QUANT)
    hi, lo = nibble_codes(byte, code_ptr, LOOKUP)
    return hi, lo, scale


@triton.jit
def _block_step(acc, a_rows, valid, byte, scale, k0, code_ptr, QBLOCK: tl.constexpr, LOOKUP: tl.constexpr,
                WEIGHTS: tl.constexpr = False):
    """acc plus rows a_rows' products with one loaded block (k0) of a 4-bit matrix and its scale."""
    a_even, a_odd = row_pairs(a_rows, k0, valid, QBLOCK)
    hi, lo = nibble_codes(byte, code_ptr, LOOKUP)
    return _scaled_products(acc, a_even, a_odd, hi, lo, scale, WEIGHTS)


@triton.jit
def _scaled_products(acc, a_even, a_odd, hi, lo, scale, WEIGHTS: tl.constexpr = False, FIRST: tl.constexpr = False):
    """acc plus one row tile's products with a decoded block: its products times the block's scale, or with
    WEIGHTS (kernels.invariant_4bit_scale=weights) its codes times the scale in their dtype, the even then the
    odd half chained into acc: the K order and arithmetic of dequantised weights in halves order
    (dequantize_slots(halves=True)), which bf16 kernels of any tile then compute bit for bit. FIRST: the
    decoded block the products' first operand, acc [len(rows), BLOCK_M] (the rows' tile transposed)."""
    if FIRST:
        return acc + (tl.dot(hi, tl.trans(a_even)) + tl.dot(lo, tl.trans(a_odd))) * scale[:, None]
    elif WEIGHTS:
        sc = scale.to(hi.dtype)[:, None]
        return tl.dot(a_odd, tl.trans(lo * sc), tl.dot(a_even, tl.trans(hi * sc), acc))
    else:
        return acc + nibble_products(a_even, a_odd, hi, lo) * scale[None, :]


@triton.jit
def _next_block(k0, K: tl.constexpr, QBLOCK: tl.constexpr):
    """The block a prefetching loop loads while it computes block k0: the next one, or k0 itself at the last
    step (loaded again, never used: every load stays inside the matrix)."""
    return tl.where(k0 + QBLOCK < K, k0 + QBLOCK, k0)


@triton.jit
def _packed_products(acc, a_rows, valid, w_ptr, widx, rows, ok, K: tl.constexpr, stride_we, absmax_ptr, code_ptr,
                     ncode_ptr, nabsmax_ptr, noffset_ptr, stride_ae, stride_ne, QBLOCK: tl.constexpr,
                     NESTED: tl.constexpr, DOUBLE_QUANT: tl.constexpr, LOOKUP: tl.constexpr,
                     PREFETCH: tl.constexpr, WEIGHTS: tl.constexpr = False):
    """acc plus a_rows [BLOCK_M, K] @ W[rows].T of a 4-bit matrix, a quantisation block at a time in order
    (each block's nibble products times its scale). PREFETCH (kernels.moe_4bit_prefetch): the next block's
    bytes and scales are loaded before this block is computed, so a step's HBM latency overlaps the
    previous step's work instead of following it (the loop is otherwise a chain of load, wait, decode,
    product); the same operations on the same values (a GPU's compiler may contract them otherwise: other
    rounding)."""
    if PREFETCH:
        byte, scale = _block_load(w_ptr, widx, rows, ok, 0, K, stride_we, absmax_ptr, ncode_ptr, nabsmax_ptr,
                                  noffset_ptr, stride_ae, stride_ne, QBLOCK, NESTED, DOUBLE_QUANT)
        for k0 in range(0, K, QBLOCK):
            byte_n, scale_n = _block_load(w_ptr, widx, rows, ok, _next_block(k0, K, QBLOCK), K, stride_we, absmax_ptr,
                                          ncode_ptr, nabsmax_ptr, noffset_ptr, stride_ae, stride_ne, QBLOCK, NESTED,
                                          DOUBLE_QUANT)
            acc = _block_step(acc, a_rows, valid, byte, scale, k0, code_ptr, QBLOCK, LOOKUP, WEIGHTS)
            byte, scale = byte_n, scale_n
    else:
        for k0 in range(0, K, QBLOCK):
            byte, scale = _block_load(w_ptr, widx, rows, ok, k0, K, stride_we, absmax_ptr, ncode_ptr, nabsmax_ptr,
                                      noffset_ptr, stride_ae, stride_ne, QBLOCK, NESTED, DOUBLE_QUANT)
            acc = _block_step(acc, a_rows, valid, byte, scale, k0, code_ptr, QBLOCK, LOOKUP, WEIGHTS)
    return acc


@triton.jit
def _up_prefetched(acc_g, acc_u, x_rows, valid, w_ptr, widx, cols, ok, I: tl.constexpr, H: tl.constexpr,
                   stride_we, absmax_ptr, code_ptr, ncode_ptr, nabsmax_ptr, noffset_ptr, stride_ae, stride_ne,
                   QBLOCK: tl.constexpr, NESTED: tl.constexpr, DOUBLE_QUANT: tl.constexpr, LOOKUP: tl.constexpr,
                   WEIGHTS: tl.constexpr = False, FIRST: tl.constexpr = False):
    """The up kernel's one-tile 4-bit loop with the next block of gate and of up prefetched (as
    _packed_products), the rows' halves of a block shared by both (FIRST: as _scaled_products)."""
    bg, sg = _block_load(w_ptr, widx, cols, ok, 0, H, stride_we, absmax_ptr, ncode_ptr, nabsmax_ptr, noffset_ptr,
                         stride_ae, stride_ne, QBLOCK, NESTED, DOUBLE_QUANT)
    bu, su = _block_load(w_ptr, widx, cols + I, ok, 0, H, stride_we, absmax_ptr, ncode_ptr, nabsmax_ptr, noffset_ptr,
                         stride_ae, stride_ne, QBLOCK, NESTED, DOUBLE_QUANT)
    for k0 in range(0, H, QBLOCK):
        nxt = _next_block(k0, H, QBLOCK)
        bg_n, sg_n = _block_load(w_ptr, widx, cols, ok, nxt, H, stride_we, absmax_ptr, ncode_ptr, nabsmax_ptr,
                                 noffset_ptr, stride_ae, stride_ne, QBLOCK, NESTED, DOUBLE_QUANT)
        bu_n, su_n = _block_load(w_ptr, widx, cols + I, ok, nxt, H, stride_we, absmax_ptr, ncode_ptr, nabsmax_ptr,
                                 noffset_ptr, stride_ae, stride_ne, QBLOCK, NESTED, DOUBLE_QUANT)
        a_even, a_odd = row_pairs(x_rows, k0, valid, QBLOCK)
        hi, lo = nibble_codes(bg, code_ptr, LOOKUP)
        acc_g = _scaled_products(acc_g, a_even, a_odd, hi, lo, sg, WEIGHTS, FIRST)
        hi, lo = nibble_codes(bu, code_ptr, LOOKUP)
        acc_u = _scaled_products(acc_u, a_even, a_odd, hi, lo, su, WEIGHTS, FIRST)
        bg, sg, bu, su = bg_n, sg_n, bu_n, su_n
    return acc_g, acc_u


@triton.jit
def _routed_up_kernel(x_ptr, index_ptr, order_ptr, starts_ptr, n_flat, w_ptr, slots_ptr, absmax_ptr, code_ptr, ncode_ptr, nabsmax_ptr,
                      noffset_ptr, out_ptr, I: tl.constexpr, H: tl.constexpr, TOPK: tl.constexpr, stride_x,
                      stride_we, stride_wn, stride_ae, stride_ne, HAS_SLOTS: tl.constexpr, PACKED: tl.constexpr,
                      QBLOCK: tl.constexpr, NESTED: tl.constexpr, DOUBLE_QUANT: tl.constexpr, LOOKUP: tl.constexpr,
                      SORTED: tl.constexpr, NFLAT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr, SUBTILES: tl.constexpr = 1, PREFETCH: tl.constexpr = False,
                      SCALE_WEIGHTS: tl.constexpr = False, WEIGHTS_FIRST: tl.constexpr = False):
    """Program (e, j): for every (token, choice) routed to expert e, features [j*BLOCK_N, (j+1)*BLOCK_N)
    of act(x @ gate.T) * (x @ up.T), written at the entry's flat row of out [T*TOPK, I]. gate is rows
    [0, I) of the expert's gate_up, up rows [I, 2I): both tiles of a feature slice are read together.
    The expert's matrix is w[e], w[slots[e]] (4-bit experts dequantised into slots), or with PACKED
    the 4-bit bytes of expert e themselves, decoded a quantisation block (QBLOCK elements) at a time,
    with SUBTILES=4 once for four BLOCK_M-row tiles, each of which runs the same operations as alone;
    PREFETCH: each block's bytes loaded a step ahead (_packed_products); SCALE_WEIGHTS: the scale applied to
    the codes (_scaled_products; not with SUBTILES); WEIGHTS_FIRST (with PREFETCH, not SCALE_WEIGHTS): the decoded
    blocks the products' first operand (kernels.moe_4bit_weights_first_above)."""
    expert = tl.program_id(0)
    dt = x_ptr.dtype.element_ty
    offs, match, rank, start, count = _expert_entries(index_ptr, order_ptr, starts_ptr, n_flat, expert, SORTED, NFLAT)
    widx = _weight_index(slots_ptr, expert, HAS_SLOTS)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    m0 = 0
    if PACKED and SUBTILES == 4:  # resolved when compiled; leaves m0 >= count
        while m0 < count:
            _up_4bit_four_tiles(x_ptr, order_ptr, offs, match, rank, start, m0, count, w_ptr, widx, cols, absmax_ptr,
                                code_ptr, ncode_ptr, nabsmax_ptr, noffset_ptr, out_ptr, I, H, TOPK, stride_x,
                                stride_we, stride_ae, stride_ne, QBLOCK, NESTED, DOUBLE_QUANT, LOOKUP, SORTED, BLOCK_M,
                                BLOCK_N)
            m0 += 4 * BLOCK_M
    while m0 < count:
        flat, valid = _entry_tile(offs, match, rank, order_ptr, start, m0, count, SORTED, BLOCK_M)
        token = flat // TOPK
        acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if PACKED and PREFETCH:
            if WEIGHTS_FIRST:  # [BLOCK_N, BLOCK_M] accumulators, transposed for the store
                acc_g = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
                acc_u = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
            acc_g, acc_u = _up_prefetched(acc_g, acc_u, x_ptr + token[:, None] * stride_x, valid, w_ptr, widx, cols,
                                          cols < I, I, H, stride_we, absmax_ptr, code_ptr, ncode_ptr, nabsmax_ptr,
                                          noffset_ptr, stride_ae, stride_ne, QBLOCK, NESTED, DOUBLE_QUANT, LOOKUP,
                                          SCALE_WEIGHTS, WEIGHTS_FIRST)
            if WEIGHTS_FIRST:
                acc_g, acc_u = tl.trans(acc_g), tl.trans(acc_u)
        elif PACKED:  # one block a step, its row halves shared by gate and up
            ok = cols < I
            for k0 in range(0, H, QBLOCK):
                a_even, a_odd = row_pairs(x_ptr + token[:, None] * stride_x, k0, valid, QBLOCK)
                hi, lo, sc = _nibble_block(w_ptr, widx, cols, ok, k0, H, stride_we, absmax_ptr, code_ptr, ncode_ptr,
                                           nabsmax_ptr, noffset_ptr, stride_ae, stride_ne, QBLOCK, NESTED, DOUBLE_QUANT,
                                           LOOKUP)
                acc_g = _scaled_products(acc_g, a_even, a_odd, hi, lo, sc, SCALE_WEIGHTS)
                hi, lo, sc = _nibble_block(w_ptr, widx, cols + I, ok, k0, H, stride_we, absmax_ptr, code_ptr,
                                           ncode_ptr, nabsmax_ptr, noffset_ptr, stride_ae, stride_ne, QBLOCK, NESTED,
                                           DOUBLE_QUANT, LOOKUP)
                acc_u = _scaled_products(acc_u, a_even, a_odd, hi, lo, sc, SCALE_WEIGHTS)
        else:
            for k0 in range(0, H, BLOCK_K):
                k = k0 + ks
                a = tl.load(x_ptr + token[:, None] * stride_x + k[None, :],
                            mask=valid[:, None] & (k[None, :] < H), other=0.0)
                inside = (cols[:, None] < I) & (k[None, :] < H)
                base = w_ptr + widx * stride_we + cols[:, None] * stride_wn + k[None, :]
                acc_g += tl.dot(a, tl.trans(tl.load(base, mask=inside, other=0.0)))
                acc_u += tl.dot(a, tl.trans(tl.load(base + I * stride_wn, mask=inside, other=0.0)))
        _store_up(out_ptr, flat, valid, cols, acc_g, acc_u, I, dt)
        m0 += BLOCK_M


@triton.jit
def _store_up(out_ptr, flat, valid, cols, acc_g, acc_u, I: tl.constexpr, dt):
    """act(gate) * up of a tile's rows at their flat rows of out, rounded where torch's path rounds (GEMM
    outputs, the activation, the product) so that both paths give the same numbers up to summation order."""
    g = acc_g.to(dt).to(tl.float32)
    h = _gelu_tanh(g).to(dt).to(tl.float32) * acc_u.to(dt).to(tl.float32)
    tl.store(out_ptr + flat[:, None] * I + cols[None, :], h.to(dt), mask=valid[:, None] & (cols[None, :] < I))


@triton.jit
def _up_4bit_four_tiles(x_ptr, order_ptr, offs, match, rank, start, m0, count, w_ptr, widx, cols, absmax_ptr,
                        code_ptr, ncode_ptr, nabsmax_ptr, noffset_ptr, out_ptr, I: tl.constexpr, H: tl.constexpr,
                        TOPK: tl.constexpr, stride_x, stride_we, stride_ae, stride_ne, QBLOCK: tl.constexpr,
                        NESTED: tl.constexpr, DOUBLE_QUANT: tl.constexpr, LOOKUP: tl.constexpr, SORTED: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The up kernel's 4-bit step for the expert's entries m0 .. m0 + 4*BLOCK_M - 1 as four BLOCK_M-row tiles
    that share each decoded block: every tile's products, scales, sums and rounding are those of the
    one-tile loop (the same tl.dot shapes), only the decode is done once for the four."""
    dt = x_ptr.dtype.element_ty
    f0, v0 = _entry_tile(offs, match, rank, order_ptr, start, m0, count, SORTED, BLOCK_M)
    f1, v1 = _entry_tile(offs, match, rank, order_ptr, start, m0 + BLOCK_M, count, SORTED, BLOCK_M)
    f2, v2 = _entry_tile(offs, match, rank, order_ptr, start, m0 + 2 * BLOCK_M, count, SORTED, BLOCK_M)
    f3, v3 = _entry_tile(offs, match, rank, order_ptr, start, m0 + 3 * BLOCK_M, count, SORTED, BLOCK_M)
    r0, r1 = x_ptr + (f0 // TOPK)[:, None] * stride_x, x_ptr + (f1 // TOPK)[:, None] * stride_x
    r2, r3 = x_ptr + (f2 // TOPK)[:, None] * stride_x, x_ptr + (f3 // TOPK)[:, None] * stride_x
    g0 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    g1, g2, g3, u0, u1, u2, u3 = g0, g0, g0, g0, g0, g0, g0
    ok = cols < I
    for k0 in range(0, H, QBLOCK):
        hg, lg, sg = _nibble_block(w_ptr, widx, cols, ok, k0, H, stride_we, absmax_ptr, code_ptr, ncode_ptr,
                                   nabsmax_ptr, noffset_ptr, stride_ae, stride_ne, QBLOCK, NESTED, DOUBLE_QUANT, LOOKUP)
        hu, lu, su = _nibble_block(w_ptr, widx, cols + I, ok, k0, H, stride_we, absmax_ptr, code_ptr, ncode_ptr,
                                   nabsmax_ptr, noffset_ptr, stride_ae, stride_ne, QBLOCK, NESTED, DOUBLE_QUANT, LOOKUP)
        ae, ao = row_pairs(r0, k0, v0, QBLOCK)
        g0, u0 = _scaled_products(g0, ae, ao, hg, lg, sg), _scaled_products(u0, ae, ao, hu, lu, su)
        ae, ao = row_pairs(r1, k0, v1, QBLOCK)
        g1, u1 = _scaled_products(g1, ae, ao, hg, lg, sg), _scaled_products(u1, ae, ao, hu, lu, su)
        ae, ao = row_pairs(r2, k0, v2, QBLOCK)
        g2, u2 = _scaled_products(g2, ae, ao, hg, lg, sg), _scaled_products(u2, ae, ao, hu, lu, su)
        ae, ao = row_pairs(r3, k0, v3, QBLOCK)
        g3, u3 = _scaled_products(g3, ae, ao, hg, lg, sg), _scaled_products(u3, ae, ao, hu, lu, su)
    _store_up(out_ptr, f0, v0, cols, g0, u0, I, dt)
    _store_up(out_ptr, f1, v1, cols, g1, u1, I, dt)
    _store_up(out_ptr, f2, v2, cols, g2, u2, I, dt)
    _store_up(out_ptr, f3, v3, cols, g3, u3, I, dt)


@triton.jit
def _routed_down_kernel(inter_ptr, index_ptr, order_ptr, starts_ptr, weights_ptr, n_flat, w_ptr, slots_ptr, absmax_ptr, code_ptr, ncode_ptr,
                        nabsmax_ptr, noffset_ptr, out_ptr, I: tl.constexpr, H: tl.constexpr, stride_we, stride_wn,
                        stride_ae, stride_ne, HAS_SLOTS: tl.constexpr, PACKED: tl.constexpr, QBLOCK: tl.constexpr,
                        NESTED: tl.constexpr, DOUBLE_QUANT: tl.constexpr, LOOKUP: tl.constexpr,
                        SORTED: tl.constexpr, NFLAT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr, SUBTILES: tl.constexpr = 1, PREFETCH: tl.constexpr = False,
                        SCALE_WEIGHTS: tl.constexpr = False):
    """Program (e, j): out[f, j-slice] = (inter[f] @ down_e.T) x router weight of f, for every flat
    entry f routed to expert e; out is float32 [T*TOPK, H], summed over the choices afterwards. The
    weights as in the up kernel: plain, through slots, or PACKED 4-bit (SUBTILES, PREFETCH, SCALE_WEIGHTS
    as there)."""
    expert = tl.program_id(0)
    dt = inter_ptr.dtype.element_ty
    offs, match, rank, start, count = _expert_entries(index_ptr, order_ptr, starts_ptr, n_flat, expert, SORTED, NFLAT)
    widx = _weight_index(slots_ptr, expert, HAS_SLOTS)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    m0 = 0
    if PACKED and SUBTILES == 4:  # resolved when compiled; leaves m0 >= count
        while m0 < count:
            _down_4bit_four_tiles(inter_ptr, order_ptr, offs, match, rank, start, m0, count, weights_ptr, w_ptr, widx,
                                  cols, absmax_ptr, code_ptr, ncode_ptr, nabsmax_ptr, noffset_ptr, out_ptr, I, H,
                                  stride_we, stride_ae, stride_ne, QBLOCK, NESTED, DOUBLE_QUANT, LOOKUP, SORTED,
                                  BLOCK_M, BLOCK_N)
            m0 += 4 * BLOCK_M
    while m0 < count:
        flat, valid = _entry_tile(offs, match, rank, order_ptr, start, m0, count, SORTED, BLOCK_M)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if PACKED:
            acc = _packed_products(acc, inter_ptr + flat[:, None] * I, valid, w_ptr, widx, cols, cols < H, I,
                                   stride_we, absmax_ptr, code_ptr, ncode_ptr, nabsmax_ptr, noffset_ptr, stride_ae,
                                   stride_ne, QBLOCK, NESTED, DOUBLE_QUANT, LOOKUP, PREFETCH, SCALE_WEIGHTS)
        else:
            for k0 in range(0, I, BLOCK_K):
                k = k0 + ks
                a = tl.load(inter_ptr + flat[:, None] * I + k[None, :], mask=valid[:, None] & (k[None, :] < I),
                            other=0.0)
                b = tl.load(w_ptr + widx * stride_we + cols[:, None] * stride_wn + k[None, :],
                            mask=(cols[:, None] < H) & (k[None, :] < I), other=0.0)
                acc += tl.dot(a, tl.trans(b))
        _store_down(out_ptr, weights_ptr, flat, valid, cols, acc, H, dt)
        m0 += BLOCK_M


@triton.jit
def _store_down(out_ptr, weights_ptr, flat, valid, cols, acc, H: tl.constexpr, dt):
    """A tile's rows of down, rounded to dt as torch's GEMM output is, times their float32 router weights (as
    transformers multiplies), at their flat rows of out."""
    weight = tl.load(weights_ptr + flat, mask=valid, other=0.0)
    y = acc.to(dt).to(tl.float32) * weight[:, None]
    tl.store(out_ptr + flat[:, None] * H + cols[None, :], y, mask=valid[:, None] & (cols[None, :] < H))


@triton.jit
def _down_4bit_four_tiles(inter_ptr, order_ptr, offs, match, rank, start, m0, count, weights_ptr, w_ptr, widx, cols,
                          absmax_ptr, code_ptr, ncode_ptr, nabsmax_ptr, noffset_ptr, out_ptr, I: tl.constexpr,
                          H: tl.constexpr, stride_we, stride_ae, stride_ne, QBLOCK: tl.constexpr, NESTED: tl.constexpr,
                          DOUBLE_QUANT: tl.constexpr, LOOKUP: tl.constexpr, SORTED: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The down kernel's 4-bit step for entries m0 .. m0 + 4*BLOCK_M - 1 as four tiles sharing each decoded
    block (as _up_4bit_four_tiles)."""
    dt = inter_ptr.dtype.element_ty
    f0, v0 = _entry_tile(offs, match, rank, order_ptr, start, m0, count, SORTED, BLOCK_M)
    f1, v1 = _entry_tile(offs, match, rank, order_ptr, start, m0 + BLOCK_M, count, SORTED, BLOCK_M)
    f2, v2 = _entry_tile(offs, match, rank, order_ptr, start, m0 + 2 * BLOCK_M, count, SORTED, BLOCK_M)
    f3, v3 = _entry_tile(offs, match, rank, order_ptr, start, m0 + 3 * BLOCK_M, count, SORTED, BLOCK_M)
    a0 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    a1, a2, a3 = a0, a0, a0
    ok = cols < H
    for k0 in range(0, I, QBLOCK):
        hi, lo, sc = _nibble_block(w_ptr, widx, cols, ok, k0, I, stride_we, absmax_ptr, code_ptr, ncode_ptr,
                                   nabsmax_ptr, noffset_ptr, stride_ae, stride_ne, QBLOCK, NESTED, DOUBLE_QUANT, LOOKUP)
        ae, ao = row_pairs(inter_ptr + f0[:, None] * I, k0, v0, QBLOCK)
        a0 = _scaled_products(a0, ae, ao, hi, lo, sc)
        ae, ao = row_pairs(inter_ptr + f1[:, None] * I, k0, v1, QBLOCK)
        a1 = _scaled_products(a1, ae, ao, hi, lo, sc)
        ae, ao = row_pairs(inter_ptr + f2[:, None] * I, k0, v2, QBLOCK)
        a2 = _scaled_products(a2, ae, ao, hi, lo, sc)
        ae, ao = row_pairs(inter_ptr + f3[:, None] * I, k0, v3, QBLOCK)
        a3 = _scaled_products(a3, ae, ao, hi, lo, sc)
    _store_down(out_ptr, weights_ptr, f0, v0, cols, a0, H, dt)
    _store_down(out_ptr, weights_ptr, f1, v1, cols, a1, H, dt)
    _store_down(out_ptr, weights_ptr, f2, v2, cols, a2, H, dt)
    _store_down(out_ptr, weights_ptr, f3, v3, cols, a3, H, dt)


@triton.jit
def _route_kernel(scores_ptr, scale_ptr, weights_ptr, index_ptr, stride_s, E: tl.constexpr, K: tl.constexpr,
                  BLOCK_E: tl.constexpr):
    """Program t: Gemma-4's router after its projection for token t, as transformers computes it
    (float32 softmax over the experts, top-k, renormalised, times the per-expert scale), in one
    kernel instead of torch.topk's sort and four more launches. Top-k by K rounds of max (the lowest
    expert id first among equal probabilities)."""
    row = tl.program_id(0)
    e = tl.arange(0, BLOCK_E)
    s = tl.load(scores_ptr + row * stride_s + e, mask=e < E, other=-float("inf")).to(tl.float32)
    p = tl.exp(s - tl.max(s, 0))
    p = p / tl.sum(p, 0)
    p = tl.where(e < E, p, -1.0)
    kk = tl.arange(0, K)
    top_p = tl.zeros((K,), dtype=tl.float32)
    top_i = tl.zeros((K,), dtype=tl.int32)
    for j in tl.static_range(K):
        best = tl.max(p, 0)
        idx = tl.min(tl.where(p == best, e, BLOCK_E), 0)
        top_p = tl.where(kk == j, best, top_p)
        top_i = tl.where(kk == j, idx, top_i)
        p = tl.where(e == idx, -1.0, p)
    w = top_p / tl.sum(top_p, 0) * tl.load(scale_ptr + top_i).to(tl.float32)
    tl.store(weights_ptr + row * K + kk, w)
    tl.store(index_ptr + row * K + kk, top_i.to(tl.int64))


def route(scores: torch.Tensor, per_expert_scale: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`moe.route` in one Triton kernel: scores [T, E] -> (float32 weights, int64 expert ids) [T, k].
    k must be a power of two (Gemma-4: 8); otherwise `moe.route` (torch) runs."""
    if k & (k - 1):
        return torch_route(scores, per_expert_scale, k)
    scores, per_expert_scale = scores.contiguous(), per_expert_scale.contiguous()
    t, e = scores.shape
    weights = torch.empty(t, k, dtype=torch.float32, device=scores.device)
    index = torch.empty(t, k, dtype=torch.int64, device=scores.device)
    if t:
        _route_kernel[(t,)](scores, per_expert_scale, weights, index, scores.stride(0), E=e, K=k,
                            BLOCK_E=triton.next_power_of_2(e))
    return weights, index


# the routed kernels read a decode step's whole routing in every program up to kernels.moe_sort_above
# (token, choice) entries; bigger steps up to KERNEL_MAX_ENTRIES (RL batches of 512 x top-8) have
# their entries sorted by expert first (a stable argsort, counts, cumsum: three small kernels) and
# each program reads only its own range; bigger still (prefill) go to torch's path.
KERNEL_MAX_ENTRIES = 4096
# tile options of the two kernels, from experiments/bench_moe_kernel.py's grid on the H200 (up BLOCK_N
# 32 with down 128 was best or within noise of it at bs 8 and 32, 9-10% under 64/128)
UP_TILES = dict(BLOCK_N=32, BLOCK_K=128, num_warps=4, num_stages=3)
DOWN_TILES = dict(BLOCK_N=128, BLOCK_K=128, num_warps=4, num_stages=3)


def block_m_for(n_flat: int, experts: int, packed: bool) -> int:
    """Entries of one expert per tile for a step of n_flat entries. An expert with more entries than
    a tile streams its weights once per tile, so bf16 tiles grow with the mean entries per expert
    (16 up to 128 rows x top-8 over 128 experts, 32 at 256, 64 at 512: on the H200 622 vs 772 us a
    layer at 256, 893 vs 1,408 at 512); the fused 4-bit kernels stay at 16, their fastest at every
    size (32 and 64 ran 1.1-2.2x slower; not profiled why)."""
    if packed:
        return BLOCK_M
    return min(64, max(BLOCK_M, triton.next_power_of_2(2 * -(-n_flat // experts))))


# packed bytes per program of the 4-bit dequantise kernel, whole quantisation blocks: the dense groups'
# kernel of this form (linear4bit.DEQUANT_TILES) was best at 2,048 on the H200, 2.1x bitsandbytes' op
DEQUANT_BYTES = 2048


def dequantize_slots(w, ids: torch.Tensor, dtype: torch.dtype, nbytes: int = DEQUANT_BYTES,
                     halves: bool = False) -> torch.Tensor:
    """[S, N, K] weights of 4-bit experts ids ([S] int32 on the device; -1: a padding slot, left
    unwritten) from a `quant.PackedExpertWeight` [E, N, K], in `dtype`; a program dequantises
    `nbytes` packed bytes (whole quantisation blocks). halves: each block's even then odd weights, code x
    scale in `dtype` (the scaled-weights arithmetic; rows of whole blocks only)."""
    _, n, k = w.shape
    expert_bytes = n * k // 2
    out = torch.empty(ids.shape[0], n, k, dtype=dtype, device=w.packed.device)
    dq = bool(w.double_quant)
    absmax = w.absmax
    nested = w.nested_absmax if dq else absmax  # placeholders when not double-quantised (never read)
    blocks = max(1, nbytes // (w.block_size // 2))
    _dequant_kernel[(ids.shape[0], triton.cdiv(triton.cdiv(expert_bytes, w.block_size // 2), blocks))](
        packed_ptr=w.packed, absmax_ptr=absmax,
        code4_ptr=code4(w.quant_type, w.packed.device, dtype if halves else torch.float32),
        ncode_ptr=w.nested_code if dq else absmax, nabsmax_ptr=nested, noffset_ptr=w.nested_offset if dq else absmax,
        ids_ptr=ids, out_ptr=out, BYTES=expert_bytes, stride_pe=w.packed.stride(0), stride_ae=absmax.stride(0),
        stride_ne=nested.stride(0), QBLOCK=w.block_size, NESTED=w.NESTED_BLOCK, DOUBLE_QUANT=dq, BLOCKS=blocks,
        HALVES=halves, enable_fp_fusion=False)  # multiply and add rounded apart, as bitsandbytes rounds them
    return out


def dequantize_experts(w, experts: Optional[torch.Tensor], how: str) -> torch.Tensor:
    """[S, R, C] weights of 4-bit experts `experts` ([S] ids; all when None) the way kernels.moe_dequant
    names: bnb (bitsandbytes' op after torch decodes the scales) or triton (the slot kernel, one pass)."""
    if how == "bnb":
        return w.dequantize(experts)
    ids = torch.arange(w.shape[0], device=w.packed.device) if experts is None else experts
    return dequantize_slots(w, ids.to(torch.int32), w.dtype)


def expert_slots(top_k_index: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For a step's routing: ids [S] of the experts with rows (ascending; -1 pads to the static
    S = min(E, entries)) and slots [E] (expert -> its position in ids, -1 when it has no rows)."""
    flat = top_k_index.reshape(-1)
    counts = torch.zeros(num_experts, dtype=torch.int32, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
    used = counts > 0
    ids = routed_experts(counts, min(num_experts, flat.numel()))
    ids = torch.where(used[ids], ids, -1).to(torch.int32)
    slots = torch.where(used, torch.cumsum(used.to(torch.int32), 0) - 1, -1).to(torch.int32)
    return ids, slots


def fused_4bit_fits(gate_up, down) -> bool:
    """The 4-bit GEMM kernels decode one quantisation block per step of a row, so each matrix's rows
    (H for gate_up, I for down) must be whole blocks; otherwise the experts go through slots."""
    h, i = gate_up.shape[2], down.shape[2]
    return h % gate_up.block_size == 0 and i % down.block_size == 0 and gate_up.block_size == down.block_size


def _check_step(x, top_k_index, gate_up, down, packed_mode: Optional[str], code_lookup: str,
                max_entries: Optional[int], scale_weights: bool = False) -> None:
    """decode_experts' arguments, refused with what is wrong."""
    check_lookup_device(code_lookup, x.device)
    if packed_mode not in (None, "fused", "slots"):
        raise ValueError(f"packed_mode={packed_mode!r}: fused or slots")
    if x.dtype not in (torch.bfloat16, torch.float16):
        raise TypeError(f"the Triton expert kernels take bf16/fp16 rows, got {x.dtype}")
    for name, w in (("gate_up", gate_up), ("down", down)):
        if isinstance(w, torch.Tensor) and w.dtype != x.dtype:
            raise TypeError(f"decode_experts: {name} is {w.dtype}; the rows are {x.dtype}")
    if scale_weights and not isinstance(gate_up, torch.Tensor) and not fused_4bit_fits(gate_up, down):
        raise ValueError(f"scale_weights needs rows of whole quantisation blocks: H={gate_up.shape[2]}, "
                         f"I={down.shape[2]}, block {gate_up.block_size}")
    if max_entries is not None and top_k_index.numel() > max_entries:
        raise ValueError(f"decode_experts takes at most {max_entries} (token, choice) entries, "
                         f"got {top_k_index.numel()}")


def _packed_mode(gate_up, down, packed_mode: Optional[str], n_flat: int, fused_max_entries: int) -> str:
    """How 4-bit experts run: the one asked for, else fused where the rows are whole blocks and the
    step is at most `fused_max_entries` entries (past it every expert has many entries, and the fused
    kernels decode each weight block once per 16-entry tile; the slots are transient: 26B-A4B's
    gate_up of all 128 experts is 1 GB of bf16 at such a step, in the graph pool)."""
    if packed_mode is None:
        packed_mode = "fused" if fused_4bit_fits(gate_up, down) and n_flat <= fused_max_entries else "slots"
    if packed_mode == "fused" and not fused_4bit_fits(gate_up, down):
        raise ValueError(f"packed_mode=fused needs rows of whole quantisation blocks: H={gate_up.shape[2]}, "
                         f"I={gate_up.shape[1] // 2}, block {gate_up.block_size}")
    return packed_mode


def _weight_operands(w, x: torch.Tensor, fused: bool, slotted: bool, ids, code_lookup: str,
                     halves: bool = False) -> dict:
    """A weight's kernel arguments: plain (or slotted: with `halves`, dequantised in the scaled-weights
    arithmetic and halves order) bf16, or the 4-bit buffers (the code table in x's dtype: a block's nibble
    products or codes are scaled by its scale; LOOKUP: how the kernels read it, for prmt the table's PTX)."""
    if fused:
        lookup = lookup_constexpr(code_lookup, w.quant_type, x.dtype)
        dq = bool(w.double_quant)
        return dict(w_ptr=w.packed, absmax_ptr=w.absmax, code_ptr=code4(w.quant_type, x.device, x.dtype),
                    ncode_ptr=w.nested_code if dq else w.absmax, nabsmax_ptr=w.nested_absmax if dq else w.absmax,
                    noffset_ptr=w.nested_offset if dq else w.absmax, stride_we=w.packed.stride(0), stride_wn=0,
                    stride_ae=w.absmax.stride(0), stride_ne=w.nested_absmax.stride(0) if dq else 0,
                    QBLOCK=w.block_size, NESTED=w.NESTED_BLOCK, DOUBLE_QUANT=dq, LOOKUP=lookup)
    w = dequantize_slots(w, ids, x.dtype, halves=halves) if slotted else w
    w = w if w.stride(2) == 1 else w.contiguous()
    return dict(w_ptr=w, absmax_ptr=w, code_ptr=w, ncode_ptr=w, nabsmax_ptr=w, noffset_ptr=w,
                stride_we=w.stride(0), stride_wn=w.stride(1), stride_ae=0, stride_ne=0, QBLOCK=16, NESTED=1,
                DOUBLE_QUANT=False, LOOKUP="table")


def decode_experts(x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, gate_up, down,
                   up_tiles: Optional[dict] = None, down_tiles: Optional[dict] = None,
                   packed_mode: Optional[str] = None, sort_entries: Optional[bool] = None, kernels: Kernels = Kernels(),
                   max_entries: Optional[int] = KERNEL_MAX_ENTRIES, scale_weights: bool = False) -> torch.Tensor:
    """Gemma-4's routed experts for a decode-sized step in two kernels, with no sort of rows by expert.

    x [T, H] bf16/fp16; top_k_* [T, K]; gate_up [E, 2I, H], down [E, H, I], as tensors of x's dtype
    or PackedExpertWeights. 4-bit experts: packed_mode "fused" (the default where the rows are whole
    quantisation blocks, up to kernels.moe_fused_max_entries entries) decodes the bytes inside the
    GEMM kernels; "slots" dequantises the experts with rows into slots first, one matrix at a time,
    then runs the bf16 kernels. The activation is gelu_pytorch_tanh, Gemma-4's. Returns [T, H] in x's
    dtype: sum over choices of weight x expert(x). *_tiles override UP_TILES / DOWN_TILES (BLOCK_N,
    BLOCK_K, num_warps, num_stages; fused 4-bit steps are one quantisation block each, whatever BLOCK_K
    says) and BLOCK_M (default: block_m_for the step's size). kernels.moe_code_lookup: how the fused mode
    turns 4-bit values into weights (triton4bit.nibble_codes). sort_entries: list each expert's entries
    through a sort outside the kernels (default: above kernels.moe_sort_above entries) instead of every
    program matching the whole routing; the same tiles either way. max_entries: the largest step taken (None:
    any, with sort_entries; matching reads the whole routing in every program). scale_weights (4-bit experts,
    kernels.invariant_4bit_scale=weights): fused, each block's scale applied to its codes (_scaled_products);
    slots, the experts so dequantised in halves order, rows reordered to match; both without multiply-add
    contraction, as the dequantise (contracted, 67 of 512 tokens differed: probe_invariance scaled_weights)."""
    _check_step(x, top_k_index, gate_up, down, packed_mode, kernels.moe_code_lookup, max_entries, scale_weights)
    t, topk = top_k_index.shape
    e, two_i, h = gate_up.shape
    i = two_i // 2
    n_flat = t * topk
    if n_flat == 0:
        return x.new_zeros(t, h)
    packed = not isinstance(gate_up, torch.Tensor)
    packed_mode = _packed_mode(gate_up, down, packed_mode, n_flat, kernels.moe_fused_max_entries) if packed \
        else packed_mode
    fused, slotted = packed and packed_mode == "fused", packed and packed_mode == "slots"
    up_tiles, down_tiles = _step_tiles(n_flat, e, fused, kernels, up_tiles, down_tiles)
    x = x.contiguous()
    index = top_k_index.reshape(-1).to(torch.int32)
    weights = top_k_weights.reshape(-1).float()
    sort_entries = n_flat > kernels.moe_sort_above if sort_entries is None else sort_entries
    order, starts, nflat = _entry_lists(index, e, sort_entries)
    ids, slots = expert_slots(top_k_index, e) if slotted else (None, index)  # index: a placeholder, never read
    halves = slotted and scale_weights
    operands = functools.partial(_weight_operands, x=x, fused=fused, slotted=slotted, ids=ids,
                                 code_lookup=kernels.moe_code_lookup, halves=halves)
    weighted = {"SCALE_WEIGHTS": fused and scale_weights, "enable_fp_fusion": not scale_weights}
    ops = operands(gate_up)
    rows = halves_order(x, gate_up.block_size) if halves else x
    inter = torch.empty(n_flat, i, dtype=x.dtype, device=x.device)
    _routed_up_kernel[(e, triton.cdiv(i, up_tiles["BLOCK_N"]))](
        x_ptr=rows, index_ptr=index, order_ptr=order, starts_ptr=starts, n_flat=n_flat, slots_ptr=slots,
        out_ptr=inter, I=i, H=h, TOPK=topk, stride_x=rows.stride(0), HAS_SLOTS=slotted, PACKED=fused,
        SORTED=sort_entries, NFLAT=nflat, **ops, **up_tiles, **weighted)
    del ops  # one dequantised matrix alive at a time
    ops = operands(down)
    inter = halves_order(inter, down.block_size) if halves else inter
    out = torch.empty(n_flat, h, dtype=torch.float32, device=x.device)
    _routed_down_kernel[(e, triton.cdiv(h, down_tiles["BLOCK_N"]))](
        inter_ptr=inter, index_ptr=index, order_ptr=order, starts_ptr=starts, weights_ptr=weights, n_flat=n_flat,
        slots_ptr=slots, out_ptr=out, I=i, H=h, HAS_SLOTS=slotted, PACKED=fused, SORTED=sort_entries, NFLAT=nflat,
        **ops, **down_tiles, **weighted)
    summed = torch.empty(t, h, dtype=x.dtype, device=x.device)
    return sum_rows(out, summed)


# the fused 4-bit up kernel with the decoded blocks as the products' first operand: 64 features a program
# (one 26B-A4B bnb4 gate_up alone on an H100, prmt, no prefetch: 285-378 us at 32-128 rows against 348-451
# in UP_TILES' form; experiments/bench_4bit_forms.py dot_w_prmt)
UP_TILES_WEIGHTS_FIRST = dict(BLOCK_N=64, WEIGHTS_FIRST=True)


def _step_tiles(n_flat: int, experts: int, fused: bool, kernels: Kernels, up_tiles: Optional[dict],
                down_tiles: Optional[dict]) -> tuple[dict, dict]:
    """The up and down kernels' tiles for a step: UP_TILES / DOWN_TILES, BLOCK_M by the step's size and
    PREFETCH by kernels.moe_4bit_prefetch, then the caller's overrides; with none for the up kernel (the
    default mode's steps: the invariant experts pass theirs, a row's bits there must not follow the step's
    size), the fused 4-bit up kernel weights first past kernels.moe_4bit_weights_first_above entries."""
    block_m = {"BLOCK_M": block_m_for(n_flat, experts, fused), "PREFETCH": kernels.moe_4bit_prefetch}
    first = fused and up_tiles is None and kernels.moe_4bit_prefetch and n_flat > kernels.moe_4bit_weights_first_above
    up = {**UP_TILES, **block_m, **(UP_TILES_WEIGHTS_FIRST if first else {})}
    return {**up, **(up_tiles or {})}, {**DOWN_TILES, **block_m, **(down_tiles or {})}


def _entry_lists(index: torch.Tensor, experts: int, sort_entries: bool) -> tuple:
    """(order, starts, NFLAT) for the kernels: sorted, each expert's flat entries are
    order[starts[e]:starts[e+1]] (ascending within an expert); matched, the programs read the routing
    itself, NFLAT wide (order and starts are placeholders, never read)."""
    if not sort_entries:
        return index, index, max(16, triton.next_power_of_2(index.numel()))
    order = torch.argsort(index, stable=True).to(torch.int32)
    counts = torch.zeros(experts, dtype=torch.int32, device=index.device).scatter_add_(0, index.long(),
                                                                                       torch.ones_like(index))
    starts = torch.cat([counts.new_zeros(1), torch.cumsum(counts, 0, dtype=torch.int32)])
    return order, starts, 16  # NFLAT: the matching's width, unused


def kernels_compute(x: torch.Tensor, act, gate_up, down) -> bool:
    """bf16/fp16 rows, Gemma-4's activation, weights of the rows' dtype or 4-bit experts that dequantise
    to it: what the routed kernels compute."""
    # a PackedExpertWeight's dtype is the one it dequantises to
    return (x.dtype in (torch.bfloat16, torch.float16) and is_gelu_tanh(act) and gate_up.dtype == x.dtype
            and down.dtype == x.dtype and isinstance(gate_up, torch.Tensor) == isinstance(down, torch.Tensor))


def is_gelu_tanh(act) -> bool:
    """act is transformers' gelu_pytorch_tanh (the only activation the routed kernels compute)."""
    return type(act).__name__ in ("GELUTanh", "PytorchGELUTanh") or getattr(act, "approximate", None) == "tanh"


class TritonExperts:
    """kernels.moe=triton: decode steps' routed experts in the two kernels above, with the step
    thresholds and the prefill path's dequantise of `kernels` (moe_sort_above, moe_fused_max_entries,
    moe_dequant)."""

    def __init__(self, kernels: Kernels = Kernels()):
        self.kernels = kernels

    @staticmethod
    def takes(x: torch.Tensor, top_k_index: torch.Tensor, act, gate_up, down) -> bool:
        """A decode-sized step the kernels compute (anything else: torch's path)."""
        return top_k_index.numel() <= KERNEL_MAX_ENTRIES and kernels_compute(x, act, gate_up, down)

    def __call__(self, x, top_k_index, top_k_weights, gate_up, down, act=None) -> torch.Tensor:
        # act: Gemma-4's gelu-tanh, which `takes` checked and the kernels apply
        return decode_experts(x, top_k_index, top_k_weights, gate_up, down, kernels=self.kernels)

    def dequantize(self, w, experts: Optional[torch.Tensor]) -> torch.Tensor:
        """Torch's path (prefill-sized steps) over 4-bit experts: [S, R, C] weights of `experts` ([S]
        ids; all when None) the way kernels.moe_dequant names, bitsandbytes' weights bit for bit
        either way."""
        return dequantize_experts(w, experts, self.kernels.moe_dequant)


def invariant_block_m(n_flat: int, experts: int, packed: bool) -> int:
    """Entries of one expert per tile of a batch-invariant step. bf16 experts: sized by the step (16 at
    decode, 128 rows x top-8 over 128 experts; up to 128 at prefill), since their products give a row
    the same bits at every BLOCK_M (experiments/probe_invariance.py moe_tiles: 26B-A4B's layer at 8,192
    tokens 14.2 ms at 16 rows, 4.3 at 128 on the H200). 4-bit experts: 16 always, since the nibble
    products' bits change at 64 rows (tl.dot's other tensor-core instructions), and 32 was slower."""
    if packed:
        return BLOCK_M
    return min(128, max(BLOCK_M, triton.next_power_of_2(2 * -(-n_flat // experts))))


def invariant_experts(x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, gate_up,
                      down, kernels: Kernels = Kernels()) -> torch.Tensor:
    """The routed experts of any step, decode or prefill, with a row's bits independent of the step
    (engine.batch_invariant, kernels.invariant_experts=triton): decode_experts' two kernels with each
    expert's entries listed by a sort (never the matching, whose width follows the step), tiles of
    invariant_block_m rows, 4-bit experts always decoded inside the kernels (or always through slots
    where their rows are not whole quantisation blocks: the two give other bits). From `kernels`:
    invariant_4bit_subtiles 4 lets a step with at least 64 entries an expert on average decode each 4-bit
    block once for four 16-row tiles, each tile's operations unchanged; moe_4bit_prefetch loads each 4-bit
    block's bytes a step ahead, with subtiles=1 only; moe_code_lookup as at decode. A row's output is its K
    steps in order and its choices summed in order, as at decode in the default mode.
    invariant_4bit_scale=weights (4-bit experts of whole-block rows): each block's scale applied to its codes,
    so that steps of more than moe_fused_max_entries entries dequantise the routed experts in that arithmetic
    and run the bf16 kernels with tiles sized by the step, and smaller ones decode inside the kernels, a row
    getting the same bits either way."""
    subtiles = kernels.invariant_4bit_subtiles
    packed = not isinstance(gate_up, torch.Tensor)
    packed_mode = ("fused" if fused_4bit_fits(gate_up, down) else "slots") if packed else None
    n_flat, experts = top_k_index.numel(), gate_up.shape[0]
    if packed_mode == "fused" and kernels.invariant_4bit_scale == "weights":
        return _invariant_scaled_weights(x, top_k_index, top_k_weights, gate_up, down, kernels)
    fused = packed_mode == "fused"
    # the four-tile loop does not prefetch, and a row must get the same bits from it and from the one-tile
    # loop (the two loops round otherwise on a GPU): with subtiles=4 neither prefetches
    tiles = {"BLOCK_M": invariant_block_m(n_flat, experts, fused),
             "PREFETCH": kernels.moe_4bit_prefetch and subtiles == 1}
    if fused and subtiles == 4 and n_flat >= 4 * BLOCK_M * experts:
        tiles["SUBTILES"] = 4
    return decode_experts(x, top_k_index, top_k_weights, gate_up, down, up_tiles=tiles, down_tiles=tiles,
                          packed_mode=packed_mode, sort_entries=True, kernels=kernels, max_entries=None)


def _invariant_scaled_weights(x, top_k_index, top_k_weights, gate_up, down, kernels: Kernels) -> torch.Tensor:
    """invariant_experts under kernels.invariant_4bit_scale=weights: past moe_fused_max_entries entries the
    slots in halves order with the bf16 tiles of the step (a GPU's tensor cores add a product's 16-element
    K steps in order whatever the tile, so the slots' BLOCK_K need not be the fused loop's; Triton's
    interpreter sums a whole tl.dot at once, so on the CPU it is the fused loop's half block); else fused,
    16-row tiles (prefetching as kernels.moe_4bit_prefetch: no rounding step of its own to move)."""
    n_flat, experts = top_k_index.numel(), gate_up.shape[0]
    if n_flat > kernels.moe_fused_max_entries:
        tiles = {"BLOCK_M": invariant_block_m(n_flat, experts, False)}
        if not x.is_cuda:
            tiles["BLOCK_K"] = gate_up.block_size // 2
        mode = "slots"
    else:
        tiles, mode = {"BLOCK_M": BLOCK_M, "PREFETCH": kernels.moe_4bit_prefetch}, "fused"
    return decode_experts(x, top_k_index, top_k_weights, gate_up, down, up_tiles=tiles, down_tiles=tiles,
                          packed_mode=mode, sort_entries=True, kernels=kernels, max_entries=None, scale_weights=True)
