"""`hydra/launcher=flexgemma_local` (the default of flexgemma's multiruns) and `flexgemma_slurm`.

They take the options of hydra-submitit-launcher's `submitit_local` / `submitit_slurm` (timeout_min,
partition, gres, ...), plus `parallel_jobs` for the local one. The local config is spelled out here
rather than derived from the plugin's, so that flexgemma's primary config (which names it as the
launcher) still composes for single runs where hydra-submitit-launcher is not installed.
"""

from dataclasses import dataclass
from typing import Optional

from hydra.core.config_store import ConfigStore


@dataclass
class FlexgemmaLocalConf:
    _target_: str = "hydra_plugins.flexgemma_launcher.launcher.FlexgemmaLocalLauncher"
    # jobs at once: null = one per visible GPU (each job sees only its GPU), 1 on a machine without one
    parallel_jobs: Optional[int] = None
    timeout_min: int = 24 * 60  # a job running longer is stopped and recorded as failed
    # job logs: <id>_0_log.out / .err (no %j folder: submitit's local executor would create one literally)
    submitit_folder: str = "${hydra.sweep.dir}/.submitit"
    name: str = "${hydra.job.name}"
    stderr_to_stdout: bool = False
    # the remaining options of submitit_local, kept for compatibility
    cpus_per_task: Optional[int] = None
    gpus_per_node: Optional[int] = None
    tasks_per_node: int = 1
    mem_gb: Optional[int] = None
    nodes: int = 1


ConfigStore.instance().store(group="hydra/launcher", name="flexgemma_local", node=FlexgemmaLocalConf,
                             provider="flexgemma")

try:
    from hydra_plugins.hydra_submitit_launcher.config import SlurmQueueConf
except ImportError:  # without hydra-submitit-launcher there is no SLURM launcher to configure
    SlurmQueueConf = None

if SlurmQueueConf is not None:

    @dataclass
    class FlexgemmaSlurmConf(SlurmQueueConf):
        _target_: str = "hydra_plugins.flexgemma_launcher.launcher.FlexgemmaSlurmLauncher"
        gpus_per_node: Optional[int] = 1  # one job, one GPU
        tasks_per_node: int = 1

    ConfigStore.instance().store(group="hydra/launcher", name="flexgemma_slurm", node=FlexgemmaSlurmConf,
                                 provider="flexgemma")
