"""Build the transformers Gemma4ForCausalLM the engine runs: a named variant with random weights, or
the text backbone of a local checkpoint directory (`model.path`).

transformers owns the modules and parameters (so peft and bitsandbytes keep working on them);
this module only decides the config, the dtype, the device and where the weights come from.
"""

from __future__ import annotations

import json
import logging
import warnings
from pathlib import Path
from typing import Any, Optional

import torch
from omegaconf import OmegaConf

log = logging.getLogger("flexgemma")

# Checkpoint key prefixes of the multimodal Gemma4ForConditionalGeneration and what they map to in
# Gemma4ForCausalLM. Everything else there (vision/audio towers, their embedders) is never read.
_TEXT_PREFIXES = (("model.language_model.", "model."), ("model.", "model."), ("lm_head.", "lm_head."))


class ModelLoadError(ValueError):
    """A model directory or variant that cannot be loaded; the message says what to fix."""


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name in ("auto", None):
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[name]


def _plain(obj: Any) -> Any:
    return OmegaConf.to_container(obj, resolve=True) if OmegaConf.is_config(obj) else obj


def text_config_from_dict(d: dict):
    from transformers import Gemma4TextConfig

    d = {k: _plain(v) for k, v in _plain(d).items()}
    n = d.get("num_hidden_layers")
    types = d.get("layer_types")
    if n is not None and types is not None and len(types) > n:
        # a reduced-layer variant (e.g. model.hf_config.num_hidden_layers=6): keep the first n types
        d["layer_types"] = list(types[:n])
        shared = d.get("num_kv_shared_layers") or 0
        if shared:
            d["num_kv_shared_layers"] = max(0, min(shared, n - len(types) + shared))
    for k in ("architectures", "transformers_version", "dtype", "torch_dtype", "use_cache"):
        d.pop(k, None)
    return Gemma4TextConfig(**d)


def _read_checkpoint_config(path: Path) -> dict:
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise ModelLoadError(f"model.path={path}: no config.json there (expected a Hugging Face checkpoint directory)")
    raw = json.loads(cfg_file.read_text())
    mtype = raw.get("model_type")
    if mtype == "gemma4":
        text = raw.get("text_config")
        if not isinstance(text, dict):
            raise ModelLoadError(f"{cfg_file}: model_type 'gemma4' but no text_config")
        text = dict(text)
        text.setdefault("model_type", "gemma4_text")
    elif mtype == "gemma4_text":
        text = dict(raw)
    else:
        raise ModelLoadError(
            f"{cfg_file}: model_type {mtype!r} is not a Gemma-4 model (expected 'gemma4' or 'gemma4_text')"
        )
    if raw.get("quantization_config") or text.get("quantization_config"):
        raise ModelLoadError(
            f"{cfg_file} holds a quantization_config: pre-quantised checkpoints load with quant=bnb4 "
            "(not supported by this build yet); use a bf16/fp32 checkpoint"
        )
    text.pop("quantization_config", None)
    return text


def _weight_files(path: Path, allow_pickle: bool) -> tuple[list[Path], str]:
    st = sorted(path.glob("*.safetensors"))
    if st:
        return st, "safetensors"
    bins = sorted(path.glob("*.bin"))
    if bins:
        if not allow_pickle:
            raise ModelLoadError(
                f"model.path={path} has only pickled weights ({bins[0].name}, ...). Pickle files can run code when "
                "loaded, so flexgemma refuses them. Convert them to safetensors, or accept the risk with "
                "model.allow_pickle=true."
            )
        return bins, "pickle"
    return [], "none"


def _iter_checkpoint_tensors(files: list[Path], kind: str):
    if kind == "safetensors":
        from safetensors import safe_open

        for f in files:
            with safe_open(str(f), framework="pt", device="cpu") as h:
                for key in h.keys():
                    yield key, (lambda h=h, key=key: h.get_tensor(key))
    else:
        for f in files:
            sd = torch.load(str(f), map_location="cpu", weights_only=False)
            for key, t in sd.items():
                yield key, (lambda t=t: t)


def _text_key(key: str) -> Optional[str]:
    for src, dst in _TEXT_PREFIXES:
        if key.startswith(src):
            rest = key[len(src):]
            if src == "model." and rest.split(".")[0] in ("vision_tower", "audio_tower", "embed_vision", "embed_audio"):
                return None
            return dst + rest
    return None


@torch.no_grad()
def _load_weights(model, files: list[Path], kind: str) -> dict[str, int]:
    params = dict(model.named_parameters())
    params.update(dict(model.named_buffers()))
    loaded, skipped = set(), 0
    for key, get in _iter_checkpoint_tensors(files, kind):
        name = _text_key(key)
        if name is None or name not in params:
            skipped += 1  # vision/audio towers, KV-shared layers' unused k/v projections
            continue
        target = params[name]
        t = get()
        if tuple(t.shape) != tuple(target.shape):
            raise ModelLoadError(f"checkpoint tensor {key}: shape {tuple(t.shape)} != model {tuple(target.shape)}")
        target.copy_(t.to(dtype=target.dtype))
        loaded.add(name)
    expected = {n for n, _ in model.named_parameters()}
    if model.config.tie_word_embeddings:
        expected.discard("lm_head.weight")
    missing = sorted(expected - loaded)
    if missing:
        raise ModelLoadError(f"checkpoint is missing {len(missing)} text weights, e.g. {missing[:3]}")
    return {"loaded": len(loaded), "skipped": skipped}


def build_model(model_cfg, device: torch.device):
    """Returns (Gemma4ForCausalLM in eval mode on `device`, tokenizer or None, info dict)."""
    from transformers import Gemma4ForCausalLM

    dtype = resolve_dtype(str(getattr(model_cfg.dtype, "value", model_cfg.dtype)), device)
    path = Path(model_cfg.path).expanduser() if model_cfg.path else None
    info: dict[str, Any] = {"name": model_cfg.name, "dtype": str(dtype).removeprefix("torch.")}
    if path is not None:
        if not path.is_dir():
            raise ModelLoadError(f"model.path={path} does not exist or is not a directory")
        text = _read_checkpoint_config(path)
        files, kind = _weight_files(path, bool(model_cfg.allow_pickle))
    else:
        if model_cfg.hf_config is None:
            raise ModelLoadError(f"model {model_cfg.name!r} has no hf_config and no model.path")
        text, files, kind = _plain(model_cfg.hf_config), [], "none"
    config = text_config_from_dict(text)
    config._attn_implementation = "sdpa"

    # Build straight in the target dtype and device: float32 first would need twice the memory.
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        torch.manual_seed(int(model_cfg.seed))
        with torch.device(device):
            model = Gemma4ForCausalLM(config)
    finally:
        torch.set_default_dtype(prev)
    model.eval().requires_grad_(False)
    if files:
        info.update(_load_weights(model, files, kind))
        info["weights"] = str(path)
    else:
        info["weights"] = "random"
        if path is not None:
            warnings.warn(
                f"model.path={path} has no weight files (*.safetensors): using RANDOM weights (seed {model_cfg.seed})",
                stacklevel=2,
            )
    tokenizer = load_tokenizer(path) if path is not None else None
    info["params"] = sum(p.numel() for p in model.parameters())
    return model, tokenizer, info


def load_tokenizer(path: Optional[Path]):
    if path is None or not any((path / f).exists() for f in ("tokenizer.json", "tokenizer_config.json")):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))
