"""Python keyword arguments as the CLI's overrides, composed into a config: what build_engine(model=...,
**overrides) and Engine.from_model(..., **overrides) take."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Optional



def _value(v) -> str:
    """A Python value as a Hydra override value."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (list, tuple)):
        return "[" + ",".join(_value(x) for x in v) + "]"
    return str(v)


def _quoted(text: str) -> str:
    """A string as a Hydra override value, quoted unless it is a plain path or name."""
    if re.fullmatch(r"[\w./~+-]+", text):
        return text
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


def model_overrides(model: str) -> list[str]:
    """model= of the Python API: a variant (conf/model/NAME.yaml), or a checkpoint directory (as
    vLLM's LLM(model=DIR)): the directory as model.path, named after it, on the schema of the
    default variant (a checkpoint's config.json and tokenizer replace the variant's)."""
    from flexgemma.config.compose import model_names
    from flexgemma.config.schema import DEFAULT_MODEL

    if model in model_names() or not ("/" in model or Path(model).expanduser().is_dir()):
        return [f"+model={model}"]  # a variant, or an unknown name: compose lists the variants
    name = Path(model).expanduser().name or "checkpoint"
    return [f"+model={DEFAULT_MODEL}", f"model.path={_quoted(model)}", f"model.name={_quoted(name)}"]


def override_list(model: Optional[str] = None, quant: Optional[str] = None, lora: Optional[str] = None,
                  **overrides) -> list[str]:
    """Keyword arguments as CLI overrides: model="e2b" -> +model=e2b, model="/ckpt/dir" -> a checkpoint
    directory, engine__max_batch_size=8 -> engine.max_batch_size=8 (a key may also be given with dots
    through **{"kv.page_size": 8})."""
    out = model_overrides(model) if model else []
    out += [f"quant={quant}"] if quant else []
    out += [f"lora={lora}"] if lora else []
    for key, v in overrides.items():
        out.append(f"{key.replace('__', '.')}={_value(v)}")
    return out


def engine_config(model: Optional[str] = None, quant: Optional[str] = None, lora: Optional[str] = None,
                  **overrides):
    from flexgemma.config.compose import compose

    return compose(override_list(model, quant, lora, **overrides))
