"""flexgemma's forward over a transformers Gemma4ForCausalLM: embeddings, per-layer inputs, the
layer loop over the paged cache, final norm, lm_head and the logit soft-cap.

Tokens of a step are packed into one flat sequence [T]; the layer loop reads only `LayerSpec`s.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch.nn.attention.flex_attention import BlockMask

from flexgemma.engine.kv_cache import KVCache
from flexgemma.model.attention import PagedAttention, attention_fn, kernel_options, rope_tables
from flexgemma.model.moe import moe_block
from flexgemma.model.spec import ModelSpec


class GemmaForward(torch.nn.Module):
    def __init__(self, hf_model, spec: ModelSpec, cache: KVCache, attn_cfg, max_len: int, backend: str):
        super().__init__()
        self.hf = [hf_model]  # a list: not a submodule, so its parameters are listed once, by transformers
        self.spec = spec
        self.cache = cache
        self.layers = hf_model.model.layers
        flex = attention_fn(backend)
        self.attn = [
            PagedAttention(
                s, layer.self_attn, cache, flex,
                {ph: kernel_options(attn_cfg[ph], s.head_dim) for ph in ("prefill", "decode")},
            )
            for s, layer in zip(spec.layers, self.layers)
        ]
        p = next(hf_model.parameters())
        compute_dtype = hf_model.model.embed_tokens.weight.dtype if p.dtype.is_floating_point else torch.bfloat16
        self.rope = rope_tables(hf_model, max_len, compute_dtype, p.device)

    @property
    def model(self):
        return self.hf[0]

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        slots: torch.Tensor,  # [T] flat cache slot of each token's K/V
        masks: dict[str, BlockMask],
        logits_index: Optional[torch.Tensor],  # rows whose logits are needed (None: all)
        decode: bool,
    ) -> torch.Tensor:
        base = self.model.model
        embeds = base.embed_tokens(input_ids)
        per_layer = None
        if self.spec.per_layer_input_dim:
            # transformers' own PLE maths, on the packed tokens as a batch of one
            per_layer = base.project_per_layer_inputs(embeds[None], base.get_per_layer_inputs(input_ids[None], None))[0]
        rope = {t: (cos[positions], sin[positions]) for t, (cos, sin) in self.rope.items()}
        h = embeds
        for s, layer, attn in zip(self.spec.layers, self.layers, self.attn):
            cos, sin = rope[s.layer_type]
            residual = h
            a = attn(layer.input_layernorm(h), cos, sin, slots, masks[s.layer_type], decode)
            h = residual + layer.post_attention_layernorm(a)
            residual = h
            m = layer.mlp(layer.pre_feedforward_layernorm(h))
            if s.moe:
                m = moe_block(layer, residual, m)
            h = residual + layer.post_feedforward_layernorm(m)
            if s.per_layer_input:
                g = layer.act_fn(layer.per_layer_input_gate(h)) * per_layer[:, s.index, :]
                h = h + layer.post_per_layer_input_norm(layer.per_layer_projection(g))
            h = h * layer.layer_scalar
        if logits_index is not None:
            h = h[logits_index]
        logits = self.model.lm_head(base.norm(h)).float()
        if self.spec.softcap is not None:
            logits = torch.tanh(logits / self.spec.softcap) * self.spec.softcap
        return logits
