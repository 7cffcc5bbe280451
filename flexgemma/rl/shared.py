"""One model, two views: the engine's (merged adapters) and the trainer's (pristine base + live LoRA).

The trainer trains the engine's own peft model, so there is one copy of the base weights. The
engine keeps, for each merged target, a pristine copy and the merged tensor its forward and CUDA
graphs read (flexgemma/model/lora.py). The two views differ only in which tensor the wrapped base
module holds and whether peft runs the adapter:

- trainer view: each merged target's base module holds a Parameter over the *pristine* tensor and
  its peft adapter runs (base(x) + s B A x, with gradients into A and B). The merged tensors are
  left alone (the engine's graphs keep their addresses).
- engine view: the base modules hold the merged tensors again and the merged adapters are disabled;
  `engine.update_lora(model)` then rebuilds the merged tensors from pristine + the trained factors.

Unmerged adapters (4-bit base Linear modules) run through peft in both views; their base weights
are the packed 4-bit tensors, shared as they are. No view switch copies a weight.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn

from flexgemma.config.schema import ConfigError


class SharedModel:
    """The engine's peft model, switchable between the trainer's view and the engine's."""

    def __init__(self, engine, upcast_lora: bool = True, engine_forward: bool = False):
        lora = engine.lora
        if lora is None:
            raise ConfigError("task=grpo trains a LoRA adapter: add lora=r16 (or r32, r64, or lora.path=DIR)")
        if lora.pristine_on_cpu and any(t.weight.is_cuda for t in lora.targets):
            raise ConfigError("task=grpo trains on the pristine base weights, which lora.pristine_on_cpu=true keeps "
                              "on the CPU: use lora.pristine_on_cpu=false")
        self.engine, self.lora = engine, lora
        self.peft_model = lora.peft_model
        self._merged_params = {id(t): self._owner(t) for t in lora.targets}
        self._trainer_params = {id(t): nn.Parameter(t.pristine, requires_grad=False) for t in lora.targets}
        for p in lora.slots.values():
            if upcast_lora and p.dtype in (torch.bfloat16, torch.float16):
                # optimizer updates of 1e-5 vanish in bf16; the engine casts factors to its dtype when merging
                p.data = p.data.float()
            p.requires_grad_(True)
        self.view = "engine"
        # task.trainer_forward=engine: the trainer runs the engine's forward over the merged weights, so the
        # model stays in the engine's view (a backward recomputing a layer reads what the forward read)
        self.engine_forward = engine_forward
        if engine_forward:
            self.engine_view()
            self._trainable()
        else:
            self.trainer_view()

    def _trainable(self) -> None:
        for p in self.lora.slots.values():  # peft turns gradients off when it disables an adapter
            p.requires_grad_(True)

    @staticmethod
    def _owner(target) -> tuple[nn.Module, str, nn.Parameter]:
        layer = target.layer
        name = getattr(layer, "parameter_name", None) or "weight"  # ParamWrapper (experts) or lora.Linear
        module = layer.get_base_layer()
        param = getattr(module, name)
        if param is not target.weight:
            raise RuntimeError(f"{target.name}: the base module does not hold the engine's merged tensor")
        return module, name, param

    def owner(self, target) -> tuple[nn.Module, str, nn.Parameter]:
        """(module, attribute name, the engine's merged Parameter) of a merge target."""
        return self._merged_params[id(target)]

    def trainer_view(self) -> None:
        """Base modules read the pristine weights; every adapter runs in peft's forward."""
        for t in self.lora.targets:
            module, name, _ = self._merged_params[id(t)]
            setattr(module, name, self._trainer_params[id(t)])
            t.layer.enable_adapters(True)
        for p in self.lora.slots.values():  # peft turns gradients off when it disables an adapter
            p.requires_grad_(True)
        self.view = "trainer"

    def engine_view(self) -> None:
        """Base modules hold the merged tensors again; merged adapters do not run a second time."""
        for t in self.lora.targets:
            module, name, param = self._merged_params[id(t)]
            setattr(module, name, param)
            t.layer.enable_adapters(False)
        self.view = "engine"

    @contextmanager
    def engine_side(self):
        """The engine's view for the duration (a rollout), back to the trainer's after (with
        engine_forward the model never leaves the engine's view)."""
        if self.engine_forward:
            yield
            return
        self.engine_view()
        try:
            yield
        finally:
            self.trainer_view()

    def merged_for_training(self) -> None:
        """task.trainer_forward=engine, before a trainer forward: the merged weights rebuilt when the factors
        changed since the last rebuild (an optimizer step), so the engine's forward reads W + s B A of the
        factors it differentiates."""
        if not self.engine_forward:
            raise RuntimeError("SharedModel(engine_forward=False) runs the trainer through transformers")
        self._trainable()
        seen = tuple(p._version for p in self.lora.slots.values())
        if seen != getattr(self, "_merged_at", None):
            self.lora.refresh()
            self._merged_at = tuple(p._version for p in self.lora.slots.values())

    def base_bytes(self) -> dict[str, int]:
        """Bytes of the weights the trainer and engine share, of the engine's merged copies and of the
        adapter factors. The census runs in the trainer's view, whose module tree holds the pristine
        weights, not the merged ones (4-bit weights count with their quant states)."""
        from flexgemma.model.quant import storage_census

        nbytes = lambda ts: sum(t.numel() * t.element_size() for t in ts)  # noqa: E731
        view = self.view
        self.trainer_view()
        adapter = nbytes(self.lora.slots.values())
        total = storage_census(self.lora.model)["quant/weight_bytes"]
        if view == "engine":
            self.engine_view()
        return {"shared_base_bytes": total - adapter, "merged_copy_bytes": nbytes(t.weight for t in self.lora.targets),
                "adapter_bytes": adapter}
