"""What a variant costs before it is built: parameters, weight bytes and a rough build time.

The parameters are counted on the meta device (no memory, well under a second even for 26B-A4B).
A big model on a CPU (or on a GPU with too little free memory) is refused before anything is
allocated, with the estimate and the CPU-sized variant of the same architecture; the user can
insist with model.allow_large_cpu=true.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from flexgemma.config.schema import ConfigError
from flexgemma.model.spec import ModelSpec

# Beyond this a CPU builds and runs a model too slowly to be useful (minutes to build, seconds a
# token); the tiny variants have ~1M parameters.
CPU_PARAMS_LIMIT = 1_000_000_000
# Rough build rates in parameters a second (random init, or init + 4-bit packing). The CPU bnb4 rate
# is one 26B-A4B layer built on a 2-core machine (~20M/s); the others are order-of-magnitude guesses,
# and only the order of magnitude matters for the message.
_RATES = {("cpu", False): 150e6, ("cpu", True): 20e6, ("cuda", False): 5e9, ("cuda", True): 1e9}
# bnb4: 4 bits a weight plus one float32 absmax per block of 64
_BNB4_BYTES = 0.5 + 4 / 64


@dataclass(frozen=True)
class BuildEstimate:
    name: str
    params: int
    weight_bytes: int
    seconds: float
    moe: bool
    quantised: bool
    kv_bytes_per_token: int  # over every KV-writing layer, in the model dtype


def _text_config(model_cfg):
    from flexgemma.model.load import _plain, _read_checkpoint_config, text_config_from_dict

    if model_cfg.path:
        text, _ = _read_checkpoint_config(Path(model_cfg.path).expanduser())
    else:
        text = _plain(model_cfg.hf_config)
    return text_config_from_dict(text)


def estimate_build(model_cfg, quant_cfg, device: torch.device) -> Optional[BuildEstimate]:
    """Parameters, weight bytes (embeddings in the model dtype, the rest 4-bit under bnb4) and
    seconds to build `model_cfg` on `device`, counted on the meta device. None for a model.path
    that is not a directory (the build says what is wrong with it)."""
    from transformers import Gemma4ForCausalLM

    from flexgemma.model.load import model_dtype

    if model_cfg.path and not Path(model_cfg.path).expanduser().is_dir():
        return None
    quantised = quant_cfg is not None and quant_cfg.method != "none"
    dtype = model_dtype(model_cfg, quant_cfg, device)
    config = _text_config(model_cfg)
    with torch.device("meta"):
        model = Gemma4ForCausalLM(config)
    embed = {id(p) for m in model.modules() if isinstance(m, torch.nn.Embedding) for p in m.parameters()}
    seen, params, nbytes = set(), 0, 0.0
    full = torch.finfo(dtype).bits // 8
    for p in model.parameters():  # tied parameters once
        if id(p) in seen:
            continue
        seen.add(id(p))
        params += p.numel()
        nbytes += p.numel() * (_BNB4_BYTES if quantised and id(p) not in embed and p.dim() >= 2 else full)
    rate = _RATES[("cuda" if device.type == "cuda" else "cpu", quantised)]
    kv = ModelSpec.from_hf_config(config).kv_bytes_per_token(full)
    return BuildEstimate(str(model_cfg.name), params, int(nbytes), params / rate,
                         bool(getattr(config, "enable_moe_block", False)), quantised, kv)


def _duration(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    return f"{seconds / 60:.0f} min" if seconds < 5400 else f"{seconds / 3600:.1f} h"


def describe(est: BuildEstimate, kv_bytes: int, device: torch.device) -> str:
    how = "bnb4" if est.quantised else "unquantised"
    return (f"model {est.name!r}: {est.params / 1e9:.2f}B parameters ({how}) need ~{est.weight_bytes / 2**30:.1f} GiB "
            f"of weights + {kv_bytes / 2**30:.2f} GiB of KV pool and ~{_duration(est.seconds)} to build on "
            f"{device.type} (rough)")


def refuse_if_too_large(est: BuildEstimate, kv_bytes: int, device: torch.device, free_bytes: int) -> None:
    """Raises ConfigError (one line: the estimate, why, and the alternatives) when the model is too
    large for a CPU run or does not fit the device's free memory."""
    need = est.weight_bytes + kv_bytes
    small = "tiny_moe (the same MoE architecture" if est.moe else "tiny (the same dense architecture"
    # 4-bit weights shrink the memory, not the parameter count: quant=bnb4 is offered for memory only
    shrink = ""
    if device.type != "cuda" and est.params > CPU_PARAMS_LIMIT:
        why = f"too large for a CPU (over {CPU_PARAMS_LIMIT / 1e9:.0f}B parameters, 4-bit or not)"
    elif need > 0.95 * free_bytes:
        why = f"more than the {free_bytes / 2**30:.1f} GiB free on {device.type}"
        shrink = "" if est.quantised else ", quant=bnb4"
    else:
        return
    raise ConfigError(
        f"{describe(est, kv_bytes, device)}: {why}. Use +model={small} at CPU size), a GPU with enough memory"
        f"{shrink}, or model.allow_large_cpu=true to build it anyway"
    )
