"""The Triton kernel of `logprobs.token_logprobs` (imported only on a GPU)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

_BLOCK = 4096


@triton.jit
def _capped(x, cap, HAS_CAP: tl.constexpr):
    if HAS_CAP:
        x = libdevice.tanh(x / cap) * cap
    return x


@triton.jit
def _token_logprob_kernel(head_ptr, token_ptr, out_ptr, stride, cap, V: tl.constexpr, HAS_CAP: tl.constexpr,
                          BLOCK: tl.constexpr):
    """Program (row): a running (max, sum of exp) per lane over the vocabulary in BLOCK steps, the lanes
    combined once at the end; the token's capped logit through the same arithmetic."""
    row = tl.program_id(0)
    base = head_ptr + row * stride
    lane_max = tl.full((BLOCK,), float("-inf"), tl.float32)
    lane_sum = tl.zeros((BLOCK,), tl.float32)
    for v0 in range(0, V, BLOCK):
        offs = v0 + tl.arange(0, BLOCK)
        z = _capped(tl.load(base + offs, mask=offs < V, other=float("-inf")).to(tl.float32), cap, HAS_CAP)
        new_max = tl.maximum(lane_max, z)
        safe = tl.where(new_max == float("-inf"), 0.0, new_max)
        lane_sum = lane_sum * tl.exp(lane_max - safe) + tl.exp(z - safe)
        lane_max = new_max
    top = tl.max(lane_max, 0)
    lse = top + tl.log(tl.sum(lane_sum * tl.exp(lane_max - top), 0))
    token = tl.load(token_ptr + row)
    zt = _capped(tl.load(base + token).to(tl.float32), cap, HAS_CAP)
    tl.store(out_ptr + row, zt - lse)


def token_logprobs(head: torch.Tensor, tokens: torch.Tensor, softcap) -> torch.Tensor:
    t, v = head.shape
    out = torch.empty(t, dtype=torch.float32, device=head.device)
    if t:
        if head.stride(-1) != 1:
            head = head.contiguous()
        _token_logprob_kernel[(t,)](head, tokens, out, head.stride(0), float(softcap or 1.0), V=v,
                                    HAS_CAP=softcap is not None, BLOCK=min(_BLOCK, triton.next_power_of_2(v)),
                                    num_warps=8)
    return out
