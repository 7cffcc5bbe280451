"""Routed experts of Gemma-4 26B-A4B: a grouped GEMM over the fused 3-D expert weights.

Rows (token, choice) are sorted by expert; one grouped matmul runs gate_up for every expert's
rows, one runs down, and the weighted results are summed back per token. Offsets are computed on
the device (no .item(), no Python loop over experts), so the path is capturable in a CUDA graph.
`experts_loop` is the plain per-expert reference the tests compare against.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _grouped_mm_available(x: torch.Tensor) -> bool:
    return x.is_cuda and x.dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm")


def _segment_mm(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """x [N, K] rows grouped by expert, w [E, K, M], offsets [E] cumulative ends -> [N, M]."""
    if _grouped_mm_available(x):
        return torch._grouped_mm(x, w, offs=offsets)
    # where torch has no grouped kernel (the CPU, float32): the same product, expert by expert
    out = x.new_empty(x.shape[0], w.shape[-1])
    start = 0
    for e, end in enumerate(offsets.tolist()):
        if end > start:
            out[start:end] = x[start:end] @ w[e]
        start = end
    return out


def experts_grouped(
    x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, gate_up: torch.Tensor,
    down: torch.Tensor, act,
) -> torch.Tensor:
    """x [T, H]; top_k_* [T, K]; gate_up [E, 2I, H]; down [E, H, I] -> [T, H]."""
    t, k = top_k_index.shape
    n_exp = gate_up.shape[0]
    flat = top_k_index.reshape(-1)
    order = torch.argsort(flat, stable=True)
    token = order // k
    counts = torch.bincount(flat, minlength=n_exp)
    offsets = torch.cumsum(counts, 0).to(torch.int32)
    rows = x[token]
    h = _segment_mm(rows, gate_up.transpose(1, 2), offsets)
    g, u = h.chunk(2, dim=-1)
    h = _segment_mm(act(g) * u, down.transpose(1, 2), offsets)
    h = h * top_k_weights.reshape(-1)[order, None]  # float32 router weights, as transformers multiplies
    return torch.zeros_like(x).index_add_(0, token, h.to(x.dtype))


def experts_loop(x, top_k_index, top_k_weights, gate_up, down, act) -> torch.Tensor:
    """Reference: each expert on the rows routed to it."""
    out = torch.zeros_like(x)
    for e in range(gate_up.shape[0]):
        tok, slot = torch.where(top_k_index == e)
        if tok.numel() == 0:
            continue
        g, u = F.linear(x[tok], gate_up[e]).chunk(2, dim=-1)
        y = F.linear(act(g) * u, down[e]) * top_k_weights[tok, slot, None]
        out.index_add_(0, tok, y.to(out.dtype))
    return out


def moe_block(layer, residual: torch.Tensor, dense_out: torch.Tensor) -> torch.Tensor:
    """Gemma-4's MLP + experts: both normed, summed (before the post-feedforward norm)."""
    _, weights, index = layer.router(residual)
    experts = layer.experts
    if hasattr(experts, "get_base_layer"):  # peft's expert LoRA wraps the module; the merge is in its Parameters
        experts = experts.get_base_layer()
    routed = experts_grouped(
        layer.pre_feedforward_layernorm_2(residual), index, weights,
        experts.gate_up_proj, experts.down_proj, experts.act_fn,
    )
    return layer.post_feedforward_layernorm_1(dense_out) + layer.post_feedforward_layernorm_2(routed)
