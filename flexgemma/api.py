"""Engine.from_model(hf_model, tokenizer=None, **overrides): an engine over a transformers model the
caller has (build_engine(model=..., **overrides) is its sibling in builder.py).

Both compose conf/ like the CLI (every override the CLI takes works here), and leave the caller's
Hydra state as it was (flexgemma.config.compose restores an initialised GlobalHydra).
"""

from __future__ import annotations

import torch

from flexgemma.config.schema import ConfigError
from flexgemma.config.overrides import engine_config


def _check_hf_model(hf_model) -> None:
    config = getattr(hf_model, "config", None)
    kind = getattr(config, "model_type", None)
    if kind == "gemma4":
        raise ConfigError("Engine.from_model takes the text model (Gemma4ForCausalLM, model_type gemma4_text); this "
                          "is a multimodal Gemma4ForConditionalGeneration: save it and build with model.path=DIR, "
                          "which loads its text backbone")
    if kind != "gemma4_text" or not hasattr(getattr(hf_model, "model", None), "embed_tokens"):
        raise ConfigError(f"Engine.from_model needs a transformers Gemma4ForCausalLM, got {type(hf_model).__name__} "
                          f"(model_type {kind!r})")


def engine_from_model(hf_model, tokenizer=None, **overrides):
    """An engine that runs `hf_model`'s weights in place (no copy), on the model's device and dtype.

    The caller's model is not rewritten: projections are not fused (kernels.fuse_projections=false
    unless overridden) and no LoRA is attached unless lora= is given (that wraps the model with peft).
    Quantised (bitsandbytes) models are not supported here: build those with quant=bnb4."""
    from flexgemma.builder import assemble_engine
    from flexgemma.config.resolve import resolve
    from flexgemma.model.quant import storage_census

    _check_hf_model(hf_model)
    param = next(hf_model.parameters())
    if param.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ConfigError(f"Engine.from_model: weights of dtype {param.dtype} are not supported (quantised?): "
                          "build with build_engine(model=..., quant='bnb4') instead")
    overrides.setdefault("kernels__fuse_projections", False)
    overrides.setdefault("device", param.device.type)
    lora_name = overrides.pop("lora", None)
    cfg = engine_config(model="tiny", lora=lora_name, **overrides)  # model=tiny only fills the schema's section
    cfg.model.name = getattr(hf_model.config, "name_or_path", "") or "from_model"
    cfg.model.hf_config = None  # the caller's model is the architecture
    r = resolve(cfg, param.device)
    if r.kernels.fuse_projections:
        from flexgemma.model.projections import fuse_projections

        fused = fuse_projections(hf_model)
    census = storage_census(hf_model)
    info = {"name": cfg.model.name, "dtype": str(param.dtype).removeprefix("torch."), "weights": "caller's model",
            "params": census["params"], "quant/fraction_4bit": census["quant/fraction_4bit"],
            "quant/weight_bytes": census["quant/weight_bytes"]}
    if r.kernels.fuse_projections:
        info["fused_projections"] = fused
    from flexgemma.model.lora import attach_lora

    lora = attach_lora(hf_model, cfg.lora, r.lora_merge)
    return assemble_engine(cfg, hf_model, tokenizer, info, lora, r)
