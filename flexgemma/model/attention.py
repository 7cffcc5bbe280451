"""Attention of one Gemma-4 layer over the paged cache: q/k/v projections, their norms, RoPE, the
KV write and the flex_attention call. The projections are the transformers modules (so LoRA and
4-bit wrappers apply); the norms read those modules' weights; flexgemma owns how they combine.
"""

from __future__ import annotations

import functools
import inspect
import logging
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from flexgemma.model.compiled import CompileCounter, compile_fn
from flexgemma.config.kernels import Kernels
from flexgemma.model.kv_pools import KVPools
from flexgemma.model.projections import Projection
from flexgemma.model.spec import LayerSpec

log = logging.getLogger("flexgemma")


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


# config field -> flex kernel option: tile sizes are template constants (upper case), warps and
# stages are Triton launch parameters (lower case); a wrongly cased key is silently ignored
_KERNEL_KEYS = {"block_m": "BLOCK_M", "block_n": "BLOCK_N", "num_warps": "num_warps", "num_stages": "num_stages"}


def kernel_options(phase_cfg: Any, head_dim: int, page_size: int, dtype: torch.dtype = torch.bfloat16) -> Optional[dict]:
    """torch flex kernel options for one phase, with the head_dim-512 overrides on those layers.

    float32 tiles take twice the shared memory of bf16: on head_dim >= 256 layers they are capped
    (32, or 16 and one stage at head_dim 512) so they fit the H200's 227 KiB (torch's own float32
    prefill tile for head_dim 256 needs 297 KiB; the bf16 head_dim-512 options need 325 KiB).
    """

    def opts(k) -> dict:
        out = {key: getattr(k, name) for name, key in _KERNEL_KEYS.items() if getattr(k, name) is not None}
        out.update(dict(k.extra or {}))
        return out

    merged = opts(phase_cfg)
    # a kernel tile never spans two pages: torch's default BLOCK_N (128 for some head dims and
    # dtypes) would not divide a 64-token page and fails at lowering
    merged.setdefault("BLOCK_N", min(page_size, 64))
    if head_dim >= 512:
        merged.update(opts(phase_cfg.full_attention))
    if dtype == torch.float32 and head_dim >= 256:
        cap = 16 if head_dim >= 512 else 32
        for key in ("BLOCK_M", "BLOCK_N"):
            merged[key] = min(merged.get(key, cap), cap)
        merged["num_stages"] = 1 if head_dim >= 512 else min(merged.get("num_stages", 2), 2)
    return merged or None


class PagedAttention:
    """One layer's attention: projections (as `projections.projection` runs them), fused norm +
    RoPE, the KV write and the attention kernel of the phase."""

    def __init__(self, spec: LayerSpec, hf_attn, pools: KVPools, attention: "AttentionKernels", ops, eps: float,
                 options: dict[str, Optional[dict]], project: Callable[..., Projection], kernels: Kernels = Kernels()):
        self.spec, self.m, self.pools, self.attention, self.ops, self.eps = spec, hf_attn, pools, attention, ops, eps
        self.options = options  # phase -> flex kernel options for this layer's head_dim
        # kernels.fused_kv_write: the K/V norms and the pool write as one compiled function (glue.kv_norm_write)
        self.fused_kv_write = kernels.fused_kv_write
        # the projections the layer uses: q, and k / v where it writes its own KV (one GEMM when fused)
        used = ["q_proj"] + (["k_proj"] if spec.writes_kv else []) + \
            (["v_proj"] if spec.writes_kv and not spec.k_eq_v else [])
        self.project_qkv = project(hf_attn, used, fused="fused_qkv")
        self.project_o = project(hf_attn, ["o_proj"])

    def __call__(self, x, cos, sin, slots, mask: BlockMask, decode: bool) -> torch.Tensor:
        s, m, ops = self.spec, self.m, self.ops
        t = x.shape[0]
        parts = self.project_qkv(x)
        q_lin = parts[0]
        k_lin = parts[1] if s.writes_kv else None
        v_lin = k_lin if s.k_eq_v or not s.writes_kv else parts[2]
        q = ops.norm_rope(q_lin.reshape(t, s.num_heads, s.head_dim), m.q_norm.weight, cos, sin, self.eps)
        if s.writes_kv:
            raw_k = k_lin.reshape(t, s.num_kv_heads, s.head_dim)
            raw_v = v_lin.reshape(t, s.num_kv_heads, s.head_dim)
            if self.fused_kv_write:
                ops.kv_norm_write(raw_k, raw_v, m.k_norm.weight, cos, sin, self.eps, *self.pools.layer_kv(s.index),
                                  slots[s.layer_type])
            else:
                k = ops.norm_rope(raw_k, m.k_norm.weight, cos, sin, self.eps)
                v = ops.rms_norm(raw_v, None, self.eps)  # values: a scale-free norm, no RoPE
                self.pools.write(s.index, k, v, slots[s.layer_type])  # each layer type's own slots
        kc, vc = self.pools.layer_kv(s.kv_source)
        if isinstance(mask, VarlenPrefill):  # each chunk's keys read from the pool by slot
            out = self.attention.varlen_prefill(q, kc, vc, mask)
        elif decode:
            out = self.attention.decode(q, kc, vc, mask, self.options["decode"])
        else:
            out = self.attention.prefill(q, kc, vc, mask, self.options["prefill"])
        return self.project_o(out.reshape(t, s.num_heads * s.head_dim))[0]


