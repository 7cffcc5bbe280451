"""Routed experts whose every (token, expert) row gets the same bits in any step.

kernels.invariant_experts picks how. `triton` (a GPU's default, bf16/fp16 models): the decode kernels of
model/moe_kernel.py for every step (moe_kernel.invariant_experts; tiles that give a row the same bits at
any size), 4-bit experts decoded inside them, so a decode step costs what it costs in the default mode. `grouped` (the CPU, float32 models,
or asked for): every row computed as `matmul.linear` computes a row, the rows grouped by expert (any
grouping gives a row the same bits), each group against its expert's matrix (4-bit experts dequantised
into slots first), a token's k results added in expert order (moe.sum_per_token). The two give other bits."""

from __future__ import annotations

import torch

from flexgemma.config.kernels import Kernels
from flexgemma.model.invariant.matmul import K_CHUNK, _tiles, linear
from flexgemma.model.moe import routed_experts, sum_per_token


def grouped_linear(rows: torch.Tensor, w: torch.Tensor, counts: torch.Tensor, k_chunk: int = K_CHUNK,
                   flatten: bool = False) -> torch.Tensor:
    """rows [N, K] grouped by expert (counts [E], in expert order), w [E, out, K] -> [N, out]; flatten: as
    `linear`'s."""
    if rows.is_cuda:
        from flexgemma.model.invariant import triton_matmul

        # few rows an expert (decode): 16-row tiles; many (prefill): 64 (speed only, not a row's bits)
        per_expert = rows.shape[0] / max(1, w.shape[0])
        return triton_matmul.grouped(rows.contiguous(), w, counts, k_chunk, _tiles(16 if per_expert <= 16 else 64,
                                                                                 w.shape[1], rows.dtype), flatten)
    out = rows.new_empty(rows.shape[0], w.shape[1])
    start = 0
    for e, n in enumerate(counts.tolist()):
        if n:
            out[start: start + n] = linear(rows[start: start + n], w[e])
        start += n
    return out


class InvariantExperts:
    """ops.experts_kernel under engine.batch_invariant: takes every step, bf16/fp32 or 4-bit experts."""

    def __init__(self, kernels=None):
        self.k_chunk = kernels.invariant_k_chunk if kernels is not None else K_CHUNK
        self.flatten = kernels.invariant_flatten if kernels is not None else False
        self.moe_dequant = kernels.moe_dequant if kernels is not None else "bnb"
        self.how = kernels.invariant_experts if kernels is not None else "grouped"
        self.kernels = kernels if kernels is not None else Kernels()  # the triton path's tiles and 4-bit choices

    def takes(self, *args) -> bool:
        return True

    def _dequantize(self, w, experts: torch.Tensor) -> torch.Tensor:
        """[S, out, in] weights of 4-bit experts `experts` as kernels.moe_dequant names (the slot kernel
        on a GPU only)."""
        if not experts.is_cuda:
            return w.dequantize(experts)
        from flexgemma.model.moe_kernel import dequantize_experts

        return dequantize_experts(w, experts, self.moe_dequant)

    def __call__(self, x, top_k_index, top_k_weights, gate_up, down, act) -> torch.Tensor:
        if self.how == "triton":
            from flexgemma.model import moe_kernel

            # an engine's rows, activation and weights never change, so every step takes the same path
            if moe_kernel.kernels_compute(x, act, gate_up, down):
                return moe_kernel.invariant_experts(x, top_k_index, top_k_weights, gate_up, down, self.kernels)
        t, k = top_k_index.shape
        n_exp = gate_up.shape[0]
        flat = top_k_index.reshape(-1)
        groups = n_exp
        if not isinstance(gate_up, torch.Tensor):  # 4-bit: only the routed experts, each in a slot
            experts = routed_experts(torch.zeros(n_exp, dtype=torch.long, device=flat.device).scatter_add_(
                0, flat, torch.ones_like(flat)), min(n_exp, t * k))
            slot = torch.empty(n_exp, dtype=torch.long, device=flat.device)
            slot[experts] = torch.arange(experts.numel(), device=flat.device)
            flat, groups = slot[flat], experts.numel()
            gate_up, down = self._dequantize(gate_up, experts), self._dequantize(down, experts)
        order = torch.argsort(flat, stable=True)
        counts = torch.zeros(groups, dtype=torch.long, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))
        h = grouped_linear(x[order // k], gate_up, counts, self.k_chunk, self.flatten)
        g, u = h.chunk(2, dim=-1)
        h = grouped_linear(act(g) * u, down, counts, self.k_chunk, self.flatten)
        return sum_per_token(h, order, top_k_weights, x)
