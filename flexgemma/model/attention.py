"""Attention of one Gemma-4 layer over the paged cache: q/k/v projections, their norms, RoPE, the
KV write and the flex_attention call. The projections and norms are the transformers modules
(so LoRA and 4-bit wrappers apply); flexgemma owns how they are combined.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from flexgemma.engine.kv_cache import KVCache
from flexgemma.model.spec import LayerSpec


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE as transformers applies it (rotate-half); x [T, heads, D], cos/sin [T, D]."""
    cos, sin = cos[:, None, :], sin[:, None, :]
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def rope_tables(hf_model, max_len: int, dtype: torch.dtype, device: torch.device) -> dict[str, tuple]:
    """cos/sin [max_len, head_dim] per layer type, from the model's own rotary module."""
    rotary = hf_model.model.rotary_emb
    pos = torch.arange(max_len, device=device)[None, :]
    probe = torch.zeros(1, dtype=dtype, device=device)
    tables = {}
    for layer_type in sorted(set(hf_model.config.layer_types)):
        cos, sin = rotary(probe, pos, layer_type)
        tables[layer_type] = (cos[0].contiguous(), sin[0].contiguous())
    return tables


def kernel_options(phase_cfg: Any, head_dim: int) -> Optional[dict]:
    """torch flex kernel options for one phase, with the head_dim-512 overrides on those layers."""

    def opts(k) -> dict:
        out = {name.upper(): getattr(k, name) for name in ("block_m", "block_n", "num_warps", "num_stages")}
        out = {k2: v for k2, v in out.items() if v is not None}
        out.update(dict(k.extra or {}))
        return out

    merged = opts(phase_cfg)
    if head_dim >= 512:
        merged.update(opts(phase_cfg.full_attention))
    return merged or None


class PagedAttention:
    """Callable per layer; `flex` is one of `attention_fn`'s backends."""

    def __init__(self, spec: LayerSpec, hf_attn, cache: KVCache, flex: Callable, kernels: dict[str, Optional[dict]]):
        self.spec, self.m, self.cache, self.flex = spec, hf_attn, cache, flex
        self.kernels = kernels  # phase -> kernel options

    def __call__(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        slots: torch.Tensor,
        mask: BlockMask,
        decode: bool,
    ) -> torch.Tensor:
        s, m = self.spec, self.m
        t = x.shape[0]
        q = m.q_norm(m.q_proj(x).view(t, s.num_heads, s.head_dim))
        q = rotate(q, cos, sin)
        if s.writes_kv:
            raw_k = m.k_proj(x).view(t, s.num_kv_heads, s.head_dim)
            raw_v = raw_k if s.k_eq_v else m.v_proj(x).view(t, s.num_kv_heads, s.head_dim)
            k = rotate(m.k_norm(raw_k), cos, sin)
            v = m.v_norm(raw_v)
            self.cache.write(s.index, k, v, slots)
        kc, vc = self.cache.layer_kv(s.kv_source)
        if decode:  # one query per sequence: [B, H, 1, D] against the pool broadcast over B
            out = self.flex(
                q[:, :, None, :], kc, vc, block_mask=mask, scale=1.0, enable_gqa=True,
                kernel_options=self.kernels["decode"],
            )[:, :, 0, :]
        else:  # packed prefill: [1, H, T, D]
            out = self.flex(
                q.transpose(0, 1)[None], kc, vc, block_mask=mask, scale=1.0, enable_gqa=True,
                kernel_options=self.kernels["prefill"],
            )[0].transpose(0, 1)
        return m.o_proj(out.reshape(t, s.num_heads * s.head_dim))


def dense_attention(q, k, v, block_mask: BlockMask, scale: float, enable_gqa: bool, kernel_options=None):
    """The CPU path: the same mask_mod evaluated on broadcast index tensors, then SDPA.

    Only the pages the BlockMask lists (plus the sink page) are gathered, so the cost follows the
    live KV, not the pool. Eager flex_attention computes the same thing through vmap over the
    whole pool at ~25 ms a call.
    """
    b, _, q_len, _ = q.shape
    dev = q.device
    page = block_mask.BLOCK_SIZE[1]
    listed = torch.arange(block_mask.kv_indices.shape[-1], device=dev) < block_mask.kv_num_blocks[..., None]
    pages = torch.unique(torch.cat([torch.zeros(1, dtype=torch.int32, device=dev), block_mask.kv_indices[listed]]))
    slots = (pages[:, None].long() * page + torch.arange(page, device=dev)).reshape(-1)
    mask = block_mask.mask_mod(
        torch.arange(b, device=dev)[:, None, None, None],
        torch.zeros(1, 1, 1, 1, dtype=torch.long, device=dev),
        torch.arange(q_len, device=dev)[None, None, :, None],
        slots[None, None, None, :],
    )
    k = k[:, :, slots].expand(b, -1, -1, -1)
    v = v[:, :, slots].expand(b, -1, -1, -1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=enable_gqa)


ATTENTION_BACKENDS = ("flex", "flex_eager", "dense")


def attention_fn(backend: str) -> Callable:
    """flex: compiled flex_attention (the GPU path); flex_eager: torch's unfused reference;
    dense: mask_mod + SDPA (the CPU path)."""
    if backend == "flex":
        from flexgemma.engine.compiled import configure_dynamo

        configure_dynamo()
        # default dynamic: a prefill length that changes becomes a dynamic dim after one recompile
        return torch.compile(flex_attention, fullgraph=True)
    if backend == "flex_eager":
        import warnings

        warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")
        return flex_attention
    if backend == "dense":
        return dense_attention
    raise ValueError(f"attn.backend={backend!r}: choose one of {ATTENTION_BACKENDS} or auto")