class AttentionKernels:
    """The attention calls of both phases for one backend.

    flex: compiled flex_attention; decode is compiled with a static batch (torch's flex *decoding*
    kernel needs one) for each of a few row counts (`kernels.decode_rows`), and a step pads its
    queries to the smallest that holds them (padding rows list no pages, so their programs exit at
    once). Few counts: few compiles; not one: a batch of 8 padded to 512 rows would also get the
    kernel's split of the KV for 512 rows, one program a row, where 16 rows split each row's KV over
    many. Prefill is compiled with a dynamic length. Other backends run at the batch they are given.
    """

    def __init__(self, backend: str, kernels: Kernels = Kernels(), counter=None):
        self.backend, self.kernels = backend, kernels
        if backend == "flex":
            counter = counter or CompileCounter()
            self._decode = compile_fn(flex_attention, counter, dynamic=False)
            self._prefill = compile_fn(flex_attention, counter, dynamic=None)
        else:
            self._decode = self._prefill = attention_fn(backend)

    def decode(self, q, k, v, mask, options):
        """q [B, H, D] -> [B, H, D]: one query per sequence against the pool broadcast over B."""
        b = q.shape[0]
        rows = self.kernels.padded_rows(b)
        if rows > b:
            q = F.pad(q, (0, 0, 0, 0, 0, rows - b))
        out = self._call(self._decode, "decode", q[:, :, None, :], k, v, mask, options)
        return out[:b, :, 0, :]

    def prefill(self, q, k, v, mask, options):
        """q [T, H, D] packed -> [T, H, D]."""
        out = self._call(self._prefill, "prefill", q.transpose(0, 1)[None], k, v, mask, options)
        return out[0].transpose(0, 1)

    @staticmethod
    def _call(fn, phase, q, k, v, mask, options):
        try:
            return fn(q, k, v, block_mask=mask, scale=1.0, enable_gqa=True, kernel_options=options)
        except Exception as e:  # noqa: BLE001 - kernel options that do not fit surface as a Triton/Inductor error
            text = str(e)
            if "out of resource" not in text and "No valid triton configs" not in text \
                    and "must be divisible by BLOCK_M and BLOCK_N" not in text:
                raise
            from flexgemma.config.schema import ConfigError

            key = f"attn.{phase}" + (".full_attention" if q.shape[-1] >= 512 else "")
            reason = text.strip().splitlines()[0][:300]
            raise ConfigError(
                f"flex_attention kernel options {options} ({phase}, head_dim {q.shape[-1]}, {q.dtype}) do not work "
                f"on this GPU: {reason}. Lower {key}.block_m / block_n / num_stages."
            ) from e

    @staticmethod
    def varlen_prefill(q, k_pool, v_pool, layout: "VarlenPrefill"):
        """q [T, H, D] packed; each chunk's keys and values read from the pool at `layout.k_slots`."""
        k = k_pool[0].index_select(1, layout.k_slots).transpose(0, 1)
        v = v_pool[0].index_select(1, layout.k_slots).transpose(0, 1)
        if q.is_cuda:
            return flash_varlen(q, k, v, layout)
        return varlen_reference(q, k, v, layout)


class InvariantAttentionKernels:
    """engine.batch_invariant: both phases through `invariant.attention.paged_attention`, which reads
    the step's `RowTable`s (the masks the engine builds in this mode) instead of BlockMasks. A decode
    step runs at the batch it is given: no row padding, nothing chosen from the batch."""

    backend = "invariant"
    decode_rows = None

    def __init__(self, page_size: int, kernels: Kernels = Kernels()):
        from flexgemma.model.invariant.attention import InvariantAttentionOptions

        self.page_size = page_size
        self.options = InvariantAttentionOptions(kernels.invariant_split_tokens, kernels.invariant_block_n,
                                                 kernels.invariant_flatten)

    def padded_rows(self, b: int) -> int:
        return b

    def decode(self, q, k, v, rows, options=None):
        from flexgemma.model.invariant.attention import paged_attention

        return paged_attention(q, k, v, rows, self.page_size, self.options)

    prefill = decode  # the RowTable says which phase: one computation for both


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
    """flex_eager: torch's unfused flex reference; dense: mask_mod + SDPA (the CPU path)."""
    if backend == "flex_eager":
        import warnings

        warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")
        return flex_attention
    if backend == "dense":
        return dense_attention
    raise ValueError(f"attn.backend={backend!r}: choose one of {ATTENTION_BACKENDS} or auto")


