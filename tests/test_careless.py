"""Careless and hostile input of issue 36 (docs/hostile-input.md): chat messages and prompts that
are not text, prompts files that are not JSON, garbage given to the report, job locks, score()
arguments. Each is refused by name; nothing else of the call (or report) is lost."""

from __future__ import annotations

import json

import pytest

from flexgemma import RequestError, SamplingParams, build_engine, compose
from flexgemma.run.job import run_job
from flexgemma.tasks.workload import WorkloadError

from conftest import SMALL, make_engine

GREEDY = SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True)
TINY_JOB = ["+model=tiny", "device=cpu", "logger=none", "kv.page_size=8", "kv.cpu_pages=80", "engine.max_model_len=256",
            "workload.num_prompts=2", "workload.max_new_tokens=3", "workload.rounds=1", "workload.warmup_rounds=0"]


@pytest.fixture
def text_engine(checkpoint_with_tokenizer):  # noqa: F811
    return build_engine(compose(["+model=tiny", f"model.path={checkpoint_with_tokenizer}", *SMALL]))


BAD_PROMPTS = [
    ("hello \ud800 world", r"request 1: prompt text holds a lone surrogate '\\ud800' at character 6"),
    ([{"role": "user", "content": None}], r"request 1: chat message 0: 'content' is None \(NoneType\), not a string"),
    ([{"role": "user", "content": "hi"}, {"role": 123, "content": "x"}],
     r"request 1: chat message 1: 'role' is 123 \(int\), not a string"),
    ([{"role": "user", "content": 5.5}], r"chat message 0: 'content' is 5.5 \(float\)"),
    ([{"role": "user", "content": "the \udfff cat"}], r"chat message 0: 'content' holds a lone surrogate"),
    ([{"role": "user"}], r"chat message 0 .* needs a 'role' and a 'content'"),
]


@pytest.mark.parametrize("bad,message", BAD_PROMPTS, ids=range(len(BAD_PROMPTS)))
def test_a_prompt_that_is_not_text_errors_alone(text_engine, bad, message):
    """A lone surrogate or a message whose role/content is not a string: that request errors (its
    message's index and field named), the others run."""
    good = "hello world the cat"
    want = text_engine.generate([good], GREEDY)[0].token_ids
    outs = text_engine.generate([good, bad, good], GREEDY)
    assert outs[0].token_ids == outs[2].token_ids == want
    assert outs[1].finish_reason == "error"
    assert __import__("re").search(message, outs[1].error), outs[1].error
    with pytest.raises(RequestError, match=message.removeprefix("request 1: ")):
        text_engine.add_request(bad, GREEDY)
    assert not text_engine.has_work


def test_content_parts_are_text(text_engine):
    parts = [{"role": "user", "content": [{"type": "text", "text": "the cat sat"}]}]
    assert text_engine.generate([parts], GREEDY)[0].finish_reason == "length"


def test_a_prompts_file_with_bad_messages_deep_json_or_surrogates_names_each_line(tmp_path, checkpoint_with_tokenizer):  # noqa: F811
    lines = ['{"prompt": "hello world"}',
             '{"messages": [{"role": "user", "content": null}]}',
             '{"messages": [{"role": 123, "content": "hi"}]}',
             '{"prompt": "the \\ud800 cat"}',
             "[" * 100_000,
             '"bare \\udc00 string"',
             '{"messages": [{"role": "user", "content": "hello"}]}']
    f = tmp_path / "p.jsonl"
    f.write_text("\n".join(lines) + "\n")
    cfg = compose([*TINY_JOB, "workload=jsonl", f"workload.path={f}", "workload.num_prompts=null",
                   f"model.path={checkpoint_with_tokenizer}"])
    with pytest.raises(WorkloadError) as e:
        run_job(cfg, tmp_path / "job")
    listed = e.value.args[0].splitlines()[1:]
    assert [ln.split(": ", 1)[0] for ln in listed] == [f"  {f}:{n}" for n in (2, 3, 4, 5, 6)]
    assert "chat message 0: 'content' is None" in listed[0] and "'role' is 123" in listed[1]
    assert "lone surrogate" in listed[2] and "nested too deeply" in listed[3] and "lone surrogate" in listed[4]


