"""bitsandbytes 4-bit weights (quant=bnb4): Linear4bit for every nn.Linear of the text backbone,
expert-by-expert NF4 packing of the fused 3-D MoE experts, and the census of what is 4-bit.

- Linear layers (attention q/k/v/o, dense MLP gate/up/down, the MoE router, the per-layer-input
  gate/projection and the model-level per-layer projection) become `bitsandbytes.nn.Linear4bit`,
  exactly the modules transformers' own bitsandbytes integration makes (so peft can wrap them).
- The fused experts (`gate_up_proj` [E, 2I, H], `down_proj` [E, H, I]) are Parameters, which
  bitsandbytes' module replacement skips. `PackedExperts` replaces `Gemma4TextExperts`: every
  expert is quantised by `bitsandbytes.functional.quantize_4bit` on its own (its blocks never
  straddle two experts) and stacked, so a step can gather the packed rows of the experts it routes
  to and dequantise only those, on the device (see `moe.experts_grouped`).
- Embeddings (and the lm_head tied to them), norms, scalars and router scales stay in the model
  dtype; `storage_census` counts them honestly in the 4-bit fraction.
"""

from __future__ import annotations

import logging
import math
import os
import sys
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from flexgemma.config.schema import ConfigError

log = logging.getLogger("flexgemma")

# Modules that stay in the model dtype: lm_head is tied to the embedding table (a gather, not a matmul).
SKIP_MODULES = ("lm_head",)


@dataclass(frozen=True)
class Bnb4Settings:
    quant_type: str = "nf4"
    double_quant: bool = False  # 8-bit absmax with a second-level scale (~0.37 instead of 0.5 bits/param)
    block_size: int = 64
    compute_dtype: torch.dtype = torch.bfloat16

    @classmethod
    def from_config(cls, quant_cfg, compute_dtype: torch.dtype) -> Optional["Bnb4Settings"]:
        """None for quant=bf16 (method none); the settings for bnb4 (config.QuantConfig checked them)."""
        if quant_cfg is None or quant_cfg.method == "none":
            return None
        return cls(str(quant_cfg.quant_type), bool(quant_cfg.double_quant), int(quant_cfg.block_size), compute_dtype)


def quiet_bitsandbytes_notice() -> None:
    """bitsandbytes' CPU backend logs, when imported, that an optional `kernels` package is missing;
    peft imports bitsandbytes whenever it is installed, so every LoRA run on a CPU would print it,
    4-bit or not. flexgemma's 4-bit CPU path does not need that package."""
    logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)


def import_bitsandbytes_offline() -> None:
    """Imports bitsandbytes (when installed, once) with the Hugging Face Hub held offline. On a CPU with
    AVX512-BF16 its import asks the Hub, through the `kernels` package that transformers brings, for a
    kernel to download and run: a flexgemma job reaches no host and runs no downloaded code, so it keeps
    bitsandbytes' own CPU kernels (quietly: the fallback is not the user's concern). peft imports
    bitsandbytes whenever it is installed: call this before the first peft import too."""
    import warnings

    quiet_bitsandbytes_notice()
    if "bitsandbytes" in sys.modules:
        return
    import huggingface_hub.constants as hub

    kernels_log = logging.getLogger("kernels")
    offline, level = hub.HF_HUB_OFFLINE, kernels_log.level
    hub.HF_HUB_OFFLINE = True
    kernels_log.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import bitsandbytes  # noqa: F401
    except ImportError:
        pass  # not installed, or broken: the caller that needs it says so
    finally:
        hub.HF_HUB_OFFLINE = offline
        kernels_log.setLevel(level)


def require_bitsandbytes(device: torch.device):
    """Imports bitsandbytes and checks it has 4-bit kernels for `device`; a clear error otherwise."""
    import_bitsandbytes_offline()
    try:
        import bitsandbytes as bnb
    except ImportError as e:
        from flexgemma.config.extras import MissingExtra, install_hint

        raise MissingExtra(f"quant=bnb4 needs bitsandbytes ({e}): {install_hint('bnb')} "
                           "(Linux/Windows, CUDA or CPU), or run with quant=bf16") from e
    if device.type == "cpu" and os.environ.get("OMP_WAIT_POLICY", "").upper() != "PASSIVE":
        log.warning("quant=bnb4 on the CPU: bitsandbytes' and torch's OpenMP pools busy-wait against each other "
                    "(4-bit matmuls up to ~300x slower on few cores); export OMP_WAIT_POLICY=PASSIVE before starting")
    if device.type == "cuda":
        from bitsandbytes.cextension import lib

        if not getattr(lib, "compiled_with_cuda", False):
            raise ConfigError(
                f"quant=bnb4 on {device}: bitsandbytes {bnb.__version__} found no CUDA library for this torch/CUDA "
                "(run `python -m bitsandbytes` to see why; install a bitsandbytes wheel built for your CUDA), "
                "or run with quant=bf16 / device=cpu"
            )
    return bnb


