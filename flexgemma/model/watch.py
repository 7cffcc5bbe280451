"""Every parameter the engine's forward reads, and what happens when the caller changes one.

The forward does not always read a parameter where its module holds it: q/k/v and gate/up run
from one fused tensor per group (projections.fuse_projections), 4-bit groups from one
concatenation (linear4bit), merged LoRA targets hold base + adapter (lora), the unmerged LoRA
groups run copies of the factors, and captured CUDA graphs read fixed addresses. `WeightWatch`
remembers, for each parameter of each module, the Parameter object, the storage the forward runs
it from, its in-place change counter and SAMPLES of its values; `check()` (before requests are
admitted) compares them:

- changed in place (its counter moved, or a sampled value changed: `p.data.copy_(w)` moves no
  counter, and inference-mode tensors keep none): the forward already reads the new values. A
  LoRA factor changed in place: the adapters are rebuilt (`LoraAdapters.refresh`), as
  update_lora would.
- replaced (`module.weight = nn.Parameter(w)`, `p.data = w`, `load_state_dict(assign=True)`): the
  new values are copied INTO the storage the forward runs from (fused rows, a merged target, the
  graphs' addresses) and the Parameter is pointed at that storage (`p.data`), so later in-place
  changes of it are seen too.
- refused (WeightError naming the parameter and what to do; nothing is changed): a replacement
  of another shape, dtype or device, of a 4-bit weight, or of a LoRA factor's Parameter object.

A change through `.data` that alters none of a tensor's sampled values (a few rows of it) is not
seen: call engine.weights_changed() after one. A module replaced as a whole is not seen either.
The trainer's view of a shared model (rl/shared.py: a merged target's module holding a Parameter
over the target's pristine copy) is a known alias, not a change.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn

SAMPLES = 64  # values sampled per tensor: evenly spaced over its elements

_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}  # compare bits: NaN equals itself


class WeightError(RuntimeError):
    """A change to the model's weights the engine cannot take; the message names the parameter."""


def _version(t: torch.Tensor) -> Optional[int]:
    try:
        return t._version
    except RuntimeError:  # an inference-mode tensor keeps no counter: its samples stand in
        return None


