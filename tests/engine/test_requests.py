"""Bad input: clear errors, and the other requests of the same call are not lost."""

import json

import pytest
import torch

from flexgemma import ConfigError, RequestError, SamplingParams, build_engine, compose
from flexgemma.model.load import ModelLoadError


def test_bad_requests_are_reported_per_request(tiny_engine):
    good = [2, 10, 11]
    prompts = [good, [], [2, 600], list(range(3, 300)), good]
    bad = SamplingParams()
    bad.max_new_tokens = 0  # changed after construction (which refuses it): the engine checks again
    params = [SamplingParams(max_new_tokens=5, temperature=0.0, ignore_eos=True)] * 4 + [bad]
    outs = tiny_engine.generate(prompts, params)
    assert outs[0].finish_reason == "length" and len(outs[0].token_ids) == 5
    assert outs[1].finish_reason == "error" and "empty prompt" in outs[1].error
    assert outs[2].finish_reason == "error" and "token id 600 is outside the vocabulary [0, 512)" in outs[2].error
    assert outs[3].finish_reason == "error" and "maximum length is 256" in outs[3].error
    assert outs[4].finish_reason == "error" and "max_new_tokens=0" in outs[4].error


def test_strict_raises_before_generating(tiny_engine):
    with pytest.raises(RequestError, match="request 1: empty prompt"):
        tiny_engine.generate([[2, 5], []], SamplingParams(max_new_tokens=3), strict=True)


def test_stops_on_eos_and_at_max_model_len(tiny_engine):
    prompt = [2, 10, 11]
    greedy = tiny_engine.generate([prompt], SamplingParams(max_new_tokens=20, temperature=0.0, ignore_eos=True))[0]
    stop_tok = greedy.token_ids[4]
    out = tiny_engine.generate([prompt], SamplingParams(max_new_tokens=20, temperature=0.0,
                                                        stop_token_ids=(stop_tok,)))[0]
    assert out.finish_reason == "stop" and out.token_ids == greedy.token_ids[: greedy.token_ids.index(stop_tok) + 1]
    long_prompt = [2] + list(range(3, 250))
    out = tiny_engine.generate([long_prompt], SamplingParams(max_new_tokens=100, temperature=0.0,
                                                             ignore_eos=True))[0]
    assert out.finish_reason == "max_model_len" and len(long_prompt) + len(out.token_ids) == 256


def test_eos_of_the_model_stops(tiny_engine):
    # make EOS (id 1) the argmax everywhere by boosting its embedding row (the tied lm_head)
    emb = tiny_engine.model.model.embed_tokens.weight
    saved = emb[1].clone()
    try:
        with torch.no_grad():
            emb[1] = tiny_engine.model.model.norm.weight.sign() * 5
        out = tiny_engine.generate([[2, 10, 11]], SamplingParams(max_new_tokens=20, temperature=0.0))[0]
        assert out.finish_reason == "stop" and out.token_ids[-1] == 1
    finally:
        with torch.no_grad():
            emb[1] = saved


def test_missing_model_path_is_clear():
    with pytest.raises(ModelLoadError, match="does not exist"):
        build_engine(compose(["+model=tiny", "model.path=/nonexistent/ckpt", "device=cpu"]))


def test_pickle_weights_are_refused_unless_allowed(tmp_path):
    cfg = compose(["+model=tiny"])
    (tmp_path / "config.json").write_text(json.dumps(dict(cfg.model.hf_config)))
    torch.save({}, tmp_path / "pytorch_model.bin")
    with pytest.raises(ModelLoadError, match="pickled weights.*model.allow_pickle=true"):
        build_engine(compose(["+model=tiny", f"model.path={tmp_path}", "device=cpu"]))


def test_pool_too_small_for_one_sequence_is_clear():
    with pytest.raises(ConfigError, match="cannot hold one sequence"):
        build_engine(compose(["+model=tiny", "kv.page_size=8", "kv.cpu_pages=4", "device=cpu"]))


def test_model_too_large_for_memory_is_refused_before_allocating(monkeypatch):
    import flexgemma.model.load as load

    monkeypatch.setattr(load, "free_memory", lambda device: 1 << 30)  # pretend 1 GiB is free
    with pytest.raises(ModelLoadError, match=r"'e2b': 4\.63B parameters need .* GiB in float32, but cpu has 1\.0 GiB"):
        build_engine(compose(["+model=e2b", "device=cpu", "model.allow_large_cpu=true"]))
