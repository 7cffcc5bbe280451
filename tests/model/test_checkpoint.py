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
