"""LoRA adapters for RL loops: real peft adapters, merged into the base weights by refresh.

In GRPO the trainer changes the adapter every step and the engine must then generate with the new
weights at full speed. flexgemma keeps a pristine copy of every targeted base weight and rebuilds
the merged weight from it in one fused op, written into the SAME tensor the forward (and every
captured CUDA graph) reads:

    W  <-  addmm(W_pristine, B, A, alpha=scale)          (Linear weights, [out, in])
    W  <-  baddbmm(W_pristine, B_e, A_e, alpha=scale)    (3-D expert weights, one op per tensor)

Merging or unmerging in place (W += dW; W -= dW) is never done: it drifts by ~1 ulp per cycle in
bf16. A rebuild from the pristine copy is a pure function of (pristine, adapter), so restoring an
adapter restores the merged weights bit for bit, forever.

Modes:
- merged (bf16/fp32 weights): peft's adapter layers are disabled, so the wrapped modules run only
  their base layer, whose weight holds the merge. Two copies of the targeted weights exist
  (pristine + merged), or one on the GPU with `pristine_on_cpu` (pinned CPU memory; a refresh
  then copies over PCIe first).
- unmerged (4-bit base Linear modules): the adapter runs beside the base layer. The engine's
  forward runs projections that share an input as a `LowRankGroup` (one GEMM for all their A
  factors, one addmm per member), over copies of the factors that refresh rebuilds; anything
  else goes through peft's own wrapped modules. An update copies the new factors into the adapter
  tensors in place. Expert Parameters are never quantised and stay merged in both modes.

Several adapters (`lora.adapter_names`) are peft adapters of those names, all active at once: the
forward adds every adapter's delta, so the merge is W + sum_i scale_i B_i A_i (their factors are
concatenated along the rank, so it is still one op per weight).
"""

from __future__ import annotations

import copy
import hashlib
import logging
import math
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Optional

import torch
import torch.nn.functional as F
from torch import nn

from flexgemma.model.files import get_tensor, open_safetensors, read_json_object
from flexgemma.model.quant import import_bitsandbytes_offline, quiet_bitsandbytes_notice

log = logging.getLogger("flexgemma")
quiet_bitsandbytes_notice()  # before anything imports peft (which imports bitsandbytes when installed)

# peft `target_parameters` of Gemma-4's routed experts: gate_up [E, 2I, H] and down [E, H, I].
EXPERT_PARAMETERS = ("experts.gate_up_proj", "experts.down_proj")

# Prefixes a trainer's keys may carry: DDP, torch.compile, PeftModel; and the multimodal text path.
_STRIP_PREFIXES = ("module.", "_orig_mod.", "base_model.model.")
_OTHER_TOWERS = ("model.vision_tower.", "model.audio_tower.", "model.embed_vision.", "model.embed_audio.")
# `<path>.lora_A.<adapter>.weight` (a live peft model) or `<path>.lora_A.weight` (a saved adapter)
_KEY = re.compile(r"^(?P<path>.+)\.lora_(?P<ab>[AB])(?:\.(?P<adapter>[^.]+))?\.weight$")


class LoraError(ValueError):
    """An adapter or update that does not fit the engine's model; the message says what is wrong."""


def lora_enabled(lora_cfg) -> bool:
    return int(lora_cfg.rank) > 0 or bool(lora_cfg.path)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def tensor_digest(t: torch.Tensor) -> str:
    """sha256 of a tensor's bytes (bit-exact identity, any dtype)."""
    flat = t.detach().contiguous().reshape(-1)
    return hashlib.sha256(flat.view(torch.uint8).cpu().numpy().tobytes()).hexdigest()


