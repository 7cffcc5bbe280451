"""resolve(cfg, device): every `auto` of a config turned into what runs on this device, once.

The builder reads these values and nothing below it decides `auto` again. A choice that cannot run
here (triton without Triton, or off the GPU) is a ConfigError naming the key.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from flexgemma.config import ConfigError, validate_kernels
from flexgemma.model.load import model_dtype


@dataclass(frozen=True)
class Resolved:
    device: torch.device
    dtype: torch.dtype  # the model's compute dtype (model.dtype)
    attention_backend: str  # flex | flex_eager | dense (attn.backend)
    compile: bool  # torch.compile the glue and the sampler (engine.compile)
    moe_kernel: str  # triton | grouped_mm (engine.moe_kernel)
    linear4bit_kernel: str  # triton | bnb (engine.linear4bit_kernel; bnb without quant=bnb4)
    quantised: bool  # quant.method is not none
    lora_merge: bool  # merge LoRA into the weights (lora.merge; null: merged unless 4-bit)
    batch_invariant: bool = False  # engine.batch_invariant: the kernels of model/invariant


def resolve_device(name) -> torch.device:
    name = str(getattr(name, "value", name))
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device=cuda but torch sees no GPU: use device=cpu (or device=auto)")
    return torch.device(name)


def resolve(cfg, device: torch.device) -> Resolved:
    """`cfg` a composed (DictConfig) or typed (config.Config) config; `device` from resolve_device."""
    backend = str(getattr(cfg.attn.backend, "value", cfg.attn.backend))
    if backend == "auto":
        backend = "flex" if device.type == "cuda" else "dense"
    if backend == "flex":
        validate_kernels(cfg)  # the compiled kernels' tiles must fit the pages (the eager paths have none)
    quantised = cfg.quant is not None and cfg.quant.method != "none"
    invariant = bool(getattr(cfg.engine, "batch_invariant", False))
    if invariant and device.type == "cuda" and int(cfg.kv.page_size) < 16:
        raise ConfigError(f"engine.batch_invariant=true on a GPU needs kv.page_size >= 16 (the attention kernel's "
                          f"smallest tile), got {cfg.kv.page_size}")
    return Resolved(
        device=device,
        dtype=model_dtype(cfg.model, cfg.quant, device),
        attention_backend=backend,
        compile=bool(cfg.engine.compile) if cfg.engine.compile is not None else device.type == "cuda",
        moe_kernel=kernel_choice("moe_kernel", str(cfg.engine.moe_kernel), "grouped_mm", device),
        linear4bit_kernel=kernel_choice("linear4bit_kernel", str(cfg.engine.linear4bit_kernel), "bnb", device)
        if quantised else "bnb",
        quantised=quantised,
        lora_merge=(not quantised) if cfg.lora.merge is None else bool(cfg.lora.merge),
        batch_invariant=invariant,
    )


def _triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def kernel_choice(option: str, value: str, torch_name: str, device: torch.device) -> str:
    """engine.<option> resolved: auto is the Triton kernels on a GPU (measured faster on the H200,
    experiments/RESULTS.md), `torch_name` elsewhere; triton where Triton cannot run is an error."""
    if value == "auto":
        return "triton" if device.type == "cuda" and _triton_available() else torch_name
    if value == "triton":
        if not _triton_available():
            raise ConfigError(f"engine.{option}=triton needs the triton package (it comes with CUDA builds of "
                              f"torch): use engine.{option}={torch_name}")
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ConfigError(f"engine.{option}=triton runs on a GPU, not on {device.type} (the tests run it "
                              f"there through TRITON_INTERPRET=1): use engine.{option}={torch_name}")
    return value
