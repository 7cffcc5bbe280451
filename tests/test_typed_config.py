"""The config is typed once on each path: compose() returns the typed Config, which build_engine and
run_job take as it is; a composed DictConfig (Hydra's) is typed once at the boundary."""

import pytest
from hydra import compose as hydra_compose, initialize_config_dir

from flexgemma import build_engine, compose
from flexgemma.config.compose import conf_dir
from flexgemma.config.schema import Config, register_configs
from flexgemma.run.job import run_job

SMALL = ["device=cpu", "workload.num_prompts=2", "workload.max_new_tokens=2", "workload.rounds=1",
         "workload.warmup_rounds=0", "logger=none"]


@pytest.fixture
def typings(monkeypatch):
    """How many times a config is typed (config.validate, wherever it is called from)."""
    import sys

    calls = []
    real = sys.modules["flexgemma.config.schema"].validate

    def counted(cfg):
        calls.append(1)
        return real(cfg)

    for name in ("flexgemma.config.schema", "flexgemma.config.compose", "flexgemma.run.job"):  # the package's `compose` is the function
        monkeypatch.setattr(sys.modules[name], "validate", counted)
    return calls


def test_compose_returns_the_typed_config_and_the_job_types_nothing_more(tmp_path, typings):
    cfg = compose(["+model=tiny", *SMALL])
    assert isinstance(cfg, Config) and typings == [1]
    summary = run_job(cfg, tmp_path / "job")
    assert summary["status"] == "ok" and typings == [1]  # neither the job nor build_engine typed it again
    assert "kernels:" in (tmp_path / "job" / "config_resolved.yaml").read_text()


def test_a_composed_dictconfig_is_typed_once_at_the_boundary(tmp_path, typings):
    register_configs()
    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        raw = hydra_compose(config_name="config", overrides=["+model=tiny", *SMALL])
    engine = build_engine(raw)
    assert engine.info["name"] == "tiny" and typings == [1]
    assert run_job(raw, tmp_path / "job")["status"] == "ok" and typings == [1, 1]


def test_build_engine_still_takes_keyword_overrides_and_refuses_both():
    assert build_engine(model="tiny", device="cpu", engine__max_batch_size=2).runner.max_batch == 2
    with pytest.raises(TypeError, match="either a config or keyword arguments"):
        build_engine(compose(["+model=tiny"]), device="cpu")
    with pytest.raises(TypeError, match="takes a config"):
        build_engine(42)