def merge_into(weight: torch.Tensor, pristine: torch.Tensor, lhs: torch.Tensor, rhs: torch.Tensor,
               alpha: float, staged: Optional[bool] = None) -> None:
    """weight <- pristine + alpha * lhs @ rhs, written into weight's own storage.

    2-D: lhs [out, r], rhs [r, in]; 3-D: lhs [E, out, r], rhs [E, r, in]. With the pristine copy on
    the same device this is one fused op; from pinned CPU memory (`staged`) it is a copy then one
    in-place accumulate (the same arithmetic: beta=1 on the same values).
    """
    batched = weight.dim() == 3
    if staged is None:
        staged = pristine.device != weight.device
    if not staged:
        (torch.baddbmm if batched else torch.addmm)(pristine, lhs, rhs, alpha=alpha, out=weight)
    else:
        weight.copy_(pristine, non_blocking=True)
        (weight.baddbmm_ if batched else weight.addmm_)(lhs, rhs, alpha=alpha)


def _copy_all(dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
    if all(d.device == v.device and d.dtype == v.dtype for d, v in zip(dst, src)):
        torch._foreach_copy_(dst, src)  # one fused launch group (a trainer on the same GPU)
    else:
        for d, v in zip(dst, src):
            d.copy_(v, non_blocking=True)


def _delta_factors(layer, adapter: str) -> tuple[torch.Tensor, torch.Tensor, float]:
    """(lhs, rhs, scale) with delta = scale * lhs @ rhs, in the layout of the base weight."""
    from peft.tuners.lora import ParamWrapper

    if isinstance(layer, ParamWrapper):
        return layer.get_delta_factors(adapter)  # [E, out, r], [E, r, in] for Gemma-4's [E, out, in]
    return layer.lora_B[adapter].weight, layer.lora_A[adapter].weight, float(layer.scaling[adapter])


def _combined_factors(parts: list[tuple[torch.Tensor, torch.Tensor, float]]):
    """Several adapters as one low-rank product: [s1/s0 B1 | s2/s0 B2 ...] @ [A1; A2; ...] * s0."""
    if len(parts) == 1:
        return parts[0]
    s0 = parts[0][2]
    lhs = torch.cat([b if s == s0 else b * (s / s0) for b, _, s in parts], dim=-1)
    rhs = torch.cat([a for _, a, _ in parts], dim=-2)
    return lhs, rhs, s0


@dataclass
class MergeTarget:
    """One base weight the engine reads, its pristine copy and the peft layer holding its adapter."""

    name: str  # e.g. model.layers.0.self_attn.q_proj.weight, model.layers.0.experts.gate_up_proj
    weight: torch.Tensor  # the tensor the forward reads; rebuilt in place, never reallocated
    pristine: torch.Tensor
    layer: Any  # peft lora.Linear or lora.ParamWrapper

    def merge(self, adapters: list[str]) -> None:
        parts = [_delta_factors(self.layer, a) for a in adapters if a in self.layer.lora_A]
        lhs, rhs, scale = _combined_factors(parts)
        merge_into(self.weight, self.pristine, lhs.to(self.weight.dtype), rhs.to(self.weight.dtype), scale)


def live_factors(layers: list, adapters: list[str]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer (s B, A) of its adapters combined, from the peft tensors themselves (differentiable
    when gradients are on): what `LowRankGroup` copies and what the trainer's forward multiplies."""
    out = []
    for layer in layers:
        lhs, rhs, scale = _combined_factors([_delta_factors(layer, a) for a in adapters if a in layer.lora_A])
        out.append((lhs * scale, rhs))
    return out


class LowRankGroup:
    """Unmerged adapters of projections that read one input (q/k/v, gate/up, or one alone), run
    beside their (4-bit) base layers in fewer launches than peft's: the A factors of every member
    and adapter as one GEMM, then each member's B, its scale folded in, added onto the base output
    by one addmm; or, over a `linear4bit.Linear4bitGroup` of the bases, B as one block-diagonal
    matrix that the 4-bit kernel adds inside its tile. (peft's forward clones the base output, then
    runs A, B, the scale and the add: five launches a projection, ~3 ms of a bs-64 E2B step.) The
    factors are copies in the compute dtype, rebuilt in place by `rebuild` so that captured graphs
    read the current adapter."""

    def __init__(self, layers: list, adapters: list[str], dtype: torch.dtype, base=None, linear=None, bases=None):
        # linear / bases (engine.batch_invariant): every product through `linear`, the members' base
        # outputs from `bases` (a projections.DenseGroup), the adapter's added after its own rounding
        self.layers, self.adapters, self.base, self.linear, self.bases = layers, adapters, base, linear, bases
        parts = self._factors()
        self.a = torch.cat([a for _, a in parts]).to(dtype)  # [sum of ranks, in]
        self.ranks = [a.shape[0] for _, a in parts]
        if base is None:
            self.b = [b.to(dtype).contiguous() for b, _ in parts]  # per member [out, rank], scaled
        else:  # [sum of outs, sum of ranks]: member i's B at rows of its outputs, columns of its rank
            self.b_diag = torch.zeros(sum(b.shape[0] for b, _ in parts), sum(self.ranks), dtype=dtype,
                                      device=self.a.device)
            self._fill_diag(parts)

    def _factors(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return live_factors(self.layers, self.adapters)

    def _fill_diag(self, parts) -> None:
        o0 = r0 = 0
        for b, _ in parts:
            self.b_diag[o0: o0 + b.shape[0], r0: r0 + b.shape[1]].copy_(b)
            o0, r0 = o0 + b.shape[0], r0 + b.shape[1]

    @torch.no_grad()
    def rebuild(self) -> None:
        parts = self._factors()
        self.a.copy_(torch.cat([a for _, a in parts]))
        if self.base is not None:
            self._fill_diag(parts)
            return
        for dst, (b, _) in zip(self.b, parts):
            dst.copy_(b)

    def __call__(self, x: torch.Tensor) -> list[torch.Tensor]:
        """x [T, in] -> each member's output [T, out]: base(x) + x A^T (s B)^T."""
        if self.linear is not None:
            xa = self.linear(x, self.a)
            starts = [sum(self.ranks[:i]) for i in range(len(self.ranks))]
            return [y + self.linear(xa[:, r0: r0 + r], b)
                    for y, b, r0, r in zip(self.bases(x), self.b, starts, self.ranks)]
        xa = F.linear(x, self.a)
        if self.base is not None:
            return list(self.base.matmul(x, xa, self.b_diag).split(self.base.splits, dim=-1))
        outs, r0 = [], 0
        for layer, b, r in zip(self.layers, self.b, self.ranks):
            outs.append(torch.addmm(layer.get_base_layer()(x), xa[:, r0: r0 + r], b.t()))
            r0 += r
        return outs


def _check_value(key: str, value: Any) -> None:
    """An incoming adapter tensor must be a finite floating-point torch tensor: anything else would
    either fail half-way through an update or merge garbage (NaN, or an int cast) into every weight."""
    if not isinstance(value, torch.Tensor):
        raise LoraError(f"adapter tensor {key} is a {type(value).__name__}, not a torch.Tensor "
                        "(convert it with torch.as_tensor)")
    if value.layout != torch.strided:
        raise LoraError(f"adapter tensor {key} is a {value.layout} tensor: LoRA factors must be dense "
                        "(convert it with .to_dense())")
    if not value.dtype.is_floating_point:
        raise LoraError(f"adapter tensor {key} has dtype {value.dtype}: LoRA factors must be floating point "
                        "(float32, bfloat16 or float16)")
    if value.is_meta:
        raise LoraError(f"adapter tensor {key} is on the meta device (it holds no values)")
    if not bool(torch.isfinite(value).all()):
        bad = int((~torch.isfinite(value)).sum())
        raise LoraError(f"adapter tensor {key} holds {bad} non-finite values (NaN or inf) of {value.numel()}")


def _normalise_path(path: str) -> Optional[str]:
    """A module path as the engine's Gemma4ForCausalLM names it; None for other towers' modules."""
    changed = True
    while changed:
        changed = False
        for p in _STRIP_PREFIXES:
            if path.startswith(p):
                path, changed = path[len(p):], True
    if path.startswith("model.language_model."):  # an adapter of the multimodal model
        path = "model." + path[len("model.language_model."):]
    if path.startswith(_OTHER_TOWERS):
        return None
    return path


class LoraAdapters:
    """The engine's adapters: the peft model, the merge targets, and in-place updates."""

    def __init__(self, peft_model, model, adapter_names: list[str], merge: bool, pristine_on_cpu: bool):
        from peft.tuners.lora import LoraLayer, ParamWrapper

        self.peft_model = peft_model
        self.model = model  # the Gemma4ForCausalLM (peft injected its layers in place)
        self.adapter_names = list(adapter_names)
        self.merged = merge
        self.pristine_on_cpu = pristine_on_cpu
        self.device = next(model.parameters()).device
        self.attached: dict[str, Any] = {}  # how attach_lora attached them (source, rank, first refresh)
        self.layers = {n: m for n, m in model.named_modules() if isinstance(m, LoraLayer)}
        # slot key "<path>.lora_A.<adapter>" -> the adapter tensor an update copies into
        self.slots: dict[str, torch.Tensor] = {}
        for path, layer in self.layers.items():
            for a in self.adapter_names:
                if a in layer.lora_A:
                    self.slots[f"{path}.lora_A.{a}"] = layer.lora_A[a].weight
                    self.slots[f"{path}.lora_B.{a}"] = layer.lora_B[a].weight
        self.targets: list[MergeTarget] = []
        self.unmerged_bases: dict[str, torch.Tensor] = {}  # base weights an unmerged adapter runs beside
        for path, layer in self.layers.items():
            expert = isinstance(layer, ParamWrapper)
            # merged mode merges everything; unmerged mode merges only the (never quantised) experts
            if merge or expert:
                if expert:  # nested wrappers: experts (down_proj) -> experts.base_layer (gate_up_proj)
                    weight, owner = layer.get_param(), path
                    while owner.endswith(".base_layer"):
                        owner = owner[: -len(".base_layer")]
                    name = f"{owner}.{layer.parameter_name}"
                else:
                    weight, name = layer.get_base_layer().weight, f"{path}.weight"
                self.targets.append(MergeTarget(name, weight, self._pristine_copy(weight), layer))
            else:
                self.unmerged_bases[f"{path}.weight"] = layer.get_base_layer().weight
            layer.enable_adapters(not (merge or expert))  # a merged adapter must not run a second time
        peft_model.requires_grad_(False)
        self.last_refresh: dict[str, float] = {}
        self.groups: list[LowRankGroup] = []  # the forward's unmerged groups (`group`), rebuilt by refresh
        self.dtype = model.model.embed_tokens.weight.dtype

    def group(self, modules: list, base=None, linear=None, bases=None) -> Optional[LowRankGroup]:
        """The forward's fast path for `modules` (one input), when every one is an unmerged adapter
        layer this class can run (plain LoRA: no variant such as DoRA, no LoRA bias); None otherwise.
        base: a `linear4bit.Linear4bitGroup` of their base layers, or None (each base layer runs);
        linear / bases: the batch-invariant product and base outputs (see LowRankGroup)."""
        if not self.can_group(modules):
            return None
        g = LowRankGroup(list(modules), self.adapter_names, self.dtype, base, linear, bases)
        self.groups.append(g)
        return g

    def can_group(self, modules: list) -> bool:
        """Every one of `modules` is an unmerged adapter layer a `LowRankGroup` can run (plain LoRA: no
        variant such as DoRA, no LoRA bias, not an expert ParamWrapper)."""
        from peft.tuners.lora import ParamWrapper

        if self.merged or not modules:
            return False
        return all(any(m is layer for layer in self.layers.values()) and not isinstance(m, ParamWrapper)
                   and not m.disable_adapters and all(a in m.lora_A for a in self.adapter_names)
                   and not any(a in getattr(m, "lora_variant", {}) or getattr(m, "lora_bias", {}).get(a, False)
                               for a in self.adapter_names)
                   for m in modules)

    def _pristine_copy(self, weight: torch.Tensor) -> torch.Tensor:
        if not weight.dtype.is_floating_point:
            raise LoraError(
                f"cannot merge a LoRA adapter into a {weight.dtype} weight (a quantised model): use lora.merge=false "
                "(or null) so the adapter runs unmerged through peft's modules"
            )
        if self.pristine_on_cpu and weight.is_cuda:
            host = torch.empty(weight.shape, dtype=weight.dtype, pin_memory=True)
            return host.copy_(weight)
        return weight.detach().clone()

    # -- refresh -----------------------------------------------------------------------------------
    @torch.no_grad()
    def refresh(self) -> float:
        """Rebuilds every merged weight from its pristine copy and the current adapters (and the
        unmerged groups' factor copies); returns ms."""
        _sync(self.device)
        t0 = time.perf_counter()
        for t in self.targets:
            t.merge(self.adapter_names)
        for g in self.groups:
            g.rebuild()
        _sync(self.device)
        return (time.perf_counter() - t0) * 1e3

    # -- updates -----------------------------------------------------------------------------------
    def _incoming(self, source, adapter_name: Optional[str]) -> dict[str, torch.Tensor]:
        """Maps a peft model or state dict onto slot keys, with clear errors for what does not fit."""
        if isinstance(source, nn.Module):
            items = [(n, p) for n, p in source.named_parameters() if ".lora_" in n]
        elif isinstance(source, Mapping):
            items = list(source.items())
        else:
            raise TypeError(f"update_lora takes a peft model or a state dict, not {type(source).__name__}")
        if adapter_name is not None and adapter_name not in self.adapter_names:
            raise LoraError(f"adapter {adapter_name!r} is not one of the engine's adapters {self.adapter_names}")
        out, unknown, keys = {}, [], {}
        for key, value in items:
            m = _KEY.match(key)
            if m is None:
                if ".lora_" in key:
                    unknown.append(key)
                continue  # base weights of a full state dict: not the adapter's
            path = _normalise_path(m["path"])
            if path is None:
                continue  # vision/audio towers of a multimodal adapter
            adapter = m["adapter"]
            if adapter is None:  # a saved adapter's keys carry no name
                if adapter_name is None and len(self.adapter_names) > 1:
                    raise LoraError(
                        f"state dict keys without an adapter name (e.g. {key}) but the engine has adapters "
                        f"{self.adapter_names}: pass adapter_name=..."
                    )
                adapter = adapter_name or self.adapter_names[0]
            elif adapter_name is not None and adapter != adapter_name:
                continue  # only the named adapter is updated
            slot = f"{path}.lora_{m['ab']}.{adapter}"
            if slot not in self.slots:
                unknown.append(key)
                continue
            if slot in out:
                raise LoraError(f"adapter tensors {keys[slot]} and {key} are both {slot} (after prefixes such as "
                                "'base_model.model.' are stripped): send each adapter tensor once")
            _check_value(key, value)
            self._check_shape(key, value, path, m["ab"], adapter)
            out[slot], keys[slot] = value, key
        if unknown:
            have = sorted({k.rsplit(".", 2)[0] for k in self.slots})
            raise LoraError(
                f"{len(unknown)} adapter tensors fit no LoRA layer of the engine, e.g. {unknown[:3]}; the engine's "
                f"adapters {self.adapter_names} are on {len(have)} modules, e.g. {have[:3]}"
            )
        touched = {k.rsplit(".", 1)[1] for k in out}
        missing = [k for k in self.slots if k.rsplit(".", 1)[1] in touched and k not in out]
        if missing:
            raise LoraError(
                f"the update lacks {len(missing)} of the adapter tensors of {sorted(touched)}, e.g. {missing[:3]}: "
                "send the whole adapter (the targets must be the engine's)"
            )
        if not out:
            raise LoraError("the update holds no LoRA tensor (keys like '<module>.lora_A[.<adapter>].weight')")
        return out

    def _check_shape(self, key: str, value: torch.Tensor, path: str, ab: str, adapter: str) -> None:
        want = tuple(self.slots[f"{path}.lora_{ab}.{adapter}"].shape)
        if tuple(value.shape) != want:
            rank_dim = 0 if ab == "A" else 1  # A [r, in], B [out, r]
            what = "rank" if value.dim() == 2 and value.shape[rank_dim] != want[rank_dim] else "layer size"
            raise LoraError(
                f"adapter tensor {key} has shape {tuple(value.shape)} but {path} needs {want}: a {what} mismatch "
                f"(the engine's rank there is {self.layers[path].r[adapter]}; was the adapter made for another "
                "rank or model?)"
            )

    @torch.no_grad()
    def update(self, source, adapter_name: Optional[str] = None) -> dict[str, float]:
        """Copies new adapter values in place and rebuilds the merged weights; returns timings (ms).

        `source`: a peft model (its lora_A/lora_B parameters, by adapter name) or a state dict with
        peft key names (`...q_proj.lora_A.default.weight`, or a saved adapter's `...q_proj.lora_A.weight`
        for `adapter_name`, default the first adapter). Every tensor keeps its storage, so captured
        CUDA graphs see the new weights at their next replay without re-capture.
        """
        incoming = self._incoming(source, adapter_name)  # every tensor checked before any weight is touched
        _sync(self.device)
        t0 = time.perf_counter()
        dst, src = [self.slots[k] for k in incoming], list(incoming.values())
        previous = [d.detach().clone() for d in dst]
        try:
            _copy_all(dst, src)
            _sync(self.device)
            t1 = time.perf_counter()
            merge_ms = self.refresh()
        except BaseException:  # an error or Ctrl-C half-way: back to the previous adapter, every weight
            self._restore(dst, previous)
            raise
        copy_ms = (t1 - t0) * 1e3
        self.last_refresh = {"refresh_ms": copy_ms + merge_ms, "copy_ms": copy_ms, "merge_ms": merge_ms,
                             "tensors": float(len(incoming))}
        return dict(self.last_refresh)

    @torch.no_grad()
    def _restore(self, slots: list[torch.Tensor], previous: list[torch.Tensor]) -> None:
        """The previous factors back, and every merged weight and factor copy rebuilt from them: the
        merge is a pure function of (pristine, factors), so this is the state before the update, bit
        for bit."""
        _copy_all(slots, previous)
        self.refresh()

    # -- inspection --------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, torch.Tensor]:
        """Copies of the adapter tensors, keyed as a live peft model names them."""
        return {f"base_model.model.{k}.weight": v.detach().clone() for k, v in self.slots.items()}

    def pristine_digests(self) -> dict[str, str]:
        """The base weights: pristine copies of merged targets, and the untouched unmerged bases."""
        out = {t.name: tensor_digest(t.pristine) for t in self.targets}
        out.update({k: tensor_digest(v) for k, v in self.unmerged_bases.items()})
        return out

    def merged_digests(self) -> dict[str, str]:
        """The weights the forward reads: merged targets, plus the adapter tensors when unmerged."""
        out = {t.name: tensor_digest(t.weight) for t in self.targets}
        if not self.merged:
            out.update({k: tensor_digest(v) for k, v in self.slots.items()})
        return out

    def save(self, directory: str | Path) -> None:
        """Saves the adapters as a peft adapter directory (loadable with lora.path)."""
        self.peft_model.save_pretrained(str(directory), selected_adapters=self.adapter_names)

    def build_info(self) -> dict[str, Any]:
        """info() and how the adapters were attached (source, rank, first refresh): the build's facts."""
        return {**self.info(), **self.attached}

    def info(self) -> dict[str, Any]:
        nbytes = lambda ts: sum(t.numel() * t.element_size() for t in ts)  # noqa: E731
        return {
            "lora_adapters": ",".join(self.adapter_names),
            "lora_mode": "merged" if self.merged else "unmerged",
            "lora_layers": len(self.layers),
            "lora_merge_targets": len(self.targets),
            "lora_params": sum(v.numel() for v in self.slots.values()),
            "lora_adapter_bytes": nbytes(self.slots.values()),
            "lora_pristine_bytes": nbytes(t.pristine for t in self.targets),
            "lora_pristine_device": "cpu" if self.pristine_on_cpu else str(self.device),
        }


# -- building ------------------------------------------------------------------------------------------
def _linear_names(model) -> set[str]:
    return {n.rsplit(".", 1)[-1] for n, m in model.named_modules()
            if isinstance(m, nn.Linear) and n.startswith("model.layers.")}


def _has_experts(model) -> bool:
    return any(n.endswith(EXPERT_PARAMETERS) for n, _ in model.named_parameters())


def _check_targets(model, target_modules, target_parameters, where: str) -> None:
    if isinstance(target_modules, (list, tuple, set)):
        have = _linear_names(model)
        missing = sorted(set(target_modules) - have)
        if missing:
            raise LoraError(
                f"{where}: target modules {missing} match no linear layer of the model; its layers have "
                f"{sorted(have)}"
            )
    params = [n for n, _ in model.named_parameters()]
    for tp in target_parameters or []:
        if not any(n == tp or n.endswith("." + tp) for n in params):
            raise LoraError(f"{where}: target parameter {tp!r} is not a parameter of the model (a MoE-only target?)")


def _peft_config(lora_cfg, model):
    from peft import LoraConfig as PeftLoraConfig

    targets = list(lora_cfg.target_modules)
    params = list(EXPERT_PARAMETERS) if lora_cfg.experts and _has_experts(model) else None
    _check_targets(model, targets, params, "lora.target_modules")
    return PeftLoraConfig(
        r=int(lora_cfg.rank), lora_alpha=float(lora_cfg.alpha), target_modules=targets or [],
        target_parameters=params, lora_dropout=0.0,  # the identity at inference (and peft's expert path has none)
        init_lora_weights=True, inference_mode=True,
    )


def _load_peft_config(directory: Path, lora_cfg, model):
    from peft import LoraConfig as PeftLoraConfig

    if not directory.is_dir():
        raise LoraError(f"lora.path={directory} does not exist or is not a directory")
    cfg_file = directory / "adapter_config.json"
    if not cfg_file.is_file():
        raise LoraError(f"lora.path={directory}: no adapter_config.json (expected a peft adapter directory)")
    raw = read_json_object(cfg_file, LoraError)
    if raw.get("peft_type", "LORA") != "LORA":
        raise LoraError(f"{cfg_file}: peft_type {raw.get('peft_type')!r} is not a LoRA adapter")
    pc = PeftLoraConfig.from_pretrained(str(directory))
    unsupported = [k for k in ("use_dora", "lora_bias", "fan_in_fan_out", "modules_to_save") if getattr(pc, k, None)]
    if unsupported:
        raise LoraError(f"{cfg_file}: {unsupported} are not supported (plain LoRA only: the merge is W + s*B@A)")
    if int(lora_cfg.rank) and int(lora_cfg.rank) != pc.r:
        raise LoraError(
            f"lora.rank={lora_cfg.rank} but the adapter at {directory} has r={pc.r}: set lora.rank={pc.r} (or 0)"
        )
    _check_targets(model, pc.target_modules, pc.target_parameters, f"adapter {cfg_file}")
    pc.lora_dropout = 0.0
    pc.inference_mode = True
    return pc


def _adapter_tensors(directory: Path) -> dict[str, torch.Tensor]:
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        pickled = sorted(directory.glob("*.bin"))
        hint = f" (only pickled {pickled[0].name}: convert it to safetensors)" if pickled else ""
        raise LoraError(f"lora.path={directory}: no adapter_model.safetensors{hint}")
    out, where = {}, {}
    for f in files:
        with open_safetensors(f, LoraError) as h:
            for k in h.keys():
                if k in out:  # a stray copy beside the adapter would load over it
                    raise LoraError(f"lora.path={directory}: tensor {k} is in both {where[k]} and {f.name}: keep one "
                                    "adapter's files in the directory")
                out[k], where[k] = get_tensor(h, f, k, LoraError), f.name
    return out


@torch.no_grad()
def randomise(adapters: LoraAdapters, seed: int, std_b: float) -> None:
    """Seeded random A ~ N(0, 1/in) and B ~ N(0, std_b^2), drawn on the CPU (the same on any device).

    peft initialises B to zero, an adapter that changes nothing, so tests of the merge could not
    fail; a random B makes every adapted weight differ from the base.
    """
    g = torch.Generator().manual_seed(int(seed))
    for a in adapters.adapter_names:
        for path in sorted(adapters.layers):
            layer = adapters.layers[path]
            if a not in layer.lora_A:
                continue
            wa, wb = layer.lora_A[a].weight, layer.lora_B[a].weight
            wa.copy_(torch.randn(wa.shape, generator=g) / math.sqrt(wa.shape[1]))
            wb.copy_(torch.randn(wb.shape, generator=g) * std_b)


def attach_lora(model, lora_cfg, merge: bool) -> Optional[LoraAdapters]:
    """Wraps `model` (in place) with the configured peft adapters and merges them when `merge` (lora.merge
    resolved: flexgemma.config.resolve); None for lora=none. What was attached: the adapters' build_info().

    Called once by build_engine, right after the model is built (and quantised), before the KV
    pool is sized and the decode graphs are captured.
    """
    if not lora_enabled(lora_cfg):
        return None
    import_bitsandbytes_offline()  # peft imports it
    from peft import get_peft_model

    names = list(lora_cfg.adapter_names)
    directory = Path(lora_cfg.path).expanduser() if lora_cfg.path else None
    pc = _load_peft_config(directory, lora_cfg, model) if directory else _peft_config(lora_cfg, model)
    # adapters in the model's dtype (peft would upcast bf16 ones to fp32): the merge runs in it
    peft_model = get_peft_model(model, copy.deepcopy(pc), adapter_name=names[0], autocast_adapter_dtype=False)
    for n in names[1:]:
        peft_model.add_adapter(n, copy.deepcopy(pc), autocast_adapter_dtype=False)
    peft_model.base_model.set_adapter(names)  # all active: their deltas add up
    adapters = LoraAdapters(peft_model, model, names, merge, bool(lora_cfg.pristine_on_cpu))
    if directory is not None:
        report = adapters.update(_adapter_tensors(directory), adapter_name=names[0])
        source = str(directory)
    else:
        randomise(adapters, int(lora_cfg.seed), float(lora_cfg.init_std_b))
        report = {"refresh_ms": adapters.refresh()}
        source = f"random(seed={lora_cfg.seed})"
    adapters.attached = {"lora_source": source, "lora_rank": pc.r, "lora_refresh_ms": report["refresh_ms"]}
    log.info("LoRA: %s r=%d on %d layers (%s), %s; refresh %.2f ms", ",".join(names), pc.r, len(adapters.layers),
             adapters.info()["lora_mode"], source, report["refresh_ms"])
    return adapters
