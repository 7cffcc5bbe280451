"""4-bit projections that read one input (q/k/v, gate/up, or one alone) as one 4-bit matrix, read
packed by a Triton kernel at decode (`kernels.linear4bit=triton`).

bitsandbytes' Linear4bit runs a batch of rows as a dequantise (4-bit bytes in, the whole bf16 matrix
out) and a bf16 GEMM over that copy: per weight it moves 0.5 + 2 + 2 bytes where bf16 moves 2, in two
launches a projection. On E2B at bs 64 on the H200 that made a decode step 9.0 ms against bf16's
5.0. Here a group's modules are concatenated into one matrix (their
bytes and block scales rebound as views of the group's, so nothing is stored twice) and a decode
step multiplies its rows against the packed bytes directly, reading 0.5 bytes per weight: one
kernel a group, each program one K step of one feature tile, and a second kernel that sums the
steps' float32 partials (programs that looped over K ran 3-7x slower on the H200).

An unmerged LoRA adapter of the group rides in the same kernel: `lora.LowRankGroup` computes
xa = x A^T for every member at once and passes a block-diagonal B, whose product the kernel adds
to the tile before the single rounding.

Steps of more than `kernels.linear4bit_max_rows` rows (large decode batches, prefill) dequantise
the group once (`kernels.linear4bit_dequant`: a kernel here, bitsandbytes' weights bit for bit at
twice the speed of its op, or bitsandbytes' op) and run one GEMM; that writes and reads 2 bytes a weight
beside the 0.5 it decodes, every step. (A kernel that decoded each block once in registers for programs
of 64-128 rows ran 3-8x slower than this on an H100: experiments/RESULTS.md, 2026-12-07.)
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from flexgemma.config.kernels import Kernels
from flexgemma.model.quant import dequantize_blocks
from flexgemma.model.triton4bit import code4, dequant_blocks, sum_rows

NESTED_BLOCK = 256  # bitsandbytes double quantisation: one float32 scale per 256 block scales
# the product kernel's tile: output features and K elements of a program, rows of a program, and K
# steps a program. On the H200 (bench_linear4bit.py) programs that looped over K steps ran at 0.03-0.1
# TB/s whatever the tiles; one 64 x 256 step a program (K split across programs, partials summed by a
# second kernel) ran E2B's groups at bs 64 in 9.2 us (q/k/v; bitsandbytes' modules 33.6), 61.2
# (double-wide gate/up; 75.0) and 32.5 (double-wide down; 41.4), with LoRA r32 inside 14.1 / 71.3 /
# 41.5 (48.9 / 92.4 / 53.6 for bitsandbytes' modules + LowRankGroup's addmms). Programs of 128 or 256
# rows were slower than 64 at every size; 2 or 4 K steps a program saved 12-17% on three groups at 64
# rows and cost 17% on the fourth, and were mostly slower at 8 and 32 rows (up to 2.1x).
TILES = dict(BLOCK_N=64, BLOCK_K=256, num_warps=4, num_stages=3, ROW_TILE=64, K_STEPS=1)


# Shapes are runtime arguments, not constexprs: one compilation serves every group and batch of a
# tile size (with K a constexpr, E2B's bnb4 + LoRA build compiled ~40 variants at ~2.5 s each).
@triton.jit
def _block_scale(absmax_ptr, ncode_ptr, nabsmax_ptr, noffset_ptr, blk, mask, NESTED: tl.constexpr,
                 DOUBLE_QUANT: tl.constexpr):
    """The float32 scales of quantisation blocks `blk`: stored as they are, or 8-bit codes decoded as
    bitsandbytes does (code x the 256-block's scale + its offset)."""
    if DOUBLE_QUANT:
        code8 = tl.load(absmax_ptr + blk, mask=mask, other=0).to(tl.int32)
        scale = tl.load(ncode_ptr + code8) * tl.load(nabsmax_ptr + blk // NESTED, mask=mask, other=0.0) \
            + tl.load(noffset_ptr + blk // NESTED, mask=mask, other=0.0)
    else:
        scale = tl.load(absmax_ptr + blk, mask=mask, other=0.0)
    return scale


@triton.jit
def _step_product(x_ptr, w_ptr, absmax_ptr, code_ptr, ncode_ptr, nabsmax_ptr, noffset_ptr, rows, valid, cols, ok,
                  k0, stride_x, row_bytes, row_blocks, QBLOCK: tl.constexpr, SCALES: tl.constexpr,
                  NESTED: tl.constexpr, DOUBLE_QUANT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr):
    """x[rows, k0:k0+BLOCK_K] @ W[cols, k0:k0+BLOCK_K]^T, float32 [BLOCK_M, BLOCK_N] (see the kernel)."""
    dt = x_ptr.dtype.element_ty
    a = tl.load(x_ptr + rows[:, None] * stride_x + (k0 + tl.arange(0, BLOCK_K))[None, :], mask=valid[:, None],
                other=0.0)
    a_even, a_odd = tl.split(tl.reshape(a, (BLOCK_M, BLOCK_K // 2, 2)))
    kb = k0 // 2 + tl.arange(0, BLOCK_K // 2)
    byte = tl.load(w_ptr + cols[:, None] * row_bytes + kb[None, :], mask=ok[:, None], other=0).to(tl.int32)
    blk = cols[:, None] * row_blocks + (k0 // QBLOCK + tl.arange(0, SCALES))[None, :]  # [BLOCK_N, SCALES]
    scale = _block_scale(absmax_ptr, ncode_ptr, nabsmax_ptr, noffset_ptr, blk, ok[:, None], NESTED,
                         DOUBLE_QUANT)[:, :, None]
    hi = tl.reshape(tl.reshape(tl.load(code_ptr + (byte >> 4)), (BLOCK_N, SCALES, BLOCK_K // 2 // SCALES)) * scale,
                    (BLOCK_N, BLOCK_K // 2))
    lo = tl.reshape(tl.reshape(tl.load(code_ptr + (byte & 15)), (BLOCK_N, SCALES, BLOCK_K // 2 // SCALES)) * scale,
                    (BLOCK_N, BLOCK_K // 2))
    return tl.dot(a_even, tl.trans(hi.to(dt))) + tl.dot(a_odd, tl.trans(lo.to(dt)))


@triton.jit(do_not_specialize=["M", "R", "split"])
def _linear_4bit_kernel(x_ptr, w_ptr, absmax_ptr, code_ptr, ncode_ptr, nabsmax_ptr, noffset_ptr, xa_ptr, b_ptr,
                        out_ptr, M, N, R, stride_x, stride_xa, row_bytes, row_blocks, split,
                        PARTIAL: tl.constexpr, QBLOCK: tl.constexpr, SCALES: tl.constexpr, NESTED: tl.constexpr,
                        DOUBLE_QUANT: tl.constexpr, LORA: tl.constexpr, BLOCK_R: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        K_STEPS: tl.constexpr):
    """Program (j, s, m): rows [m*BLOCK_M, (m+1)*BLOCK_M) of x [M, K] against features
    [j*BLOCK_N, (j+1)*BLOCK_N) of the 4-bit W [N, K] (rows of row_bytes = K/2 bytes and row_blocks =
    K/QBLOCK scales) over K_STEPS steps of BLOCK_K from s*K_STEPS*BLOCK_K (split = K / (K_STEPS *
    BLOCK_K) programs along K). A step reads BLOCK_K contiguous elements of each row (split into even
    and odd halves in registers: they meet the bytes' high and low nibbles) and BLOCK_K/2 bytes of
    each feature, decoded as bitsandbytes dequantises (float32 code x the block's float32 scale,
    rounded to x's dtype), SCALES quantisation blocks a step (1 where a block is longer than the
    step). Without PARTIAL (one program along K) the tile is stored in out's dtype, otherwise as
    float32 partials at out[m, s, :] for sum_rows. With LORA the first program along K adds xa @ B^T
    (xa [M, R], B [N, R]). Double-quantised scales are 8-bit codes decoded as bitsandbytes does (code
    x the 256-block's scale + offset; here one offset per 256-block, so matrices with different
    offsets can sit in one)."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    ok = cols < N
    rows = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
    valid = rows < M
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for st in tl.static_range(K_STEPS):
        acc += _step_product(x_ptr, w_ptr, absmax_ptr, code_ptr, ncode_ptr, nabsmax_ptr, noffset_ptr, rows, valid,
                             cols, ok, (tl.program_id(1) * K_STEPS + st) * BLOCK_K, stride_x, row_bytes, row_blocks,
                             QBLOCK, SCALES, NESTED, DOUBLE_QUANT, BLOCK_M, BLOCK_N, BLOCK_K)
    if LORA:
        if tl.program_id(1) == 0:
            r = tl.arange(0, BLOCK_R)
            xa = tl.load(xa_ptr + rows[:, None] * stride_xa + r[None, :], mask=valid[:, None] & (r[None, :] < R),
                         other=0.0)
            b = tl.load(b_ptr + cols[:, None] * R + r[None, :], mask=ok[:, None] & (r[None, :] < R), other=0.0)
            acc += tl.dot(xa, tl.trans(b))
    inside = valid[:, None] & ok[None, :]
    if PARTIAL:
        tl.store(out_ptr + (rows[:, None] * split + tl.program_id(1)) * N + cols[None, :], acc, mask=inside)
    else:
        tl.store(out_ptr + rows[:, None] * N + cols[None, :], acc.to(out_ptr.dtype.element_ty), mask=inside)


# the dequantise kernel's options: bytes of one program (whole quantisation blocks) and warps. Best of
# bench_dequant4bit.py's grid (1,024-8,192 bytes, 4 or 8 warps) summed over 31B's and E2B's groups on
# the H200. A first version decoded a block's scale once per byte (four gathers a byte) and ran at 1.9
# TB/s; a table of code pairs (one 8-byte load a byte instead of a 4-byte load a nibble) was 15-25%
# slower.
DEQUANT_TILES = dict(BYTES=2048, num_warps=4)


@triton.jit(do_not_specialize=["n_blocks"])
def _dequant_4bit_kernel(w_ptr, absmax_ptr, code_ptr, ncode_ptr, nabsmax_ptr, noffset_ptr, out_ptr, n_blocks,
                         QBLOCK: tl.constexpr, NESTED: tl.constexpr, DOUBLE_QUANT: tl.constexpr,
                         BLOCKS: tl.constexpr):
    """Quantisation blocks [pid*BLOCKS, (pid+1)*BLOCKS) of a 4-bit matrix (QBLOCK/2 bytes each) -> their
    weights in out's dtype, decoded as the product kernel above decodes them (float32 code x the
    block's float32 scale, rounded once), the high nibble first. One kernel reading 0.5 bytes and
    writing 2 a weight, where bitsandbytes' op needs the scales decoded first (a separate pass)."""
    blk = tl.program_id(0) * BLOCKS + tl.arange(0, BLOCKS)
    ok = blk < n_blocks
    scale = _block_scale(absmax_ptr, ncode_ptr, nabsmax_ptr, noffset_ptr, blk, ok, NESTED, DOUBLE_QUANT)
    dequant_blocks(w_ptr, code_ptr, out_ptr, blk, ok, scale, QBLOCK, BLOCKS)


def _linear4bit_type():
    from bitsandbytes.nn import Linear4bit

    return Linear4bit


def groupable(modules: list) -> Optional[str]:
    """Why `modules` cannot run as one Linear4bitGroup, or None when they can: Linear4bit modules
    without bias, on one device, of one input width, 4-bit type, block size and compute dtype, whose
    rows are whole quantisation blocks and whose bytes are plain uint8."""
    if not modules:
        return "no modules"
    linear4bit = _linear4bit_type()
    if not all(type(m) is linear4bit for m in modules):
        return "not all bitsandbytes Linear4bit"
    states = [m.weight.quant_state for m in modules]
    if any(qs is None for qs in states):
        return "not quantised yet"
    if any(m.bias is not None for m in modules):
        return "a bias"
    first = states[0]
    k = modules[0].in_features
    for m, qs in zip(modules, states):
        if (m.in_features, qs.quant_type, qs.blocksize, qs.dtype, m.weight.device) != \
                (k, first.quant_type, first.blocksize, first.dtype, modules[0].weight.device):
            return "different input widths, 4-bit types, block sizes, dtypes or devices"
        if m.weight.dtype != torch.uint8 or m.weight.numel() * 2 != m.in_features * m.out_features:
            return "bytes not plain uint8"
        if bool(qs.nested) != bool(first.nested):
            return "double quantisation on some members only"
    if k % first.blocksize:
        return f"rows of {k} weights are not whole blocks of {first.blocksize}"
    if first.dtype not in (torch.bfloat16, torch.float16):
        return f"compute dtype {first.dtype} (the kernel takes bf16/fp16)"
    return None


class Linear4bitGroup:
    """Linear4bit modules that read one input, as one 4-bit matrix [sum of outputs, in].

    The members' bytes and block scales are rebound as views of the group's concatenation (their
    own forward, state dicts and peft still see the same numbers). Double-quantised scales stay
    8-bit when each member's block count is a multiple of 256 (true of Gemma-4's shapes), with one
    offset per 256-block; otherwise they are decoded to float32 (0.5 bit a weight more)."""

    def __init__(self, modules: list, kernels: Kernels = Kernels()):
        why = groupable(modules)
        if why is not None:
            raise ValueError(f"Linear4bitGroup: {why}")
        self.modules = list(modules)
        # steps of more rows dequantise the group and run one GEMM, by this way (kernels.linear4bit_*)
        self.max_rows, self.dequant = kernels.linear4bit_max_rows, kernels.linear4bit_dequant
        qs = [m.weight.quant_state for m in modules]
        self.quant_type, self.block_size, self.dtype = qs[0].quant_type, qs[0].blocksize, qs[0].dtype
        self.in_features = modules[0].in_features
        self.splits = [m.out_features for m in modules]
        self.out_features = sum(self.splits)
        self.device = modules[0].weight.device
        self.packed = self._concat_rebind([m.weight for m in modules], lambda i, t: setattr(modules[i].weight, "data", t))
        nested = bool(qs[0].nested)
        blocks = [m.out_features * m.in_features // self.block_size for m in modules]
        self.double_quant = nested and all(b % NESTED_BLOCK == 0 for b in blocks[:-1]) and \
            all(torch.equal(q.state2.code, qs[0].state2.code) for q in qs)
        if self.double_quant:
            self.absmax = self._concat_rebind([q.absmax for q in qs], lambda i, t: setattr(qs[i], "absmax", t))
            self.nested_absmax = self._concat_rebind([q.state2.absmax for q in qs],
                                                     lambda i, t: setattr(qs[i].state2, "absmax", t))
            self.nested_offset = torch.cat([q.offset.float().reshape(1).expand(q.state2.absmax.numel()) for q in qs])
            self.nested_code = qs[0].state2.code.float().contiguous()
        elif nested:  # decoded scales: bitsandbytes' own blockwise decode plus each member's offset
            import bitsandbytes.functional as bf

            self.absmax = torch.cat([bf.dequantize_blockwise(q.absmax, q.state2).float() + q.offset for q in qs])
        else:
            self.absmax = self._concat_rebind([q.absmax.float() for q in qs], lambda i, t: setattr(qs[i], "absmax", t))
        self.code = code4(self.quant_type, self.device)  # float32: weights decode as bitsandbytes decodes them

    @staticmethod
    @torch.no_grad()
    def _concat_rebind(parts: list[torch.Tensor], rebind) -> torch.Tensor:
        """One flat tensor of `parts`; rebind(i, view) then points member i at its slice of it."""
        flat = torch.cat([p.data.reshape(-1) for p in parts])
        start = 0
        for i, p in enumerate(parts):
            n = p.numel()
            rebind(i, flat[start: start + n].view(p.shape))
            start += n
        return flat

    @property
    def extra_bytes(self) -> int:
        """Bytes this group holds beyond its members' own storage (offsets, or decoded scales)."""
        if self.double_quant:
            return self.nested_offset.numel() * 4
        mq = self.modules[0].weight.quant_state
        return self.absmax.numel() * 4 if mq.nested else 0

    def scales(self) -> torch.Tensor:
        """float32 [out * in / block] block scales, decoded where they are 8-bit."""
        if not self.double_quant:
            return self.absmax
        n = self.absmax.numel()
        per_block = lambda t: t.repeat_interleave(NESTED_BLOCK)[:n]  # noqa: E731
        return self.nested_code[self.absmax.long()] * per_block(self.nested_absmax) + per_block(self.nested_offset)

    def dequantize(self) -> torch.Tensor:
        """[out, in] weights in the compute dtype, the way kernels.linear4bit_dequant names."""
        return self.dequantize_triton() if self.dequant == "triton" else self.dequantize_bnb()

    def dequantize_triton(self, tiles: Optional[dict] = None) -> torch.Tensor:
        """The weights by one Triton kernel, each program whole quantisation blocks whose scales it
        decodes once (bitsandbytes' op, after torch decodes the 8-bit scales, took twice as long on
        31B's groups on the H200). `tiles` override DEQUANT_TILES (BYTES, num_warps)."""
        n = self.packed.numel()
        if 2 * n >= 2 ** 31:  # the kernel indexes weights in int32
            raise ValueError(f"Linear4bitGroup.dequantize_triton: {2 * n:,} weights in one group; the kernel takes "
                             f"fewer than 2**31 (use kernels.linear4bit_dequant=bnb)")
        tiles = {**DEQUANT_TILES, **(tiles or {})}
        out = torch.empty(2 * n, dtype=self.dtype, device=self.packed.device)
        dq = self.double_quant
        q = self.block_size
        blocks = max(1, tiles["BYTES"] // (q // 2))  # a power of two: q and BYTES are
        n_blocks = 2 * n // q
        _dequant_4bit_kernel[(triton.cdiv(n_blocks, blocks),)](
            self.packed, self.absmax, self.code, self.nested_code if dq else self.absmax,
            self.nested_absmax if dq else self.absmax, self.nested_offset if dq else self.absmax, out, n_blocks,
            QBLOCK=q, NESTED=NESTED_BLOCK, DOUBLE_QUANT=dq, BLOCKS=blocks, num_warps=tiles["num_warps"],
            enable_fp_fusion=False)  # the scale's multiply and add rounded apart, as torch's ops round them
        return out.view(self.out_features, self.in_features)

    def dequantize_bnb(self) -> torch.Tensor:
        """The same weights by bitsandbytes' registered dequantise op."""
        return dequantize_blocks(self.packed, self.scales(), self.block_size, self.quant_type,
                                 self.dtype).view(self.out_features, self.in_features)

    def matmul(self, x: torch.Tensor, xa: Optional[torch.Tensor] = None, b: Optional[torch.Tensor] = None,
               tiles: Optional[dict] = None) -> torch.Tensor:
        """x [T, in] -> [T, out] = x W^T (+ xa b^T: an unmerged LoRA's rank-space rows [T, R] and its
        block-diagonal B [out, R])."""
        t = x.shape[0]
        if t > self.max_rows or t == 0:
            y = F.linear(x, self.dequantize())
            return y if xa is None else torch.addmm(y, xa, b.t())
        if x.dtype != self.dtype:
            raise TypeError(f"Linear4bitGroup: rows are {x.dtype}; the group computes in {self.dtype}")
        tiles = {**TILES, **(tiles or {})}
        x = x if x.stride(-1) == 1 else x.contiguous()
        n, k, q = self.out_features, self.in_features, self.block_size
        block_n = tiles["BLOCK_N"]
        n_tiles = triton.cdiv(n, block_n)
        # a K step: BLOCK_K elements, or fewer where K is not a multiple (a power of two dividing K: K is
        # whole quantisation blocks, so the step is whole blocks or a part of one); one step a program
        block_k = min(tiles["BLOCK_K"], k & -k)
        # K steps a program: the most that divide K's steps, up to K_STEPS (each program along K writes
        # a float32 partial per row and feature, which at 64 rows outweigh 31B's 4-bit weights)
        steps = k // block_k
        k_steps = max(d for d in range(1, max(1, tiles["K_STEPS"]) + 1) if steps % d == 0)
        split = steps // k_steps
        out = torch.empty(t, n, dtype=x.dtype, device=x.device)
        dst = out if split == 1 else torch.empty(t * split, n, dtype=torch.float32, device=x.device)
        dq = self.double_quant
        lora = xa is not None
        r = xa.shape[1] if lora else 0
        block_m = min(tiles["ROW_TILE"], max(16, triton.next_power_of_2(t)))
        _linear_4bit_kernel[(n_tiles, split, triton.cdiv(t, block_m))](
            x_ptr=x, w_ptr=self.packed, absmax_ptr=self.absmax, code_ptr=self.code,
            ncode_ptr=self.nested_code if dq else self.absmax, nabsmax_ptr=self.nested_absmax if dq else self.absmax,
            noffset_ptr=self.nested_offset if dq else self.absmax, xa_ptr=xa if lora else x, b_ptr=b if lora else x,
            out_ptr=dst, M=t, N=n, R=r, stride_x=x.stride(0), stride_xa=xa.stride(0) if lora else 0,
            row_bytes=k // 2, row_blocks=k // q, split=split, PARTIAL=split > 1, QBLOCK=q, SCALES=max(1, block_k // q), NESTED=NESTED_BLOCK, DOUBLE_QUANT=dq, LORA=lora,
            BLOCK_R=max(16, triton.next_power_of_2(r)), BLOCK_M=block_m, BLOCK_N=block_n,
            BLOCK_K=block_k, K_STEPS=k_steps,
            num_warps=tiles["num_warps"], num_stages=tiles["num_stages"],
        )
        return out if split == 1 else sum_rows(dst, out)

    def __call__(self, x: torch.Tensor) -> list[torch.Tensor]:
        """x [T, in] -> each member's output [T, out_i] (column slices of one product)."""
        return list(self.matmul(x).split(self.splits, dim=-1))


def group_or_none(modules: list, kernels: Kernels = Kernels()) -> Optional[Linear4bitGroup]:
    """A Linear4bitGroup of `modules` (each a Linear4bit, or a peft wrapper around one), or None
    where they cannot form one."""
    bases = [m.get_base_layer() if hasattr(m, "get_base_layer") else m for m in modules]
    return Linear4bitGroup(bases, kernels) if groupable(bases) is None else None
