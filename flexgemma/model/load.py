"""Build the transformers Gemma4ForCausalLM the engine runs: a named variant with random weights, or
the text backbone of a local checkpoint directory (`model.path`).

transformers owns the modules and parameters (so peft and bitsandbytes keep working on them);
this module only decides the config, the dtype, the device and where the weights come from.
"""

from __future__ import annotations

import logging
import sys
import warnings
from pathlib import Path
from typing import Any, Optional

import torch
from omegaconf import OmegaConf
from tqdm.auto import tqdm

from flexgemma.config.schema import FlexgemmaWarning
from flexgemma.model.files import get_tensor, open_safetensors, read_json_object

log = logging.getLogger("flexgemma")

# Weight files of formats flexgemma does not read: a directory holding only these must not run on
# random weights (a checkpoint saved with torch.save, a Lightning .ckpt, a GGUF export).
_UNREADABLE_WEIGHTS = ("*.pt", "*.pth", "*.ckpt", "*.pkl", "*.gguf", "*.h5", "*.msgpack", "*.npz", "*.onnx")

# Checkpoint key prefixes of the multimodal Gemma4ForConditionalGeneration and what they map to in
# Gemma4ForCausalLM. Everything else there (vision/audio towers, their embedders) is never read.
_TEXT_PREFIXES = (("model.language_model.", "model."), ("model.", "model."), ("lm_head.", "lm_head."))


class ModelLoadError(ValueError):
    """A model directory or variant that cannot be loaded; the message says what to fix."""


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name in ("auto", None):
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def model_dtype(model_cfg, quant_cfg, device: torch.device) -> torch.dtype:
    """model.dtype resolved: auto is bfloat16 on a GPU and float32 on the CPU, except that bnb4
    computes in bf16 on every device unless model.dtype says otherwise."""
    name = str(getattr(model_cfg.dtype, "value", model_cfg.dtype))
    if name == "auto" and quant_cfg is not None and quant_cfg.method != "none":
        return torch.bfloat16
    return resolve_dtype(name, device)


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
    raw = read_json_object(cfg_file, ModelLoadError)
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
    qcfg = raw.get("quantization_config") or text.get("quantization_config")
    text.pop("quantization_config", None)
    if qcfg:
        method = qcfg.get("quant_method")
        if method != "bitsandbytes" or not (qcfg.get("load_in_4bit") or qcfg.get("_load_in_4bit")):
            raise ModelLoadError(
                f"{cfg_file}: quantization_config {method!r} (4-bit: {qcfg.get('load_in_4bit')}) is not supported: "
                "flexgemma loads bitsandbytes 4-bit checkpoints (quant=bnb4) and bf16/fp32 ones"
            )
    return text, qcfg or None


_INDEXES = (("model.safetensors.index.json", "safetensors"), ("pytorch_model.bin.index.json", "pickle"))


def _indexed_files(path: Path) -> Optional[tuple[list[Path], str]]:
    """The shards a checkpoint's index lists (exactly those: a stray file beside them is not read),
    or None without an index."""
    for name, kind in _INDEXES:
        index = path / name
        if not index.is_file():
            continue
        weight_map = read_json_object(index, ModelLoadError).get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise ModelLoadError(f"{index}: 'weight_map' must be an object of tensor name -> shard file name")
        shards = sorted(set(weight_map.values()))
        missing = [s for s in shards if not (path / s).is_file() or Path(s).name != s]
        if missing:
            raise ModelLoadError(f"{index} lists shards that are not files in {path}: {missing[:3]} (an incomplete "
                                 "download? fetch them again)")
        stray = sorted(f.name for f in path.glob("*.safetensors" if kind == "safetensors" else "*.bin")
                       if f.name not in shards)
        if stray:
            log.warning("model.path=%s: %s not listed in %s: not loaded", path, ", ".join(stray[:3]), name)
        return [path / s for s in shards], kind
    return None


def _weight_files(path: Path, allow_pickle: bool) -> tuple[list[Path], str]:
    indexed = _indexed_files(path)
    if indexed is not None and (indexed[1] == "safetensors" or allow_pickle):
        return indexed
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
    other = sorted(f.name for pattern in _UNREADABLE_WEIGHTS for f in path.glob(pattern))
    if other:
        raise ModelLoadError(
            f"model.path={path} holds weights flexgemma cannot read ({', '.join(other[:3])}): it reads "
            "*.safetensors (save with save_pretrained(..., safe_serialization=True)), or pickled *.bin with "
            "model.allow_pickle=true. It will not run on random weights instead."
        )
    return [], "none"


