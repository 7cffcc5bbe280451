"""`python -m flexgemma [model=NAME] [overrides...]`: the Hydra entry point; nothing else.

The task function is flexgemma.run.job.hydra_task (a module function, not one of `__main__`, so that a
launcher can pickle it by reference into each job's own process).
"""

from __future__ import annotations

import os

# Before torch is imported: OpenMP threads that spin while waiting (the default policy) fight
# torch's own pool and any other library's (bitsandbytes) on a CPU, making runs 3-30x slower at
# random. A user's own setting is kept.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# TRL's trainers send usage telemetry to the Hugging Face Hub (huggingface_hub reads the switch once,
# at import): a job talks to no host. HF_HUB_OFFLINE is left alone: a user's reward may use the Hub.
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

import sys  # noqa: E402

import hydra  # noqa: E402

from flexgemma.config.compose import (_check_model_override, check_extras, check_override_keys, conf_dir,  # noqa: E402
                               normalise_overrides)
from flexgemma.config.schema import ConfigError, check_moved_keys, register_configs  # noqa: E402
from flexgemma.rl.ranks import world  # noqa: E402
from flexgemma.run.job import hydra_task  # noqa: E402

_main = hydra.main(config_path=str(conf_dir()), config_name="config", version_base="1.3")(hydra_task)


def main() -> None:
    if {"--help", "-h"} & set(sys.argv[1:]):  # flexgemma's page; Hydra's own is --hydra-help
        from flexgemma.run.help import help_text

        print(help_text())
        return
    # no logging.basicConfig: Hydra configures the job's logging (a second handler printed every line twice)
    register_configs()
    try:
        # rewritten before Hydra parses them: model=NAME as +model=NAME, the model that will run named
        sys.argv[1:] = normalise_overrides(sys.argv[1:])
        check_moved_keys(sys.argv[1:])
        _check_model_override(sys.argv[1:])
        check_override_keys(sys.argv[1:])
        check_extras(sys.argv[1:])
    except ConfigError as e:
        print(f"flexgemma: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    if world().size > 1 and {"-m", "--multirun"} & set(sys.argv[1:]):
        print("flexgemma: a multirun under torchrun/accelerate would start every sweep job once per rank: run one "
              "job per torchrun (or a sweep of multi-GPU jobs through hydra/launcher=flexgemma_slurm, docs/grpo.md)",
              file=sys.stderr)
        raise SystemExit(2)
    if world().size > 1 and not world().is_main:
        # torchrun/accelerate: each rank composes its own Hydra run dir (a timestamp, maybe a second
        # apart); only rank 0 writes the run's records, so the others make no dir, .hydra or log file
        sys.argv += ["hydra.run.dir=.", "hydra.output_subdir=null", "hydra/job_logging=stdout"]
    _main()


if __name__ == "__main__":
    main()
