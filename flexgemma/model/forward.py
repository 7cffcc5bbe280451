"""flexgemma's forward over a transformers Gemma4ForCausalLM: embeddings, per-layer inputs, the
layer loop over the paged cache, final norm, lm_head and the logit soft-cap.

Tokens of a step are packed into one flat sequence [T]; the layer loop reads only `LayerSpec`s.
Matrix products run as `projections.projection` decides (fused GEMMs, 4-bit or LoRA groups, or
the model's own modules, so peft and bitsandbytes wrappers apply); norms, RoPE and activations are
the compiled glue of glue.py over those modules' weights.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Optional

import torch
import torch.utils.checkpoint
from torch.nn.attention.flex_attention import BlockMask

from flexgemma.config.kernels import Kernels
from flexgemma.model.attention import AttentionKernels, PagedAttention, kernel_options, rope_tables
from flexgemma.model.kv_pools import KVPools
from flexgemma.model.moe import moe_block
from flexgemma.model.projections import Projection, dense_weight, linear4bit_groups, projection
from flexgemma.model.spec import ModelSpec


class GemmaForward(torch.nn.Module):
    def __init__(self, hf_model, spec: ModelSpec, pools: KVPools, attn_cfg, max_len: int,
                 attention: AttentionKernels, ops, lora=None, kernels: Kernels = Kernels(), invariant=None,
                 project: Optional[Callable[..., Projection]] = None):
        super().__init__()
        self.hf = [hf_model]  # a list: not a submodule, so its parameters are listed once, by transformers
        self.spec, self.pools, self.attention, self.ops, self.attn_cfg = spec, pools, attention, ops, attn_cfg
        self.kernels = kernels
        self.layers = hf_model.model.layers
        self.eps = spec.rms_eps
        # engine.batch_invariant: the batch-invariant matrix product (model/invariant/matmul.py) that every
        # product of the forward runs through, the head's and the per-layer inputs' too; None: the usual ones
        self.invariant = invariant
        dtype = hf_model.model.embed_tokens.weight.dtype
        # every projection of the model, as `projection` decides to run it (decided here, once):
        # `lora` the engine's adapters or None; 4-bit bases may run as one group (kernels.linear4bit)
        # (`project` given: the trainer's forward, model/trainable.py, with its own trainable projections)
        make = project or functools.partial(projection, lora=lora, kernels=kernels, invariant=invariant)
        self.made: dict[tuple, Projection] = {}  # (id(owner), names) -> the projection running them

        def project(owner, names, fused=None):
            self.made[id(owner), tuple(names)] = made = make(owner, names, fused=fused)
            return made

        # the fused K/V write is one call over the pools, which the CPU's invariant row padding cannot wrap
        if invariant is not None and not hf_model.model.embed_tokens.weight.is_cuda:
            kernels = dataclasses.replace(kernels, fused_kv_write=False)
        self.checkpoint_layers = False  # the trainer's forward recomputes each layer in the backward
        # contexts(layer spec) -> torch.utils.checkpoint's context_fn pair for that layer (the trainer's:
        # what a recomputation runs)
        self.checkpoint_contexts: Optional[Callable] = None
        # MoE models: the last forward's routed experts, uint8 [rows whose head it returned, MoE layers, top-k]
        self.routing: Optional[torch.Tensor] = None
        self._routing: Optional[list] = None
        # routing replay (the trainer's forward): MoE layer index -> [T, k] expert ids to use (-1: the row's own)
        self.replay: dict[int, torch.Tensor] = {}
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
        head: bool = True,  # False: those rows' final hidden states, for head() to take in parts
    ) -> torch.Tensor:
        if self.invariant is not None and not input_ids.is_cuda:
            from flexgemma.model.invariant.rows import serial

            with serial():  # one thread: the CPU's loops never split a row's work (model/invariant/rows.py)
                return self._forward(input_ids, positions, slots, masks, logits_index, decode, head)
        return self._forward(input_ids, positions, slots, masks, logits_index, decode, head)

    def _forward(self, input_ids, positions, slots, masks, logits_index, decode, head) -> torch.Tensor:
        x = self.hidden(input_ids, positions, slots, masks, decode)
        if logits_index is not None:
            x = x[logits_index]
        self.routing = self.routed_experts(logits_index)
        return self.head(x) if head else x

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """The LM head's output of final hidden states, before the soft-cap: the sampler caps it inside its
        own compiled graph, so the cap can fuse into its reductions over the vocabulary (capping here wrote
        float32 logits, 108 us a step at E2B 256 rows x 262k, which the sampler then read at twice the bytes
        of bf16); `logits` caps it for the callers that need logits. Under engine.batch_invariant a row's
        output does not depend on the rows beside it, so rows may go through in parts."""
        if self.invariant is None:
            return self.model.lm_head(x)
        if x.is_cuda:
            return self.run_module(self.model.lm_head, x)
        from flexgemma.model.invariant.rows import serial

        with serial():  # as forward(): the CPU's loops never split a row's work
            return self.run_module(self.model.lm_head, x)

    def routed_experts(self, rows: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
        """uint8 [T or len(rows), MoE layers, top-k]: the last hidden()'s routed experts (None: no MoE)."""
        if not self._routing:
            return None
        routing = torch.stack(self._routing, dim=1).to(torch.uint8)
        return routing if rows is None else routing[rows]

    def hidden(self, input_ids, positions, slots, masks, decode: bool) -> torch.Tensor:
        """[T, hidden]: every token through the layers and the final norm (what the head reads)."""
        base, ops, eps = self.model.model, self.ops, self.eps
        self._routing = [] if any(s.moe for s in self.spec.layers) else None
        embeds = base.embed_tokens(input_ids)
        per_layer = self.per_layer_inputs(input_ids, embeds) if self.spec.per_layer_input_dim else None
        rope = {t: (cos[positions], sin[positions]) for t, (cos, sin) in self.rope.items()}
        h = embeds
        # x is always h normed for what reads it next: each residual add also norms for the next
        # consumer in the same kernel (add_norm_norm), the last one for the final norm
        x = ops.rms_norm(h, self.layers[0].input_layernorm.weight, eps)
        next_norm = [layer.input_layernorm.weight for layer in self.layers[1:]] + [base.norm.weight]
        for s, w_next in zip(self.spec.layers, next_norm):
            args = (s, w_next, h, x, rope[s.layer_type], slots, masks[s.layer_type], decode, per_layer)
            if self.checkpoint_layers and torch.is_grad_enabled():
                contexts = {"context_fn": functools.partial(self.checkpoint_contexts, s)} if self.checkpoint_contexts else {}
                h, x = torch.utils.checkpoint.checkpoint(self.layer, *args, use_reentrant=False, **contexts)
            else:
                h, x = self.layer(*args)
        return x

    def layer(self, s, w_next, h, x, rope, slots, mask, decode, per_layer):
        """One layer: (residual, its norm for the next consumer) -> the same after the layer."""
        ops, eps, layer = self.ops, self.eps, self.layers[s.index]
        cos, sin = rope
        a = self.attn[s.index](x, cos, sin, slots, mask, decode)
        h, x = ops.add_norm_norm(h, a, layer.post_attention_layernorm.weight, eps,
                                 layer.pre_feedforward_layernorm.weight)
        project = self.project[s.index]
        g, u = project["gate_up"](x)
        m = project["down"](ops.gelu_mul(g, u))[0]
        if s.moe:
            m = moe_block(layer, h, m, ops, eps, self.run_module if self.invariant else None, self._routing,
                          self.replay.get(s.index))
        if s.per_layer_input:
            h = ops.add_norm(h, m, layer.post_feedforward_layernorm.weight, eps)
            g = ops.gelu_mul(project["ple_gate"](h)[0], per_layer[:, s.index, :])
            m, w_end = project["ple_out"](g)[0], layer.post_per_layer_input_norm.weight
        else:
            w_end = layer.post_feedforward_layernorm.weight
        return ops.add_norm_norm(h, m, w_end, eps, w_next, layer.layer_scalar)

    def run_module(self, module, x: torch.Tensor) -> torch.Tensor:
        """x through a linear module's dense weight by the batch-invariant product."""
        return self.invariant(x, dense_weight(module))

    def per_layer_inputs(self, input_ids: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor:
        """[T, layers, dim]: transformers' per-layer-input maths on the packed tokens as a batch of one;
        under engine.batch_invariant the same maths with the projection through the invariant product."""
        base = self.model.model
        token_part = base.get_per_layer_inputs(input_ids[None], None)
        if self.invariant is None:
            return base.project_per_layer_inputs(embeds[None], token_part)[0]
        proj = self.run_module(base.per_layer_model_projection, embeds) * \
            base.per_layer_model_projection_scale
        proj = base.per_layer_projection_norm(proj.reshape(proj.shape[0], len(self.layers), -1))
        return (proj + token_part[0]) * base.per_layer_input_scale

    def logits(self, head: torch.Tensor) -> torch.Tensor:
        """float32 logits from forward()'s head output (soft-capped when the model caps them)."""
        return self.ops.final_logits(head, self.spec.softcap)