def _text_key(key: str) -> Optional[str]:
    for src, dst in _TEXT_PREFIXES:
        if key.startswith(src):
            rest = key[len(src):]
            if src == "model." and rest.split(".")[0] in ("vision_tower", "audio_tower", "embed_vision", "embed_audio"):
                return None
            return dst + rest
    return None


def check_source_dtype(key: str, src: torch.Tensor, target: torch.Tensor) -> None:
    """A float parameter takes only float values: an int8/bool tensor cast to float is garbage, silently."""
    if target.dtype.is_floating_point and not src.dtype.is_floating_point:
        raise ModelLoadError(
            f"checkpoint tensor {key} has dtype {src.dtype} but the model's parameter is floating point "
            f"({target.dtype}): a quantised or corrupt checkpoint? flexgemma reads bf16/fp16/fp32 weights (and "
            "bitsandbytes 4-bit linears with quant=bnb4)"
        )


def check_finite(key: str, t: torch.Tensor) -> None:
    """Checked on the loaded parameter (on its device: fast on a GPU), after the dtype cast. A NaN or
    inf anywhere makes the float32 sum non-finite; the sum needs no tensor-sized temporary (a 0.5 GB
    expert tensor would need a 0.5 GB mask), and finite weights cannot reach 3e38."""
    if t.dtype.is_floating_point and not bool(torch.isfinite(t.sum(dtype=torch.float32))):
        bad = int((~torch.isfinite(t)).sum())
        raise ModelLoadError(f"checkpoint tensor {key} holds {bad} non-finite values (NaN or inf) of {t.numel()}: "
                             "a corrupt checkpoint, or one saved after training diverged")


