"""flexgemma: a fast Gemma-4 generation engine on flex_attention, and the experiment framework around it.

    from flexgemma import compose, build_engine, SamplingParams
    cfg = compose(["+model=tiny", "quant=bf16"])
    engine = build_engine(cfg)
    outs = engine.generate([[2, 818, 5279], [2, 651]], SamplingParams(max_new_tokens=32, temperature=0.0))
"""

from flexgemma.api import engine_from_model
from flexgemma.builder import build_engine
from flexgemma.compose import compose
from flexgemma.config import ConfigError
from flexgemma.engine.engine import Engine, RequestError
from flexgemma.engine.score import ScoreOutput
from flexgemma.engine.sequence import CompletionOutput, RequestOutput, SamplingParams
from flexgemma.outputs import outputs_to_dataset

__all__ = ["compose", "build_engine", "SamplingParams", "RequestOutput", "CompletionOutput", "ScoreOutput", "Engine",
           "ConfigError", "RequestError", "outputs_to_dataset"]
# Engine.from_model: an engine over a transformers model the caller has. Defined in api.py (it
# builds, which engine.py must not import); set here, where every import of the engine passes first.
Engine.from_model = staticmethod(engine_from_model)

__version__ = "0.1.0"
