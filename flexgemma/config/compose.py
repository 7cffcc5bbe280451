"""Where the configs live, Hydra's compose API with the same overrides as the CLI, the embedded
default model, and `to_config`: the one place a composed config becomes the typed Config.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Optional, Sequence

from omegaconf import DictConfig, OmegaConf, open_dict

from flexgemma.config.schema import DEFAULT_MODEL, Config, ConfigError, check_moved_keys, register_configs, validate

log = logging.getLogger("flexgemma")


def conf_dir() -> Path:
    """conf/ beside the package in a checkout; flexgemma/conf inside an installed wheel."""
    here = Path(__file__).resolve().parents[1]  # the package: this module is in its config/
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
    log.warning("no model given: using the embedded default '%s' (pick one with model=NAME: %s)",
                DEFAULT_MODEL, ", ".join(model_names()))
    default = OmegaConf.load(conf_dir() / "model" / f"{DEFAULT_MODEL}.yaml")
    with open_dict(cfg):
        # the variant file sets only name and hf_config: model.dtype/seed/... overrides stay
        cfg.model = OmegaConf.merge(cfg.model, default)
    return cfg


def to_config(cfg) -> Config:
    """The typed Config of `cfg`: itself when typed already; a composed DictConfig (Hydra's, or one
    composed by hand) with the embedded default model filled in, typed once (every group checks
    itself, then the rules across groups; a ConfigError names the key)."""
    if isinstance(cfg, Config):
        return cfg
    return validate(ensure_model(cfg))


# config groups that are not in the defaults list (a model has no default variant, an experiment is
# optional): Hydra wants `+model=NAME`; `model=NAME` is taken as the same
_APPENDED_GROUPS = ("model", "experiment")


def preset_models(experiment: str) -> list[str]:
    """The models an experiment preset is written for (its `preset.models`), [] when it names none."""
    import yaml

    path = conf_dir() / "experiment" / f"{experiment}.yaml"
    if not path.is_file():
        return []  # Hydra's own error names the missing preset
    data = yaml.safe_load(path.read_text()) or {}
    return list((data.get("preset") or {}).get("models") or [])


def normalise_overrides(overrides: Sequence[str]) -> list[str]:
    """The overrides as Hydra needs them: `model=NAME` and `experiment=NAME` become `+model=NAME` and
    `+experiment=NAME`, and without a model the one that will run is added (a preset's own model, else
    the embedded default), so that `--cfg job`, the job's overrides and its directory name it."""
    out, model_given, experiment = [], False, None
    for o in overrides:
        key, eq, value = o.partition("=")
        bare = key.lstrip("+~")
        if eq and bare in _APPENDED_GROUPS:
            if key == bare:
                o = f"+{o}"
            model_given |= bare == "model"
            if bare == "experiment" and not key.startswith("~"):
                experiment = value.split(",")[0].strip()
        out.append(o)
    if not model_given:
        models = preset_models(experiment) if experiment else []
        name = models[0] if models else DEFAULT_MODEL
        if not models:
            log.warning("no model given: using the embedded default '%s' (pick one with model=NAME: %s)",
                        name, ", ".join(model_names()))
        # beside the other overrides (Hydra's argument parser takes them as one run of positionals),
        # else first: after the flags, `--info` would take it as its value
        first = next((i for i, o in enumerate(out) if "=" in o and not o.startswith("-")), 0)
        out.insert(first, f"+model={name}")
    return _model_before_experiment(out)


def _model_before_experiment(out: list[str]) -> list[str]:
    """Hydra merges appended groups in the order given: a preset's own `model.*` keys (such as
    grpo_tiny's initializer_range) must come after the model's config, whichever was typed first."""
    def index(group: str) -> Optional[int]:
        return next((i for i, o in enumerate(out) if o.startswith(f"+{group}=")), None)

    m, e = index("model"), index("experiment")
    if m is not None and e is not None and e < m:
        out.insert(e, out.pop(m))
    return out


def compose(overrides: Optional[Sequence[str]] = None, config_name: str = "config") -> Config:
    """Composes conf/ with Hydra's compose API, e.g. compose(["+model=tiny", "quant=bf16"]), into the
    typed Config (what build_engine and run_job take)."""
    from hydra import compose as hydra_compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    register_configs()
    overrides = normalise_overrides(overrides or [])
    check_moved_keys(overrides)
    _check_model_override(overrides)
    check_override_keys(overrides)
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
    return to_config(cfg)


def check_override_keys(overrides: list[str]) -> None:
    """A key no config group declares is an error with a did-you-mean, with or without `+`."""
    from flexgemma.config.schema import Config
    from flexgemma.config.keys import override_problems

    problems = override_problems(overrides, Config)
    if problems:
        raise ConfigError("; ".join(problems))


def _check_model_override(overrides: list[str]) -> None:
    for o in overrides:
        key, _, value = o.partition("=")
        if key.lstrip("+~") == "model" and value and value not in model_names():
            raise ConfigError(f"unknown model {value!r}: choose one of {', '.join(model_names())} "
                              "(or give a checkpoint directory with +model=... model.path=DIR)")


# Hydra sweepers that come with an extra: the override or preset that picks one says which to install
_SWEEPER_EXTRAS = {"optuna": ("hydra_plugins.hydra_optuna_sweeper", "optuna")}
# launchers that exist only with the [slurm] extra (flexgemma_local runs without it, in process)
_SUBMITIT_LAUNCHERS = ("flexgemma_slurm", "submitit_local", "submitit_slurm")


def check_extras(overrides: list[str]) -> None:
    """Raises MissingExtra when the overrides pick a sweeper whose extra is not installed (Hydra's own
    error would only say that the config group option is missing)."""
    from flexgemma.config.extras import installed, missing_extra

    for o in overrides:
        key, _, value = o.partition("=")
        key = key.lstrip("+~")
        sweepers = []
        if key == "hydra/launcher" and value in _SUBMITIT_LAUNCHERS and not installed("submitit"):
            raise missing_extra("submitit", "slurm", f"{o} (each job in its own process, locally or on SLURM)")
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