def free_memory(device: torch.device) -> int:
    """Bytes the model may take on `device`: free GPU memory, or available RAM on the CPU."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            info = dict(line.split(":", 1) for line in f)
        return int(info["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return 1 << 62  # unknown: do not refuse


def check_fits(model_cls, config, dtype: torch.dtype, device: torch.device, name: str) -> None:
    """Refuses, before allocating anything, a model whose weights alone exceed free memory."""
    with torch.device("meta"):
        n = sum(p.numel() for p in model_cls(config).parameters())
    need = n * torch.finfo(dtype).bits // 8
    free = free_memory(device)
    if need > 0.95 * free:
        raise ModelLoadError(
            f"model {name!r}: {n / 1e9:.2f}B parameters need {need / 2**30:.1f} GiB in "
            f"{str(dtype).removeprefix('torch.')}, but {device} has {free / 2**30:.1f} GiB free. Use a GPU "
            "(device=cuda), quant=bnb4, model.dtype=bfloat16, a smaller variant, or fewer layers "
            "(model.hf_config.num_hidden_layers=N)"
        )


def build_model(model_cfg, device: torch.device, quant_cfg=None):
    """Returns (Gemma4ForCausalLM in eval mode on `device`, tokenizer or None, info dict).

    With quant=bnb4 (`quant_cfg.method == "bnb4"`) the model is built on the meta device and made
    real one module at a time on `device` (random init or checkpoint tensors), each decoder layer
    quantised to 4-bit before the next one exists: the full bf16 model is never held anywhere.
    """
    from transformers import Gemma4ForCausalLM

    from flexgemma.model.quant import Bnb4Settings, require_bitsandbytes, storage_census

    quantised = quant_cfg is not None and quant_cfg.method != "none"
    dtype = model_dtype(model_cfg, quant_cfg, device)
    path = Path(model_cfg.path).expanduser() if model_cfg.path else None
    info: dict[str, Any] = {"name": model_cfg.name, "dtype": str(dtype).removeprefix("torch.")}
    text, files, kind = _model_source(model_cfg, path, quantised)
    config = text_config_from_dict(text)
    config._attn_implementation = "sdpa"
    reader = CheckpointReader(files, kind) if files else None
    if quantised:
        require_bitsandbytes(device)
        settings = Bnb4Settings.from_config(quant_cfg, dtype)
        model = _build_quantised(Gemma4ForCausalLM, config, dtype, device, settings, reader, int(model_cfg.seed))
        model.is_loaded_in_4bit = True  # what peft reads to wrap Linear4bit with its 4-bit LoRA layer
        info.update({"quant/method": "bnb4", "quant/quant_type": settings.quant_type,
                     "quant/double_quant": settings.double_quant, "quant/block_size": settings.block_size})
    else:
        check_fits(Gemma4ForCausalLM, config, dtype, device, model_cfg.name)
        model = _build_plain(Gemma4ForCausalLM, config, dtype, device, reader, int(model_cfg.seed))
    model.eval().requires_grad_(False)
    info.update(_weights_info(model_cfg, path, reader, quantised))
    census = storage_census(model)
    info.update({k: census[k] for k in ("params", "quant/fraction_4bit", "quant/weight_bytes")})
    tokenizer = model_tokenizer(model_cfg, path, config.vocab_size)
    return model, tokenizer, info


def model_tokenizer(model_cfg, path: Optional[Path], vocab_size: int):
    """A checkpoint's own tokenizer (or None), or a random-weight model's model.tokenizer (a shipped
    name or a directory). One that makes ids past the model's vocabulary is refused here, not at the
    first prompt."""
    tokenizer = load_tokenizer(path) if path is not None else None
    name = getattr(model_cfg, "tokenizer", None)
    if path is None and name:
        from flexgemma.tokenizers import tokenizer_dir

        try:
            where = tokenizer_dir(str(name))
        except ValueError as e:
            raise ModelLoadError(str(e)) from None
        tokenizer = load_tokenizer(where)
    if tokenizer is not None and len(tokenizer) > vocab_size:
        raise ModelLoadError(f"the tokenizer has {len(tokenizer)} tokens but model {model_cfg.name!r} a vocabulary of "
                             f"{vocab_size}: its ids past {vocab_size - 1} would have no embedding")
    return tokenizer


def _model_source(model_cfg, path: Optional[Path], quantised: bool) -> tuple[dict, list[Path], str]:
    """(the text config as a dict, weight files, their kind): a checkpoint directory's, or the
    variant's hf_config with no files (random weights)."""
    if path is None:
        if model_cfg.hf_config is None:
            raise ModelLoadError(f"model {model_cfg.name!r} has no hf_config and no model.path")
        return _plain(model_cfg.hf_config), [], "none"
    if not path.is_dir():
        raise ModelLoadError(f"model.path={path} does not exist or is not a directory")
    text, ckpt_quant = _read_checkpoint_config(path)
    files, kind = _weight_files(path, bool(model_cfg.allow_pickle))
    if ckpt_quant and files and not quantised:
        raise ModelLoadError(
            f"model.path={path} is a pre-quantised bitsandbytes 4-bit checkpoint: load it with quant=bnb4"
        )
    return text, files, kind


def _build_plain(model_cls, config, dtype, device, reader: Optional["CheckpointReader"], seed: int):
    """The model straight in the target dtype and on `device` (float32 first would need twice the
    memory), then the checkpoint's tensors copied in."""
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        torch.manual_seed(seed)
        with torch.device(device):
            model = model_cls(config)
    finally:
        torch.set_default_dtype(prev)
    if reader is not None:
        reader.copy_into(model, "", model)
    return model


def _weights_info(model_cfg, path: Optional[Path], reader: Optional["CheckpointReader"], quantised: bool) -> dict:
    """Where the weights came from, for the info dict; a directory without weight files warns."""
    if reader is None:
        if path is not None:
            warnings.warn(
                f"model.path={path} has no weight files (*.safetensors): using RANDOM weights (seed {model_cfg.seed})",
                FlexgemmaWarning, stacklevel=3,
            )
        return {"weights": "random"}
    out = {"weights": str(path), "loaded": reader.loaded, "skipped": reader.skipped}
    if quantised:
        out["prequantized"] = reader.prequantized
    return out


