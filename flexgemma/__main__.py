"""`python -m flexgemma [+model=NAME] [overrides...]`: the Hydra entry point; nothing else."""

from __future__ import annotations

import logging
import sys

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from flexgemma.compose import _check_model_override, conf_dir, ensure_model
from flexgemma.config import ConfigError, register_configs, validate
from flexgemma.run import run_job

log = logging.getLogger("flexgemma")


@hydra.main(config_path=str(conf_dir()), config_name="config", version_base="1.3")
def _main(cfg: DictConfig) -> None:
    cfg = ensure_model(cfg)
    try:
        validate(cfg)
    except ConfigError as e:
        log.error("invalid configuration: %s", e)
        raise SystemExit(2) from None
    run_job(cfg, HydraConfig.get().runtime.output_dir)


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="[%(name)s] %(message)s")
    register_configs()
    try:
        _check_model_override(sys.argv[1:])
    except ConfigError as e:
        print(f"flexgemma: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    _main()


if __name__ == "__main__":
    main()
