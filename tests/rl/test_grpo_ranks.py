"""task=grpo across ranks (flexgemma/rl/ranks.py): torchrun with 2 CPU processes and gloo on tiny,
each with its own engine; and the pieces (adapter check, metric reduction, config errors) alone."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("trl")

from flexgemma import compose  # noqa: E402
from flexgemma.config.schema import ConfigError  # noqa: E402
from flexgemma.rl import ranks  # noqa: E402
from flexgemma.run.job import run_job  # noqa: E402
from flexgemma.tasks import grpo  # noqa: E402

from conftest import ROOT  # noqa: E402 - the repository
LEARN = ["lora=r16", "task=grpo", "device=cpu", "model.dtype=float32", "logger=none", "workload.max_prompt_len=16",
         "model.hf_config.initializer_range=0.2", "task.learning_rate=1e-2"]
STEPS, PROMPTS, GROUP = 3, 4, 4


@pytest.mark.slow
def test_two_ranks_shard_whole_groups_keep_equal_adapters_and_write_one_record(tmp_path):
    run_dir = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "TRL_EXPERIMENTAL_SILENCE": "1",
           "CUDA_VISIBLE_DEVICES": ""}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           "-m", "flexgemma", "+model=tiny", *LEARN, f"task.steps={STEPS}", f"task.prompts_per_step={PROMPTS}",
           f"task.num_generations={GROUP}", f"hydra.run.dir={run_dir}"]
    p = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-5000:]
    # one set of records, rank 0's: the other rank made no run dir of its own
    assert sorted(x.name for x in tmp_path.iterdir()) == ["run"]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "ok" and summary["grpo/steps"] == STEPS and summary["grpo/ranks"] == 2
    assert summary["grpo/logprob_absdiff_mean"] <= 1e-4
    rows = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    assert [r["grpo/step"] for r in rows] == list(range(1, STEPS + 1))
    assert (run_dir / "adapter").is_dir()
    steps = [json.loads(line) for line in open(run_dir / "ranks.jsonl")]
    assert [s["step"] for s in steps] == list(range(1, STEPS + 1))
    seen = set()
    for s in steps:
        a, b = s["adapter_sha256"]
        assert a == b  # both engines take the same adapter after the step
        assert a not in seen  # and it changed: the step trained it
        seen.add(a)
        r0, r1 = s["shards"]
        for shard in (r0, r1):  # each rank: its half of the prompts, every group whole and consecutive
            assert len(shard) == PROMPTS // 2 and all(n == GROUP for _, n in shard), s
        assert not {k for k, _ in r0} & {k for k, _ in r1}, s  # different prompts per rank
    # the log shows both ranks' digests each step
    out = p.stdout + p.stderr
    assert all(f"rank {r}/2: adapter sha256 {s['adapter_sha256'][r][:16]}" in out for s in steps for r in (0, 1))


def test_a_mismatch_names_the_ranks():
    ranks.check_equal(1, ["ab" * 32] * 3)
    with pytest.raises(ranks.AdapterMismatch, match=r"rank\(s\) \[2\] differs from rank 0's"):
        ranks.check_equal(4, ["ab" * 32, "ab" * 32, "cd" * 32])


def test_adapter_digest_sees_every_factor():
    import torch

    a = {"x": torch.zeros(4), "y": torch.ones(2, 2)}
    d = ranks.adapter_digest(a)
    assert d == ranks.adapter_digest({k: v.clone() for k, v in a.items()})
    b = {"x": torch.zeros(4), "y": torch.ones(2, 2)}
    b["y"][1, 1] = 1 + 2**-20
    assert ranks.adapter_digest(b) != d
    assert ranks.adapter_digest({"z": a["x"], "y": a["y"]}) != d  # names count


def test_step_metrics_sum_tokens_and_take_the_slowest_rank():
    parts = [{"rewards": [1.0, 0.0], "rollout_s": 2.0, "step_s": 3.0, "refresh_ms": 5.0, "rollout_tokens": 100.0,
              "logprob_absdiff_mean": 1e-6, "logprob_absdiff_max": 2e-6, "kl_k3": 0.0, "is_ratio_p99": 1.0,
              "is_ratio_max": 1.5},
             {"rewards": [0.5], "rollout_s": 4.0, "step_s": 1.0, "refresh_ms": 7.0, "rollout_tokens": 60.0,
              "logprob_absdiff_mean": 3e-6, "logprob_absdiff_max": 1e-6, "kl_k3": 2e-9, "is_ratio_p99": 1.2,
              "is_ratio_max": 1.1}]
    r = ranks.reduce_step(parts)
    assert r["rewards"] == [1.0, 0.0, 0.5] and r["rollout_tokens"] == 160.0
    assert (r["rollout_s"], r["step_s"], r["refresh_ms"]) == (4.0, 3.0, 7.0)
    assert r["logprob_absdiff_mean"] == pytest.approx(2e-6) and r["logprob_absdiff_max"] == 2e-6
    assert r["kl_k3"] == pytest.approx(1e-9) and r["is_ratio_max"] == 1.5


def test_world_comes_from_torchruns_variables(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("RANK", "9")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert ranks.world() == ranks.World(rank=9, local_rank=1, size=8) and not ranks.world().is_main
    monkeypatch.setenv("RANK", "x")
    with pytest.raises(ConfigError, match="RANK"):
        ranks.world()


def test_prompts_per_step_must_split_into_whole_groups(tmp_path):
    cfg = compose(["+model=tiny", *LEARN, "task.prompts_per_step=4", "task.num_generations=8"])
    import torch

    args = grpo.grpo_args(cfg, tmp_path, torch.device("cpu"), world_size=2)
    assert args.per_device_train_batch_size == 16 and args.gradient_accumulation_steps == 1  # 2 prompts x 8 a rank
    with pytest.raises(ConfigError, match="multiple of the 3 ranks"):
        grpo.grpo_args(cfg, tmp_path, torch.device("cpu"), world_size=3)
    cfg = compose(["+model=tiny", *LEARN, "task.prompts_per_step=4", "task.num_generations=8", "task.micro_batch=32"])
    with pytest.raises(ConfigError, match="a rank's 16 completions"):
        grpo.grpo_args(cfg, tmp_path, torch.device("cpu"), world_size=2)


def test_other_tasks_refuse_to_run_across_ranks(tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(ConfigError, match="only task=grpo runs across ranks"):
        run_job(compose(["+model=tiny", "device=cpu", "logger=none"]), tmp_path)
    assert not any(tmp_path.iterdir())


def test_a_submitit_slurm_task_finds_its_rank(monkeypatch):
    pytest.importorskip("submitit")
    monkeypatch.setattr(os, "environ", dict(os.environ))  # export() writes variables: into a copy, dropped after
    for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "LOCAL_WORLD_SIZE"):
        os.environ.pop(k, None)
    slurm = {"SUBMITIT_EXECUTOR": "slurm", "SLURM_JOB_ID": "77", "SLURM_NTASKS": "16", "SLURM_PROCID": "11",
             "SLURM_LOCALID": "3", "SLURM_NODEID": "1", "SLURM_JOB_NUM_NODES": "2", "SLURM_JOB_NODELIST": "gpu[01-02]"}
    os.environ.update(slurm)
    assert ranks.world() == ranks.World(rank=11, local_rank=3, size=16)
    assert os.environ["MASTER_ADDR"] == "gpu01"


def test_a_multirun_under_torchrun_is_refused(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0"}
    p = subprocess.run([sys.executable, "-m", "flexgemma", "-m", "+model=tiny", *LEARN], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 2 and "multirun under torchrun" in p.stderr
    assert not any(tmp_path.iterdir())
