"""A Triton GEMM for routed experts at decode batch sizes (`engine.moe_kernel=triton`).

At decode, 26B-A4B's rows spread thin: bs 8 routes 64 rows to ~52 experts, one or two rows each.
`torch._grouped_mm` tiles each expert's rows in blocks of 64+ rows, and the step read its bytes
at 1.4 TB/s on the H200 (RESULTS.md). Here one program owns one expert and a BLOCK_N slice of its
output features: it streams that slice of the expert's weights once and multiplies all of the
expert's rows (in blocks of 16, the smallest tensor-core tile) against it. Experts with no rows
exit at once. Weights are read in their stored [E, N, K] layout (K contiguous), no transpose.

With quant=bnb4 the same kernel reads the packed 4-bit experts (`quant.PackedExpertWeight`) and
decodes each tile in registers (code[nibble] x block scale, the scale itself decoded when double
quantised): no bf16 copy of the routed experts is written and read back, which at batch >= 16 is
1.5 GB per layer on 26B-A4B.

Imported only when selected: Triton is a GPU dependency (the CPU runs it only through Triton's
interpreter, TRITON_INTERPRET=1, which the tests use).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

BLOCK_M = 16  # rows of one expert per tile: tl.dot's smallest M


@triton.jit
def _packed_tile(packed_ptr, absmax_ptr, code4_ptr, ncode_ptr, nabsmax_ptr, noffset_ptr, expert, cols, k, inside,
                 K: tl.constexpr, stride_pe, stride_ae, stride_ne, QBLOCK: tl.constexpr, NESTED: tl.constexpr,
                 DOUBLE_QUANT: tl.constexpr):
    """[BLOCK_N, BLOCK_K] float32 weights of a 4-bit expert: code[nibble] x its block's scale."""
    flat = cols[:, None] * K + k[None, :]  # element index inside the expert, as bitsandbytes packs it
    byte = tl.load(packed_ptr + expert * stride_pe + flat // 2, mask=inside, other=0).to(tl.int32)
    nibble = tl.where(flat % 2 == 0, byte >> 4, byte & 15)  # the first element in the high half
    value = tl.load(code4_ptr + nibble)
    blk = flat // QBLOCK
    if DOUBLE_QUANT:
        code8 = tl.load(absmax_ptr + expert * stride_ae + blk, mask=inside, other=0).to(tl.int32)
        scale = tl.load(ncode_ptr + code8) * tl.load(nabsmax_ptr + expert * stride_ne + blk // NESTED,
                                                       mask=inside, other=0.0) + tl.load(noffset_ptr + expert)
    else:
        scale = tl.load(absmax_ptr + expert * stride_ae + blk, mask=inside, other=0.0)
    return value * scale


@triton.jit
def _expert_rows_kernel(x_ptr, w_ptr, absmax_ptr, code4_ptr, ncode_ptr, nabsmax_ptr, noffset_ptr, ids_ptr,
                        out_ptr, ends_ptr, N: tl.constexpr, K: tl.constexpr, stride_x, stride_we, stride_wn,
                        stride_ae, stride_ne, stride_out, PACKED: tl.constexpr, QBLOCK: tl.constexpr,
                        NESTED: tl.constexpr, DOUBLE_QUANT: tl.constexpr, HAS_IDS: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Program (g, j): the rows of group g times output features [j*BLOCK_N, (j+1)*BLOCK_N) of the
    group's expert (ids[g], or g). Plain weights: w [G, N, K]; packed: w [E, N*K/2] uint8."""
    group = tl.program_id(0)
    end = tl.load(ends_ptr + group)
    start = tl.where(group > 0, tl.load(ends_ptr + tl.maximum(group - 1, 0)), 0)
    if HAS_IDS:
        expert = tl.load(ids_ptr + group)
    else:
        expert = group
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    m0 = start
    while m0 < end:  # (a while loop: Triton's interpreter takes no loaded value as a range bound)
        rows = m0 + tl.arange(0, BLOCK_M)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + ks
            a = tl.load(x_ptr + rows[:, None] * stride_x + k[None, :],
                        mask=(rows[:, None] < end) & (k[None, :] < K), other=0.0)
            inside = (cols[:, None] < N) & (k[None, :] < K)
            if PACKED:
                b = _packed_tile(w_ptr, absmax_ptr, code4_ptr, ncode_ptr, nabsmax_ptr, noffset_ptr, expert, cols, k,
                                 inside, K, stride_we, stride_ae, stride_ne, QBLOCK, NESTED, DOUBLE_QUANT)
            else:
                b = tl.load(w_ptr + expert * stride_we + cols[:, None] * stride_wn + k[None, :], mask=inside, other=0.0)
            acc += tl.dot(a, tl.trans(b.to(x_ptr.dtype.element_ty)))
        tl.store(out_ptr + rows[:, None] * stride_out + cols[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=(rows[:, None] < end) & (cols[None, :] < N))
        m0 += BLOCK_M


def _launch(x: torch.Tensor, n: int, k: int, groups: int, ends: torch.Tensor, block_n: int, block_k: int,
            num_warps: int, num_stages: Optional[int] = None, **weights) -> torch.Tensor:
    if x.dtype not in (torch.bfloat16, torch.float16):
        raise TypeError(f"the Triton expert kernel takes bf16/fp16 rows, got {x.dtype}")
    x = x.contiguous()
    out = torch.empty(x.shape[0], n, dtype=x.dtype, device=x.device)
    if x.shape[0] == 0:
        return out
    _expert_rows_kernel[(groups, triton.cdiv(n, block_n))](
        x_ptr=x, out_ptr=out, ends_ptr=ends, N=n, K=k, stride_x=x.stride(0), stride_out=out.stride(0),
        BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=num_warps,
        **({"num_stages": num_stages} if num_stages else {}), **weights)
    return out


def expert_rows_mm(x: torch.Tensor, w: torch.Tensor, ends: torch.Tensor, block_n: int = 64, block_k: int = 128,
                   num_warps: int = 4, num_stages: Optional[int] = None) -> torch.Tensor:
    """x [R, K] rows grouped by expert; w [G, N, K] (group g's matrix, as stored); ends [G] int32
    cumulative row ends (group g owns rows [ends[g-1], ends[g])) -> [R, N] = x_g @ w[g].T per group.
    bf16/fp16 inputs, float32 accumulation."""
    if w.dtype != x.dtype:
        raise TypeError(f"expert_rows_mm takes rows and weights of one dtype, got {x.dtype} / {w.dtype}")
    if w.stride(2) != 1:
        w = w.contiguous()
    g, n, k = w.shape
    return _launch(x, n, k, g, ends, block_n, block_k, num_warps, num_stages, w_ptr=w, absmax_ptr=w, code4_ptr=w, ncode_ptr=w,
                   nabsmax_ptr=w, noffset_ptr=w, ids_ptr=ends, stride_we=w.stride(0), stride_wn=w.stride(1),
                   stride_ae=0, stride_ne=0, PACKED=False, QBLOCK=1, NESTED=1, DOUBLE_QUANT=False, HAS_IDS=False)


_CODES: dict = {}


def _code4(quant_type: str, device: torch.device) -> torch.Tensor:
    """bitsandbytes' 16-entry table of a 4-bit type (nf4, fp4), float32, on `device`."""
    key = (quant_type, str(device))
    if key not in _CODES:
        import bitsandbytes.functional as bf

        _CODES[key] = bf.get_4bit_type(quant_type, device=device).float().contiguous()
    return _CODES[key]


def expert_rows_mm_4bit(x: torch.Tensor, weight, ids: Optional[torch.Tensor], ends: torch.Tensor,
                        block_n: int = 64, block_k: int = 128, num_warps: int = 4,
                        num_stages: Optional[int] = None) -> torch.Tensor:
    """expert_rows_mm over a `quant.PackedExpertWeight` [E, N, K]: group g multiplies expert ids[g]
    (expert g when ids is None), decoded tile by tile in registers."""
    _, n, k = weight.shape
    dq = bool(weight.double_quant)
    absmax = weight.absmax
    nested = weight.nested_absmax if dq else absmax  # placeholders when not double-quantised (never read)
    return _launch(
        x, n, k, ids.shape[0] if ids is not None else weight.shape[0], ends, block_n, block_k, num_warps, num_stages,
        w_ptr=weight.packed, absmax_ptr=absmax, code4_ptr=_code4(weight.quant_type, x.device),
        ncode_ptr=weight.nested_code if dq else absmax, nabsmax_ptr=nested,
        noffset_ptr=weight.nested_offset if dq else absmax, ids_ptr=ids if ids is not None else ends,
        stride_we=weight.packed.stride(0), stride_wn=0, stride_ae=absmax.stride(0), stride_ne=nested.stride(0),
        PACKED=True, QBLOCK=weight.block_size, NESTED=weight.NESTED_BLOCK, DOUBLE_QUANT=dq,
        HAS_IDS=ids is not None)


class TritonExperts:
    """engine.moe_kernel=triton: the routed experts' two GEMMs, over plain or packed 4-bit weights."""

    def dense(self, x: torch.Tensor, w: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
        return expert_rows_mm(x, w, ends)

    def packed(self, x: torch.Tensor, weight, ids: Optional[torch.Tensor], ends: torch.Tensor) -> torch.Tensor:
        return expert_rows_mm_4bit(x, weight, ids, ends)