# -- linear layers -----------------------------------------------------------------------------
def generic_cpu_kernel(q) -> None:
    """Keeps a Linear4bit off bitsandbytes' AVX512-BF16 CPU kernel, which repacks the weight in
    place at the first forward (it then no longer matches the checkpoint layout), asserts on
    shapes Gemma has (the 16-wide per-layer-input gate) and gives a one-row input other numerics
    than a batch. The generic path dequantises and multiplies: the same maths for any batch."""
    q.support_avx512bf16_for_cpu = False


def generic_cpu_kernels(model: nn.Module) -> nn.Module:
    """generic_cpu_kernel on every Linear4bit of `model` (e.g. a model transformers quantised)."""
    from bitsandbytes.nn import Linear4bit

    for m in model.modules():
        if isinstance(m, Linear4bit):
            generic_cpu_kernel(m)
    return model


def linear4bit_from(linear: nn.Linear, s: Bnb4Settings, device: torch.device) -> nn.Module:
    """A bitsandbytes Linear4bit holding `linear`'s weight quantised on `device` (the bf16 copy is
    dropped with `linear`)."""
    import bitsandbytes as bnb

    q = bnb.nn.Linear4bit(
        linear.in_features, linear.out_features, bias=linear.bias is not None, compute_dtype=s.compute_dtype,
        compress_statistics=s.double_quant, quant_type=s.quant_type, quant_storage=torch.uint8, device="meta",
    )
    w = bnb.nn.Params4bit(
        linear.weight.data, requires_grad=False, blocksize=s.block_size, compress_statistics=s.double_quant,
        quant_type=s.quant_type, quant_storage=torch.uint8, module=q,
    )
    q.weight = w.to(device)  # quantises (bitsandbytes' own kernel on `device`)
    if linear.bias is not None:
        q.bias = nn.Parameter(linear.bias.data.to(device), requires_grad=False)
    generic_cpu_kernel(q)
    return q


def linear4bit_prequantized(weight: torch.Tensor, stats: dict[str, torch.Tensor], bias: Optional[torch.Tensor],
                            compute_dtype: torch.dtype, device: torch.device) -> nn.Module:
    """A Linear4bit from a bitsandbytes checkpoint's packed weight and its `weight.*` quant-state tensors."""
    import bitsandbytes as bnb

    w = bnb.nn.Params4bit.from_prequantized(weight, stats, requires_grad=False, device=device)
    out_features, in_features = w.quant_state.shape
    q = bnb.nn.Linear4bit(
        in_features, out_features, bias=bias is not None, compute_dtype=compute_dtype,
        compress_statistics=w.compress_statistics, quant_type=w.quant_type, quant_storage=w.quant_storage,
        device="meta",
    )
    w.module = q
    q.weight = w
    q.quant_state = w.quant_state
    if bias is not None:
        q.bias = nn.Parameter(bias.to(device=device, dtype=compute_dtype), requires_grad=False)
    generic_cpu_kernel(q)
    return q


