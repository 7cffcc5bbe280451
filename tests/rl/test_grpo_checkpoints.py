"""task=grpo loses nothing: checkpoints every task.save_every steps, a re-run of the job directory
continues from the last one (exactly as a run that never stopped), a failure names the step and the
checkpoint, a reward that raises or returns garbage is named; the task's keys are checked."""

from __future__ import annotations

import json
import math
import os

import pytest

pytest.importorskip("trl")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

from safetensors.torch import load_file  # noqa: E402

from flexgemma import ConfigError, compose  # noqa: E402
from flexgemma.rl.rewards import TargetTokens  # noqa: E402
from flexgemma.run.job import run_job  # noqa: E402
from flexgemma.tasks.grpo import RecordedReward, RewardError, checkpoints  # noqa: E402

LEARN = ["+model=tiny", "lora=r16", "task=grpo", "device=cpu", "model.dtype=float32", "logger=none",
         "workload.max_prompt_len=16", "model.hf_config.initializer_range=0.2", "task.learning_rate=2e-2",
         "task.max_new_tokens=4"]
FLAKY = "task.reward._target_=test_grpo_checkpoints.FailsAtStep"


class FailsAtStep(TargetTokens):
    """TargetTokens that raises on its `fail_at`-th call (a step's rollout calls it once)."""

    calls = 0

    def __init__(self, low: int = 3, high: int = 67, fail_at: int = 0):
        super().__init__(low, high)
        self.fail_at = fail_at

    def __call__(self, **kw):
        FailsAtStep.calls += 1
        if FailsAtStep.calls == self.fail_at:
            raise ValueError("the judge is down")
        return super().__call__(**kw)


def rows(job) -> list[dict]:
    return [json.loads(line) for line in open(job / "metrics.jsonl")]


def adapter(job) -> dict:
    return load_file(str(job / "adapter" / "adapter_model.safetensors"))


def test_a_rerun_of_the_job_dir_continues_from_its_last_checkpoint_as_if_it_never_stopped(tmp_path):
    first = run_job(compose([*LEARN, "task.steps=2", "task.save_every=1"]), tmp_path / "job")
    assert first["grpo/steps"] == 2
    assert [s for s, _ in checkpoints(tmp_path / "job" / "trainer")] == [1, 2]
    earlier = rows(tmp_path / "job")
    resumed = run_job(compose([*LEARN, "task.steps=3", "task.save_every=1"]), tmp_path / "job")
    whole = run_job(compose([*LEARN, "task.steps=3"]), tmp_path / "whole")
    got = rows(tmp_path / "job")
    assert got[:2] == earlier  # the first two steps' rows came from the checkpoint, not from running them again
    assert resumed["grpo/steps"] == 3 and [r["grpo/step"] for r in got] == [1, 2, 3]
    assert [r["grpo/reward_mean"] for r in got] == [r["grpo/reward_mean"] for r in rows(tmp_path / "whole")]
    a, b = adapter(tmp_path / "job"), adapter(tmp_path / "whole")
    assert all((a[k] == b[k]).all() for k in a)  # the same adapter bit for bit: seeds, data order and optimizer
    assert [s for s, _ in checkpoints(tmp_path / "job" / "trainer")] == [2, 3]  # task.keep_checkpoints=2
    assert whole["status"] == "ok"


def test_a_run_that_fails_keeps_its_last_checkpoint_and_says_where(tmp_path):
    FailsAtStep.calls = 0
    job = tmp_path / "job"
    s = run_job(compose([*LEARN, "task.steps=3", "task.save_every=1", FLAKY, "+task.reward.fail_at=2"]), job,
                raise_errors=False)
    assert s["status"] == "failed"
    assert s["error"].startswith("GrpoFailed: task=grpo failed at step 2: RewardError: reward target_tokens at step 2 "
                                 "raised ValueError: the judge is down; the last checkpoint is ")
    assert f"{job / 'trainer' / 'checkpoint-1'} (step 1): re-run the same job directory" in s["error"]
    done = run_job(compose([*LEARN, "task.steps=3", "task.save_every=1", "task.resume=true"]), job)
    assert done["grpo/steps"] == 3 and [r["grpo/step"] for r in rows(job)] == [1, 2, 3]
    s = run_job(compose([*LEARN, "task.steps=1", FLAKY, "+task.reward.fail_at=3"]), tmp_path / "none",
                raise_errors=False)
    assert "no checkpoint was saved (task.save_every=N" in s["error"]


def test_resume_true_needs_a_checkpoint_and_false_refuses_one(tmp_path):
    s = run_job(compose([*LEARN, "task.steps=1", "task.resume=true"]), tmp_path / "a", raise_errors=False)
    assert s["status"] == "invalid" and "task.resume=true but" in s["error"] and "holds no checkpoint" in s["error"]
    run_job(compose([*LEARN, "task.steps=1", "task.save_every=1"]), tmp_path / "b")
    s = run_job(compose([*LEARN, "task.steps=2", "task.resume=false"]), tmp_path / "b", raise_errors=False)
    assert s["status"] == "invalid" and "task.resume=false but" in s["error"] and "step 1" in s["error"]


