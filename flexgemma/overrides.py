"""Python keyword arguments as the CLI's overrides, composed into a config: what build_engine(model=...,
**overrides) and Engine.from_model(..., **overrides) take."""

from __future__ import annotations

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
                  **overrides):
    from flexgemma.compose import compose

    return compose(override_list(model, quant, lora, **overrides))
