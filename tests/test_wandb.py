"""W&B logging through the real wandb library, read back from the offline run: a job that cannot run
is still logged and finished, with its error and a non-zero exit code."""

import json

from flexgemma import compose
from flexgemma.run.job import run_job
from flexgemma.run.wandb_logger import offline_runs, read_offline_run

from conftest import SMALL


def test_invalid_and_failed_jobs_are_logged_and_finished(tmp_path):
    invalid = run_job(compose(["+model=tiny", "logger=wandb_offline", "logger.tags=[mine]", "kv.max_pages=2", *SMALL]),
                      tmp_path / "invalid", raise_errors=False)
    assert invalid["status"] == "invalid" and "kv.max_pages" in invalid["error"]
    failed = run_job(compose(["+model=tiny", "logger=wandb_offline", "model.path=/nonexistent/ckpt", *SMALL]),
                     tmp_path / "failed", raise_errors=False)
    assert failed["status"] == "failed" and "ModelLoadError" in failed["error"]

    (run_dir,) = offline_runs(tmp_path / "invalid")
    wb = read_offline_run(run_dir)
    assert wb["exit_code"] == 2 and wb["summary"]["status"] == "invalid"
    assert (run_dir / "files" / "summary.json").exists()  # the record files go with the run
    assert wb["summary"]["error"] == json.loads((tmp_path / "invalid" / "summary.json").read_text())["error"]
    assert wb["job_type"] == "bench" and wb["name"] == "tiny-bench" and wb["project"] == "flexgemma"
    assert {"quant=bf16", "model=tiny", "mine"} <= set(wb["tags"])
    assert wb["config"]["config"]["kv"]["max_pages"] == 2 and wb["config"]["env"]["env/python"]
    wb = read_offline_run(offline_runs(tmp_path / "failed")[0])
    assert wb["exit_code"] == 1 and "ModelLoadError" in wb["summary"]["error"] and wb["summary"]["traceback"]


def test_logger_none_writes_no_wandb_run(tmp_path):
    summary = run_job(compose(["+model=tiny", "logger=none", "kv.max_pages=2", *SMALL]), tmp_path / "j", raise_errors=False)
    assert summary["status"] == "invalid" and offline_runs(tmp_path / "j") == []
