"""ModelSpec / LayerSpec: every per-layer difference of Gemma-4, derived once from the HF config.

The forward, the KV cache and the mask builder read these; none of them asks the HF config or
re-derives a layer's shape. This is the one place that knows how Gemma-4 layers differ.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

SLIDING = "sliding_attention"
FULL = "full_attention"


@dataclass(frozen=True)
class LayerSpec:
    index: int
    layer_type: str  # SLIDING | FULL: picks the RoPE table, the mask and the kernel options
    window: Optional[int]  # sliding window in tokens (a query sees itself and window-1 before); None = causal
    head_dim: int
    num_heads: int
    num_kv_heads: int
    kv_source: int  # the layer whose KV this layer attends to (itself unless KV-shared)
    writes_kv: bool  # owns K/V projections and a KV pool; False for KV-shared layers
    k_eq_v: bool  # values are the raw key projection through a scale-free norm (no v_proj)
    mlp_width: int  # dense MLP width (doubled on KV-shared layers of E2B)
    moe: bool  # routed experts beside the dense MLP
    per_layer_input: bool  # PLE residual after the MLP


@dataclass(frozen=True)
class ModelSpec:
    layers: tuple[LayerSpec, ...]
    hidden_size: int
    vocab_size: int
    max_position: int
    softcap: Optional[float]
    eos_token_ids: tuple[int, ...]
    per_layer_input_dim: int  # 0 when the model has no per-layer inputs
    rms_eps: float

    @property
    def layer_types(self) -> tuple[str, ...]:
        return tuple(sorted({layer.layer_type for layer in self.layers}))

    @property
    def kv_layers(self) -> tuple[LayerSpec, ...]:
        return tuple(layer for layer in self.layers if layer.writes_kv)

    def kv_bytes_per_token(self, element_size: int, layer_types=None) -> int:
        return sum(2 * s.num_kv_heads * s.head_dim * element_size for s in self.kv_layers
                   if layer_types is None or s.layer_type in layer_types)

    def kv_bytes_per_sequence(self, tokens: int, element_size: int) -> int:
        """KV bytes one sequence of `tokens` tokens holds: K and V of every KV-writing layer (KV-shared
        layers hold none), a sliding layer at most its window."""
        return sum(2 * s.num_kv_heads * s.head_dim * element_size * (tokens if s.window is None else min(tokens, s.window))
                   for s in self.kv_layers)

    @classmethod
    def from_hf_config(cls, config) -> "ModelSpec":
        n = config.num_hidden_layers
        types = list(config.layer_types)
        first_shared = n - (config.num_kv_shared_layers or 0)
        # A KV-shared layer reads the last non-shared layer of its own type (as transformers does).
        last_writer = {t: max((i for i in range(first_shared) if types[i] == t), default=None) for t in set(types)}
        layers = []
        for i, t in enumerate(types):
            per_layer = config.per_layer_config[i]
            shared = i >= first_shared and first_shared < n
            if shared and last_writer[t] is None:
                raise ValueError(f"layer {i} is KV-shared but no earlier {t} layer writes KV")
            double = bool(config.use_double_wide_mlp) and shared and first_shared > 0
            layers.append(
                LayerSpec(
                    index=i,
                    layer_type=t,
                    window=config.sliding_window if t == SLIDING else None,
                    head_dim=per_layer.head_dim,
                    num_heads=config.num_attention_heads,
                    num_kv_heads=per_layer.num_key_value_heads,
                    kv_source=last_writer[t] if shared else i,
                    writes_kv=not shared,
                    k_eq_v=bool(config.attention_k_eq_v) and t == FULL,
                    mlp_width=config.intermediate_size * (2 if double else 1),
                    moe=bool(config.enable_moe_block),
                    per_layer_input=bool(config.hidden_size_per_layer_input),
                )
            )
        eos = config.eos_token_id
        eos = tuple(eos) if isinstance(eos, (list, tuple)) else (() if eos is None else (eos,))
        return cls(
            layers=tuple(layers),
            hidden_size=config.hidden_size,
            vocab_size=config.vocab_size,
            max_position=config.max_position_embeddings,
            softcap=config.final_logit_softcapping,
            eos_token_ids=eos,
            per_layer_input_dim=config.hidden_size_per_layer_input or 0,
            rms_eps=config.rms_norm_eps,
        )
