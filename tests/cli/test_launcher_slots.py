"""hydra/launcher=flexgemma_local places one job per visible GPU at a time: checked on the CPU with a
fake CUDA_VISIBLE_DEVICES of 8 devices and fake submitit handles (no process is started)."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("submitit")

from hydra_plugins.flexgemma_launcher import launcher as L  # noqa: E402


class FakeHandle:
    """A job that ends after `polls` calls of done()."""

    def __init__(self, polls: int):
        self.polls = polls

    def done(self) -> bool:
        self.polls -= 1
        return self.polls < 0

    def cancel(self, check=False):
        pass


def run_slots(monkeypatch, visible: str | None, n_jobs: int, parallel_jobs=None, polls=lambda i: 2 + i % 3):
    """(gpu of each job in submit order, the largest number of jobs running at once)."""
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    monkeypatch.setattr(L, "_POLL_S", 0.0)
    launcher = L.FlexgemmaLocalLauncher(parallel_jobs=parallel_jobs)
    running: dict[int, str] = {}
    placed: list = []
    peak = [0]

    def submit(job, state, gpu):
        assert gpu is None or gpu not in running.values(), f"job {job.idx} put on busy GPU {gpu}: {running}"
        running[job.idx] = gpu
        placed.append(gpu)
        peak[0] = max(peak[0], len(running))
        return FakeHandle(polls(job.idx))

    def collect(job, handle):
        del running[job.idx]

    monkeypatch.setattr(launcher, "_submit", submit)
    monkeypatch.setattr(launcher, "_collect", collect)
    jobs = [L._Job(i, [f"seed={i}"], Path(f"/nonexistent/{i}")) for i in range(n_jobs)]
    finished = []
    launcher._run(jobs, {}, finished.append)
    assert sorted(j.idx for j in finished) == list(range(n_jobs)) and not running
    return placed, peak[0]


def test_eight_gpus_take_eight_jobs_at_once_each_on_its_own(monkeypatch):
    placed, peak = run_slots(monkeypatch, "0,1,2,3,4,5,6,7", 8)
    assert placed == [str(i) for i in range(8)] and peak == 8


def test_more_jobs_than_gpus_wait_for_a_free_one(monkeypatch):
    placed, peak = run_slots(monkeypatch, "0,1,2,3,4,5,6,7", 20)
    assert peak == 8 and len(placed) == 20  # never two jobs on one GPU (asserted at each submit)
    assert set(placed) == {str(i) for i in range(8)}


def test_uuids_and_a_gpu_subset_are_passed_as_listed(monkeypatch):
    uuids = ",".join(f"GPU-{i:04x}" for i in range(8))
    placed, peak = run_slots(monkeypatch, uuids, 8)
    assert placed == uuids.split(",")
    placed, _ = run_slots(monkeypatch, "6,7", 4)
    assert set(placed) == {"6", "7"}


def test_parallel_jobs_caps_the_slots(monkeypatch):
    placed, peak = run_slots(monkeypatch, "0,1,2,3,4,5,6,7", 10, parallel_jobs=4)
    assert peak == 4 and set(placed) == {"0", "1", "2", "3"}


def test_no_gpu_runs_one_job_at_a_time(monkeypatch):
    placed, peak = run_slots(monkeypatch, "", 3)
    assert placed == [None] * 3 and peak == 1
    placed, peak = run_slots(monkeypatch, "-1", 2)
    assert placed == [None] * 2 and peak == 1
