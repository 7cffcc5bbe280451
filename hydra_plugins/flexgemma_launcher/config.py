"""`hydra/launcher=flexgemma_local` (the default of flexgemma's multiruns) and `flexgemma_slurm`.

They take every option of hydra-submitit-launcher's `submitit_local` / `submitit_slurm` (timeout_min,
partition, gres, ...), plus `parallel_jobs` for the local one.
"""

from dataclasses import dataclass
from typing import Optional

from hydra.core.config_store import ConfigStore
from hydra_plugins.hydra_submitit_launcher.config import LocalQueueConf, SlurmQueueConf


@dataclass
class FlexgemmaLocalConf(LocalQueueConf):
    _target_: str = "hydra_plugins.flexgemma_launcher.launcher.FlexgemmaLocalLauncher"
    # jobs at once: null = one per visible GPU (each job sees only its GPU), 1 on a machine without one
    parallel_jobs: Optional[int] = None
    timeout_min: int = 24 * 60  # a job running longer is stopped and recorded as failed


@dataclass
class FlexgemmaSlurmConf(SlurmQueueConf):
    _target_: str = "hydra_plugins.flexgemma_launcher.launcher.FlexgemmaSlurmLauncher"
    gpus_per_node: Optional[int] = 1  # one job, one GPU
    tasks_per_node: int = 1


ConfigStore.instance().store(group="hydra/launcher", name="flexgemma_local", node=FlexgemmaLocalConf,
                             provider="flexgemma")
ConfigStore.instance().store(group="hydra/launcher", name="flexgemma_slurm", node=FlexgemmaSlurmConf,
                             provider="flexgemma")