# FlashAttention's largest head_dim: layers with wider heads (Gemma-4's head_dim-512 full-attention
# layers) keep flex under kernels.prefill_attention=varlen
FLASH_MAX_HEAD_DIM = 256


@dataclass
class VarlenPrefill:
    """A prefill step described for kernels.prefill_attention=varlen: packed variable-length
    attention (FlashAttention) over keys gathered by slot, instead of flex over the whole pool,
    where short packed prompts leave most tiles partial and each partial tile evaluates the
    mask_mod. Chunk i's queries are rows cu_seqlens_q[i]:cu_seqlens_q[i+1] of the step, its keys
    k_slots[cu_seqlens_k[i]:cu_seqlens_k[i+1]]: the positions its queries may read, ending at its
    last query (the causal mask aligned bottom-right). The padding is one chunk more, its keys the
    sink slot."""

    cu_seqlens_q: torch.Tensor  # [N + 1] int32
    cu_seqlens_k: torch.Tensor  # [N + 1] int32
    max_q: int
    max_k: int
    k_slots: torch.Tensor  # [cu_seqlens_k[-1]] int64 flat pool slots
    window: Optional[int]  # sliding layers: a key sits less than `window` positions behind its query


@functools.cache
def _varlen_attn() -> tuple[Callable, frozenset]:
    """torch's varlen_attn (2.11, the oldest torch flexgemma takes, has its scale and window) and its
    parameters' names, looked up once."""
    from torch.nn.attention.varlen import varlen_attn

    return varlen_attn, frozenset(inspect.signature(varlen_attn).parameters)


def flash_varlen(q, k, v, layout: VarlenPrefill):
    """torch's varlen_attn (FlashAttention, bf16/fp16 on a GPU), scale 1 as flex's."""
    varlen_attn, params = _varlen_attn()
    extra = {}
    if k.shape[1] != q.shape[1]:
        if "enable_gqa" in params:
            extra["enable_gqa"] = True
        else:  # torch before 2.12: one K/V head per query head
            k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
            v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    # FlashAttention's window (left, right): keys at [i - left, i + right]; left = window - 1 keeps
    # those less than `window` behind, as the mask_mod does
    window = (-1, 0) if layout.window is None else (layout.window - 1, 0)
    return varlen_attn(q.contiguous(), k.contiguous(), v.contiguous(), layout.cu_seqlens_q, layout.cu_seqlens_k,
                       layout.max_q, layout.max_k, scale=1.0, window_size=window, **extra)


def varlen_reference(q, k, v, layout: VarlenPrefill):
    """The CPU path of varlen_prefill, what flash_varlen computes in any dtype: chunk by chunk, its
    queries against its keys, causal aligned bottom-right, within the window, through SDPA."""
    out = torch.empty_like(q)
    cq, ck = layout.cu_seqlens_q.tolist(), layout.cu_seqlens_k.tolist()
    for qa, qb, ka, kb in zip(cq, cq[1:], ck, ck[1:]):
        nq, nk = qb - qa, kb - ka
        qpos = torch.arange(nk - nq, nk, device=q.device)[:, None]
        kpos = torch.arange(nk, device=q.device)[None, :]
        mask = kpos <= qpos
        if layout.window is not None:
            mask &= kpos > qpos - layout.window
        o = F.scaled_dot_product_attention(q[qa:qb].transpose(0, 1), k[ka:kb].transpose(0, 1),
                                           v[ka:kb].transpose(0, 1), attn_mask=mask, scale=1.0, enable_gqa=True)
        out[qa:qb] = o.transpose(0, 1)
    return out


def check_varlen(device: torch.device, dtype: torch.dtype, invariant: bool) -> None:
    """kernels.prefill_attention=varlen at build: FlashAttention on a GPU takes bf16 or fp16; the
    batch-invariant mode has its own prefill kernel."""
    from flexgemma.config.schema import ConfigError

    if invariant:
        log.warning("kernels.prefill_attention=varlen does nothing under engine.batch_invariant=true: the invariant "
                    "attention kernel computes both phases")
        return
    if device.type != "cuda":
        return  # the CPU computes the same mask through SDPA
    if dtype not in (torch.bfloat16, torch.float16):
        raise ConfigError(f"kernels.prefill_attention=varlen runs FlashAttention, which takes bf16 or fp16, and this "
                          f"model computes in {dtype}: use kernels.prefill_attention=flex or model.dtype=bfloat16")
