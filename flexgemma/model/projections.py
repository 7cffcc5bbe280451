"""How the projections of a Gemma-4 layer run: the one place that decides it (`projection`).

Projections that read the same input (q/k/v of the attention, gate/up of the MLP, or one alone)
run as one callable x -> [each projection's output], chosen once at build, in this order:

1. fused GEMM: the plain bf16/fp32 modules' weights concatenated into one matrix
   (`fuse_projections`, before peft wraps them), one F.linear a group. At batch 64 these are
   skinny GEMMs whose launches cost as much as their bytes; fused, a layer runs three fewer.
   The fused weight is the storage: each module's weight is rebound to a view of its rows, so
   checkpoints, adapters merged into the weights and CUDA graphs all see one set of numbers.
2. an unmerged LoRA group (`lora.LowRankGroup`) over the base layers or over their 4-bit group.
3. a 4-bit group (`linear4bit.Linear4bitGroup`, kernels.linear4bit=triton).
4. module by module, each looked up at its call (a peft wrapper injected after the build runs).

The MoE router's projection is not one of these: `moe.moe_block` calls it as its module (as a
4-bit group it would run another kernel than the one measured).
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from flexgemma.config.kernels import Kernels

Projection = Callable[[torch.Tensor], Sequence[torch.Tensor]]


def _plain(mods) -> bool:
    return all(type(m) is nn.Linear and m.bias is None for m in mods) and \
        len({(m.weight.dtype, m.weight.device, m.weight.shape[1]) for m in mods}) == 1


@torch.no_grad()
def _fuse(mods) -> torch.Tensor:
    fused = torch.cat([m.weight for m in mods], dim=0)
    start = 0
    for m in mods:
        rows = m.weight.shape[0]
        m.weight = nn.Parameter(fused[start: start + rows], requires_grad=m.weight.requires_grad)
        start += rows
    return fused


def fuse_projections(model) -> int:
    """Fuses q/k/v (where a layer has k and v or k alone) and gate/up; returns how many groups."""
    n = 0
    for layer in model.model.layers:
        attn = layer.self_attn
        qkv = [m for m in (attn.q_proj, getattr(attn, "k_proj", None), getattr(attn, "v_proj", None)) if m is not None]
        if len(qkv) > 1 and _plain(qkv):
            attn.fused_qkv = _fuse(qkv)
            n += 1
        mlp = layer.mlp
        if _plain([mlp.gate_proj, mlp.up_proj]):
            mlp.fused_gate_up = _fuse([mlp.gate_proj, mlp.up_proj])
            n += 1
    return n


def runs_plain(module) -> bool:
    """The module computes x @ weight.T and nothing else: a plain Linear, or a peft LoRA wrapper
    whose adapter is merged into that weight and disabled."""
    if type(module) is nn.Linear:
        return True
    base = getattr(module, "base_layer", None)
    return base is not None and type(base) is nn.Linear and bool(getattr(module, "disable_adapters", False))


def runs_base_only(module) -> bool:
    """No adapter runs in `module`: not a peft wrapper, or one whose adapters are disabled."""
    return not hasattr(module, "base_layer") or bool(getattr(module, "disable_adapters", False))


class FusedLinear:
    """Projections of one input as one GEMM over their fused weight [sum of outputs, in]; `linear` the
    product (F.linear, or the batch-invariant one)."""

    def __init__(self, weight: torch.Tensor, splits: list[int], linear: Callable = F.linear):
        self.weight, self.splits, self.linear = weight, splits, linear

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.linear(x, self.weight).split(self.splits, dim=-1)


def dense_weight(module) -> torch.Tensor:
    """The [out, in] matrix `module` multiplies by: a plain Linear's weight, a merged-and-disabled
    peft wrapper's base weight, or a bitsandbytes Linear4bit's weights dequantised (exactly)."""
    if runs_plain(module):
        return getattr(module, "base_layer", module).weight
    base = module.get_base_layer() if hasattr(module, "get_base_layer") and runs_base_only(module) else module
    quant_state = getattr(getattr(base, "weight", None), "quant_state", None)
    if quant_state is not None and getattr(base, "bias", None) is None:
        import bitsandbytes.functional as bf

        return bf.dequantize_4bit(base.weight.data, quant_state).to(quant_state.dtype)
    raise TypeError(f"engine.batch_invariant: cannot run {type(module).__name__} as a plain matrix product "
                    "(a bias, an adapter variant, or a module type the batch-invariant path does not know)")


class DenseGroup:
    """Projections of one input through `linear` over each module's dense weight (4-bit weights
    dequantised per call, as one matrix when they form a `linear4bit.Linear4bitGroup`): the
    batch-invariant path for what is not a plain fused weight."""

    def __init__(self, modules: list, linear: Callable, packed=None):
        self.modules, self.linear, self.packed = modules, linear, packed

    def __call__(self, x: torch.Tensor) -> list[torch.Tensor]:
        if self.packed is not None:
            return list(self.linear(x, self.packed.dequantize()).split(self.packed.splits, dim=-1))
        return [self.linear(x, dense_weight(m)) for m in self.modules]


def _fused(owner, fused: Optional[str], modules) -> Optional[FusedLinear]:
    """`owner`'s fused weight `fused` as a FusedLinear, if it holds exactly `modules` (in order) and
    every one still runs as a plain Linear."""
    w = getattr(owner, fused, None) if fused else None
    if w is None or not all(runs_plain(m) for m in modules):
        return None
    splits = [m.weight.shape[0] for m in modules]
    return FusedLinear(w, splits) if sum(splits) == w.shape[0] else None


def projection(owner, names: list[str], fused: Optional[str] = None, lora=None,
               kernels: Kernels = Kernels(), invariant: Optional[Callable] = None) -> Projection:
    """x -> [owner.<name>(x) for each name], for projections that read the same input, run the
    fastest way that computes the same thing (see the module's docstring). `fused`: the attribute
    of `owner` that `fuse_projections` stored their fused weight under; `lora`: the engine's
    `lora.LoraAdapters` (None without LoRA); `kernels`: with linear4bit=triton 4-bit bases may run
    as one group; `invariant`: the batch-invariant matrix product, through which every product then runs."""
    modules = [getattr(owner, n) for n in names]
    if invariant is not None:
        return _invariant_projection(owner, modules, fused, lora, kernels, invariant)
    fused_linear = _fused(owner, fused, modules)
    if fused_linear is not None:
        return fused_linear
    packed = None
    if kernels.linear4bit == "triton":
        from flexgemma.model.linear4bit import group_or_none  # imports Triton, which CPU installs may lack

        packed = group_or_none(modules, kernels)
    group = lora.group(modules, packed) if lora is not None else None
    if group is not None:
        return group
    if packed is not None and all(runs_base_only(m) for m in modules):
        return packed
    return lambda x: [getattr(owner, n)(x) for n in names]


def _invariant_projection(owner, modules: list, fused: Optional[str], lora, kernels: Kernels,
                          linear: Callable) -> Projection:
    """`projection` under engine.batch_invariant: the fused weight, or each base's dense weight, through
    `linear`; an unmerged adapter beside them through `linear` too."""
    fused_linear = _fused(owner, fused, modules)
    if fused_linear is not None:
        return FusedLinear(fused_linear.weight, fused_linear.splits, linear)
    packed = None
    if kernels.linear4bit == "triton":
        from flexgemma.model.linear4bit import group_or_none

        packed = group_or_none(modules, kernels)
    bases = DenseGroup([m.get_base_layer() if hasattr(m, "get_base_layer") else m for m in modules], linear, packed)
    group = lora.group(modules, None, linear=linear, bases=bases) if lora is not None else None
    if group is not None:
        return group
    if not all(runs_base_only(m) for m in modules):
        raise TypeError("engine.batch_invariant: an adapter these projections run is not one the engine's LoRA "
                        "group can run (a DoRA or bias variant, or a peft wrapper injected after the build)")
    return bases


def _base_of(f):
    """What runs a projection's base product: a LoRA group's base (or its DenseGroup's packed 4-bit
    group), a DenseGroup's packed group, or the projection itself."""
    if type(f).__name__ == "Linear4bitGroup":  # by name: importing linear4bit imports Triton
        return f
    for attr in ("base", "bases", "packed"):
        inner = getattr(f, attr, None)
        if inner is not None and not isinstance(inner, torch.Tensor):
            return _base_of(inner)
    return f


def linear4bit_groups(projections: list[Projection]) -> list:
    """The `linear4bit.Linear4bitGroup`s among `projections` (alone or under a LoRA group)."""
    bases = [_base_of(f) for f in projections]
    # by name: importing linear4bit imports Triton, which CPU-only installs may lack
    return [b for b in bases if type(b).__name__ == "Linear4bitGroup"]
