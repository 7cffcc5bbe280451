"""flexgemma: a fast Gemma-4 generation engine on flex_attention, and the experiment framework around it.

    from flexgemma import compose, build_engine, SamplingParams
    cfg = compose(["+model=tiny", "quant=bf16"])   # the typed config (flexgemma.config.schema.Config)
    engine = build_engine(cfg)
    outs = engine.generate([[2, 18, 279], [2, 51]], SamplingParams(max_new_tokens=32, temperature=0.0))

The names below are imported on first use (module __getattr__), so that `python -m flexgemma` can
set the OpenMP wait policy before torch is imported.
"""

import importlib

# the config layer imports no torch: these two are imported at once
from flexgemma.config.compose import compose
from flexgemma.config.schema import ConfigError

_EXPORTS = {
    "build_engine": "flexgemma.builder",
    "Engine": "flexgemma.engine.engine",
    "RequestError": "flexgemma.engine.engine",
    "WeightError": "flexgemma.model.watch",
    "ScoreOutput": "flexgemma.engine.score",
    "CompletionOutput": "flexgemma.engine.sequence",
    "RequestOutput": "flexgemma.engine.sequence",
    "SamplingParams": "flexgemma.engine.sequence",
    "outputs_to_dataset": "flexgemma.outputs",
}

__all__ = ["compose", "build_engine", "SamplingParams", "RequestOutput", "CompletionOutput", "ScoreOutput", "Engine",
           "ConfigError", "RequestError", "WeightError", "outputs_to_dataset"]
__version__ = "0.1.0"


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'flexgemma' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    if name == "Engine" and not hasattr(value, "from_model"):
        # Engine.from_model: an engine over a transformers model the caller has; defined in api.py
        # (it builds, which engine.py must not import), attached when Engine is taken from here
        from flexgemma.api import engine_from_model

        value.from_model = staticmethod(engine_from_model)
    globals()[name] = value  # the next access is a plain attribute
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