# -- the report over garbage ------------------------------------------------------------------------------
def test_garbage_job_files_are_named_one_line_each_and_the_report_is_still_made(tmp_path, capsys):
    """A binary metrics.jsonl and overrides.yaml, JSON nested 200,000 deep (summary.json and a
    metrics.jsonl line), YAML nested as deep: each is one line naming the file (and line), and the
    report of the sweep is made from everything else."""
    from conftest import cpu_summary, write_job

    from flexgemma.report.__main__ import main as report_main

    sweep = tmp_path / "sweep"
    for n, speed in enumerate([1000.0, 1200.0]):
        write_job(sweep / f"{n}_seed={n}", ["+model=tiny", f"seed={n}"], cpu_summary(speed), rounds=[speed] * 3)
    bad = write_job(sweep / "2_seed=2", ["+model=tiny", "seed=2"], cpu_summary(900.0), rounds=[900.0] * 3)
    (bad / "metrics.jsonl").write_bytes(bytes(range(256)) * 4)
    (bad / ".hydra" / "overrides.yaml").write_bytes(b"\xff\xfe\x00garbage")
    deep = write_job(sweep / "3_seed=3", ["+model=tiny", "seed=3"], None)
    (deep / "summary.json").write_text("[" * 200_000)
    (deep / "config_resolved.yaml").write_text("[" * 200_000)
    with open(sweep / "0_seed=0" / "metrics.jsonl", "a") as f:
        f.write("[" * 200_000 + "\n")
    assert report_main([str(sweep), "--out", str(tmp_path / "out")]) == 0
    err = capsys.readouterr().err.splitlines()
    assert sorted(err) == sorted([
        f"flexgemma.report: {bad / 'metrics.jsonl'}: not UTF-8 text (byte 128); left out",
        f"flexgemma.report: {bad / '.hydra' / 'overrides.yaml'}: not UTF-8 text (byte 0); left out",
        f"flexgemma.report: {deep / 'config_resolved.yaml'}: nested too deeply to read; left out",
        f"flexgemma.report: {sweep / '0_seed=0' / 'metrics.jsonl'}:4: nested too deeply to read; left out",
    ])
    md = (tmp_path / "out" / "report.md").read_text()
    assert "summary.json cannot be read: nested too deeply to read" in md and "1,200" in md


# -- job locks ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("pid", [2**70, 2**40, 0, -1, True], ids=["2**70", "2**40", "0", "-1", "true"])
def test_a_lock_whose_pid_no_process_can_have_is_stale(tmp_path, pid):
    """A pid too large for the OS (OverflowError in os.kill), or 0 / -1 (process groups: os.kill(0, 0)
    succeeds) hold nothing: the lock is stale, taken over, and the job runs."""
    import socket

    from flexgemma.run.joblock import JobLock, holder

    job = tmp_path / "job"
    job.mkdir()
    (job / "job.lock").write_text(json.dumps({"host": socket.gethostname(), "pid": pid, "start": None}))
    assert holder(job) is None
    with JobLock(job):
        pass
    (job / "job.lock").write_text('{"pid": ' + "[" * 200_000)
    assert holder(job) is None


def test_a_sweep_job_with_a_huge_pid_lock_runs(tmp_path):
    import socket

    job = tmp_path / "job"
    job.mkdir()
    (job / "job.lock").write_text(json.dumps({"host": socket.gethostname(), "pid": 2**70, "start": "1"}))
    assert run_job(compose(TINY_JOB), job)["status"] == "ok"


# -- score() arguments ------------------------------------------------------------------------------------
@pytest.mark.parametrize("sequences,prompt_lens,message", [
    ([[2, 5, 6, 7]], None, r"prompt_lens=None is not a list of ints, one per sequence"),
    (None, [1], r"sequences=None is not a list of token-id lists"),
    ([[2, 5, 6, 7]], 2, r"prompt_lens=2 is not a list of ints"),
    ("2 5 6", [1], r"sequences='2 5 6' is not a list"),
])
def test_score_names_the_argument_that_is_not_a_list(tiny_engine, sequences, prompt_lens, message):
    with pytest.raises(RequestError, match=r"invalid score\(\) call \(nothing was run\): " + message):
        tiny_engine.score(sequences, prompt_lens)
    assert len(tiny_engine.score([[2, 5, 6, 7]], [2])[0].logprobs) == 2  # the engine is untouched


def test_token_id_lines_are_not_taken_for_chat_messages():
    from flexgemma.tasks.workload import record_problem

    assert record_problem({"prompt_token_ids": [2, 7, 9]}) is None
    assert record_problem({"messages": [{"role": "user", "content": "hi"}]}) is None
