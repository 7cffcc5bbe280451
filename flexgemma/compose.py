"""Where the configs live, Hydra's compose API with the same overrides as the CLI, and the
embedded default model.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Optional, Sequence

from omegaconf import DictConfig, OmegaConf, open_dict

from flexgemma.config import DEFAULT_MODEL, ConfigError, register_configs, validate

log = logging.getLogger("flexgemma")


def conf_dir() -> Path:
    """conf/ beside the package in a checkout; flexgemma/conf inside an installed wheel."""
    here = Path(__file__).resolve().parent
    for candidate in (here.parent / "conf", here / "conf"):
        if (candidate / "config.yaml").is_file():
            return candidate
    raise FileNotFoundError(f"flexgemma's conf/ directory was not found near {here}")


def model_names() -> list[str]:
    return sorted(p.stem for p in (conf_dir() / "model").glob("*.yaml"))


def ensure_model(cfg: DictConfig) -> DictConfig:
    """Fills in the embedded default model when no +model=... was given (and says so)."""
    if not OmegaConf.is_missing(cfg.model, "name"):
        return cfg
    log.warning("no model given: using the embedded default '%s' (pick one with +model=NAME: %s)",
                DEFAULT_MODEL, ", ".join(model_names()))
    default = OmegaConf.load(conf_dir() / "model" / f"{DEFAULT_MODEL}.yaml")
    with open_dict(cfg):
        # the variant file sets only name and hf_config: model.dtype/seed/... overrides stay
        cfg.model = OmegaConf.merge(cfg.model, default)
    return cfg


def compose(overrides: Optional[Sequence[str]] = None, config_name: str = "config") -> DictConfig:
    """Composes conf/ with Hydra's compose API, e.g. compose(["+model=tiny", "quant=bf16"])."""
    from hydra import compose as hydra_compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    register_configs()
    overrides = list(overrides or [])
    _check_model_override(overrides)
    # a caller's own Hydra (an @hydra.main app, a notebook's initialize()) gets its state back
    original = GlobalHydra.instance()
    saved = original.hydra
    original.clear()
    try:
        with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
            cfg = hydra_compose(config_name=config_name, overrides=overrides)
    finally:
        original.hydra = saved
        GlobalHydra.set_instance(original)
    cfg = ensure_model(cfg)
    validate(cfg)
    return cfg


def _check_model_override(overrides: list[str]) -> None:
    for o in overrides:
        key, _, value = o.partition("=")
        if key.lstrip("+~") == "model" and value and value not in model_names():
            raise ConfigError(f"unknown model {value!r}: choose one of {', '.join(model_names())} "
                              "(or give a checkpoint directory with +model=... model.path=DIR)")