def _sample(t: torch.Tensor) -> Optional[torch.Tensor]:
    """A view of SAMPLES evenly spaced elements of t (None for a non-contiguous tensor)."""
    if not t.is_contiguous() or t.numel() == 0:
        return None
    flat = t.view(-1)
    return flat[:: max(1, flat.numel() // SAMPLES)][:SAMPLES]


@dataclass
class Watched:
    """One parameter of one module."""

    name: str  # qualified: model.layers.0.self_attn.q_proj.weight
    module: nn.Module
    attr: str
    param: nn.Parameter  # the object the module holds
    run: torch.Tensor  # the storage the forward reads it from (a factor: the Parameter's own storage)
    kind: str  # "plain", "4bit", "factor" (a LoRA factor) or "merged" (base + a merged LoRA adapter)
    alias_ptr: Optional[int] = None  # "merged": the pristine copy's address (the trainer's view reads it)
    ptr: int = 0
    version: Optional[int] = None
    view: Optional[torch.Tensor] = None  # _sample(run)

    def record(self) -> None:
        """Takes the parameter's current state as the one seen."""
        if self.kind == "factor":
            self.run = self.param.detach()
        self.ptr, self.version = self.param.data_ptr(), _version(self.param)
        self.view = _sample(self.run)


def _kind(param, factors: set, merged: dict) -> str:
    if id(param) in factors:
        return "factor"
    if id(param) in merged:
        return "merged"
    return "4bit" if hasattr(param, "quant_state") else "plain"


class WeightWatch:
    """See the module docstring. `lora`: the engine's model.lora.LoraAdapters, or None."""

    def __init__(self, model, lora=None):
        self.lora = lora
        factors = {id(p) for p in lora.slots.values()} if lora is not None else set()
        merged = {id(t.weight): t for t in lora.targets} if lora is not None else {}
        self.entries: list[Watched] = []
        for mname, module in model.named_modules():
            for attr, p in module._parameters.items():
                if p is None:
                    continue
                kind = _kind(p, factors, merged)
                alias = merged[id(p)].pristine.data_ptr() if kind == "merged" else None
                self.entries.append(Watched(f"{mname}.{attr}" if mname else attr, module, attr, p, p.detach(), kind,
                                            alias))
        self.rebaseline()

    def rebaseline(self) -> None:
        """Takes every parameter's current state as seen (after the engine changed weights itself)."""
        for e in self.entries:
            e.record()
        self._groups: dict[torch.dtype, list[Watched]] = {}
        self._offset: dict[int, int] = {}  # id(entry) -> where its samples start in its group's
        filled: dict[torch.dtype, int] = {}
        for e in self.entries:
            if e.view is not None:
                self._offset[id(e)] = filled.get(e.view.dtype, 0)
                filled[e.view.dtype] = self._offset[id(e)] + e.view.numel()
                self._groups.setdefault(e.view.dtype, []).append(e)
        self._reference = {dt: self._values(es) for dt, es in self._groups.items()}

    @staticmethod
    def _values(entries: list[Watched]) -> torch.Tensor:
        cat = torch.cat([e.view for e in entries])
        return cat.view(_BITS[cat.element_size()]) if cat.dtype.is_floating_point else cat

    # -- the check ---------------------------------------------------------------------------------
    def check(self, refresh_factors: bool = True) -> bool:
        """Takes (or refuses) every change since the last look; True when the weights changed.
        refresh_factors: rebuild the adapters after a factor changed (False: the caller will)."""
        replaced, changed = [], []
        for e in self.entries:
            cur = e.module._parameters.get(e.attr)
            if cur is not e.param or cur.data_ptr() != e.ptr:
                if not (e.alias_ptr is not None and cur is not None and cur.data_ptr() == e.alias_ptr):
                    replaced.append((e, cur))
            elif e.version is not None and _version(cur) != e.version:
                changed.append(e)
        changed += self._sampled_changes()
        if not replaced and not changed:
            return False
        for e, cur in replaced:
            self._refuse(e, cur)  # all of them before any is taken: a refusal changes nothing
        with torch.no_grad():
            for e, cur in replaced:
                self._take(e, cur)
        factors = any(e.kind == "factor" for e in [e for e, _ in replaced] + changed)
        if refresh_factors and factors and self.lora is not None:
            self.lora.refresh()
        self.rebaseline()
        return True

    def _sampled_changes(self) -> list[Watched]:
        out = []
        for dt, es in self._groups.items():
            if not torch.equal(self._values(es), self._reference[dt]):
                out += [e for e in es if not torch.equal(self._values([e]), self._values_of(e))]
        return out

    def _values_of(self, e: Watched) -> torch.Tensor:
        """e's reference samples (its slice of its group's)."""
        start = self._offset[id(e)]
        return self._reference[e.view.dtype][start: start + e.view.numel()]

    def _refuse(self, e: Watched, cur: Any) -> None:
        what = f"{e.name} was replaced (a new Parameter, `.data = ...` or load_state_dict(assign=True))"
        if cur is None or not isinstance(cur, torch.Tensor):
            raise WeightError(f"{e.name} was removed from its module: put a Parameter of shape "
                              f"{tuple(e.run.shape)} back (nothing was run)")
        if e.kind == "4bit":
            raise WeightError(f"{what}, but it is a 4-bit weight: the engine runs 4-bit weights from packed copies "
                              "it made at build and cannot take a new quantised tensor. Build a new engine over the "
                              "new weights (build_engine / Engine.from_model); nothing was run")
        if e.kind == "factor" and cur is not e.param:
            raise WeightError(f"{what}, but it is a LoRA factor: change adapters with engine.update_lora(state_dict) "
                              "(in place), or put the original Parameter back; nothing was run")
        if e.kind == "factor":
            return  # `.data = w` of a factor: the adapters read the Parameter object
        have = (tuple(cur.shape), cur.dtype, cur.device)
        want = (tuple(e.run.shape), e.run.dtype, e.run.device)
        if have != want:
            raise WeightError(f"{what} by a {have[0]} {have[1]} tensor on {have[2]}, but the engine runs it as "
                              f"{want[0]} {want[1]} on {want[2]}{self._where(e)}: give it a tensor of that shape, "
                              "dtype and device, or change it in place (`with torch.no_grad(): p.copy_(w)`); "
                              "nothing was run")

    @staticmethod
    def _where(e: Watched) -> str:
        if e.kind == "merged":
            return " (holding base + the merged LoRA adapter)"
        shared = e.run.untyped_storage().nbytes() > e.run.numel() * e.run.element_size()
        return " (rows of a fused projection weight)" if shared else ""

    @staticmethod
    def _take(e: Watched, cur: torch.Tensor) -> None:
        """Copies the replacing values into the storage the forward reads and points the Parameter
        there (a factor's Parameter keeps its own storage: the adapters read it)."""
        if e.kind != "factor":
            if cur.data_ptr() != e.run.data_ptr():
                e.run.copy_(cur.detach())
            cur.data = e.run
        e.param = cur
