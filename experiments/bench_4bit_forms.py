"""Where a 4-bit routed expert projection's time goes at decode sizes (a micro-benchmark, not a test).

26B-A4B bnb4's decode step spends ~1 ms a layer in the fused 4-bit expert kernels at 128 rows, reading
~0.4 GB: ~0.4 TB/s against the HBM's 3.35-4.8 (experiments/RESULTS.md, probe moe_tiles). This times one
layer's gate_up projection (act(x @ gate.T) * (x @ up.T), [E, 2I, H] 4-bit, each expert's entries listed
by a sort) in three forms, on the same bytes and routing:

  dot      the production kernel (moe_kernel._routed_up_kernel, PACKED): each quantisation block's
           nibbles decoded, then two tensor-core products with 16-row tiles of entries, scaled after
           (also at BLOCK_N 32-128 and 4 or 8 warps; dot_sel: its code table held as scalars);
  fma      each block decoded once for ENTRIES entries at a time, products on the CUDA cores (a 3-D
           broadcast and a sum over the block), scaled after: no tile of 16 rows, no operand shuffle
           through shared memory;
  dot_w    the tensor-core products with the operands swapped: the decoded weights [BLOCK_N, block] are the
           first operand (the MMA's M, 64 rows and up) and 16 entries the second (its N), the layout a
           small-batch weight-only GEMM takes (dot_w_prmt: its code table looked up by prmt, a GPU only);
  dot_ws   the production kernel with kernels.invariant_4bit_scale=weights (SCALE_WEIGHTS: a block's scale
           applied to its codes in the rows' dtype, both halves' products chained into the accumulator), each
           block a step ahead (dot_ws_prmt: with prmt): the decode side of an invariant bnb4 prefill through
           dequantised bf16 kernels with step-sized tiles;
  dotk{2,4}  KB = 2 or 4 quantisation blocks a step: each block's codes times its scale in float32, rounded
           to the rows' dtype once (the weights bitsandbytes' dequantisation gives), then one product per
           nibble half over the whole step (K = KB * QBLOCK / 2): 4-8x fewer, deeper products than dot's
           two K=32 ones a block (dotk*_w: weights as the first operand; *_prmt: prmt lookup, a GPU only;
           *_t: the bytes stored tile-major, each 32 rows' bytes of a step contiguous, `retile`);
  bytes    the same programs reading the same bytes and scales and doing nothing with them but a sum:
           the ceiling a kernel of this grid and access pattern can reach.

For each form: median microseconds (CUDA events) and TB/s of the bytes of the experts with rows; for fma,
its largest difference from dot (float32 vs bf16 rounding only) and whether a row's output is bitwise the
same alone and in the step (what engine.batch_invariant would need).

    python experiments/bench_4bit_forms.py --batch-sizes 8,32,128
    TRITON_INTERPRET=1 python experiments/bench_4bit_forms.py --device cpu --check ...   (the CPU: no timing)
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flexgemma.config.kernels import Kernels  # noqa: E402
from flexgemma.model.ptx_lookup import lookup_asm  # noqa: E402
from flexgemma.model.triton4bit import code4, nibble_codes  # noqa: E402
from flexgemma.model.moe_kernel import (  # noqa: E402
    UP_TILES, _block_scales, _entry_lists, _nibble_block, _routed_up_kernel, _store_up, _weight_operands,
    decode_experts, invariant_experts)


@triton.jit
def _sorted_tile(x_ptr, order_ptr, start, m0, count, H: tl.constexpr, TOPK: tl.constexpr, ROWS: tl.constexpr):
    """An expert's entries m0 .. m0+ROWS-1 (its range of the sorted entries): their flat ids, which exist,
    and their token rows' pointers."""
    want = m0 + tl.arange(0, ROWS)
    valid = want < count
    flat = tl.load(order_ptr + start + want, mask=valid, other=0)
    return flat, valid, x_ptr + (flat // TOPK)[:, None] * H


@triton.jit
def _program_slice(starts_ptr, I: tl.constexpr, BLOCK_N: tl.constexpr):
    """Program (e, j)'s expert, its BLOCK_N features (and which exist), and the expert's range of the sorted
    entries (start, count)."""
    expert = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    start = tl.load(starts_ptr + expert)
    return expert, cols, cols < I, start, tl.load(starts_ptr + expert + 1) - start


@triton.jit
def _zero_tile(ENTRIES: tl.constexpr, BLOCK_N: tl.constexpr, SWAP: tl.constexpr):
    """A float32 accumulator of a tile: [ENTRIES, BLOCK_N], or with SWAP (the weights the products' first
    operand) [BLOCK_N, ENTRIES]."""
    if SWAP:
        return tl.zeros((BLOCK_N, ENTRIES), dtype=tl.float32)
    else:
        return tl.zeros((ENTRIES, BLOCK_N), dtype=tl.float32)


@triton.jit
def _up_forms_kernel(x_ptr, order_ptr, starts_ptr, w_ptr, absmax_ptr, code_ptr, ncode_ptr, nabsmax_ptr, noffset_ptr,
                     out_ptr, I: tl.constexpr, H: tl.constexpr, TOPK: tl.constexpr, stride_we, stride_ae, stride_ne,
                     QBLOCK: tl.constexpr, NESTED: tl.constexpr, DOUBLE_QUANT: tl.constexpr, ENTRIES: tl.constexpr,
                     BLOCK_N: tl.constexpr, SWAP: tl.constexpr, LOOKUP: tl.constexpr):
    """Program (e, j): features [j*BLOCK_N, (j+1)*BLOCK_N) of expert e's entries, ENTRIES at a time, each
    quantisation block decoded once for them. SWAP=False (fma): [ENTRIES, BLOCK_N] products on the CUDA
    cores; SWAP=True (dot_w): tensor-core products (decoded block) x (entries' halves).T into [BLOCK_N,
    ENTRIES] accumulators, transposed for the production epilogue."""
    expert, cols, ok, start, count = _program_slice(starts_ptr, I, BLOCK_N)
    half = tl.arange(0, QBLOCK // 2)
    dt = x_ptr.dtype.element_ty
    m0 = 0
    while m0 < count:
        flat, valid, row = _sorted_tile(x_ptr, order_ptr, start, m0, count, H, TOPK, ENTRIES)
        acc_g = _zero_tile(ENTRIES, BLOCK_N, SWAP)
        acc_u = _zero_tile(ENTRIES, BLOCK_N, SWAP)
        for k0 in range(0, H, QBLOCK):
            xe = tl.load(row + k0 + 2 * half[None, :], mask=valid[:, None], other=0.0)
            xo = tl.load(row + k0 + 2 * half[None, :] + 1, mask=valid[:, None], other=0.0)
            for part in tl.static_range(2):  # gate rows [0, I), then up rows [I, 2I)
                hi, lo, scale = _nibble_block(w_ptr, expert, cols + part * I, ok, k0, H, stride_we, absmax_ptr,
                                              code_ptr, ncode_ptr, nabsmax_ptr, noffset_ptr, stride_ae, stride_ne,
                                              QBLOCK, NESTED, DOUBLE_QUANT, LOOKUP)
                if SWAP:
                    prod = (tl.dot(hi, tl.trans(xe)) + tl.dot(lo, tl.trans(xo))) * scale[:, None]
                else:
                    prod = (tl.sum(xe.to(tl.float32)[:, None, :] * hi.to(tl.float32)[None, :, :], axis=2)
                            + tl.sum(xo.to(tl.float32)[:, None, :] * lo.to(tl.float32)[None, :, :], axis=2)) \
                        * scale[None, :]
                if part == 0:
                    acc_g += prod
                else:
                    acc_u += prod
        if SWAP:  # the production kernel's epilogue on [ENTRIES, BLOCK_N] accumulators
            acc_g, acc_u = tl.trans(acc_g), tl.trans(acc_u)
        _store_up(out_ptr, flat, valid, cols, acc_g, acc_u, I, dt)
        m0 += ENTRIES


@triton.jit
def _byte_at(rows, c, H: tl.constexpr, STEP: tl.constexpr, TILE_N: tl.constexpr):
    """Offset of byte c of row `rows` in an expert's packed bytes: bitsandbytes' row-major layout (TILE_N 0),
    or tile-major (TILE_N > 0, retile()): each TILE_N rows' STEP bytes of a K step stored contiguously."""
    if TILE_N == 0:
        return rows * (H // 2) + c
    else:
        return ((rows // TILE_N) * (H // 2 // STEP) + c // STEP) * (TILE_N * STEP) + (rows % TILE_N) * STEP + c % STEP


def retile(packed: torch.Tensor, rows: int, h: int, step: int, tile_n: int) -> torch.Tensor:
    """An expert stack's packed bytes [E, rows*h/2] in _byte_at's tile-major layout (a copy)."""
    e = packed.shape[0]
    t = packed.reshape(e, rows // tile_n, tile_n, h // 2 // step, step).permute(0, 1, 3, 2, 4)
    return t.contiguous().reshape(e, -1)


@triton.jit
def _up_kstep_kernel(x_ptr, order_ptr, starts_ptr, w_ptr, absmax_ptr, code_ptr, ncode_ptr, nabsmax_ptr, noffset_ptr,
                     out_ptr, I: tl.constexpr, H: tl.constexpr, TOPK: tl.constexpr, stride_we, stride_ae, stride_ne,
                     QBLOCK: tl.constexpr, NESTED: tl.constexpr, DOUBLE_QUANT: tl.constexpr, ENTRIES: tl.constexpr,
                     BLOCK_N: tl.constexpr, KB: tl.constexpr, SWAP: tl.constexpr, LOOKUP: tl.constexpr,
                     TILE_N: tl.constexpr):
    """Program (e, j) as _up_forms_kernel's, KB quantisation blocks a step: the step's codes times their
    blocks' scales (float32, rounded once to the rows' dtype), then a product per nibble half over the step,
    chained into the accumulator (SWAP: the weights the first operand, [BLOCK_N, ENTRIES] accumulators;
    TILE_N: the bytes in _byte_at's layout)."""
    expert, cols, ok, start, count = _program_slice(starts_ptr, I, BLOCK_N)
    HALF: tl.constexpr = KB * QBLOCK // 2
    kh = tl.arange(0, HALF)
    dt = x_ptr.dtype.element_ty
    m0 = 0
    while m0 < count:
        flat, valid, row = _sorted_tile(x_ptr, order_ptr, start, m0, count, H, TOPK, ENTRIES)
        acc_g = _zero_tile(ENTRIES, BLOCK_N, SWAP)
        acc_u = _zero_tile(ENTRIES, BLOCK_N, SWAP)
        for k0 in range(0, H, KB * QBLOCK):
            xe = tl.load(row + k0 + 2 * kh[None, :], mask=valid[:, None], other=0.0)
            xo = tl.load(row + k0 + 2 * kh[None, :] + 1, mask=valid[:, None], other=0.0)
            for part in tl.static_range(2):  # gate rows [0, I), then up rows [I, 2I)
                rows = cols + part * I
                byte = tl.load(w_ptr + expert * stride_we + _byte_at(rows[:, None], k0 // 2 + kh[None, :], H, HALF,
                                                                     TILE_N), mask=ok[:, None], other=0)
                blk = rows[:, None] * (H // QBLOCK) + k0 // QBLOCK + tl.arange(0, KB)[None, :]
                scale = _block_scales(absmax_ptr, ncode_ptr, nabsmax_ptr, noffset_ptr, expert, blk, ok[:, None],
                                      stride_ae, stride_ne, NESTED, DOUBLE_QUANT)[:, :, None]
                hi, lo = nibble_codes(byte, code_ptr, LOOKUP)
                hi = tl.reshape(tl.reshape(hi.to(tl.float32), (BLOCK_N, KB, QBLOCK // 2)) * scale, (BLOCK_N, HALF))
                lo = tl.reshape(tl.reshape(lo.to(tl.float32), (BLOCK_N, KB, QBLOCK // 2)) * scale, (BLOCK_N, HALF))
                hi, lo = hi.to(dt), lo.to(dt)
                if part == 0:
                    if SWAP:
                        acc_g = tl.dot(lo, tl.trans(xo), tl.dot(hi, tl.trans(xe), acc_g))
                    else:
                        acc_g = tl.dot(xo, tl.trans(lo), tl.dot(xe, tl.trans(hi), acc_g))
                else:
                    if SWAP:
                        acc_u = tl.dot(lo, tl.trans(xo), tl.dot(hi, tl.trans(xe), acc_u))
                    else:
                        acc_u = tl.dot(xo, tl.trans(lo), tl.dot(xe, tl.trans(hi), acc_u))
        if SWAP:
            acc_g, acc_u = tl.trans(acc_g), tl.trans(acc_u)
        _store_up(out_ptr, flat, valid, cols, acc_g, acc_u, I, dt)
        m0 += ENTRIES


@triton.jit
def _ablate_codes(byte, code_ptr, pair_ptr, dt: tl.constexpr, LOOKUP: tl.constexpr, ASM: tl.constexpr):
    """A block's bytes -> its high and low nibbles' weights: LOOKUP 1 the production table (a load per
    nibble), 2 one load per byte from a 256-entry table of both nibbles' code bits (int32: high nibble's
    in the upper half; the same values), 3 the table held in registers and looked up by `prmt` (ASM:
    flexgemma/model/ptx_lookup.py; the same values, a GPU only), 0 no table (the nibble itself: what decoding
    costs without it)."""
    if LOOKUP == 3:
        return nibble_codes(byte, code_ptr, ASM)
    elif LOOKUP == 2:
        v = tl.load(pair_ptr + byte.to(tl.int32))
        return (v >> 16).to(tl.int16).to(dt, bitcast=True), (v & 65535).to(tl.int16).to(dt, bitcast=True)
    elif LOOKUP == 1:
        return nibble_codes(byte, code_ptr, "table")
    else:
        b = byte.to(tl.int32)
        return (b >> 4).to(dt), (b & 15).to(dt)


@triton.jit
def _up_ablate_kernel(x_ptr, order_ptr, starts_ptr, w_ptr, absmax_ptr, code_ptr, pair_ptr, out_ptr, I: tl.constexpr,
                      H: tl.constexpr, TOPK: tl.constexpr, stride_we, stride_ae, QBLOCK: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, LOOKUP: tl.constexpr, DOT: tl.constexpr,
                      SPLIT: tl.constexpr, ASM: tl.constexpr):
    """The production up kernel's one-tile 4-bit loop (sorted entries, plain float32 scales) with one part
    swapped at a time, to see where its time goes: LOOKUP (_ablate_codes); DOT False: no products, each
    decoded block summed into the accumulator instead; SPLIT: a row's even and odd elements from one
    contiguous load split in registers instead of two stride-2 loads. LOOKUP 1-2 with DOT gives the
    production kernel's bits."""
    expert = tl.program_id(0)
    dt: tl.constexpr = x_ptr.dtype.element_ty
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ok = cols < I
    start = tl.load(starts_ptr + expert)
    count = tl.load(starts_ptr + expert + 1) - start
    kb = tl.arange(0, QBLOCK // 2)
    m0 = 0
    while m0 < count:
        flat, valid, row = _sorted_tile(x_ptr, order_ptr, start, m0, count, H, TOPK, BLOCK_M)
        acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, H, QBLOCK):
            if SPLIT:
                a = tl.load(row + k0 + tl.arange(0, QBLOCK)[None, :], mask=valid[:, None], other=0.0)
                xe, xo = tl.split(tl.reshape(a, (BLOCK_M, QBLOCK // 2, 2)))
            else:
                xe = tl.load(row + k0 + 2 * kb[None, :], mask=valid[:, None], other=0.0)
                xo = tl.load(row + k0 + 2 * kb[None, :] + 1, mask=valid[:, None], other=0.0)
            for part in tl.static_range(2):
                rows = cols + part * I
                byte = tl.load(w_ptr + expert * stride_we + rows[:, None] * (H // 2) + k0 // 2 + kb[None, :],
                               mask=ok[:, None], other=0)
                scale = tl.load(absmax_ptr + expert * stride_ae + rows * (H // QBLOCK) + k0 // QBLOCK, mask=ok,
                                other=0.0)
                hi, lo = _ablate_codes(byte, code_ptr, pair_ptr, dt, LOOKUP, ASM)
                if DOT:
                    prod = (tl.dot(xe, tl.trans(hi)) + tl.dot(xo, tl.trans(lo))) * scale[None, :]
                else:
                    prod = (tl.sum(hi.to(tl.float32) + lo.to(tl.float32), 1) * scale)[None, :] \
                        + tl.sum(xe.to(tl.float32) + xo.to(tl.float32), 1)[:, None]
                if part == 0:
                    acc_g += prod
                else:
                    acc_u += prod
        _store_up(out_ptr, flat, valid, cols, acc_g, acc_u, I, dt)
        m0 += BLOCK_M


@triton.jit
def _up_bytes_kernel(starts_ptr, w_ptr, absmax_ptr, out_ptr, I: tl.constexpr, H: tl.constexpr, stride_we,
                     stride_ae, QBLOCK: tl.constexpr, BLOCK_N: tl.constexpr, KBLOCKS: tl.constexpr,
                     TILE_N: tl.constexpr = 0):
    """Program (e, j): the bytes and scales the up kernels read for features [j*BLOCK_N, ...) of expert e
    (if it has entries), summed: the memory traffic alone, KBLOCKS quantisation blocks a step (H must be
    a multiple of KBLOCKS blocks; TILE_N: the bytes in _byte_at's layout, KBLOCKS blocks a step)."""
    expert = tl.program_id(0)
    count = tl.load(starts_ptr + expert + 1) - tl.load(starts_ptr + expert)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ok = cols < I
    kb = tl.arange(0, QBLOCK // 2)
    acc = tl.zeros((BLOCK_N, QBLOCK // 2), dtype=tl.int32)
    if count > 0:
        for k0 in range(0, H, QBLOCK * KBLOCKS):
            for part in tl.static_range(2):
                rows = cols + part * I
                for u in tl.static_range(KBLOCKS):
                    b = tl.load(w_ptr + expert * stride_we + _byte_at(rows[:, None], (k0 + u * QBLOCK) // 2 + kb[None, :],
                                                                      H, KBLOCKS * QBLOCK // 2, TILE_N),
                                mask=ok[:, None], other=0)
                    s = tl.load(absmax_ptr + expert * stride_ae + rows * (H // QBLOCK) + (k0 + u * QBLOCK) // QBLOCK,
                                mask=ok, other=0)
                    acc += b.to(tl.int32) + s.to(tl.int32)[:, None]
    tl.store(out_ptr + expert * I + cols, tl.sum(acc, axis=1).to(tl.float32), mask=ok)


def up_dot(x, gate_up, index, order, starts, i, topk, tiles, code_lookup="table"):
    ops = _weight_operands(gate_up, x, fused=True, slotted=False, ids=None, code_lookup=code_lookup)
    out = torch.empty(index.numel(), i, dtype=x.dtype, device=x.device)
    _routed_up_kernel[(gate_up.shape[0], triton.cdiv(i, tiles["BLOCK_N"]))](
        x_ptr=x, index_ptr=index, order_ptr=order, starts_ptr=starts, n_flat=index.numel(), slots_ptr=index,
        out_ptr=out, I=i, H=x.shape[1], TOPK=topk, stride_x=x.stride(0), HAS_SLOTS=False, PACKED=True, SORTED=True,
        NFLAT=16, **ops, **tiles)
    return out


def up_form(form, x, gate_up, index, order, starts, i, topk, entries, block_n, warps):
    """The gate_up projection in one of FORMS (entries: BLOCK_M for the production kernel's)."""
    if FORMS[form] is None:
        return up_dot(x, gate_up, index, order, starts, i, topk,
                      {**UP_TILES, "BLOCK_M": entries, "BLOCK_N": block_n, "num_warps": warps,
                       "PREFETCH": form not in ("dot", "dot_sel"), "SCALE_WEIGHTS": form.startswith("dot_ws")},
                      DOT_LOOKUP.get(form, "table"))
    ops = _weight_operands(gate_up, x, fused=True, slotted=False, ids=None, code_lookup=DOT_LOOKUP.get(form, "table"))
    out = torch.empty(index.numel(), i, dtype=x.dtype, device=x.device)
    if form.startswith("dotk"):
        kb, tiled = int(form[4]), form.endswith("_t")
        if x.shape[1] % (kb * gate_up.block_size):  # whole steps only: a step past H would read past the rows
            raise ValueError(f"{form} needs the hidden size a multiple of {kb * gate_up.block_size}")
        w = tiled_bytes(gate_up, kb * gate_up.block_size // 2) if tiled else ops["w_ptr"]
        _up_kstep_kernel[(gate_up.shape[0], triton.cdiv(i, block_n))](
            x_ptr=x, order_ptr=order, starts_ptr=starts, w_ptr=w, absmax_ptr=ops["absmax_ptr"],
            code_ptr=ops["code_ptr"], ncode_ptr=ops["ncode_ptr"], nabsmax_ptr=ops["nabsmax_ptr"],
            noffset_ptr=ops["noffset_ptr"], out_ptr=out, I=i, H=x.shape[1], TOPK=topk, stride_we=ops["stride_we"],
            stride_ae=ops["stride_ae"], stride_ne=ops["stride_ne"], QBLOCK=ops["QBLOCK"], NESTED=ops["NESTED"],
            DOUBLE_QUANT=ops["DOUBLE_QUANT"], ENTRIES=entries, BLOCK_N=block_n, KB=kb,
            SWAP=FORMS[form], LOOKUP=ops["LOOKUP"], TILE_N=TILE_N if tiled else 0, num_warps=warps)
        return out
    _up_forms_kernel[(gate_up.shape[0], triton.cdiv(i, block_n))](
        x_ptr=x, order_ptr=order, starts_ptr=starts, w_ptr=ops["w_ptr"], absmax_ptr=ops["absmax_ptr"],
        code_ptr=ops["code_ptr"], ncode_ptr=ops["ncode_ptr"], nabsmax_ptr=ops["nabsmax_ptr"],
        noffset_ptr=ops["noffset_ptr"], out_ptr=out, I=i, H=x.shape[1], TOPK=topk, stride_we=ops["stride_we"],
        stride_ae=ops["stride_ae"], stride_ne=ops["stride_ne"], QBLOCK=ops["QBLOCK"], NESTED=ops["NESTED"],
        DOUBLE_QUANT=ops["DOUBLE_QUANT"], ENTRIES=entries, BLOCK_N=block_n, SWAP=FORMS[form], LOOKUP=ops["LOOKUP"],
        num_warps=warps)
    return out


# each form's SWAP for _up_forms_kernel, None for the production kernel: dot / dot_sel / dot_pf / dot_prmt at
# other tiles, its code table read from memory (L1) or held as scalars (kernels.moe_code_lookup=select), each
# block's bytes loaded a step ahead (kernels.moe_4bit_prefetch: the same bits as dot), or that with the table
# looked up by prmt (kernels.moe_code_lookup=prmt, a GPU only: the same bits as dot_pf); dot_ws / dot_ws_prmt
# prefetching with the scale on the codes; dot_w_prmt: dot_w with prmt
FORMS = {"dot": None, "dot_sel": None, "dot_pf": None, "dot_prmt": None, "dot_ws": None, "dot_ws_prmt": None,
         "fma": False, "dot_w": True, "dot_w_prmt": True,
         **{f"dotk{kb}{w}{p}{t}": w == "_w" for kb in (1, 2, 4) for w in ("", "_w") for p in ("", "_prmt")
            for t in ("", "_t")}}
DOT_LOOKUP = {"dot_sel": "select", **{f: "prmt" for f in FORMS if "_prmt" in f}}


TILE_N = 32  # rows of a tile-major byte tile (the *_t forms): 26B-A4B's I (704) is a multiple
_RETILED: dict = {}


def tiled_bytes(w, step: int) -> torch.Tensor:
    """w's packed bytes in _byte_at's tile-major layout, STEP bytes of a row a step (cached)."""
    key = (w.packed.data_ptr(), step)
    if key not in _RETILED:
        _RETILED[key] = retile(w.packed, w.shape[1], w.shape[2], step, TILE_N)
    return _RETILED[key]


def up_bytes(gate_up, starts, i, h, block_n, warps, kblocks=1, tiled=False):
    out = torch.empty(gate_up.shape[0], i, dtype=torch.float32, device=gate_up.packed.device)
    step = kblocks * gate_up.block_size // 2
    w = tiled_bytes(gate_up, step) if tiled else gate_up.packed
    _up_bytes_kernel[(gate_up.shape[0], triton.cdiv(i, block_n))](
        starts, w, gate_up.absmax, out, I=i, H=h, stride_we=w.stride(0),
        stride_ae=gate_up.absmax.stride(0), QBLOCK=gate_up.block_size, BLOCK_N=block_n, KBLOCKS=kblocks,
        TILE_N=TILE_N if tiled else 0, num_warps=warps)
    return out


def layer_times(x, index, gate_up, down, us) -> dict:
    """A whole routed-experts layer (decode_experts: up, down, the sum; and invariant_experts, the
    batch-invariant mode's, four-tile loops without prefetch, the default, and one-tile loops that prefetch)
    under each of LAYER_KERNELS: median us, and whether the output is bitwise that of the first kernels of its
    kind with the same prefetch (the code lookups give the same values)."""
    weights = torch.softmax(torch.randn(index.shape, device=x.device), -1)
    out, refs = {}, {}
    for name, kind, kernels in LAYER_KERNELS:
        if kernels.moe_code_lookup == "prmt" and x.device.type != "cuda":
            continue
        fn = decode_experts if kind == "decode" else invariant_experts
        run = functools.partial(fn, x, index, weights, gate_up, down, kernels=kernels)
        got = run()
        ref = refs.setdefault((kind, kernels.moe_4bit_prefetch, kernels.invariant_4bit_subtiles), got)
        out[name] = {"us": us(run), "equal": bool(torch.equal(got, ref))}
    return out


LAYER_KERNELS = [
    ("decode_prefetch_False", "decode", Kernels(moe_4bit_prefetch=False)),
    ("decode_prefetch_True", "decode", Kernels()),
    ("decode_prmt", "decode", Kernels(moe_code_lookup="prmt")),
    ("decode_prmt_rows_first", "decode", Kernels(moe_code_lookup="prmt", moe_4bit_weights_first_above=1 << 30)),
    ("decode_prmt_weights_first", "decode", Kernels(moe_code_lookup="prmt", moe_4bit_weights_first_above=0)),
    ("invariant_subtiles4", "invariant", Kernels()),
    ("invariant_subtiles4_prmt", "invariant", Kernels(moe_code_lookup="prmt")),
    ("invariant_subtiles1_prefetch", "invariant", Kernels(invariant_4bit_subtiles=1)),
    ("invariant_subtiles1_prefetch_prmt", "invariant", Kernels(invariant_4bit_subtiles=1, moe_code_lookup="prmt")),
]


ABLATIONS = {"table_dot_pairs": (1, True, False), "pair_dot_pairs": (2, True, False),
             "table_dot_split": (1, True, True), "pair_dot_split": (2, True, True),
             "none_dot_pairs": (0, True, False), "table_sum_pairs": (1, False, False),
             "pair_sum_pairs": (2, False, False), "none_sum_pairs": (0, False, False),
             "prmt_dot_pairs": (3, True, False), "prmt_sum_pairs": (3, False, False)}


def pair_table(code: torch.Tensor) -> torch.Tensor:
    """int32 [256]: for a byte b, the bits of code[b >> 4] (upper half) and code[b & 15] (lower half)."""
    bits = code.view(torch.int16).to(torch.int32) & 0xFFFF
    b = torch.arange(256, device=code.device)
    return ((bits[b >> 4] << 16) | bits[b & 15]).to(torch.int32).contiguous()


def up_ablate(name, x, gate_up, order, starts, i, topk):
    """gate_up's up kernel with ABLATIONS[name]; plain float32 scales (the experts packed without double
    quantisation)."""
    lookup, dot, split = ABLATIONS[name]
    code = code4(gate_up.quant_type, x.device, x.dtype)
    out = torch.empty(order.numel(), i, dtype=x.dtype, device=x.device)
    _up_ablate_kernel[(gate_up.shape[0], triton.cdiv(i, 32))](
        x, order, starts, gate_up.packed, gate_up.absmax, code, pair_table(code), out, I=i, H=x.shape[1], TOPK=topk,
        stride_we=gate_up.packed.stride(0), stride_ae=gate_up.absmax.stride(0), QBLOCK=gate_up.block_size,
        BLOCK_M=16, BLOCK_N=32, LOOKUP=lookup, DOT=dot, SPLIT=split, ASM=lookup_asm(code) if lookup == 3 else "",
        num_warps=4)
    return out


def ablations(x, gate_up, order, starts, i, topk, us) -> dict:
    """Each ABLATIONS variant of one gate_up projection (its own plain-scale copy of the weights): median
    us, and for those that compute the products whether they are bitwise the production kernel's."""
    ref = up_dot(x, gate_up, order, order, starts, i, topk, {**UP_TILES, "BLOCK_M": 16})
    out = {"production": {"us": us(lambda: up_dot(x, gate_up, order, order, starts, i, topk,
                                                    {**UP_TILES, "BLOCK_M": 16}))}}
    for name, (lookup, dot, _) in ABLATIONS.items():
        if lookup == 3 and x.device.type != "cuda":  # inline PTX: ptx_lookup's emulator checks it on the CPU
            continue
        got = up_ablate(name, x, gate_up, order, starts, i, topk)
        out[name] = {"us": us(lambda: up_ablate(name, x, gate_up, order, starts, i, topk))}
        if lookup and dot:
            out[name]["equal"] = bool(torch.equal(got, ref))
    return out


def routing(t, e, k, device, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    idx = torch.rand(t, e, generator=g).topk(k, dim=-1).indices.to(device)
    index = idx.reshape(-1).to(torch.int32)
    order, starts, _ = _entry_lists(index, e, True)
    return index, order, starts


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch-sizes", default="8,32,128")
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=2816)
    ap.add_argument("--intermediate", type=int, default=704)
    ap.add_argument("--double-quant", type=int, default=1, help="1: the bnb4 preset's double quantisation")
    ap.add_argument("--iters", type=int, default=40)
    ap.add_argument("--device", default="cuda")
    # Triton's CPU interpreter computes bf16 products wrongly (numpy has no bf16): --check there takes fp16
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"))
    ap.add_argument("--check", action="store_true", help="no timing: a tile of each form against dot, a row alone")
    ap.add_argument("--forms", default="dot,dot_pf,dot_prmt", help=f"of {','.join(FORMS)}")
    ap.add_argument("--block-n", default="32,64,128", help="the grid's BLOCK_N values")
    ap.add_argument("--warps", default="4,8", help="the grid's num_warps values")
    ap.add_argument("--ablate", action="store_true",
                    help="only the production kernel with one part swapped at a time (ABLATIONS)")
    ap.add_argument("--out", default=None)
    return ap.parse_args()


def main() -> None:
    args = parse_args()
    from flexgemma.model.quant import Bnb4Settings, PackedExpertWeight
    from flexgemma.tasks.common import cuda_time_ms

    dev = torch.device(args.device)
    e, h, i, k = args.experts, args.hidden, args.intermediate, args.top_k
    torch.manual_seed(0)
    dt = getattr(torch, args.dtype)
    settings = Bnb4Settings(double_quant=bool(args.double_quant))
    gate_up = PackedExpertWeight.pack((torch.randn(e, 2 * i, h, device=dev) * 0.02).to(dt), settings, dev)
    down = PackedExpertWeight.pack((torch.randn(e, h, i, device=dev) * 0.02).to(dt), settings, dev)
    print(torch.__version__, triton.__version__, torch.cuda.get_device_name() if dev.type == "cuda" else dev,
          flush=True)
    if args.ablate:
        return run_ablations(args, dev, dt)
    forms = args.forms.split(",")
    # (form, entries a program takes at a time, BLOCK_N, warps)
    dots = ("dot", "dot_sel", "dot_pf", "dot_ws") + (("dot_prmt", "dot_ws_prmt") if dev.type == "cuda" else ())
    tiles = list(itertools.product(*(tuple(int(v) for v in a.split(",")) for a in (args.block_n, args.warps))))
    grid = [(f, 16, *c) for f in dots if f in forms for c in tiles] + \
        [("fma", *c) for c in itertools.product((1, 2, 4, 8), (32, 64), (4,)) if "fma" in forms] + \
        [(f, 16, *c) for f in FORMS if f in forms and (f in ("dot_w", "dot_w_prmt") or f.startswith("dotk"))
         and (dev.type == "cuda" or "_prmt" not in f) for c in tiles]
    if args.check:
        grid = [("dot_sel", 16, 64, 4), ("dot_pf", 16, 32, 4), ("fma", 1, 16, 4), ("fma", 4, 32, 4),
                ("dot_w", 16, 32, 4), ("dot_ws", 16, 32, 4), ("dotk2", 16, 32, 4), ("dotk4_w", 16, 64, 4),
                ("dotk1_t", 16, 32, 4), ("dotk4_w_t", 16, 64, 4)]
    rows = []
    for t in (int(b) for b in args.batch_sizes.split(",")):
        x = torch.randn(t, h, device=dev, dtype=dt)
        index, order, starts = routing(t, e, k, dev)
        used = int((starts[1:] > starts[:-1]).sum())
        nbytes = used * (gate_up.packed[0].numel() + gate_up.absmax[0].numel() * gate_up.absmax.element_size())

        def us(fn):
            return float("nan") if args.check else cuda_time_ms(fn, iters=args.iters) * 1e3

        res = {"batch": t, "experts_used": used, "mb": nbytes / 1e6,
               **form_results(x, gate_up, index, order, starts, i, k, grid, us, args.check)}
        print(batch_line(res, nbytes, args.check), flush=True)
        if not args.check:
            res["layer"] = layer_times(x, index.reshape(t, k), gate_up, down, us)
            print(f"batch {t}: whole layer (up + down + sum, decode_experts / invariant_experts): " + "; ".join(
                f"{key} {v['us']:.0f} us (bits {v['equal']})" for key, v in res["layer"].items()),
                flush=True)
        rows.append(res)
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))


def form_results(x, gate_up, index, order, starts, i, k, grid, us, check) -> dict:
    """One batch's timings: the production kernel (dot_us), the bytes alone at each tile and 1 or 4 blocks a
    step (bytes{kb}_{BLOCK_N}_{warps}_us), and each form of the grid with its largest difference from the
    production kernel and whether a row alone gives the same bits as in the step."""
    e, h = gate_up.shape[0], x.shape[1]
    ref = up_dot(x, gate_up, index, order, starts, i, k, {**UP_TILES, "BLOCK_M": 16})
    res = {"dot_us": us(lambda: up_dot(x, gate_up, index, order, starts, i, k, {**UP_TILES, "BLOCK_M": 16}))}
    for bn, warps, kb, t in [(32, 4, 1, True)] if check else itertools.product((32, 64, 128), (4, 8), (1, 4),
                                                                                  (False, True)):
        if h % (kb * gate_up.block_size):  # the bytes kernel takes whole steps of kb blocks
            continue
        got = up_bytes(gate_up, starts, i, h, bn, warps, kb, t)
        if check:  # the tile-major layout holds the same bytes at the addresses _byte_at gives
            assert torch.equal(got, up_bytes(gate_up, starts, i, h, bn, warps, kb)), "retile / _byte_at disagree"
        res[f"bytes{kb}{'t' if t else ''}_{bn}_{warps}_us"] = us(lambda: up_bytes(gate_up, starts, i, h, bn, warps,
                                                                                  kb, t))
    for form, entries, bn, warps in grid:
        try:
            out = up_form(form, x, gate_up, index, order, starts, i, k, entries, bn, warps)
        except Exception as err:  # a tile that does not compile is reported, not fatal
            res[f"{form}_{entries}_{bn}_{warps}"] = {"form": form, "error": f"{type(err).__name__}: {str(err)[:120]}"}
            continue
        # a row alone (token 0's choices, the same expert order) against the same row in the step
        o0, s0, _ = _entry_lists(index[:k], e, True)
        alone = up_form(form, x[:1], gate_up, index[:k], o0, s0, i, k, entries, bn, warps)
        res[f"{form}_{entries}_{bn}_{warps}"] = {
            "form": form,
            "us": us(lambda: up_form(form, x, gate_up, index, order, starts, i, k, entries, bn, warps)),
            "max_diff_vs_dot": float((out.float() - ref.float()).abs().max()),
            "row_alone_equal": bool(torch.equal(alone, out[:k]))}
    return res


def batch_line(res: dict, nbytes: float, check: bool) -> str:
    """form_results' batch in one line: each form's best tile (with --check, each form's bits)."""
    timed = {key: v for key, v in res.items() if isinstance(v, dict) and "us" in v}
    if check:
        return f"batch {res['batch']}: " + "; ".join(f"{key} max diff {v['max_diff_vs_dot']:.2e} row alone equal "
                                                     f"{v['row_alone_equal']}" for key, v in timed.items())
    floors = {kb: min(v for key, v in res.items() if key.startswith(f"bytes{kb}_")) for kb in (1, 4, "1t", "4t")
              if any(key.startswith(f"bytes{kb}_") for key in res)}
    line = (f"batch {res['batch']}: {res['experts_used']} experts, {nbytes / 1e6:.0f} MB; dot {res['dot_us']:.0f} us "
            f"({nbytes / res['dot_us'] / 1e6:.2f} TB/s); bytes alone " + ", ".join(
                f"{f:.0f} us ({nbytes / f / 1e6:.2f} TB/s) {kb} block(s) a step" for kb, f in floors.items()))
    # (kb "1t" / "4t": the bytes in the tile-major layout of the *_t forms)
    for form in FORMS:
        mine = {key: v for key, v in timed.items() if v["form"] == form}
        if not mine:
            line += f"; no {form} tile ran"
            continue
        best = min(mine, key=lambda key: mine[key]["us"])
        line += (f"; best {best} {mine[best]['us']:.0f} us ({nbytes / mine[best]['us'] / 1e6:.2f} TB/s, max diff "
                 f"{mine[best]['max_diff_vs_dot']:.2e}, row alone equal {mine[best]['row_alone_equal']})")
    return line


def run_ablations(args, dev, dt) -> None:
    """--ablate: ABLATIONS at each batch size, printed and written to --out."""
    from flexgemma.model.quant import Bnb4Settings, PackedExpertWeight
    from flexgemma.tasks.common import cuda_time_ms

    e, h, i, k = args.experts, args.hidden, args.intermediate, args.top_k
    gate_up = PackedExpertWeight.pack((torch.randn(e, 2 * i, h, device=dev) * 0.02).to(dt),
                                      Bnb4Settings(double_quant=False), dev)
    rows = []
    for t in (int(b) for b in args.batch_sizes.split(",")):
        x = torch.randn(t, h, device=dev, dtype=dt)
        _, order, starts = routing(t, e, k, dev)
        res = ablations(x, gate_up, order, starts, i, k, lambda fn: float("nan") if args.check
                        else cuda_time_ms(fn, iters=args.iters) * 1e3)
        print(f"ablate batch {t}: " + "; ".join(f"{n} {v['us']:.0f} us" + (f" (bits {v['equal']})" if "equal" in v
                                                                          else "") for n, v in res.items()), flush=True)
        rows.append({"batch": t, **res})
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
