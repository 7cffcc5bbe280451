"""A Triton GEMM for routed experts at decode batch sizes (`engine.moe_kernel=triton`).

At decode, 26B-A4B's rows spread thin: bs 8 routes 64 rows to ~52 experts, one or two rows each.
`torch._grouped_mm` tiles each expert's rows in blocks of 64+ rows, and the step read its bytes
at 1.4 TB/s on the H200 (RESULTS.md). Here one program owns one expert and a BLOCK_N slice of its
output features: it streams that slice of the expert's weights once and multiplies all of the
expert's rows (in blocks of 16, the smallest tensor-core tile) against it. Experts with no rows
exit at once. Weights are read in their stored [E, N, K] layout (K contiguous), no transpose.

Imported only when selected: Triton is a GPU dependency (the CPU runs it only through Triton's
interpreter, TRITON_INTERPRET=1, which the tests use).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_M = 16  # rows of one expert per tile: tl.dot's smallest M


@triton.jit
def _expert_rows_kernel(x_ptr, w_ptr, out_ptr, ends_ptr, N: tl.constexpr, K: tl.constexpr, stride_x, stride_we, stride_wn, stride_out,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    group = tl.program_id(0)
    end = tl.load(ends_ptr + group)
    start = tl.where(group > 0, tl.load(ends_ptr + tl.maximum(group - 1, 0)), 0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + group * stride_we + cols[:, None] * stride_wn
    m0 = start
    while m0 < end:  # (a while loop: Triton's interpreter takes no loaded value as a range bound)
        rows = m0 + tl.arange(0, BLOCK_M)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + ks
            a = tl.load(x_ptr + rows[:, None] * stride_x + k[None, :],
                        mask=(rows[:, None] < end) & (k[None, :] < K), other=0.0)
            b = tl.load(w_rows + k[None, :], mask=(cols[:, None] < N) & (k[None, :] < K), other=0.0)
            acc += tl.dot(a, tl.trans(b))
        tl.store(out_ptr + rows[:, None] * stride_out + cols[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=(rows[:, None] < end) & (cols[None, :] < N))
        m0 += BLOCK_M


def expert_rows_mm(x: torch.Tensor, w: torch.Tensor, ends: torch.Tensor, block_n: int = 64, block_k: int = 128,
                   num_warps: int = 4) -> torch.Tensor:
    """x [R, K] rows grouped by expert; w [G, N, K] (group g's matrix, as stored); ends [G] int32
    cumulative row ends (group g owns rows [ends[g-1], ends[g])) -> [R, N] = x_g @ w[g].T per group.
    bf16/fp16 inputs, float32 accumulation."""
    if x.dtype not in (torch.bfloat16, torch.float16) or w.dtype != x.dtype:
        raise TypeError(f"expert_rows_mm takes bf16/fp16 rows and weights of the same dtype, got {x.dtype} / {w.dtype}")
    x = x.contiguous()
    if w.stride(2) != 1:
        w = w.contiguous()
    r, k = x.shape
    g, n, _ = w.shape
    out = torch.empty(r, n, dtype=x.dtype, device=x.device)
    if r == 0:
        return out
    grid = (g, triton.cdiv(n, block_n))
    _expert_rows_kernel[grid](x, w, out, ends, n, k, x.stride(0), w.stride(0), w.stride(1), out.stride(0),
                              BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=num_warps)
    return out
