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
    check_extras(overrides)
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


# Hydra sweepers that come with an extra: the override or preset that picks one says which to install
_SWEEPER_EXTRAS = {"optuna": ("hydra_plugins.hydra_optuna_sweeper", "optuna")}


def check_extras(overrides: list[str]) -> None:
    """Raises MissingExtra when the overrides pick a sweeper whose extra is not installed (Hydra's own
    error would only say that the config group option is missing)."""
    from flexgemma.extras import installed, missing_extra

    for o in overrides:
        key, _, value = o.partition("=")
        key = key.lstrip("+~")
        sweepers = []
        if key == "hydra/sweeper":
            sweepers.append(value)
        elif key == "experiment":
            for name in value.split(","):
                path = conf_dir() / "experiment" / f"{name.strip()}.yaml"
                text = path.read_text() if path.is_file() else ""
                sweepers += [s for s in _SWEEPER_EXTRAS if f"/hydra/sweeper: {s}" in text]
        for sweeper in sweepers:
            module, extra = _SWEEPER_EXTRAS.get(sweeper, (None, None))
            if module and not installed(module):
                raise missing_extra(module.split(".")[-1].replace("_", "-"), extra, f"{o} (the {sweeper} sweeper)")

