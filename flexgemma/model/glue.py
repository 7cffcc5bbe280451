"""The elementwise glue of a Gemma-4 layer (norms, RoPE, gated activations, residual adds), each
a small function that torch.compile fuses into one kernel.

They take tensors only, never modules, and are compiled with dynamic shapes: one compilation
serves every layer, every batch bucket and prefill alike, so building the engine costs seconds
of compilation instead of one whole-model compile per CUDA-graph bucket. The maths is
transformers' Gemma-4 maths (float32 norms cast back to the input dtype, rotate-half RoPE).
The router's top-k (`moe.route`) lives beside the experts and is compiled here with the rest.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Optional

import torch
import torch.nn.functional as F

from flexgemma.model.compiled import compile_fn
from flexgemma.config.kernels import Kernels
from flexgemma.model.moe import route


def rms_norm(x: torch.Tensor, weight: Optional[torch.Tensor], eps: float) -> torch.Tensor:
    xf = x.float()
    out = xf * torch.pow(xf.pow(2).mean(-1, keepdim=True) + eps, -0.5)
    if weight is not None:
        out = out * weight.float()
    return out.type_as(x)


def add_norm(residual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float,
             scale: Optional[torch.Tensor] = None) -> torch.Tensor:
    """residual + norm(x), then times the layer scalar when given (the end of a layer)."""
    out = residual + rms_norm(x, weight, eps)
    return out * scale if scale is not None else out


def add_norm_norm(residual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float,
                  next_weight: torch.Tensor, scale: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """add_norm, and the result normed again for whatever reads it next, in one kernel."""
    out = add_norm(residual, x, weight, eps, scale)
    return out, rms_norm(out, next_weight, eps)


def norm_rope(x: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, eps: float) -> torch.Tensor:
    """Per-head RMSNorm then rotate-half RoPE; x [T, heads, D], cos/sin [T, D]."""
    x = rms_norm(x, weight, eps)
    cos, sin = cos[:, None, :], sin[:, None, :]
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def kv_norm_write(k: torch.Tensor, v: torch.Tensor, k_weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  eps: float, k_pool: torch.Tensor, v_pool: torch.Tensor, slots: torch.Tensor) -> None:
    """A layer's new K (norm + RoPE) and V (scale-free norm), k/v [T, kv_heads, D], written into its
    pools [1, kv_heads, S, D] at flat slots [T]: compiled, each norm and its write are one kernel
    instead of a norm kernel and an index_copy kernel."""
    k_pool.index_copy_(2, slots, norm_rope(k, k_weight, cos, sin, eps).transpose(0, 1)[None])
    v_pool.index_copy_(2, slots, rms_norm(v, None, eps).transpose(0, 1)[None])


def gelu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.gelu(gate, approximate="tanh") * up


def moe_inputs(residual: torch.Tensor, norm_weight: torch.Tensor, router_scale: torch.Tensor, root: float,
               eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The experts' input (pre_feedforward_layernorm_2) and the router's (a scale-free norm, times its
    scale and hidden_size^-0.5), from the same residual in one kernel."""
    return rms_norm(residual, norm_weight, eps), rms_norm(residual, None, eps) * router_scale * root


def add_two_norms(a: torch.Tensor, a_weight: torch.Tensor, b: torch.Tensor, b_weight: torch.Tensor,
                  eps: float) -> torch.Tensor:
    """norm(a) + norm(b): the dense MLP's and the experts' outputs, each with its own norm."""
    return rms_norm(a, a_weight, eps) + rms_norm(b, b_weight, eps)


def final_logits(x: torch.Tensor, cap: Optional[float]) -> torch.Tensor:
    """lm_head output -> float32 logits, soft-capped (cap * tanh(x / cap)) when the model caps them."""
    x = x.float()
    return x if cap is None else torch.tanh(x / cap) * cap


# the per-row tensor arguments of each row-wise glue function (model/invariant/rows.py pads them)
ROW_ARGS = {"rms_norm": (0,), "add_norm": (0, 1), "add_norm_norm": (0, 1), "norm_rope": (0, 2, 3),
            "gelu_mul": (0, 1), "final_logits": (0,), "moe_inputs": (0,), "route": (0,), "add_two_norms": (0, 2)}


def make_ops(counter=None, kernels: Kernels = Kernels()) -> SimpleNamespace:
    """The glue functions: compiled with `counter` as backend (GPU), or plain (the CPU reference);
    and the routed experts' GEMMs (`experts_kernel`: None for torch's grouped GEMM, kernels.moe)."""
    fns = dict(rms_norm=rms_norm, add_norm=add_norm, add_norm_norm=add_norm_norm, norm_rope=norm_rope,
               kv_norm_write=kv_norm_write, gelu_mul=gelu_mul, final_logits=final_logits, moe_inputs=moe_inputs,
               route=route, add_two_norms=add_two_norms)
    if counter is not None:
        fns = {k: compile_fn(f, counter) for k, f in fns.items()}
    fns["experts_kernel"] = None
    if kernels.moe == "triton":  # the routed experts and the router's top-k as Triton kernels
        from flexgemma.model import moe_kernel as mk

        fns["experts_kernel"], fns["route"] = mk.TritonExperts(kernels), mk.route
    return SimpleNamespace(**fns)
