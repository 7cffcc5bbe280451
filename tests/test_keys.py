"""Unknown keys are errors with a did-you-mean, with or without `+` (the schema groups are closed);
the free-form keys (model.hf_config, task.reward, attn.*.extra) and new top-level sweep axes stay open."""

import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from flexgemma import ConfigError, build_engine, compose
from flexgemma.config.schema import validate

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("override, suggestion", [
    ("+attn.decode.blockn=16", "attn.decode.block_n"),
    ("attn.decode.blockn=16", "attn.decode.block_n"),
    ("+attn.decode.full_attention.num_warp=4", "attn.decode.full_attention.num_warps"),
    ("+engine.max_batch=8", "engine.max_batch_size"),
    ("kv.pagesize=8", "kv.page_size"),
    ("+workload.max_new_token=8", "workload.max_new_tokens"),
    ("sed=3", "seed"),
])
def test_a_typo_is_refused_with_the_closest_key(override, suggestion):
    with pytest.raises(ConfigError, match=f"did you mean {suggestion}"):
        compose([override])


def test_the_error_lists_the_groups_keys():
    with pytest.raises(ConfigError, match=r"kv takes page_size, .*prefix_cache"):
        compose(["+kv.nonsense=1"])


@pytest.mark.parametrize("override", [
    "+repeat=1", "+model.hf_config.attn_logit_softcapping=50.0", "+attn.decode.extra.waves_per_eu=2",
    "task.reward.high=32", "+attn.prefill.extra.kpack=2",
])
def test_open_keys_stay_open(override):
    compose(["task=grpo", override])


def test_build_engine_keywords_are_checked_too():
    with pytest.raises(ConfigError, match="did you mean engine.max_batch_size"):
        build_engine(model="tiny", device="cpu", engine__max_batch=4)


def test_a_key_added_after_composition_is_refused_by_validate():
    """Hydra's own composition (what compose() and the CLI type once) with a key forced in, as a
    `+kv.cpu_page=16` adds it: validate() names it (OmegaConf's typed conversion would drop it)."""
    from hydra import compose as hydra_compose, initialize_config_dir

    from flexgemma.config.compose import conf_dir, ensure_model
    from flexgemma.config.schema import register_configs

    register_configs()
    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        cfg = hydra_compose(config_name="config", overrides=["device=cpu"])
    OmegaConf.update(cfg, "kv.cpu_page", 16, force_add=True)
    with pytest.raises(ConfigError, match="did you mean kv.cpu_pages"):
        validate(ensure_model(cfg))


def test_every_preset_composes_with_known_keys():
    for preset in sorted((ROOT / "conf" / "experiment").glob("*.yaml")):
        compose([f"experiment={preset.stem}"])  # typed once: validate() ran, unknown keys included


def test_the_cli_refuses_a_typo_before_running(tmp_path):
    r = subprocess.run([sys.executable, "-m", "flexgemma", "+attn.decode.blockn=16", f"hydra.run.dir={tmp_path}/run"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "did you mean attn.decode.block_n" in r.stderr
    assert not (tmp_path / "run").exists()  # nothing ran
