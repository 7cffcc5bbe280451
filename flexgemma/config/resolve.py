"""resolve(cfg, device): every `auto` of a config turned into what runs on this device, once.

The builder reads these values and nothing below it decides `auto` again; the kernel choices go to
the constructors as one `kernels.Kernels`. A choice that cannot run here (triton without Triton, or
off the GPU) is a ConfigError naming the key.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields

import torch

from flexgemma.config.schema import ConfigError, KernelsConfig, validate_kernels
from flexgemma.config.kernels import Kernels, attention_row_sizes
from flexgemma.model.load import model_dtype


@dataclass(frozen=True)
class Resolved:
    device: torch.device
    dtype: torch.dtype  # the model's compute dtype (model.dtype)
    attention_backend: str  # flex | flex_eager | dense (attn.backend), or invariant (engine.batch_invariant)
    compile: bool  # torch.compile the glue and the sampler (engine.compile)
    kernels: Kernels  # the kernels group, decided for this device, and the decode attention row counts
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
    """`cfg` the typed config (config.Config); `device` from resolve_device."""
    backend = str(getattr(cfg.attn.backend, "value", cfg.attn.backend))
    invariant = bool(cfg.engine.batch_invariant)
    if invariant:  # one attention kernel for both phases (model/invariant/attention.py): no flex tiles
        backend = "invariant"
    elif backend == "auto":
        backend = "flex" if device.type == "cuda" else "dense"
    if backend == "flex":
        validate_kernels(cfg)  # the compiled kernels' tiles must fit the pages (the eager paths have none)
    quantised = cfg.quant is not None and cfg.quant.method != "none"
    if invariant and device.type == "cuda" and int(cfg.kv.page_size) < 16:
        raise ConfigError(f"engine.batch_invariant=true on a GPU needs kv.page_size >= 16 (the attention kernel's "
                          f"smallest tile), got {cfg.kv.page_size}")
    compile_glue = bool(cfg.engine.compile) if cfg.engine.compile is not None else device.type == "cuda"
    if invariant and device.type == "cuda" and not compile_glue:
        raise ConfigError("engine.batch_invariant=true on a GPU needs engine.compile=true (or null): torch's eager "
                          "norms reduce a row in an order that depends on the row count; the compiled glue does not")
    dtype = model_dtype(cfg.model, cfg.quant, device)
    return Resolved(
        device=device,
        dtype=dtype,
        attention_backend=backend,
        compile=compile_glue,
        kernels=resolve_kernels(cfg.kernels, device, backend, int(cfg.engine.max_batch_size), quantised, dtype),
        quantised=quantised,
        lora_merge=(not quantised) if cfg.lora.merge is None else bool(cfg.lora.merge),
        batch_invariant=invariant,
    )


# the kernels keys whose default, `auto`, resolve_kernels decides for the device
AUTO_KERNEL_KEYS = tuple(f.name for f in fields(KernelsConfig) if f.default == "auto")


def resolve_kernels(k: KernelsConfig, device: torch.device, backend: str, max_batch_size: int,
                    quantised: bool, dtype: torch.dtype = torch.float32) -> Kernels:
    """The kernels group as the constructors read it: each key copied over, `auto` decided for
    `device`, the attention backend and the model's compute dtype, and the row counts flex decode
    attention is compiled at (flex only)."""
    values = {f.name: getattr(k, f.name) for f in fields(KernelsConfig)}
    values.update(
        moe=kernel_choice("moe", str(k.moe), "grouped_mm", device),
        invariant_experts=kernel_choice("invariant_experts", str(k.invariant_experts), "grouped", device),
        linear4bit=kernel_choice("linear4bit", str(k.linear4bit), "bnb", device) if quantised else "bnb",
        moe_code_lookup=code_lookup_choice(str(k.moe_code_lookup), device),
        invariant_loads=loads_choice(str(k.invariant_loads), device),
        prefill_attention=prefill_attention_choice(str(k.prefill_attention), device, backend, dtype),
        decode_rows=tuple(attention_row_sizes(max_batch_size)) if backend == "flex" else (),
    )
    if k.trainer_glue_backward == "auto":  # as engine.compile: torch.compile on a GPU, eager ops on the CPU
        values["trainer_glue_backward"] = "compiled" if device.type == "cuda" else "eager"
    return Kernels(**values)


def _triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def prefill_attention_choice(value: str, device: torch.device, backend: str, dtype: torch.dtype) -> str:
    """kernels.prefill_attention resolved: auto is varlen (FlashAttention) where it runs and was measured
    (E2B's prefill 97k -> 101k tok/s): the flex backend on an NVIDIA GPU of sm_80 or newer with a bf16 or
    fp16 model; flex elsewhere (the CPU, float32, the eager, dense and batch-invariant backends). An
    explicit varlen is checked at build (model.attention.check_varlen)."""
    if value != "auto":
        return value
    if backend != "flex" or dtype not in (torch.bfloat16, torch.float16) or device.type != "cuda" or torch.version.hip:
        return "flex"
    return "varlen" if torch.cuda.get_device_capability(device)[0] >= 8 else "flex"


def code_lookup_choice(value: str, device: torch.device) -> str:
    """kernels.moe_code_lookup resolved: auto is prmt (inline PTX) on an NVIDIA GPU with Triton, table
    elsewhere; prmt where PTX cannot run is an error naming the key."""
    nvidia = device.type == "cuda" and not torch.version.hip and _triton_available()
    if value == "auto":
        return "prmt" if nvidia else "table"
    if value == "prmt" and not nvidia:
        raise ConfigError(f"kernels.moe_code_lookup=prmt runs inline PTX, an NVIDIA GPU's only (this run is on "
                          f"{device.type}{' with ROCm' if torch.version.hip else ''}): use kernels.moe_code_lookup="
                          "table or select (the same values)")
    return value


def loads_choice(value: str, device: torch.device) -> str:
    """kernels.invariant_loads resolved: auto is tma on a GPU with the tensor memory accelerator (NVIDIA sm_90
    and newer), pointers elsewhere; tma on a GPU without it is an error naming the key. On the CPU the invariant
    products are torch's, which the key does not touch."""
    major, minor = (0, 0) if device.type != "cuda" or torch.version.hip else torch.cuda.get_device_capability(device)
    if value == "auto":
        return "tma" if major >= 9 else "pointers"
    if value == "tma" and device.type == "cuda":
        if major < 9:
            gpu = "a ROCm GPU" if torch.version.hip else f"an sm_{major}{minor} GPU"
            raise ConfigError(f"kernels.invariant_loads=tma moves blocks with the tensor memory accelerator of "
                              f"NVIDIA sm_90 and newer GPUs; this run is on {gpu}: use kernels.invariant_loads="
                              "pointers (the same bits)")
    return value


def kernel_choice(option: str, value: str, torch_name: str, device: torch.device) -> str:
    """kernels.<option> resolved: auto is the Triton kernels on a GPU (measured faster on the H200,
    experiments/RESULTS.md), `torch_name` elsewhere; triton where Triton cannot run is an error."""
    if value == "auto":
        return "triton" if device.type == "cuda" and _triton_available() else torch_name
    if value == "triton":
        if not _triton_available():
            raise ConfigError(f"kernels.{option}=triton needs the triton package (it comes with CUDA builds of "
                              f"torch): use kernels.{option}={torch_name}")
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ConfigError(f"kernels.{option}=triton runs on a GPU, not on {device.type} (the tests run it "
                              f"there through TRITON_INTERPRET=1): use kernels.{option}={torch_name}")
    return value
