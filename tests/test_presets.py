"""Experiment presets and launchers compose, and the Optuna preset searches for the best throughput."""

import os
import subprocess
import sys

import pytest
import yaml
from hydra import compose as hydra_compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

from flexgemma.config.compose import conf_dir
from flexgemma.config.schema import register_configs

from conftest import ROOT  # noqa: E402 - the repository


def compose_with_hydra(overrides):
    register_configs()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        return hydra_compose("config", overrides=overrides, return_hydra_config=True)


@pytest.mark.parametrize("preset, swept", [
    ("block_sweep", {"attn.decode.block_n": "16,32,64", "attn.decode.num_warps": "4,8"}),
    ("bucket_sweep", {"cudagraph": "ladder8,ladder16,dense,off"}),
    ("quant_compare", {"quant": "bf16,bnb4"}),
])
def test_grid_presets_sweep_their_keys_in_own_processes(preset, swept):
    cfg = compose_with_hydra(["+model=e2b", f"+experiment={preset}"])
    params = cfg.hydra.sweeper.params
    assert {k: str(params[k]) for k in swept} == swept
    assert cfg.workload.name == "rollout64" and cfg.hydra.launcher._target_.endswith("FlexgemmaLocalLauncher")
    assert cfg.logger.kind.value == "wandb_offline"


def test_optuna_and_slurm_compose():
    cfg = compose_with_hydra(["+experiment=optuna_kernels", "hydra/launcher=flexgemma_slurm",
                              "hydra.launcher.partition=gpu"])
    assert cfg.hydra.sweeper._target_.endswith("OptunaSweeper") and str(cfg.hydra.sweeper.direction) == "maximize"
    assert str(cfg.hydra.sweeper.params["attn.decode.block_n"]) == "choice(16, 32, 64)"
    assert cfg.task.objective == "throughput/output_tok_s_median"
    assert cfg.hydra.launcher._target_.endswith("FlexgemmaSlurmLauncher") and cfg.hydra.launcher.gpus_per_node == 1


@pytest.mark.slow
def test_optuna_preset_returns_throughput_and_reports_the_best(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    # the basic launcher runs the two trials in this one process: the quickest way to check the objective
    r = subprocess.run([sys.executable, "-m", "flexgemma", "-m", "+experiment=optuna_kernels", "model=tiny", "hydra/launcher=basic",
                        "hydra.sweeper.n_trials=2", f"hydra.sweep.dir={tmp_path}/opt", "logger=none",
                        "workload.num_prompts=2", "workload.max_new_tokens=4", "workload.rounds=1",
                        "workload.warmup_rounds=0"], cwd=tmp_path, capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-4000:]
    result = yaml.safe_load((tmp_path / "opt" / "optimization_results.yaml").read_text())
    assert result["best_value"] > 0 and set(result["best_params"]) >= {"attn.decode.block_n", "attn.prefill.block_m"}


def test_the_grpo_presets_and_the_gpu_scripts_jobs_compose():
    """experiment=grpo_e2b is on-policy by construction (invariant rollout, the engine's forward in the
    trainer, the step as one micro-batch); grpo_26b_a4b too, the 4-bit job in micro-batches of 16 with the
    KV given back; each job of
    experiments/grpo_gpu.py composes over them and says which trainer forward it runs."""
    sys.path.insert(0, str(ROOT / "experiments"))
    import grpo_gpu

    from flexgemma.config.compose import compose

    e2b = compose(["experiment=grpo_e2b"])
    assert (e2b.model.name, e2b.lora.rank, e2b.quant.method, e2b.task.name.value) == ("e2b", 32, "none", "grpo")
    assert e2b.engine.batch_invariant and e2b.task.trainer_forward == "engine" and e2b.task.micro_batch is None
    assert (e2b.task.prompts_per_step, e2b.task.num_generations, e2b.task.max_new_tokens) == (8, 8, 256)
    moe = compose(["experiment=grpo_26b_a4b"])
    assert (moe.model.name, moe.lora.rank, moe.quant.method, moe.task.micro_batch) == ("26b_a4b", 16, "bnb4", 16)
    assert moe.engine.batch_invariant and moe.task.trainer_forward == "engine"
    assert moe.task.engine_sleep and moe.engine.sleep_mode
    for name, overrides in grpo_gpu.JOBS.items():
        cfg = compose([*grpo_gpu.COMMON, *overrides])
        exact = "exact" in name
        assert (cfg.engine.batch_invariant, cfg.task.trainer_forward) == (exact, "engine" if exact else "transformers"), name
        assert cfg.model.name == ("e2b" if name.startswith("e2b") else "26b_a4b"), name
        if name.startswith("26b"):  # the name says its micro-batch and whether the KV is given back
            assert cfg.task.micro_batch == (16 if "mb16" in name else None if "mb32" in name else 8), name
            assert cfg.task.engine_sleep == cfg.engine.sleep_mode == ("sleep" in name), name
