"""bitsandbytes 4-bit bytes as Triton kernels read them: the 4-bit type's code table, whole blocks
dequantised and the sum of float32 partials, which the routed experts' kernels (moe_kernel.py) and
the dense 4-bit projections (linear4bit.py) share, and the block-at-a-time product the routed kernels
use.

A 4-bit matrix [N, K] is stored row-major as N*K/2 bytes; each byte holds two consecutive weights of
a row, the first in the high nibble; every quantisation block of QBLOCK consecutive weights has one
scale (absmax). In `nibble_products` a K step is one block: its bytes meet the rows' even elements (high
nibbles) and odd elements (low nibbles) in two products, so nothing is interleaved, and the block's
scale multiplies the products instead of every weight. (linear4bit.py decodes whole weights instead,
code x scale as bitsandbytes does, over 256-element steps.)

Imported only where Triton runs (a GPU, or the CPU through TRITON_INTERPRET=1 in the tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _select2(bit, q, code_ptr, i: tl.constexpr):
    return tl.where((q & bit) != 0, tl.load(code_ptr + i + bit), tl.load(code_ptr + i))


@triton.jit
def code_values(q, code_ptr, SELECT: tl.constexpr):
    """code[q] for 4-bit values q: a load per value from the 16-entry table (L1), or with SELECT a
    binary tree of selects over the table's 16 entries held as scalars (no memory access per value)."""
    if SELECT:
        b2, b4, b8 = (q & 2) != 0, (q & 4) != 0, (q & 8) != 0
        low = tl.where(b4, tl.where(b2, _select2(1, q, code_ptr, 6), _select2(1, q, code_ptr, 4)),
                       tl.where(b2, _select2(1, q, code_ptr, 2), _select2(1, q, code_ptr, 0)))
        high = tl.where(b4, tl.where(b2, _select2(1, q, code_ptr, 14), _select2(1, q, code_ptr, 12)),
                        tl.where(b2, _select2(1, q, code_ptr, 10), _select2(1, q, code_ptr, 8)))
        return tl.where(b8, high, low)
    else:
        return tl.load(code_ptr + q)


