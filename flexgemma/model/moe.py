"""Routed experts of Gemma-4 26B-A4B: a grouped GEMM over the fused 3-D expert weights.

Rows (token, choice) are sorted by expert; one grouped matmul runs gate_up for every expert's
rows, one runs down, and the weighted results are summed back per token. Offsets are computed on
the device (no .item(), no Python loop over experts), so the path is capturable in a CUDA graph.
`experts_loop` is the plain per-expert reference the tests compare against.

With quant=bnb4 the expert weights are `quant.PackedExpertWeight`s (4-bit, expert by expert): a
step dequantises only the experts it routes to, in a static number of slots (min(E, rows)), so the
same code runs compiled and inside a CUDA graph.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F


def _grouped_mm_available(x: torch.Tensor) -> bool:
    return x.is_cuda and x.dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm")


def _segment_mm_gathered(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """_segment_mm without a host loop (a CUDA graph cannot hold one): every row takes its group's
    matrix. [N, K, M] of weights: fine for decode-sized N (float32 graphs), not for big prefills."""
    rows = torch.arange(x.shape[0], device=x.device, dtype=offsets.dtype)
    group = torch.searchsorted(offsets, rows, right=True)
    return torch.bmm(x[:, None, :], w[group])[:, 0]


def _segment_mm(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """x [N, K] rows grouped by expert, w [E, K, M], offsets [E] cumulative ends -> [N, M]."""
    if _grouped_mm_available(x):
        return torch._grouped_mm(x, w, offs=offsets)
    if x.is_cuda and torch.cuda.is_current_stream_capturing():
        return _segment_mm_gathered(x, w, offsets)
    # where torch has no grouped kernel (the CPU, float32): the same product, expert by expert
    out = x.new_empty(x.shape[0], w.shape[-1])
    start = 0
    for e, end in enumerate(offsets.tolist()):
        if end > start:
            out[start:end] = x[start:end] @ w[e]
        start = end
    return out


def _expert_mm(x: torch.Tensor, w: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """Rows grouped by expert times their experts' [E, out, in] weights."""
    return _segment_mm(x, w.transpose(1, 2), ends)


def routed_experts(counts: torch.Tensor, slots: int) -> torch.Tensor:
    """The ids of the experts with rows (ascending), then unused ones as padding: [slots] ids, a
    static shape whatever the routing. `slots` >= the number of distinct experts routed to."""
    # a stable sort of "unused" flags keeps the used experts first and in id order, which is the
    # order of the rows sorted by expert
    return torch.argsort((counts == 0).to(torch.int32), stable=True)[:slots]


def _adapted_mm(rows: torch.Tensor, w: torch.Tensor, ends: torch.Tensor, adapters, ids) -> torch.Tensor:
    """_expert_mm plus each adapter's low-rank term (lhs [E, out, r], rhs [E, r, in], scale) of the groups'
    experts (`ids`: group g's expert id; None: group g is expert g), as x A.T B.T: no [out, in] matrix."""
    y = _expert_mm(rows, w.to(rows.dtype), ends)
    for lhs, rhs, scale in adapters:
        lhs, rhs = (t if ids is None else t[ids] for t in (lhs, rhs))
        y = y + scale * _expert_mm(_expert_mm(rows, rhs.to(rows.dtype), ends), lhs.to(rows.dtype), ends)
    return y


