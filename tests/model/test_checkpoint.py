"""model.path: a tiny multimodal checkpoint the test writes itself loads as its text backbone."""

import json

import pytest
import torch

from flexgemma import SamplingParams, build_engine, compose
from flexgemma.model.load import ModelLoadError
from flexgemma.tasks.parity import hf_greedy

from conftest import SMALL, tiny_multimodal


@pytest.fixture(scope="module")
def multimodal_checkpoint(tmp_path_factory):
    model = tiny_multimodal(seed=123)
    path = tmp_path_factory.mktemp("ckpt")
    model.save_pretrained(path)
    return path, model


def test_multimodal_checkpoint_loads_text_backbone_only(multimodal_checkpoint):
    path, mm = multimodal_checkpoint
    engine = build_engine(compose(["+model=tiny", f"model.path={path}", *SMALL]))
    assert engine.info["weights"] == str(path)
    assert engine.info["skipped"] > 0  # the vision tower and its embedder were never loaded
    assert not any("vision" in n for n, _ in engine.model.named_parameters())
    ref = mm.model.language_model.state_dict()
    for name, p in engine.model.model.state_dict().items():
        if name in ref:
            assert torch.equal(p, ref[name]), name
    # generation runs on the loaded weights and matches transformers on them
    prompt = [2, 17, 99, 301, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19]
    out = engine.generate([prompt], SamplingParams(max_new_tokens=24, temperature=0.0, ignore_eos=True))[0]
    assert out.token_ids == hf_greedy(engine.model, prompt, 24)
    with torch.no_grad():
        mm_logits = mm(input_ids=torch.tensor([prompt])).logits[0, -1]
        ours = engine.model(torch.tensor([prompt])).logits[0, -1]
    torch.testing.assert_close(ours, mm_logits)


def test_config_without_weights_warns_random(tmp_path):
    text = dict(compose(["+model=tiny"]).model.hf_config)
    (tmp_path / "config.json").write_text(json.dumps(text))
    with pytest.warns(UserWarning, match="RANDOM weights"):
        engine = build_engine(compose(["+model=tiny", f"model.path={tmp_path}", *SMALL]))
    assert engine.info["weights"] == "random"


def test_not_a_gemma4_checkpoint(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ModelLoadError, match="not a Gemma-4 model"):
        build_engine(compose(["+model=tiny", f"model.path={tmp_path}", *SMALL]))


def test_no_config_json(tmp_path):
    with pytest.raises(ModelLoadError, match="no config.json"):
        build_engine(compose(["+model=tiny", f"model.path={tmp_path}", *SMALL]))


# -- which files are the checkpoint ------------------------------------------------------------------
def _copy_with_stray_zeros(src, dst):
    """src's files plus model_backup.safetensors: every tensor again, as zeros (it sorts after model.*)."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    real = load_file(str(dst / "model.safetensors"))
    save_file({k: torch.zeros_like(v) for k, v in real.items()}, str(dst / "model_backup.safetensors"))
    return dst


def _loaded_equal(engine, mm) -> bool:
    ref = mm.model.language_model.state_dict()
    return all(torch.equal(p, ref[n]) for n, p in engine.model.model.state_dict().items() if n in ref)


def test_a_stray_copy_beside_the_weights_without_an_index_is_refused(multimodal_checkpoint, tmp_path):
    path = _copy_with_stray_zeros(multimodal_checkpoint[0], tmp_path / "ckpt")
    with pytest.raises(ModelLoadError, match=r"is stored twice: as \S+ in model\.safetensors and as \S+ in "
                                             r"model_backup\.safetensors.*move it out"):
        build_engine(compose(["+model=tiny", f"model.path={path}", *SMALL]))


def test_the_index_is_the_list_of_shards(multimodal_checkpoint, tmp_path):
    src, mm = multimodal_checkpoint
    path = _copy_with_stray_zeros(src, tmp_path / "ckpt")
    from safetensors import safe_open

    with safe_open(str(path / "model.safetensors"), "pt") as h:
        keys = list(h.keys())
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {k: "model.safetensors"
                                                                                  for k in keys}}))
    engine = build_engine(compose(["+model=tiny", f"model.path={path}", *SMALL]))
    assert _loaded_equal(engine, mm)  # the stray zeros were not read
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {keys[0]: "model-00002.safetensors"}}))
    with pytest.raises(ModelLoadError, match=r"lists shards that are not files .*model-00002\.safetensors"):
        build_engine(compose(["+model=tiny", f"model.path={path}", *SMALL]))
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": [1]}))
    with pytest.raises(ModelLoadError, match=r"model\.safetensors\.index\.json: 'weight_map' must be an object"):
        build_engine(compose(["+model=tiny", f"model.path={path}", *SMALL]))


def test_a_sharded_checkpoint_loads_through_its_index(tmp_path):
    mm = tiny_multimodal(seed=7)
    mm.save_pretrained(tmp_path, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").is_file() and len(list(tmp_path.glob("*.safetensors"))) > 1
    assert _loaded_equal(build_engine(compose(["+model=tiny", f"model.path={tmp_path}", *SMALL])), mm)