def dequantize_blocks(packed: torch.Tensor, absmax: torch.Tensor, block_size: int, quant_type: str,
                      dtype: torch.dtype) -> torch.Tensor:
    """4-bit bytes (any shape, row-major) and their float32 block scales -> the flat weights in `dtype`,
    by bitsandbytes' registered dequantise op (capturable, compilable). Laid out as rows of exactly
    one block: bitsandbytes 0.50's CPU kernel misreads rows shorter than a block."""
    n = packed.numel() * 2
    return torch.ops.bitsandbytes.dequantize_4bit(packed.reshape(-1, 1), absmax.reshape(-1), block_size, quant_type,
                                                  (n // block_size, block_size), dtype).view(n)


# -- fused experts -----------------------------------------------------------------------------
class PackedExpertWeight(nn.Module):
    """One fused expert tensor [E, R, C] as 4-bit blocks, expert by expert.

    Buffers: `packed` uint8 [E, R*C/2]; `absmax` float32 [E, R*C/block] or, with double
    quantisation, uint8 codes [E, R*C/block] + `nested_absmax` float32 [E, ceil(.../256)] +
    `nested_offset` float32 [E] + `nested_code` float32 [256] (bitsandbytes' dynamic map).
    """

    NESTED_BLOCK = 256  # bitsandbytes quantises 4-bit absmax in blocks of 256

    def __init__(self, shape, block_size: int, quant_type: str, dtype: torch.dtype, double_quant: bool):
        super().__init__()
        self.shape = torch.Size(shape)
        self.block_size, self.quant_type, self.dtype, self.double_quant = block_size, quant_type, dtype, double_quant

    @property
    def num_experts(self) -> int:
        return self.shape[0]

    @classmethod
    @torch.no_grad()
    def pack(cls, w: torch.Tensor, s: Bnb4Settings, device: torch.device) -> "PackedExpertWeight":
        import bitsandbytes.functional as bf

        e, r, c = w.shape
        if (r * c) % s.block_size:
            raise ConfigError(
                f"quant.block_size={s.block_size} does not divide one expert's {r}x{c} weights: blocks would straddle "
                "two experts; choose a block size that divides it"
            )
        out = cls(w.shape, s.block_size, s.quant_type, w.dtype if w.dtype.is_floating_point else s.compute_dtype,
                  s.double_quant)
        # One 4-bit quantisation of all experts: with R*C a multiple of the block, every block lies in
        # one expert, so row e of the reshaped result is expert e's own packing.
        q, st = bf.quantize_4bit(
            w.to(device).reshape(e * r, c).contiguous(), blocksize=s.block_size, compress_statistics=False,
            quant_type=s.quant_type, quant_storage=torch.uint8,
        )
        out.register_buffer("packed", q.reshape(e, r * c // 2))
        absmax = st.absmax.reshape(e, r * c // s.block_size)
        if not s.double_quant:
            out.register_buffer("absmax", absmax)
            return out
        # Double quantisation as bitsandbytes does it for one tensor (absmax minus its mean, 8-bit
        # blockwise), here per expert so a step decodes the scales of its experts only.
        codes, nested, offsets, code = [], [], [], None
        for i in range(e):
            offset = absmax[i].mean()
            qa, st2 = bf.quantize_blockwise(absmax[i] - offset, blocksize=cls.NESTED_BLOCK)
            codes.append(qa)
            nested.append(st2.absmax.float())
            offsets.append(offset.float())
            code = st2.code
        out.register_buffer("absmax", torch.stack(codes))
        out.register_buffer("nested_absmax", torch.stack(nested))
        out.register_buffer("nested_offset", torch.stack(offsets))
        out.register_buffer("nested_code", code.float())
        return out

    def expert_absmax(self, experts: Optional[torch.Tensor]) -> torch.Tensor:
        """float32 [S, R*C/block] block scales of the selected experts (all when None)."""
        pick = (lambda t: t) if experts is None else (lambda t: t.index_select(0, experts))
        absmax = pick(self.absmax)
        if not self.double_quant:
            return absmax
        # bitsandbytes' blockwise 8-bit decode (code[q] * scale of its 256-block) + the expert's offset,
        # here per gathered expert so nothing is decoded for experts a step does not use
        n = absmax.shape[1]
        scale = pick(self.nested_absmax).repeat_interleave(self.NESTED_BLOCK, dim=1)[:, :n]
        return self.nested_code[absmax.long()] * scale + pick(self.nested_offset)[:, None]

    def dequantize(self, experts: Optional[torch.Tensor] = None) -> torch.Tensor:
        """[S, R, C] weights of the experts `experts` ([S] ids on the device; all when None), in
        `self.dtype`. A gather and bitsandbytes' registered dequantize op: capturable, compilable."""
        packed = self.packed if experts is None else self.packed.index_select(0, experts)
        flat = dequantize_blocks(packed, self.expert_absmax(experts), self.block_size, self.quant_type, self.dtype)
        return flat.view(packed.shape[0], self.shape[1], self.shape[2])

    def storage_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers())

    def extra_repr(self) -> str:
        return f"shape={tuple(self.shape)}, {self.quant_type}, block={self.block_size}, double_quant={self.double_quant}"


class PackedExperts(nn.Module):
    """Drop-in for transformers' Gemma4TextExperts with 4-bit packed weights (same forward
    signature, so transformers' own decoder layer runs it too)."""

    def __init__(self, experts: nn.Module, s: Bnb4Settings, device: torch.device):
        super().__init__()
        self.num_experts = experts.num_experts
        self.hidden_dim, self.intermediate_dim = experts.hidden_dim, experts.intermediate_dim
        self.act_fn = experts.act_fn
        # submodules not named gate_up_proj/down_proj: peft matches targets like "down_proj" by name
        # and would try to wrap them; the properties below keep moe_block's attribute access
        self.gate_up_packed = PackedExpertWeight.pack(experts.gate_up_proj, s, device)
        self.down_packed = PackedExpertWeight.pack(experts.down_proj, s, device)

    @property
    def gate_up_proj(self) -> PackedExpertWeight:
        return self.gate_up_packed

    @property
    def down_proj(self) -> PackedExpertWeight:
        return self.down_packed

    def forward(self, hidden_states, top_k_index, top_k_weights):
        from flexgemma.model.moe import experts_grouped

        return experts_grouped(hidden_states, top_k_index, top_k_weights, self.gate_up_proj, self.down_proj,
                               self.act_fn)


def _is_experts(module: nn.Module) -> bool:
    return type(module).__name__ == "Gemma4TextExperts"


@torch.no_grad()
def quantise_module(module: nn.Module, s: Bnb4Settings, device: torch.device, prefix: str = "") -> int:
    """Replaces every nn.Linear under `module` by Linear4bit and every fused expert block by
    PackedExperts, quantised on `device`; returns how many modules were replaced."""
    import bitsandbytes as bnb

    n = 0
    for name, child in list(module.named_children()):
        full = f"{prefix}{name}"
        if full in SKIP_MODULES:
            continue
        if isinstance(child, bnb.nn.Linear4bit):
            continue
        if isinstance(child, nn.Linear):
            setattr(module, name, linear4bit_from(child, s, device))
            n += 1
        elif _is_experts(child):
            setattr(module, name, PackedExperts(child, s, device))
            n += 1
        else:
            n += quantise_module(child, s, device, f"{full}.")
    return n


# -- what is stored how ------------------------------------------------------------------------
def _linear4bit_bytes(m) -> int:
    qs = m.weight.quant_state
    total = m.weight.data.numel() * m.weight.data.element_size()
    tensors = [qs.absmax, qs.code]
    if getattr(qs, "state2", None) is not None:
        tensors += [qs.state2.absmax, qs.state2.code]
    return total + sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def storage_census(model: nn.Module) -> dict:
    """Logical parameter counts (a 4-bit weight counts its unpacked elements) and bytes held by
    weights, quant states included. A tied parameter counts once."""
    # a Linear4bit exists only once bitsandbytes is imported: a bf16 build never imports it (its
    # OpenMP pool busy-waits against torch's on the CPU)
    bnb_nn = sys.modules.get("bitsandbytes.nn")
    Linear4bit = getattr(bnb_nn, "Linear4bit", ())
    params_4bit = params_other = nbytes = 0
    seen: set[int] = set()
    for m in model.modules():
        if Linear4bit and isinstance(m, Linear4bit) and getattr(m.weight, "quant_state", None) is not None:
            params_4bit += m.in_features * m.out_features
            nbytes += _linear4bit_bytes(m)
            seen.add(id(m.weight))
        elif isinstance(m, PackedExpertWeight):
            params_4bit += math.prod(m.shape)
            nbytes += m.storage_bytes()
        for p in m.parameters(recurse=False):
            if id(p) in seen:
                continue
            seen.add(id(p))
            params_other += p.numel()
            nbytes += p.numel() * p.element_size()
    total = params_4bit + params_other
    return {
        "params": total,
        "quant/params_4bit": params_4bit,
        "quant/fraction_4bit": params_4bit / total if total else 0.0,
        "quant/weight_bytes": nbytes,
    }
