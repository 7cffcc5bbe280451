"""The tokenizer shipped for the tiny models (flexgemma/tokenizers/tiny): its special tokens are the
configs' ids, it encodes any text, and text prompts, chat messages and stop strings run on a CPU."""

import json

import pytest

from flexgemma import SamplingParams, build_engine, compose
from flexgemma.model.load import ModelLoadError, load_tokenizer
from flexgemma.tokenizers import HERE, shipped, tokenizer_dir

from conftest import make_engine

TINY = HERE / "tiny"


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(TINY)


@pytest.mark.parametrize("model", ["tiny", "tiny_moe"])
def test_special_tokens_and_size_match_the_tiny_configs(tok, model):
    cfg = compose([f"+model={model}"])
    hf = cfg.model.hf_config
    assert cfg.model.tokenizer == "tiny" and "tiny" in shipped()
    assert len(tok) == hf["vocab_size"] == 512
    assert (tok.pad_token_id, tok.eos_token_id, tok.bos_token_id) == \
        (hf["pad_token_id"], hf["eos_token_id"], hf["bos_token_id"])


def test_any_text_round_trips_and_a_prompt_starts_with_bos(tok):
    for text in ["Alice was beginning to get very tired", "Solve 2+2.", "ünïcödé ☃ and tabs\there", ""]:
        ids = tok(text)["input_ids"]
        assert ids[0] == tok.bos_token_id and all(0 <= t < 512 for t in ids)
        assert tok.decode(ids, skip_special_tokens=True) == text


def test_the_chat_template_is_gemmas_turn_format(tok):
    text = tok.apply_chat_template([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"},
                                    {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "2+2?"}],
                                   add_generation_prompt=True, tokenize=False)
    assert text == ("<bos><start_of_turn>user\nBe brief.\n\nHi!<end_of_turn>\n<start_of_turn>model\nHello.<end_of_turn>\n"
                    "<start_of_turn>user\n2+2?<end_of_turn>\n<start_of_turn>model\n")


def test_the_shipped_files_are_what_build_tiny_makes(tmp_path):
    from flexgemma.tokenizers.build_tiny import build

    build(tmp_path)
    assert json.loads((tmp_path / "tokenizer.json").read_text()) == json.loads((TINY / "tokenizer.json").read_text())


def test_text_chat_and_stop_strings_on_the_tiny_model(tiny_engine):
    assert tiny_engine.tokenizer is not None
    sp = SamplingParams(n=4, seed=0, max_new_tokens=24, ignore_eos=True)
    outs = tiny_engine.generate(["Solve 2+2.", [{"role": "user", "content": "Hi!"}]], sp)
    assert outs[0].prompt == "Solve 2+2." and outs[1].prompt.endswith("<start_of_turn>model\n")
    assert all(isinstance(c.text, str) and len(c.token_ids) == 24 for o in outs for c in o.outputs)
    # a stop string taken from what the model wrote: the completion ends there, the string cut off
    text = outs[0].outputs[0].text
    stop = text[5:7]
    cut = tiny_engine.generate(["Solve 2+2."], SamplingParams(seed=0, max_new_tokens=24, ignore_eos=True, stop=[stop]))
    c = cut[0].outputs[0]
    assert c.finish_reason == "stop" and c.stop_reason == stop and c.text == text[:text.index(stop)]


def test_model_tokenizer_takes_a_directory_and_names_what_is_wrong(tmp_path):
    load_tokenizer(TINY).save_pretrained(tmp_path / "tok")
    engine = make_engine(f"model.tokenizer={tmp_path / 'tok'}")
    assert engine.tokenizer("Alice")["input_ids"] == load_tokenizer(TINY)("Alice")["input_ids"]
    with pytest.raises(ModelLoadError, match=r"model.tokenizer=nonsense: neither a tokenizer shipped with flexgemma \(tiny"):
        make_engine("model.tokenizer=nonsense")


def test_a_tokenizer_larger_than_the_vocabulary_is_refused(tmp_path):
    hf = dict(compose(["+model=tiny"]).model.hf_config)
    with pytest.raises(ModelLoadError, match="512 tokens but model 'tiny' a vocabulary of 256"):
        build_engine(compose(["+model=tiny", "device=cpu", "model.hf_config.vocab_size=256",
                              "model.hf_config.vocab_size_per_layer_input=256"]))
    assert hf["vocab_size"] == 512
    assert tokenizer_dir("tiny") == TINY