# -- the quantised build: meta model, made real and quantised one module at a time -------------
class CheckpointReader:
    """A checkpoint's text-backbone tensors by Gemma4ForCausalLM name, read one at a time, and the
    one place they are checked (shape, dtype, finite) and copied into a model (plain or 4-bit build)."""

    _QUANT_STATE = ".weight.quant_state.bitsandbytes__"

    def __init__(self, files: list[Path], kind: str):
        self.skipped, self.loaded, self.prequantized = 0, 0, 0
        self._where: dict[str, tuple[str, Any]] = {}  # model name -> (checkpoint key, getter)
        self._file: dict[str, str] = {}  # model name -> the file holding it
        self._handles: list[Any] = []  # open safetensors files, read lazily
        for f in files:
            if kind == "safetensors":
                h = open_safetensors(f, ModelLoadError)
                self._handles.append(h)
                tensors = {key: (lambda h=h, key=key, f=f: get_tensor(h, f, key, ModelLoadError)) for key in h.keys()}
            else:
                sd = torch.load(str(f), map_location="cpu", weights_only=False)
                tensors = {key: (lambda t=t: t) for key, t in sd.items()}
            for key, get in tensors.items():
                name = _text_key(key)
                if name is None:
                    self.skipped += 1  # vision/audio towers and their embedders
                    continue
                if name in self._where:
                    raise ModelLoadError(
                        f"{name} is stored twice: as {self._where[name][0]} in {self._file[name]} and as {key} in "
                        f"{f.name} (in {f.parent}). Without a model.safetensors.index.json every *.safetensors file is read, so a "
                        "stray copy (a backup?) would load over the real weights: move it out of the directory, "
                        "or add the index that lists the shards")
                self._where[name], self._file[name] = (key, get), f.name

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def get(self, name: str) -> torch.Tensor:
        return self._where[name][1]()

    def prequantized_linears(self, module_name: str) -> list[str]:
        """`module_name` and modules under it stored as bitsandbytes 4-bit (packed weight + quant state)."""
        out = []
        for name in self._where:
            if (name.startswith(module_name + ".")) and self._QUANT_STATE in name:
                out.append(name[: name.index(self._QUANT_STATE)])
        return sorted(out)

    def quant_stats(self, module_name: str) -> dict[str, torch.Tensor]:
        pre = module_name + ".weight."
        return {n[len(pre):]: self.get(n) for n in self._where if n.startswith(pre)}

    @torch.no_grad()
    def copy_into(self, module: torch.nn.Module, prefix: str, model) -> None:
        """Copies the checkpoint's tensors into `module` (named `prefix` in `model`, with a trailing
        dot, or "" for the whole model). 4-bit parameters are skipped (placed pre-quantised); a
        missing parameter is an error, a missing buffer keeps its computed value."""
        tied = "lm_head.weight" if model.config.tie_word_embeddings else None
        missing = []
        for kind, named in (("param", module.named_parameters()), ("buffer", module.named_buffers())):
            for rel, t in named:
                name = prefix + rel
                if _is_4bit(t):
                    continue
                if name not in self._where:
                    if kind == "param" and name != tied:
                        missing.append(name)
                    continue  # non-persistent buffers keep their computed values
                self._copy_one(name, t)
        if missing:
            raise ModelLoadError(f"checkpoint is missing {len(missing)} text weights, e.g. {missing[:3]}")

    def _copy_one(self, name: str, t: torch.Tensor) -> None:
        key, get = self._where[name]
        src = get()
        if src.dtype == torch.uint8 and t.dtype != torch.uint8:
            raise ModelLoadError(
                f"checkpoint tensor {key} is packed 4-bit data flexgemma cannot place (only nn.Linear weights "
                "with a bitsandbytes quant_state are read pre-quantised; fused experts must be bf16)"
            )
        if tuple(src.shape) != tuple(t.shape):
            raise ModelLoadError(f"checkpoint tensor {key}: shape {tuple(src.shape)} != model {tuple(t.shape)}")
        check_source_dtype(key, src, t)
        t.copy_(src.to(dtype=t.dtype))
        check_finite(key, t)
        self.loaded += 1


def _is_4bit(t: torch.Tensor) -> bool:
    """A bitsandbytes 4-bit parameter (only possible once bitsandbytes is imported)."""
    bnb = sys.modules.get("bitsandbytes")
    return bnb is not None and isinstance(t, bnb.nn.Params4bit)