BAD_REWARDS = [
    (lambda **kw: [float("nan")] * len(kw["completions"]), r"returned nan \(float\) for completion 0"),
    (lambda **kw: [math.inf] + [0.0] * (len(kw["completions"]) - 1), r"returned inf \(float\) for completion 0"),
    (lambda **kw: 0.5, r"returned 0\.5 \(float\): it must return a list of 4 floats"),
    (lambda **kw: "good", r"returned 'good' \(str\)"),
    (lambda **kw: ["1.0"] * len(kw["completions"]), r"returned '1\.0' \(str\) for completion 0"),
    (lambda **kw: [1.0], r"returned 1 values for 4 completions"),
    (lambda **kw: 1 / 0, r"raised ZeroDivisionError: division by zero"),
]


@pytest.mark.parametrize("fn,message", BAD_REWARDS, ids=range(len(BAD_REWARDS)))
def test_a_bad_reward_is_named_with_its_step(fn, message):
    fn.__name__ = "judge"
    reward = RecordedReward(fn)
    reward.step = 7
    with pytest.raises(RewardError, match="^reward judge at step 7 " + message):
        reward(prompts=["p"] * 4, completions=["c"] * 4, completion_ids=[[1]] * 4)


def test_rewards_may_be_none_ints_or_numpy():
    import numpy as np

    reward = RecordedReward(lambda **kw: [None, 1, np.float32(0.5), True])
    assert reward(completions=["c"] * 4) == [None, 1, np.float32(0.5), True] and reward.values == [1.0, 0.5, 1.0]


class NanAtStep2(TargetTokens):
    def __call__(self, **kw):
        FailsAtStep.calls += 1
        out = super().__call__(**kw)
        return [math.nan] * len(out) if FailsAtStep.calls == 2 else out


def test_a_nan_reward_fails_the_job_naming_it_not_the_step_logger(tmp_path):
    FailsAtStep.calls = 0
    s = run_job(compose([*LEARN, "task.steps=2", "task.reward._target_=test_grpo_checkpoints.NanAtStep2"]),
                tmp_path / "job", raise_errors=False)
    assert s["status"] == "failed"
    assert "reward target_tokens at step 2 returned nan (float) for completion 0" in s["error"]
    assert "on_step_end" not in s["traceback"]
    s = run_job(compose([*LEARN, "task.steps=1", "task.reward._target_=math.sqrt", "+task.reward._partial_=true"]),
                tmp_path / "job2", raise_errors=False)
    assert "reward sqrt at step 1 raised TypeError" in s["error"]


@pytest.mark.parametrize("key,value", [("steps", 0), ("prompts_per_step", 0), ("num_generations", 0),
                                       ("max_new_tokens", 0), ("micro_batch", 0), ("save_every", -1),
                                       ("keep_checkpoints", 0)])
def test_grpo_keys_are_checked_by_name(key, value):
    with pytest.raises(ConfigError, match=rf"task\.{key}={value} is invalid"):
        compose([*LEARN, f"task.{key}={value}"])  # typed once: every group checks itself
    compose(["+model=tiny", f"task.{key}={value}"])  # not task=grpo: not its keys


def test_a_relaunched_sweep_continues_a_failed_grpo_job_from_its_checkpoint(tmp_path):
    """The launcher's resume: a sweep job that failed at step 3 (its reward raised) is run again by
    the re-launched sweep and continues from checkpoint-2 instead of starting over."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]  # the repository (this file is tests/rl/...)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), str(Path(__file__).parent)]),
           "TRL_EXPERIMENTAL_SILENCE": "1", "OMP_WAIT_POLICY": "PASSIVE"}
    sweep = tmp_path / "sweep"
    args = [sys.executable, "-m", "flexgemma", "-m", *LEARN, "task.steps=3", "task.save_every=1", FLAKY,
            "+task.reward.fail_at=3", "seed=0", f"hydra.sweep.dir={sweep}"]
    r = subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    failed = json.loads((sweep / "0" / "summary.json").read_text())
    assert failed["status"] == "failed" and "checkpoint-2 (step 2)" in failed["error"]
    first_rows = rows(sweep / "0")
    r = subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    done = json.loads((sweep / "0" / "summary.json").read_text())
    assert done["status"] == "ok" and done["grpo/steps"] == 3
    got = rows(sweep / "0")
    assert got[:2] == first_rows[:2] and [r["grpo/step"] for r in got] == [1, 2, 3]  # steps 1-2 not run again
