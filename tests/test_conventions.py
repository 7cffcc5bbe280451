"""Familiar spellings: model=NAME and +model=NAME, experiment=NAME and +experiment=NAME; presets name
their model and refuse another; `--cfg job` shows the model that will run."""

import os
import subprocess
import sys

import pytest

from flexgemma import ConfigError, compose
from flexgemma.config.compose import normalise_overrides

from conftest import ROOT  # noqa: E402 - the repository


def test_model_with_and_without_plus_compose_alike():
    a, b = compose(["model=e2b"]), compose(["+model=e2b"])
    assert a.model.name == b.model.name == "e2b" and a == b
    moe = compose(["+model=26b_a4b", "quant=bnb4"])  # the design's command
    assert moe.model.name == "26b_a4b" and moe.quant.method == "bnb4"


def test_experiment_without_plus_and_its_own_model():
    cfg = compose(["experiment=speed_e2b"])  # no model given: the preset's, not the tiny default
    assert cfg.model.name == "e2b" and cfg.preset.name == "speed_e2b" and cfg.workload.name == "rollout64"
    assert compose(["+experiment=speed_26b_a4b"]).model.name == "26b_a4b"
    assert compose(["model=e4b", "experiment=speed_e2b"]).model.name == "e4b"  # a model it lists


def test_preset_refuses_a_model_it_is_not_for():
    with pytest.raises(ConfigError, match=r"experiment=speed_26b_a4b is written for model=26b_a4b .* not model=tiny"):
        compose(["model=tiny", "experiment=speed_26b_a4b"])


def test_overrides_are_rewritten_beside_the_others():
    assert normalise_overrides(["-m", "seed=1,2"]) == ["-m", "+model=tiny", "seed=1,2"]
    assert normalise_overrides(["--cfg", "job"]) == ["+model=tiny", "--cfg", "job"]
    assert normalise_overrides(["--info"]) == ["+model=tiny", "--info"]  # not taken as --info's value
    assert normalise_overrides(["model=e2b,e4b", "experiment=block_sweep"]) == ["+model=e2b,e4b",
                                                                                "+experiment=block_sweep"]
    assert normalise_overrides(["experiment=speed_26b_a4b"]) == ["+model=26b_a4b", "+experiment=speed_26b_a4b"]


@pytest.mark.parametrize("args, model", [([], "tiny"), (["model=tiny_moe"], "tiny_moe"),
                                         (["experiment=speed_e2b"], "e2b")])
def test_cfg_job_shows_the_model_that_will_run(tmp_path, args, model):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "-m", "flexgemma", *args, "--cfg", "job"], capture_output=True, text=True,
                       env=env, cwd=tmp_path, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"model:\n  name: {model}\n" in r.stdout and "???" not in r.stdout.split("hf_config")[0]


@pytest.mark.parametrize("order", [["experiment=grpo_tiny", "model=tiny_moe"], ["model=tiny_moe", "experiment=grpo_tiny"]])
def test_a_presets_model_keys_win_over_the_models_whichever_is_typed_first(order):
    cfg = compose(order)
    assert cfg.model.name == "tiny_moe" and cfg.model.hf_config["initializer_range"] == 0.2
