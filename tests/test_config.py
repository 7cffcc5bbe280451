import pytest
from hydra.errors import ConfigCompositionException
from omegaconf.errors import ValidationError

from flexgemma import ConfigError, compose


def test_default_model_is_tiny_and_said(caplog):
    cfg = compose([])
    assert cfg.model.name == "tiny"
    assert cfg.model.hf_config["num_kv_shared_layers"] == 4
    assert "embedded default 'tiny'" in caplog.text


def test_plus_model_selects_variant_and_keeps_overrides():
    cfg = compose(["+model=26b_a4b", "quant=bnb4", "model.dtype=float32"])
    assert cfg.model.name == "26b_a4b" and cfg.quant.method == "bnb4"
    assert cfg.model.hf_config["num_experts"] == 128 and cfg.model.hf_config["top_k_experts"] == 8
    assert str(cfg.model.dtype.value) == "float32"
    default = compose(["model.seed=7"])  # model.* overrides survive the default variant
    assert default.model.name == "tiny" and default.model.seed == 7


@pytest.mark.parametrize("name", ["tiny", "tiny_moe", "e2b", "e4b", "26b_a4b", "31b"])
def test_every_variant_composes_into_a_gemma4_config(name):
    from flexgemma.model.load import text_config_from_dict
    from flexgemma.model.spec import ModelSpec

    cfg = compose([f"+model={name}"])
    spec = ModelSpec.from_hf_config(text_config_from_dict(dict(cfg.model.hf_config)))
    assert len(spec.layers) == cfg.model.hf_config["num_hidden_layers"]
    full = [s for s in spec.layers if s.layer_type == "full_attention"]
    sliding = [s for s in spec.layers if s.layer_type == "sliding_attention"]
    assert full and sliding and full[0].head_dim > sliding[0].head_dim
    assert all(s.window for s in sliding) and all(s.window is None for s in full)


def test_e2b_spec_kv_sharing_and_double_wide_mlp():
    from flexgemma.model.load import text_config_from_dict
    from flexgemma.model.spec import ModelSpec

    spec = ModelSpec.from_hf_config(text_config_from_dict(dict(compose(["+model=e2b"]).model.hf_config)))
    assert sum(s.writes_kv for s in spec.layers) == 15
    shared = [s for s in spec.layers if not s.writes_kv]
    assert len(shared) == 20 and {s.kv_source for s in shared} == {13, 14}
    assert all(s.mlp_width == 2 * 6144 for s in shared)
    assert spec.layers[14].head_dim == 512 and spec.layers[13].head_dim == 256


@pytest.mark.parametrize(
    "override, needle",
    [
        (["attn.q_block_size=100"], "attn.q_block_size=100"),
        (["attn.kv_block_size=32"], "attn.kv_block_size is no longer a key: a KV block of the BlockMask is one page"),
        (["lora=r16", "lora.rank=0"], "lora.rank=0"),
        (["cudagraph=ladder8", "engine.max_batch_size=80"], "has a hole"),
        (["attn.decode.num_warps=3"], "attn.decode.num_warps=3"),
        (["kv.memory_fraction=1.5"], "kv.memory_fraction"),
        (["workload.max_new_tokens=0"], "max_new_tokens"),
    ],
)
def test_invalid_values_fail_at_composition_naming_the_key(override, needle):
    with pytest.raises(ConfigError, match=needle.replace("[", r"\[").replace(".", r"\.")):
        compose(override)


def test_invalid_enum_names_allowed_values():
    with pytest.raises((ValidationError, ConfigCompositionException)) as e:
        compose(["model.dtype=float8"])
    assert "float32" in str(e.value) or "float32" in str(e.value.__cause__)


def test_unknown_model_is_a_clear_error():
    with pytest.raises(ConfigError, match="unknown model 'gemma9'.*tiny"):
        compose(["+model=gemma9"])


def test_off_ladder_needs_no_buckets():
    cfg = compose(["cudagraph=off", "engine.max_batch_size=200"])
    assert not cfg.cudagraph.enabled


def test_sweep_job_folder_names_stay_short():
    """A sweep over a preset with many overrides named its job folders past 255 bytes ("File name
    too long" on the H200); long names are now cut with a digest that still tells jobs apart."""
    from omegaconf import OmegaConf

    from flexgemma.config.compose import conf_dir
    from flexgemma.config.schema import short_dirname

    assert short_dirname("a=1,b=2") == "a=1,b=2"
    long_a, long_b = "x" * 300 + ",k=1", "x" * 300 + ",k=2"
    assert len(short_dirname(long_a)) == 120 and short_dirname(long_a) != short_dirname(long_b)
    subdir = OmegaConf.to_container(OmegaConf.load(conf_dir() / "config.yaml"))["hydra"]["sweep"]["subdir"]
    assert subdir == "${hydra:job.num}"  # short names; the overrides are recorded inside each job