def experts_grouped(
    x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, gate_up, down, act, kernel=None,
    adapters: tuple[list, list] = ([], []),
) -> torch.Tensor:
    """x [T, H]; top_k_* [T, K]; gate_up [E, 2I, H]; down [E, H, I] -> [T, H].

    gate_up / down are tensors (bf16, fp32) or packed 4-bit weights with `.dequantize(ids)`.
    kernel: moe_kernel.TritonExperts (kernels.moe=triton), which takes the steps it can (decode
    sized, bf16/fp16) whole, over the weights as stored; the rest (and kernel=None) run here: rows
    sorted by expert, torch's grouped GEMM (4-bit experts dequantised first). adapters: gate_up's and
    down's LoRA terms in low-rank form (`_adapted_mm`; the trainer's backward maths, differentiable)."""
    if kernel is not None and kernel.takes(x, top_k_index, act, gate_up, down):
        return kernel(x, top_k_index, top_k_weights, gate_up, down, act)
    up_adapters, down_adapters = adapters
    t, k = top_k_index.shape
    n_exp = gate_up.shape[0]
    flat = top_k_index.reshape(-1)
    order = torch.argsort(flat, stable=True)
    token = order // k
    # scatter_add, not bincount: bincount syncs with the host to size its output (no graph capture)
    counts = torch.zeros(n_exp, dtype=torch.long, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))
    rows = x[token]
    if isinstance(gate_up, torch.Tensor):
        offsets = torch.cumsum(counts, 0).to(torch.int32)
        h = _adapted_mm(rows, gate_up, offsets, up_adapters, None)
        g, u = h.chunk(2, dim=-1)
        h = _adapted_mm(act(g) * u, down, offsets, down_adapters, None)
    else:
        # 4-bit: at most t*k experts have rows; dequantise just those (one matrix at a time, so only
        # one of the two bf16 copies is alive), grouped in the same order as the rows
        if t * k >= n_exp:  # every expert may have rows: dequantise them all, no gather
            experts, group_counts = None, counts
        else:
            experts = routed_experts(counts, t * k)
            group_counts = counts[experts]
        offsets = torch.cumsum(group_counts, 0).to(torch.int32)
        # the kernel object dequantises in one pass where it can (the same bits), else the weights' own way
        dequantize = kernel.dequantize if kernel is not None else (lambda w, ids: w.dequantize(ids))
        h = _adapted_mm(rows, dequantize(gate_up, experts), offsets, up_adapters, experts)
        g, u = h.chunk(2, dim=-1)
        h = _adapted_mm(act(g) * u, dequantize(down, experts), offsets, down_adapters, experts)
    return sum_per_token(h, order, top_k_weights, x)


def sum_per_token(h: torch.Tensor, order: torch.Tensor, top_k_weights: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """h [T*K, H]: the rows of `order` (entries sorted by expert) -> [T, H], each token's k rows
    weighted and added in expert order: transformers' per-expert index_add arithmetic without its
    atomics on the GPU (index_add_ there sums in whatever order threads land)."""
    t, k = top_k_weights.shape
    h = (h * top_k_weights.reshape(-1)[order, None]).to(x.dtype)  # float32 router weights, as transformers
    position = torch.empty_like(order)
    position[order] = torch.arange(order.numel(), device=order.device)
    per_token = h[position.view(t, k).sort(dim=1).values]  # [T, K, H]; sorted positions follow expert ids
    out = torch.zeros_like(x)
    for j in range(k):
        out += per_token[:, j]
    return out


def route(scores: torch.Tensor, per_expert_scale: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Gemma-4's router after its projection: float32 softmax, top-k, renormalised, per-expert scale."""
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32)
    weights, index = torch.topk(probs, k, dim=-1)
    weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights * per_expert_scale[index], index


def replay_route(scores: torch.Tensor, per_expert_scale: torch.Tensor, weights: torch.Tensor, index: torch.Tensor,
                 replay: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Routing replay (R3): rows whose `replay` [T, k] holds expert ids (>= 0) take those experts, with
    `route`'s weights for them (the softmax's values there, renormalised, scaled: the same numbers
    route gives when it picks them itself); other rows keep (weights, index)."""
    replayed = replay[:, :1] >= 0
    ids = torch.where(replayed, replay.long(), index)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).gather(-1, ids)
    mine = probs / probs.sum(dim=-1, keepdim=True) * per_expert_scale[ids]
    return torch.where(replayed, mine, weights), ids


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


def moe_block(layer, residual: torch.Tensor, dense_out: torch.Tensor, ops, eps: float, run_module=None,
              routing: Optional[list] = None, replay: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Gemma-4's MLP + experts: both normed, summed (before the post-feedforward norm). The router's
    and the norms' elementwise maths are ops' fused glue; its projection is the model's module, run by
    `run_module(module, x)` when given (engine.batch_invariant)."""
    router = layer.router
    x, router_in = ops.moe_inputs(residual, layer.pre_feedforward_layernorm_2.weight, router.scale,
                                  router.scalar_root_size, eps)
    scores = router.proj(router_in) if run_module is None else run_module(router.proj, router_in)
    weights, index = ops.route(scores, router.per_expert_scale, router.config.top_k_experts)
    if replay is not None:  # the trainer replaying the rollout's experts
        weights, index = replay_route(scores, router.per_expert_scale, weights, index, replay)
    if routing is not None:  # the forward keeps each layer's routed experts (return_routed_experts)
        routing.append(index)
    experts = layer.experts
    if hasattr(experts, "get_base_layer"):  # peft's expert LoRA wraps the module; the merge is in its Parameters
        experts = experts.get_base_layer()
    routed = experts_grouped(x, index, weights, experts.gate_up_proj, experts.down_proj, experts.act_fn,
                             ops.experts_kernel)
    return ops.add_two_norms(dense_out, layer.post_feedforward_layernorm_1.weight, routed,
                             layer.post_feedforward_layernorm_2.weight, eps)
