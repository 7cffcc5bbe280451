"""One matrix product where a Gemma-4 layer has several on the same input: q/k/v of its attention
and gate/up of its MLP. At batch 64 these are skinny GEMMs whose launches cost as much as their
bytes; fused, a layer runs three fewer.

The fused weight becomes the storage: each module's weight is rebound to a view of its rows, so
checkpoints, peft adapters merged into the weights, and CUDA graphs all see one set of numbers.
Only plain bias-free nn.Linear modules are fused here; fuse before peft wraps them. 4-bit modules
of one input are grouped by `linear4bit.Linear4bitGroup` instead (through `projector`).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn as nn


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


def fused_weight(owner, name: str, modules) -> Optional[torch.Tensor]:
    """`owner`'s fused weight `name`, if every module of the group still runs as a plain Linear."""
    w = getattr(owner, name, None)
    return w if w is not None and all(runs_plain(m) for m in modules) else None


def runs_base_only(module) -> bool:
    """No adapter runs in `module`: not a peft wrapper, or one whose adapters are disabled."""
    return not hasattr(module, "base_layer") or bool(getattr(module, "disable_adapters", False))


def projector(owner, names: list[str], lora=None, linear4bit: bool = False) -> Callable[[torch.Tensor], list[torch.Tensor]]:
    """x -> [owner.<name>(x) for each name] (projections that read the same input): with
    `linear4bit`, 4-bit bases as one `linear4bit.Linear4bitGroup` (one kernel at decode); unmerged
    adapters as one `lora.LowRankGroup` over those bases (or over each base layer); else module by
    module, looked up at each call (a peft wrapper injected after the build still runs). The groups
    are decided at build."""
    modules = [getattr(owner, n) for n in names]
    packed = None
    if linear4bit:
        from flexgemma.model.linear4bit import group_or_none

        packed = group_or_none(modules)
    group = lora.group(modules, packed) if lora is not None else None
    if group is not None:
        return group
    if packed is not None and all(runs_base_only(m) for m in modules):
        return packed
    return lambda x: [getattr(owner, n)(x) for n in names]
