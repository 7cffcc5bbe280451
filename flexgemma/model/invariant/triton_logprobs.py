"""The Triton kernels of `logprobs` (imported only on a GPU): a lane update over a vocabulary slice and
the lanes' combine. The sampler, engine.score() and the trainer all run these two kernels, never a fused
one: the combine's sum is ordered by the register layout the compiler picks for its kernel, and another
kernel (a fused whole-vocabulary one) may pick another and round a logprob 1 ulp apart."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

LANES = 4096  # lanes of the log-sum-exp: lane j takes logits j, j + LANES, ... (part of the result)


@triton.jit
def _capped(x, cap, HAS_CAP: tl.constexpr):
    """cap * tanh(x / cap), tanh from exp (|error| ~1e-7 * cap): the same formula in the interpreter that
    tests the kernels on the CPU, where libdevice has no tanh."""
    if HAS_CAP:
        e = tl.exp(-2.0 * tl.abs(x / cap))
        t = (1.0 - e) / (1.0 + e)
        x = tl.where(x < 0, -t, t) * cap
    return x


@triton.jit
def _lane_step(lane_max, lane_sum, z):
    new_max = tl.maximum(lane_max, z)
    safe = tl.where(new_max == float("-inf"), 0.0, new_max)
    return new_max, lane_sum * tl.exp(lane_max - safe) + tl.exp(z - safe)


@triton.jit
def _lanes_over(base, lane_max, lane_sum, cap, V, HAS_CAP: tl.constexpr, LANES: tl.constexpr):
    for v0 in range(0, V, LANES):
        offs = v0 + tl.arange(0, LANES)
        z = _capped(tl.load(base + offs, mask=offs < V, other=float("-inf")).to(tl.float32), cap, HAS_CAP)
        lane_max, lane_sum = _lane_step(lane_max, lane_sum, z)
    return lane_max, lane_sum


@triton.jit
def _combine_lanes(lane_max, lane_sum):
    top = tl.max(lane_max, 0)
    return top + tl.log(tl.sum(lane_sum * tl.exp(lane_max - top), 0))


@triton.jit
def _update_kernel(head_ptr, max_ptr, sum_ptr, stride, cap, V, HAS_CAP: tl.constexpr, LANES: tl.constexpr):
    row = tl.program_id(0)
    lanes = tl.arange(0, LANES)
    lane_max = tl.load(max_ptr + row * LANES + lanes)
    lane_sum = tl.load(sum_ptr + row * LANES + lanes)
    lane_max, lane_sum = _lanes_over(head_ptr + row * stride, lane_max, lane_sum, cap, V, HAS_CAP, LANES)
    tl.store(max_ptr + row * LANES + lanes, lane_max)
    tl.store(sum_ptr + row * LANES + lanes, lane_sum)


@triton.jit
def _finish_kernel(max_ptr, sum_ptr, target_ptr, out_ptr, cap, HAS_CAP: tl.constexpr, LANES: tl.constexpr):
    """out = capped(target head value) - the lanes combined."""
    row = tl.program_id(0)
    lanes = tl.arange(0, LANES)
    zt = _capped(tl.load(target_ptr + row).to(tl.float32), cap, HAS_CAP)
    tl.store(out_ptr + row, zt - _combine_lanes(tl.load(max_ptr + row * LANES + lanes),
                                                tl.load(sum_ptr + row * LANES + lanes)))


# no FMA contraction: the GPU rounds each step as the interpreted tests (numpy, no FMA) check it
_OPTS = dict(num_warps=8, enable_fp_fusion=False)


def _launch(head):
    return head if head.stride(-1) == 1 else head.contiguous()


def update(head: torch.Tensor, lane_max: torch.Tensor, lane_sum: torch.Tensor, softcap) -> None:
    t, v = head.shape
    if t:
        head = _launch(head)
        _update_kernel[(t,)](head, lane_max, lane_sum, head.stride(0), float(softcap or 1.0), v,
                             HAS_CAP=softcap is not None, LANES=LANES, **_OPTS)


def finish(lane_max: torch.Tensor, lane_sum: torch.Tensor, target_head: torch.Tensor, softcap) -> torch.Tensor:
    out = torch.empty(lane_max.shape[0], dtype=torch.float32, device=lane_max.device)
    if out.numel():
        _finish_kernel[(out.numel(),)](lane_max, lane_sum, target_head.contiguous(), out, float(softcap or 1.0),
                                       HAS_CAP=softcap is not None, LANES=LANES, **_OPTS)
    return out