def _materialise(module: torch.nn.Module, device: torch.device) -> None:
    """Allocates every meta parameter/buffer of `module` on `device` (values are set after)."""
    for m in module.modules():
        for name, p in list(m._parameters.items()):
            if p is not None and p.is_meta:
                m._parameters[name] = torch.nn.Parameter(torch.empty_like(p, device=device), requires_grad=False)
        for name, b in list(m._buffers.items()):
            if b is not None and b.is_meta:
                m._buffers[name] = torch.empty_like(b, device=device)


def _set_submodule(root: torch.nn.Module, name: str, new: torch.nn.Module) -> None:
    parent, _, leaf = name.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, leaf, new)


@torch.no_grad()
def _fill_module(model, module, prefix: str, device, settings, reader: Optional[CheckpointReader], quantise: bool):
    """Makes `module` (named `prefix` in the model, with a trailing dot) real on `device`: random
    init, then checkpoint tensors (pre-quantised linears as they are), then quantises what is left
    when `quantise`. Returns the module (a new one when it was itself a linear layer)."""
    from flexgemma.model.quant import linear4bit_from, linear4bit_prequantized, quantise_module

    _materialise(module, device)
    for sub in module.modules():  # also sets the non-persistent buffers (RoPE tables, scales)
        model._init_weights(sub)
    if reader is not None:
        for lin in reader.prequantized_linears(prefix[:-1]):
            bias = reader.get(lin + ".bias") if lin + ".bias" in reader else None
            q = linear4bit_prequantized(reader.get(lin + ".weight"), reader.quant_stats(lin), bias,
                                        settings.compute_dtype, device)
            if lin == prefix[:-1]:
                module = q
            else:
                _set_submodule(module, lin[len(prefix):], q)
            reader.loaded += 1
            reader.prequantized += 1
        reader.copy_into(module, prefix, model)
    if quantise:
        import bitsandbytes as bnb

        if isinstance(module, torch.nn.Linear) and not isinstance(module, bnb.nn.Linear4bit):
            return linear4bit_from(module, settings, device)
        quantise_module(module, settings, device, prefix)
    return module


def _build_quantised(model_cls, config, dtype, device, settings, reader, seed: int):
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            model = model_cls(config)
    finally:
        torch.set_default_dtype(prev)
    torch.manual_seed(seed)
    base = model.model
    for name, child in list(base.named_children()):  # embeddings, norms, RoPE, per-layer projection
        if name != "layers":
            keep = isinstance(child, torch.nn.Embedding)  # embedding tables stay in the model dtype
            setattr(base, name, _fill_module(model, child, f"model.{name}.", device, settings, reader, not keep))
    # a bar over layers when the build lasts more than a few seconds (delay), on a terminal only
    bar = tqdm(base.layers, desc=f"building {config.num_hidden_layers} layers", unit="layer", leave=False, delay=3,
               disable=not sys.stderr.isatty())
    for i, layer in enumerate(bar):
        _fill_module(model, layer, f"model.layers.{i}.", device, settings, reader, quantise=True)
    if config.tie_word_embeddings:
        model.lm_head.weight = base.embed_tokens.weight
    else:
        _fill_module(model, model.lm_head, "lm_head.", device, settings, reader, quantise=False)
    return model


def load_tokenizer(path: Optional[Path]):
    """The checkpoint's tokenizer, never running code of the checkpoint: trust_remote_code=False is
    passed explicitly, so transformers neither asks on stdin nor imports an `auto_map` module; a
    tokenizer that only exists as such code is an error."""
    names = [f for f in ("tokenizer.json", "tokenizer_config.json") if (path / f).exists()] if path else []
    if not names:
        return None
    from transformers import AutoTokenizer

    for name in names:  # a broken file is named here, not deep inside transformers
        read_json_object(path / name, ModelLoadError)
    try:
        return AutoTokenizer.from_pretrained(str(path), trust_remote_code=False, local_files_only=True)
    except (ValueError, OSError, TypeError, KeyError, AttributeError, ImportError) as e:
        raise ModelLoadError(
            f"model.path={path}: its tokenizer cannot be loaded without running the checkpoint's own code, or is "
            f"broken ({type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}). flexgemma "
            "never runs code from a checkpoint: give a tokenizer.json (and tokenizer_config.json with a "
            "transformers tokenizer_class), or use prompt_token_ids"
        ) from e
