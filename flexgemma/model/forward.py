"""flexgemma's forward over a transformers Gemma4ForCausalLM: embeddings, per-layer inputs, the
layer loop over the paged cache, final norm, lm_head and the logit soft-cap.

Tokens of a step are packed into one flat sequence [T]; the layer loop reads only `LayerSpec`s.
Matrix products run as `projections.projection` decides (fused GEMMs, 4-bit or LoRA groups, or
the model's own modules, so peft and bitsandbytes wrappers apply); norms, RoPE and activations are
the compiled glue of glue.py over those modules' weights.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
from torch.nn.attention.flex_attention import BlockMask

from flexgemma.kernels import Kernels
from flexgemma.model.attention import AttentionKernels, PagedAttention, kernel_options, rope_tables
from flexgemma.model.kv_pools import KVPools
from flexgemma.model.moe import moe_block
from flexgemma.model.projections import linear4bit_groups, projection
from flexgemma.model.spec import ModelSpec


class GemmaForward(torch.nn.Module):
    def __init__(self, hf_model, spec: ModelSpec, pools: KVPools, attn_cfg, max_len: int,
                 attention: AttentionKernels, ops, lora=None, kernels: Kernels = Kernels()):
        super().__init__()
        self.hf = [hf_model]  # a list: not a submodule, so its parameters are listed once, by transformers
        self.spec, self.pools, self.attention, self.ops = spec, pools, attention, ops
        self.layers = hf_model.model.layers
        self.eps = spec.rms_eps
        dtype = hf_model.model.embed_tokens.weight.dtype
        # every projection of the model, as `projection` decides to run it (decided here, once):
        # `lora` the engine's adapters or None; 4-bit bases may run as one group (kernels.linear4bit)
        project = functools.partial(projection, lora=lora, kernels=kernels)
        self.attn = [
            PagedAttention(
                s, layer.self_attn, pools, attention, ops, self.eps,
                {ph: kernel_options(getattr(attn_cfg, ph), s.head_dim, pools.block_size, dtype) for ph in ("prefill", "decode")},
                project, kernels,
            )
            for s, layer in zip(spec.layers, self.layers)
        ]
        self.project = [
            {"gate_up": project(layer.mlp, ["gate_proj", "up_proj"], fused="fused_gate_up"),
             "down": project(layer.mlp, ["down_proj"]),
             **({"ple_gate": project(layer, ["per_layer_input_gate"]),
                 "ple_out": project(layer, ["per_layer_projection"])}
                if s.per_layer_input else {})}
            for s, layer in zip(spec.layers, self.layers)
        ]
        p = hf_model.model.embed_tokens.weight
        self.rope = rope_tables(hf_model, max_len, p.dtype, p.device)

    @property
    def model(self):
        return self.hf[0]

    def linear4bit_groups(self) -> list:
        """The `linear4bit.Linear4bitGroup`s the projections run (alone or under a LoRA group)."""
        return linear4bit_groups([f for a in self.attn for f in (a.project_qkv, a.project_o)] +
                                 [f for p in self.project for f in p.values()])

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        slots: dict[str, torch.Tensor],  # layer type -> [T] flat cache slot of each token's K/V
        masks: dict[str, BlockMask],
        logits_index: Optional[torch.Tensor],  # rows whose logits are needed (None: all)
        decode: bool,
    ) -> torch.Tensor:
        base, ops, eps = self.model.model, self.ops, self.eps
        embeds = base.embed_tokens(input_ids)
        per_layer = None
        if self.spec.per_layer_input_dim:
            # transformers' own PLE maths, on the packed tokens as a batch of one
            per_layer = base.project_per_layer_inputs(embeds[None], base.get_per_layer_inputs(input_ids[None], None))[0]
        rope = {t: (cos[positions], sin[positions]) for t, (cos, sin) in self.rope.items()}
        h = embeds
        # x is always h normed for what reads it next: each residual add also norms for the next
        # consumer in the same kernel (add_norm_norm), the last one for the final norm
        x = ops.rms_norm(h, self.layers[0].input_layernorm.weight, eps)
        next_norm = [layer.input_layernorm.weight for layer in self.layers[1:]] + [base.norm.weight]
        for s, layer, attn, w_next in zip(self.spec.layers, self.layers, self.attn, next_norm):
            cos, sin = rope[s.layer_type]
            a = attn(x, cos, sin, slots, masks[s.layer_type], decode)
            h, x = ops.add_norm_norm(h, a, layer.post_attention_layernorm.weight, eps,
                                     layer.pre_feedforward_layernorm.weight)
            project = self.project[s.index]
            g, u = project["gate_up"](x)
            m = project["down"](ops.gelu_mul(g, u))[0]
            if s.moe:
                m = moe_block(layer, h, m, ops, eps)
            if s.per_layer_input:
                h = ops.add_norm(h, m, layer.post_feedforward_layernorm.weight, eps)
                g = ops.gelu_mul(project["ple_gate"](h)[0], per_layer[:, s.index, :])
                m, w_end = project["ple_out"](g)[0], layer.post_per_layer_input_norm.weight
            else:
                w_end = layer.post_feedforward_layernorm.weight
            h, x = ops.add_norm_norm(h, m, w_end, eps, w_next, layer.layer_scalar)
        if logits_index is not None:
            x = x[logits_index]
        # the head's output, before the soft-cap: the sampler caps it inside its own compiled graph,
        # so the cap can fuse into its reductions over the vocabulary (capping here wrote float32
        # logits, 108 us a step at E2B 256 rows x 262k, which the sampler then read at twice the
        # bytes of bf16); `logits` caps it for the callers that need logits
        return self.model.lm_head(x)

    def logits(self, head: torch.Tensor) -> torch.Tensor:
        """float32 logits from forward()'s head output (soft-capped when the model caps them)."""
        return self.ops.final_logits(head, self.spec.softcap)