@triton.jit
def row_pairs(row_ptrs, k0, valid, QBLOCK: tl.constexpr):
    """The even and odd elements k0 .. k0+QBLOCK-1 of rows (row_ptrs [BLOCK_M, 1]): the halves that
    meet a 4-bit block's high and low nibbles."""
    kk = k0 + 2 * tl.arange(0, QBLOCK // 2)
    a_ptr = row_ptrs + kk[None, :]
    return tl.load(a_ptr, mask=valid[:, None], other=0.0), tl.load(a_ptr + 1, mask=valid[:, None], other=0.0)


@triton.jit
def block_bytes(w_ptr, rows, ok, k0, K: tl.constexpr, QBLOCK: tl.constexpr):
    """The packed bytes of W[rows, k0:k0+QBLOCK] ([len(rows), QBLOCK/2]) of the 4-bit matrix whose bytes start
    at w_ptr (rows of K weights, so a block never straddles two), as stored: a prefetched block stays
    bytes until its step decodes it (nibble_codes)."""
    kb = k0 // 2 + tl.arange(0, QBLOCK // 2)
    return tl.load(w_ptr + rows[:, None] * (K // 2) + kb[None, :], mask=ok[:, None], other=0)


@triton.jit
def nibble_codes(byte, code_ptr, LOOKUP: tl.constexpr):
    """The code values of a block's high and low nibbles (block_bytes), [len(rows), QBLOCK/2] each, before
    the block's scale, in the code table's dtype (the rows' dtype). LOOKUP (kernels.moe_code_lookup):
    "table" a load per nibble from the 16-entry table (L1), "select" a tree of selects over its entries
    held as scalars, or else the PTX of ptx_lookup.lookup_asm for this table (prmt over the table held in
    registers, four bytes at a time; a GPU only): the table's own values whichever."""
    if LOOKUP == "table" or LOOKUP == "select":
        byte = byte.to(tl.int32)
        return code_values(byte >> 4, code_ptr, LOOKUP == "select"), code_values(byte & 15, code_ptr, LOOKUP == "select")
    else:
        dt = code_ptr.dtype.element_ty
        return tl.inline_asm_elementwise(LOOKUP, "=r,=r,=r,=r,r", [byte], dtype=(dt, dt), is_pure=True, pack=4)


@triton.jit
def nibble_products(a_even, a_odd, hi, lo):
    """a @ W[rows, k0:k0+QBLOCK].T before the block's scale, [BLOCK_M, len(rows)] float32: the rows' even
    elements against the high nibbles plus their odd ones against the low nibbles."""
    return tl.dot(a_even, tl.trans(hi)) + tl.dot(a_odd, tl.trans(lo))


@triton.jit
def dequant_blocks(w_ptr, code_ptr, out_ptr, blk, live, scale, QBLOCK: tl.constexpr, BLOCKS: tl.constexpr):
    """Quantisation blocks `blk` ([BLOCKS], those with `live` set) of the 4-bit bytes at w_ptr -> their
    weights in out's dtype at out_ptr: code x the block's float32 scale (`scale` [BLOCKS]) rounded
    once, the high nibble first, as bitsandbytes dequantises (the dequantise kernels of linear4bit.py
    and moe_kernel.py)."""
    byte = tl.load(w_ptr + blk[:, None] * (QBLOCK // 2) + tl.arange(0, QBLOCK // 2)[None, :], mask=live[:, None],
                   other=0).to(tl.int32)
    dt = out_ptr.dtype.element_ty
    w = tl.join((tl.load(code_ptr + (byte >> 4)) * scale[:, None]).to(dt),
                (tl.load(code_ptr + (byte & 15)) * scale[:, None]).to(dt))
    tl.store(out_ptr + blk[:, None] * QBLOCK + tl.arange(0, QBLOCK)[None, :], tl.reshape(w, (BLOCKS, QBLOCK)),
             mask=live[:, None])


@triton.jit
def scaled_code_halves(w_ptr, code_ptr, out_ptr, blk, live, scale, QBLOCK: tl.constexpr, BLOCKS: tl.constexpr):
    """Quantisation blocks `blk` of the 4-bit bytes at w_ptr -> each block's high-nibble codes (its even
    weights) then its low-nibble ones (its odd weights), each code times the block's scale in code_ptr's dtype
    (the rows' dtype): the operands, in their K order, of the fused kernels' scaled-weights products
    (moe_kernel._scaled_products with WEIGHTS), the same expression on the same values."""
    byte = tl.load(w_ptr + blk[:, None] * (QBLOCK // 2) + tl.arange(0, QBLOCK // 2)[None, :], mask=live[:, None],
                   other=0).to(tl.int32)
    sc = scale.to(code_ptr.dtype.element_ty)[:, None]
    at = out_ptr + blk[:, None] * QBLOCK + tl.arange(0, QBLOCK // 2)[None, :]
    tl.store(at, tl.load(code_ptr + (byte >> 4)) * sc, mask=live[:, None])
    tl.store(at + QBLOCK // 2, tl.load(code_ptr + (byte & 15)) * sc, mask=live[:, None])


def halves_order(t: torch.Tensor, qblock: int) -> torch.Tensor:
    """t [R, C] with each run of `qblock` columns reordered as its even columns then its odd ones: rows in
    the K order of scaled_code_halves' weights (a copy)."""
    r, c = t.shape
    return t.reshape(r, c // qblock, qblock // 2, 2).transpose(-1, -2).reshape(r, c)


@triton.jit
def sum_rows_kernel(src_ptr, out_ptr, H: tl.constexpr, K: tl.constexpr, BLOCK: tl.constexpr):
    """Program (t, j): out[t, cols] = sum over k < K of src[t*K + k, cols] (float32), cast to out's
    dtype: partial products (a token's K routed choices, a row's K-split partials) summed and cast
    in one launch where torch's sum then cast are two."""
    t = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for k in tl.static_range(K):
        acc += tl.load(src_ptr + (t * K + k) * H + cols, mask=cols < H, other=0.0)
    tl.store(out_ptr + t * H + cols, acc.to(out_ptr.dtype.element_ty), mask=cols < H)


SUM_BLOCK = 1024


def sum_rows(src: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out [T, H] = src [T*K, H] (float32) summed over each row's K consecutive partials."""
    t, h = out.shape
    sum_rows_kernel[(t, triton.cdiv(h, SUM_BLOCK))](src, out, H=h, K=src.shape[0] // t, BLOCK=SUM_BLOCK)
    return out


_CODES: dict = {}


def code4(quant_type: str, device: torch.device, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """bitsandbytes' 16-entry table of a 4-bit type (nf4, fp4) on `device`, in `dtype`."""
    key = (quant_type, str(device), dtype)
    if key not in _CODES:
        import bitsandbytes.functional as bf

        _CODES[key] = bf.get_4bit_type(quant_type, device=device).to(dtype).contiguous()
    return _CODES[key]
