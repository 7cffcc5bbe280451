"""Triton kernels for 26B-A4B's routed experts at decode (`engine.moe_kernel=triton`).

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
- the K choices of each token summed (one reduction).

Experts with no entries exit at once. Weights are read in their stored [E, N, K] layout. Prefill
(many rows per expert) stays on torch's grouped GEMM. The kernels also read packed 4-bit experts
(`quant.PackedExpertWeight`, decoded a quantisation block at a time in registers), correctly but at
0.05 TB/s on the H200, slower than torch's dequantise-then-GEMM path, so `TritonExperts.takes` sends
4-bit experts to that path until the in-kernel decode is fast (bench_moe_kernel.py --bnb4 measures it).

Imported only when selected: Triton is a GPU dependency (the CPU runs it only through Triton's
interpreter, TRITON_INTERPRET=1, which the tests use).
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

BLOCK_M = 16  # entries of one expert per tile: tl.dot's smallest M


@triton.jit
def _packed_block(packed_ptr, absmax_ptr, code4_ptr, ncode_ptr, nabsmax_ptr, noffset_ptr, expert, rows, rows_ok, k0,
                  K: tl.constexpr, stride_pe, stride_ae, stride_ne, QBLOCK: tl.constexpr, NESTED: tl.constexpr,
                  DOUBLE_QUANT: tl.constexpr):
    """One quantisation block of each of `rows` of a 4-bit expert (elements k0 .. k0+QBLOCK-1, K a
    multiple of QBLOCK so that a block never straddles rows), as two float32 [rows, QBLOCK/2] halves:
    the even elements (bitsandbytes packs the first of a pair in the high nibble) and the odd ones.
    Decoding code[nibble] x scale, one scale per row: the scale's own decoding (double quantisation)
    is paid once per block, not per element."""
    start = rows * K + k0  # element index of each row's block inside the expert
    j = tl.arange(0, QBLOCK // 2)
    byte = tl.load(packed_ptr + expert * stride_pe + start[:, None] // 2 + j[None, :], mask=rows_ok[:, None],
                   other=0).to(tl.int32)
    blk = start // QBLOCK
    if DOUBLE_QUANT:
        code8 = tl.load(absmax_ptr + expert * stride_ae + blk, mask=rows_ok, other=0).to(tl.int32)
        scale = tl.load(ncode_ptr + code8) * tl.load(nabsmax_ptr + expert * stride_ne + blk // NESTED,
                                                       mask=rows_ok, other=0.0) + tl.load(noffset_ptr + expert)
    else:
        scale = tl.load(absmax_ptr + expert * stride_ae + blk, mask=rows_ok, other=0.0)
    even = tl.load(code4_ptr + (byte >> 4)) * scale[:, None]
    odd = tl.load(code4_ptr + (byte & 15)) * scale[:, None]
    return even, odd


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
def _routed_up_kernel(x_ptr, index_ptr, n_flat, w_ptr, absmax_ptr, code4_ptr, ncode_ptr, nabsmax_ptr, noffset_ptr,
                      out_ptr, I: tl.constexpr, H: tl.constexpr, TOPK: tl.constexpr, stride_x, stride_we, stride_wn,
                      stride_ae, stride_ne, PACKED: tl.constexpr, QBLOCK: tl.constexpr, NESTED: tl.constexpr,
                      DOUBLE_QUANT: tl.constexpr, NFLAT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr):
    """Program (e, j): for every (token, choice) routed to expert e, features [j*BLOCK_N, (j+1)*BLOCK_N)
    of act(x @ gate.T) * (x @ up.T), written at the entry's flat row of out [T*TOPK, I]. gate is rows
    [0, I) of the expert's gate_up, up rows [I, 2I): both tiles of a feature slice are read together."""
    expert = tl.program_id(0)
    dt = x_ptr.dtype.element_ty
    offs, match, rank, count = _expert_matches(index_ptr, n_flat, expert, NFLAT)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    m0 = 0
    while m0 < count:
        flat, valid = _match_tile(offs, match, rank, m0, count, BLOCK_M)
        token = flat // TOPK
        acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if PACKED:  # a quantisation block per step; the rows' even and odd elements as two products
            for k0 in range(0, H, QBLOCK):
                kk = k0 + 2 * tl.arange(0, QBLOCK // 2)
                a_ptr = x_ptr + token[:, None] * stride_x + kk[None, :]
                a_even = tl.load(a_ptr, mask=valid[:, None], other=0.0)
                a_odd = tl.load(a_ptr + 1, mask=valid[:, None], other=0.0)
                ge, go = _packed_block(w_ptr, absmax_ptr, code4_ptr, ncode_ptr, nabsmax_ptr, noffset_ptr, expert, cols,
                                       cols < I, k0, H, stride_we, stride_ae, stride_ne, QBLOCK, NESTED, DOUBLE_QUANT)
                ue, uo = _packed_block(w_ptr, absmax_ptr, code4_ptr, ncode_ptr, nabsmax_ptr, noffset_ptr, expert,
                                       cols + I, cols < I, k0, H, stride_we, stride_ae, stride_ne, QBLOCK, NESTED,
                                       DOUBLE_QUANT)
                acc_g += tl.dot(a_even, tl.trans(ge.to(dt))) + tl.dot(a_odd, tl.trans(go.to(dt)))
                acc_u += tl.dot(a_even, tl.trans(ue.to(dt))) + tl.dot(a_odd, tl.trans(uo.to(dt)))
        else:
            for k0 in range(0, H, BLOCK_K):
                k = k0 + ks
                a = tl.load(x_ptr + token[:, None] * stride_x + k[None, :], mask=valid[:, None] & (k[None, :] < H),
                            other=0.0)
                inside = (cols[:, None] < I) & (k[None, :] < H)
                base = w_ptr + expert * stride_we + cols[:, None] * stride_wn + k[None, :]
                acc_g += tl.dot(a, tl.trans(tl.load(base, mask=inside, other=0.0)))
                acc_u += tl.dot(a, tl.trans(tl.load(base + I * stride_wn, mask=inside, other=0.0)))
        # rounded where torch's path rounds (GEMM outputs, the activation, the product) so that both
        # paths give the same numbers up to summation order
        g = acc_g.to(dt).to(tl.float32)
        h = _gelu_tanh(g).to(dt).to(tl.float32) * acc_u.to(dt).to(tl.float32)
        tl.store(out_ptr + flat[:, None] * I + cols[None, :], h.to(dt), mask=valid[:, None] & (cols[None, :] < I))
        m0 += BLOCK_M


@triton.jit
def _routed_down_kernel(inter_ptr, index_ptr, weights_ptr, n_flat, w_ptr, absmax_ptr, code4_ptr, ncode_ptr,
                        nabsmax_ptr, noffset_ptr, out_ptr, I: tl.constexpr, H: tl.constexpr, stride_we, stride_wn,
                        stride_ae, stride_ne, PACKED: tl.constexpr, QBLOCK: tl.constexpr, NESTED: tl.constexpr,
                        DOUBLE_QUANT: tl.constexpr, NFLAT: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Program (e, j): out[f, j-slice] = (inter[f] @ down_e.T) x router weight of f, for every flat
    entry f routed to expert e; out is float32 [T*TOPK, H], summed over the choices afterwards."""
    expert = tl.program_id(0)
    dt = inter_ptr.dtype.element_ty
    offs, match, rank, count = _expert_matches(index_ptr, n_flat, expert, NFLAT)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    m0 = 0
    while m0 < count:
        flat, valid = _match_tile(offs, match, rank, m0, count, BLOCK_M)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if PACKED:
            for k0 in range(0, I, QBLOCK):
                kk = k0 + 2 * tl.arange(0, QBLOCK // 2)
                a_ptr = inter_ptr + flat[:, None] * I + kk[None, :]
                a_even = tl.load(a_ptr, mask=valid[:, None], other=0.0)
                a_odd = tl.load(a_ptr + 1, mask=valid[:, None], other=0.0)
                be, bo = _packed_block(w_ptr, absmax_ptr, code4_ptr, ncode_ptr, nabsmax_ptr, noffset_ptr, expert, cols,
                                       cols < H, k0, I, stride_we, stride_ae, stride_ne, QBLOCK, NESTED, DOUBLE_QUANT)
                acc += tl.dot(a_even, tl.trans(be.to(dt))) + tl.dot(a_odd, tl.trans(bo.to(dt)))
        else:
            for k0 in range(0, I, BLOCK_K):
                k = k0 + ks
                a = tl.load(inter_ptr + flat[:, None] * I + k[None, :], mask=valid[:, None] & (k[None, :] < I),
                            other=0.0)
                b = tl.load(w_ptr + expert * stride_we + cols[:, None] * stride_wn + k[None, :],
                            mask=(cols[:, None] < H) & (k[None, :] < I), other=0.0)
                acc += tl.dot(a, tl.trans(b))
        weight = tl.load(weights_ptr + flat, mask=valid, other=0.0)
        y = acc.to(dt).to(tl.float32) * weight[:, None]  # float32 router weights, as transformers multiplies
        tl.store(out_ptr + flat[:, None] * H + cols[None, :], y, mask=valid[:, None] & (cols[None, :] < H))
        m0 += BLOCK_M


_CODES: dict = {}


def _code4(quant_type: str, device: torch.device) -> torch.Tensor:
    """bitsandbytes' 16-entry table of a 4-bit type (nf4, fp4), float32, on `device`."""
    key = (quant_type, str(device))
    if key not in _CODES:
        import bitsandbytes.functional as bf

        _CODES[key] = bf.get_4bit_type(quant_type, device=device).float().contiguous()
    return _CODES[key]


# the routed kernels read a decode step's whole routing in every program: up to this many (token,
# choice) entries (bucket 64 x top-8 = 512); bigger steps sort rows by expert instead
ROUTED_MAX_ENTRIES = 1024
# tile options of the two kernels, from experiments/bench_moe_kernel.py on the H200 (the up kernel
# reads a gate and an up tile per step, so its BLOCK_N=64 streams 128 weight rows, like down's 128)
UP_TILES = dict(BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=3)
DOWN_TILES = dict(BLOCK_N=128, BLOCK_K=128, num_warps=4, num_stages=3)


def _weight_args(w) -> dict:
    """Kernel arguments of an expert weight [E, N, K]: a bf16/fp16 tensor or a PackedExpertWeight."""
    if isinstance(w, torch.Tensor):
        if w.stride(2) != 1:
            w = w.contiguous()
        return dict(w_ptr=w, absmax_ptr=w, code4_ptr=w, ncode_ptr=w, nabsmax_ptr=w, noffset_ptr=w,
                    stride_we=w.stride(0), stride_wn=w.stride(1), stride_ae=0, stride_ne=0, PACKED=False,
                    QBLOCK=1, NESTED=1, DOUBLE_QUANT=False)
    dq = bool(w.double_quant)
    absmax = w.absmax
    nested = w.nested_absmax if dq else absmax  # placeholders when not double-quantised (never read)
    return dict(w_ptr=w.packed, absmax_ptr=absmax, code4_ptr=_code4(w.quant_type, w.packed.device),
                ncode_ptr=w.nested_code if dq else absmax, nabsmax_ptr=nested,
                noffset_ptr=w.nested_offset if dq else absmax, stride_we=w.packed.stride(0), stride_wn=0,
                stride_ae=absmax.stride(0), stride_ne=nested.stride(0), PACKED=True, QBLOCK=w.block_size,
                NESTED=w.NESTED_BLOCK, DOUBLE_QUANT=dq)


def decode_experts(x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, gate_up, down,
                   up_tiles: Optional[dict] = None, down_tiles: Optional[dict] = None) -> torch.Tensor:
    """Gemma-4's routed experts for a decode-sized step in two kernels, with no sort of rows by expert.

    x [T, H] bf16/fp16; top_k_* [T, K]; gate_up [E, 2I, H], down [E, H, I], as tensors of x's dtype
    or PackedExpertWeights (4-bit, decoded in the kernels). The activation is gelu_pytorch_tanh,
    Gemma-4's. Returns [T, H] in x's dtype: sum over choices of weight x expert(x). *_tiles override
    UP_TILES / DOWN_TILES (BLOCK_N, BLOCK_K, num_warps, num_stages)."""
    if x.dtype not in (torch.bfloat16, torch.float16):
        raise TypeError(f"the Triton expert kernels take bf16/fp16 rows, got {x.dtype}")
    t, topk = top_k_index.shape
    e, two_i, h = gate_up.shape
    i = two_i // 2
    n_flat = t * topk
    for name, w in (("gate_up", gate_up), ("down", down)):
        if not weights_supported(w, x.dtype):
            raise TypeError(f"decode_experts: {name} must be {x.dtype} or 4-bit with blocks that tile its rows")
    if n_flat > ROUTED_MAX_ENTRIES:
        raise ValueError(f"decode_experts takes at most {ROUTED_MAX_ENTRIES} (token, choice) entries, got {n_flat}")
    up_tiles, down_tiles = {**UP_TILES, **(up_tiles or {})}, {**DOWN_TILES, **(down_tiles or {})}
    x = x.contiguous()
    index = top_k_index.reshape(-1).to(torch.int32)
    weights = top_k_weights.reshape(-1).float()
    nflat = max(16, triton.next_power_of_2(n_flat))
    inter = torch.empty(n_flat, i, dtype=x.dtype, device=x.device)
    out = torch.empty(n_flat, h, dtype=torch.float32, device=x.device)
    if n_flat == 0:
        return x.new_zeros(t, h)
    _routed_up_kernel[(e, triton.cdiv(i, up_tiles["BLOCK_N"]))](
        x_ptr=x, index_ptr=index, n_flat=n_flat, out_ptr=inter, I=i, H=h, TOPK=topk, stride_x=x.stride(0),
        NFLAT=nflat, BLOCK_M=BLOCK_M, **up_tiles, **_weight_args(gate_up))
    _routed_down_kernel[(e, triton.cdiv(h, down_tiles["BLOCK_N"]))](
        inter_ptr=inter, index_ptr=index, weights_ptr=weights, n_flat=n_flat, out_ptr=out, I=i, H=h,
        NFLAT=nflat, BLOCK_M=BLOCK_M, **down_tiles, **_weight_args(down))
    return out.view(t, topk, h).sum(1).to(x.dtype)


def weights_supported(w, dtype: torch.dtype) -> bool:
    """Plain weights of the rows' dtype, or 4-bit ones whose quantisation blocks tile each row (the
    kernels decode a block per step, 16+ elements of each half)."""
    if isinstance(w, torch.Tensor):
        return w.dtype == dtype
    return w.block_size >= 32 and w.shape[-1] % w.block_size == 0


def is_gelu_tanh(act) -> bool:
    """act is transformers' gelu_pytorch_tanh (the only activation the routed kernels compute)."""
    return type(act).__name__ in ("GELUTanh", "PytorchGELUTanh") or getattr(act, "approximate", None) == "tanh"


class TritonExperts:
    """engine.moe_kernel=triton: decode steps' routed experts in the two kernels above."""

    @staticmethod
    def takes(x: torch.Tensor, top_k_index: torch.Tensor, act, gate_up, down) -> bool:
        """A decode-sized bf16/fp16 step with Gemma-4's activation over plain weights (anything else:
        torch's path). 4-bit experts go to torch's path too: decode_experts reads them correctly, but its
        in-kernel decode ran at 0.05 TB/s on the H200, 2-4x slower than dequantising the routed experts
        and running the grouped GEMM (experiments/bench_moe_kernel.py --bnb4, RESULTS.md)."""
        return (x.dtype in (torch.bfloat16, torch.float16) and top_k_index.numel() <= ROUTED_MAX_ENTRIES
                and is_gelu_tanh(act) and isinstance(gate_up, torch.Tensor) and isinstance(down, torch.Tensor)
                and weights_supported(gate_up, x.dtype) and weights_supported(down, x.dtype))

    def __call__(self, x, top_k_index, top_k_weights, gate_up, down) -> torch.Tensor:
        return decode_experts(x, top_k_index, top_k_weights, gate_up, down)
