"""Engines from Python arguments: build_engine(model=..., quant=..., lora=..., **overrides) and
Engine.from_model(hf_model, tokenizer=None, **overrides) for a transformers model the caller has.

Both compose conf/ like the CLI (every override the CLI takes works here), and leave the caller's
Hydra state as it was (flexgemma.compose restores an initialised GlobalHydra).
"""

from __future__ import annotations

from typing import Optional

import torch
from omegaconf import DictConfig, open_dict

from flexgemma.config import ConfigError


def _value(v) -> str:
    """A Python value as a Hydra override value."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (list, tuple)):
        return "[" + ",".join(_value(x) for x in v) + "]"
    return str(v)


def override_list(model: Optional[str] = None, quant: Optional[str] = None, lora: Optional[str] = None,
                  **overrides) -> list[str]:
    """Keyword arguments as CLI overrides: model="e2b" -> +model=e2b, engine__max_batch_size=8 ->
    engine.max_batch_size=8 (a key may also be given with dots through **{"kv.page_size": 8})."""
    out = [f"+model={model}"] if model else []
    out += [f"quant={quant}"] if quant else []
    out += [f"lora={lora}"] if lora else []
    for key, v in overrides.items():
        out.append(f"{key.replace('__', '.')}={_value(v)}")
    return out


def engine_config(model: Optional[str] = None, quant: Optional[str] = None, lora: Optional[str] = None,
                  **overrides) -> DictConfig:
    from flexgemma.compose import compose

    return compose(override_list(model, quant, lora, **overrides))


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

    The caller's model is not rewritten: projections are not fused (engine.fuse_projections=false
    unless overridden) and no LoRA is attached unless lora= is given (that wraps the model with peft).
    Quantised (bitsandbytes) models are not supported here: build those with quant=bnb4."""
    from flexgemma.builder import assemble_engine
    from flexgemma.model.quant import storage_census

    _check_hf_model(hf_model)
    param = next(hf_model.parameters())
    if param.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ConfigError(f"Engine.from_model: weights of dtype {param.dtype} are not supported (quantised?): "
                          "build with build_engine(model=..., quant='bnb4') instead")
    overrides.setdefault("engine__fuse_projections", False)
    overrides.setdefault("device", param.device.type)
    lora_name = overrides.pop("lora", None)
    cfg = engine_config(model="tiny", lora=lora_name, **overrides)  # model=tiny only fills the schema's section
    with open_dict(cfg):
        cfg.model.name = getattr(hf_model.config, "name_or_path", "") or "from_model"
        cfg.model.hf_config = None
    if cfg.engine.fuse_projections:
        from flexgemma.model.fuse import fuse_projections

        fused = fuse_projections(hf_model)
    census = storage_census(hf_model)
    info = {"name": cfg.model.name, "dtype": str(param.dtype).removeprefix("torch."), "weights": "caller's model",
            "params": census["params"], "quant/fraction_4bit": census["quant/fraction_4bit"],
            "quant/weight_bytes": census["quant/weight_bytes"]}
    if cfg.engine.fuse_projections:
        info["fused_projections"] = fused
    from flexgemma.model.lora import attach_lora

    lora = attach_lora(hf_model, cfg.lora, info)
    return assemble_engine(cfg, hf_model, tokenizer, info, lora, param.device)
