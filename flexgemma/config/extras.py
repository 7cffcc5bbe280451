"""The optional extras (`pip install -e ".[EXTRA]"` in the checkout): a feature whose package is
missing says which extra brings it, instead of an ImportError from deep inside.

| extra    | brings                                   | for                                             |
|----------|------------------------------------------|-------------------------------------------------|
| bnb      | bitsandbytes                             | quant=bnb4                                      |
| wandb    | wandb                                    | logger=wandb_offline / wandb_online             |
| report   | matplotlib (pandas, pyarrow: optional)   | python -m flexgemma.report                      |
| slurm    | submitit, hydra-submitit-launcher        | multiruns (-m): one process a job, local/SLURM  |
|          |                                          | (without it a local sweep runs in one process)  |
| optuna   | hydra-optuna-sweeper                     | experiment=optuna_kernels                       |
| rl       | trl, datasets                            | task=grpo                                       |
"""

from __future__ import annotations

import importlib
import importlib.util

from flexgemma.config.schema import ConfigError


class MissingExtra(ConfigError, ImportError):
    """A feature's package is not installed; the message names the extra that installs it."""


def installed(module: str) -> bool:
    """Whether `module` can be imported, without importing it."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package missing, or a broken module spec
        return False


def install_hint(extra: str) -> str:
    """The command that installs an extra: flexgemma installs from its checkout (it is not on PyPI)."""
    return f'pip install -e ".[{extra}]" in the flexgemma checkout'


def missing_extra(module: str, extra: str, feature: str, why: str = "") -> MissingExtra:
    why = f" ({why})" if why else ""
    return MissingExtra(f"{feature} needs {module}, which is not installed{why}: {install_hint(extra)}")


def require(module: str, extra: str, feature: str):
    """Imports and returns `module`, or raises MissingExtra naming the extra to install."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise missing_extra(module, extra, feature, str(e)) from None
