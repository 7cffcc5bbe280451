"""vLLM's call shapes: one prompt alone, prompt dicts, SamplingParams checked at construction and its
max_tokens, build_engine(model=DIR), wake_up() and sleep(level=1)."""

import dataclasses

import pytest
import torch

from flexgemma import SamplingParams, build_engine
from flexgemma.engine.engine import RequestError

from conftest import SMALL, tiny_multimodal

GREEDY = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)


def test_a_flat_list_of_ints_is_one_prompt(tiny_engine):
    want = tiny_engine.generate([[2, 18, 279]], GREEDY)
    got = tiny_engine.generate([2, 18, 279], GREEDY)
    assert len(got) == 1 and got[0].finish_reason == "length"
    assert got[0].token_ids == want[0].token_ids and got[0].prompt_token_ids == [2, 18, 279]
    assert tiny_engine.generate((2, 18, 279), GREEDY)[0].token_ids == want[0].token_ids


def test_vllm_prompt_dicts(tiny_engine):
    ids = [2, 40, 41, 42]
    want = tiny_engine.generate([ids, "Alice was"], GREEDY)
    got = tiny_engine.generate([{"prompt_token_ids": ids}, {"prompt": "Alice was"}], GREEDY)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert got[1].prompt == "Alice was" and got[1].prompt_token_ids == want[1].prompt_token_ids
    one = tiny_engine.generate({"prompt_token_ids": ids}, GREEDY)  # one dict alone: a call of one
    assert one[0].token_ids == want[0].token_ids
    rid = tiny_engine.add_request({"prompt": "Alice was"}, GREEDY)
    while tiny_engine.has_work:
        for out in tiny_engine.step():
            assert out.request_id == rid and out.token_ids == want[1].token_ids


def test_a_string_alone_is_one_prompt(tiny_engine):
    assert tiny_engine.generate("Alice was", GREEDY)[0].token_ids == tiny_engine.generate(["Alice was"], GREEDY)[0].token_ids


@pytest.mark.parametrize("prompt, message", [
    ({"prompt_token_ids": [2, 5], "multi_modal_data": {}}, "a prompt dict holds one key"),
    ({"prompt": 5}, "'prompt' must be a string"),
    ({"prompt_token_ids": [2, 999]}, "token id 999 is outside the vocabulary"),
])
def test_bad_prompt_dicts_are_named(tiny_engine, prompt, message):
    out = tiny_engine.generate([prompt, [2, 5]], GREEDY)
    assert out[0].finish_reason == "error" and message in out[0].error, out[0].error
    assert out[1].finish_reason == "length"
    with pytest.raises(RequestError, match=message):
        tiny_engine.add_request(prompt, GREEDY)


@pytest.mark.parametrize("kwargs, message", [
    ({"temperature": "hot"}, "temperature='hot' must be a finite number"),
    ({"top_p": 0.0}, "top_p=0.0 must be a number in"),
    ({"max_new_tokens": 0}, "max_new_tokens=0 must be in"),
    ({"n": 2.5}, "n=2.5 must be an integer"),
    ({"stop": [""]}, "stop="),
    ({"max_tokens": 8, "max_new_tokens": 16}, "max_tokens=8 and max_new_tokens=16 are the same setting"),
])
def test_sampling_params_are_checked_at_construction(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_max_tokens_is_vllms_name_for_max_new_tokens():
    assert SamplingParams(max_tokens=8).max_new_tokens == 8
    assert SamplingParams(max_tokens=8, max_new_tokens=8).max_tokens == 8
    assert SamplingParams().max_new_tokens == SamplingParams().max_tokens == 64
    changed = dataclasses.replace(SamplingParams(max_tokens=8), temperature=0.0)  # the tasks copy params this way
    assert changed.max_new_tokens == 8 and changed.temperature == 0.0


def test_params_changed_after_construction_are_still_refused(tiny_engine):
    sp = SamplingParams(max_new_tokens=4)
    sp.temperature = float("nan")
    out = tiny_engine.generate([[2, 5]], sp)[0]
    assert out.finish_reason == "error" and "temperature=nan" in out.error


def test_build_engine_takes_a_checkpoint_directory(tmp_path):
    model = tiny_multimodal(seed=5)
    model.save_pretrained(tmp_path / "my-ckpt")
    engine = build_engine(model=str(tmp_path / "my-ckpt"), **{k: v for k, v in (o.split("=") for o in SMALL)})
    assert engine.info["weights"] == str(tmp_path / "my-ckpt") and engine.info["name"] == "my-ckpt"
    assert engine.tokenizer is None  # the checkpoint has none; tiny's shipped one is not put in its place
    ref = model.model.language_model.embed_tokens.weight
    assert torch.equal(engine.model.model.embed_tokens.weight, ref)
    with pytest.raises(Exception, match="does not exist or is not a directory"):
        build_engine(model=str(tmp_path / "missing" / "ckpt"), device="cpu")


def test_wake_up_and_sleep_level(tiny_engine):
    want = tiny_engine.generate([[2, 7, 8]], GREEDY)[0].token_ids
    with pytest.raises(ValueError, match="only level=1"):
        tiny_engine.sleep(level=2)
    tiny_engine.sleep(level=1)
    assert tiny_engine.wake_up(tags=["weights"]) == {"seconds": 0.0, "recaptured": False}  # weights never left
    assert tiny_engine.asleep
    with pytest.raises(ValueError, match="wake_up"):
        tiny_engine.wake_up(tags=["kv"])
    tiny_engine.wake_up(tags=["kv_cache"])
    assert not tiny_engine.asleep and tiny_engine.generate([[2, 7, 8]], GREEDY)[0].token_ids == want
    tiny_engine.sleep()
    tiny_engine.wake_up()
    assert not tiny_engine.asleep
