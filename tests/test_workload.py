"""workload=jsonl: prompts as text, chat messages or token ids, tokenised with the checkpoint's own
tokenizer and chat template (a tiny one this test builds), n completions per prompt with distinct
seeds, written to completions.jsonl."""

import json

import pytest

from flexgemma import ConfigError, compose
from flexgemma.run.job import run_job

from conftest import SMALL

def test_jsonl_prompts_with_the_checkpoints_tokenizer_and_n_samples(checkpoint_with_tokenizer, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps(r) for r in [
        {"prompt": "hello world the cat"},
        {"messages": [{"role": "user", "content": "the cat sat on the mat"}]},
        {"prompt_token_ids": [2, 40, 41, 42]},
    ]) + "\n")
    cfg = compose(["+model=tiny", f"model.path={checkpoint_with_tokenizer}", "workload=jsonl",
                   f"workload.path={prompts}", "workload.n=3", "workload.max_new_tokens=5", "logger=none", *SMALL])
    summary = run_job(cfg, tmp_path / "job")
    assert summary["status"] == "ok" and summary["workload/prompts"] == 9

    rows = [json.loads(x) for x in (tmp_path / "job" / "completions.jsonl").read_text().splitlines()]
    assert [(r["prompt_index"], r["sample"]) for r in rows] == [(i, j) for i in range(3) for j in range(3)]
    assert len({r["seed"] for r in rows}) == 9  # every completion its own seed
    assert rows[0]["prompt"] == "hello world the cat" and rows[0]["prompt_tokens"] == 5  # <bos> + 4 words
    assert rows[3]["prompt"] == [{"role": "user", "content": "the cat sat on the mat"}]
    # <bos> <start> user the cat sat on the mat <end> <start> model
    assert rows[3]["prompt_tokens"] == 12
    assert rows[6]["prompt"] == [2, 40, 41, 42]
    assert all(len(r["token_ids"]) <= 5 and isinstance(r["completion"], str) for r in rows)
    # temperature 1 with distinct seeds: the samples of a group differ
    assert len({tuple(r["token_ids"]) for r in rows[:3]}) > 1
    assert summary["samples"][0]["completion"] == rows[0]["completion"]


def test_jsonl_text_without_a_tokenizer_is_an_invalid_configuration(tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "hello"}) + "\n")
    cfg = compose(["+model=tiny", "model.tokenizer=null", "workload=jsonl", f"workload.path={prompts}", "logger=none",
                   *SMALL])
    summary = run_job(cfg, tmp_path / "job", raise_errors=False)
    assert summary["status"] == "invalid" and "tokenizer" in summary["error"]
    with pytest.raises(ConfigError, match="workload.path=FILE"):
        compose(["+model=tiny", "workload=jsonl"])
