"""Multirun sweeps as a user runs them: every job in its own process, failures recorded, resumable,
and an offline W&B run in every job directory holding the job's metrics."""

import json
import re
import textwrap
from pathlib import Path

import pytest
import yaml

from flexgemma.run.metrics import is_catalogued
from flexgemma.run.wandb_logger import offline_runs, read_offline_run

from conftest import APP, APP_CONFIG, run_python

TINY_WORKLOAD = ["workload.num_prompts=2", "workload.max_new_tokens=4", "workload.rounds=1", "workload.warmup_rounds=0"]


def job_dirs(sweep: Path) -> dict[str, Path]:
    """job directory by the job's swept values, e.g. {"16,ladder8": ...}."""
    out = {}
    for d in sweep.iterdir():
        if (d / ".hydra").is_dir():
            overrides = dict(o.split("=", 1) for o in yaml.safe_load((d / ".hydra" / "overrides.yaml").read_text()))
            out[f"{overrides['attn.decode.block_n']},{overrides['cudagraph']}"] = d
    return out


@pytest.mark.slow
def test_sweep_of_two_block_sizes_and_two_ladders_records_fails_and_resumes(tmp_path):
    sweep = tmp_path / "sweep"
    # The prompts file of each job is named after its swept values; the one of (32, ladder16) is
    # missing, so that job fails (FileNotFoundError) while the other three run.
    prompts = [{"prompt_token_ids": [2, 17, 99, 301, 5, 6]}, {"prompt_token_ids": [2, 40, 41]}]
    for name in ("16_ladder8", "16_ladder16", "32_ladder8"):
        (tmp_path / f"prompts_{name}.jsonl").write_text("\n".join(json.dumps(p) for p in prompts))
    args = ["-m", "flexgemma", "-m", f"hydra.sweep.dir={sweep}", "attn.decode.block_n=16,32",
            "cudagraph=ladder8,ladder16", "workload=jsonl", "workload.temperature=0",
            f"workload.path='{tmp_path}/prompts_${{attn.decode.block_n}}_${{cudagraph.name}}.jsonl'",
            "hydra.job.config.override_dirname.exclude_keys=[hydra.sweep.dir,workload.path]", *TINY_WORKLOAD]

    r = run_python(args, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-4000:]
    jobs = job_dirs(sweep)
    assert sorted(jobs) == ["16,ladder16", "16,ladder8", "32,ladder16", "32,ladder8"]
    assert sorted(d.name for d in jobs.values()) == ["0", "1", "2", "3"]  # short names, overrides inside
    assert not (sweep / ".submitit" / "%j").exists()
    summaries = {k: json.loads((d / "summary.json").read_text()) for k, d in jobs.items()}
    failed = summaries.pop("32,ladder16")
    assert failed["status"] == "failed" and "FileNotFoundError" in failed["error"]
    assert all(s["status"] == "ok" and s["throughput/output_tok_s_median"] > 0 for s in summaries.values())
    assert "sweep results:" in r.stdout and "failed" in r.stdout  # the end-of-sweep table

    # every key of summary.json and metrics.jsonl is in the metrics catalogue
    ok_dir = jobs["16,ladder8"]
    rows = [json.loads(x) for x in (ok_dir / "metrics.jsonl").read_text().splitlines()]
    assert [k for s in summaries.values() for k in s if not is_catalogued(k)] == []
    assert [k for row in rows for k in row if not is_catalogued(k)] == []
    completions = [json.loads(x) for x in (ok_dir / "completions.jsonl").read_text().splitlines()]
    assert [c["prompt_index"] for c in completions] == [0, 1] and all(len(c["token_ids"]) == 4 for c in completions)

    # the offline W&B run of a job holds the same metrics under the same names
    (run_dir,) = offline_runs(ok_dir)
    wb = read_offline_run(run_dir)
    ok = summaries["16,ladder8"]
    assert wb["state"] == "finished" and wb["exit_code"] == 0 and wb["job_type"] == "bench"
    assert wb["group"] == f"{tmp_path.name}_sweep"  # the sweep directory
    assert wb["name"] == "+model=tiny,attn.decode.block_n=16,cudagraph=ladder8,workload.max_new_tokens=4,workload.num_prompts=2," \
                         "workload.rounds=1,workload.temperature=0,workload.warmup_rounds=0,workload=jsonl"
    assert {"attn=default", "cudagraph=ladder8", "model=tiny", "workload=jsonl"} <= set(wb["tags"])
    for key in ("throughput/output_tok_s_median", "throughput/decode_tok_s_best", "latency/ttft_p99_ms",
                "memory/kv_pool_gib", "build/seconds", "bench/generated_tokens_per_round"):
        assert wb["summary"][key] == pytest.approx(ok[key]), key
    assert wb["summary"]["status"] == "ok" and wb["summary"]["env/torch"] == ok["env/torch"]
    assert wb["config"]["config"]["attn"]["decode"]["block_n"] == 16 and wb["config"]["env"]["env/torch"]
    tables = [h for h in wb["history"] if any(k.startswith("completions") for k in h)]  # a wandb.Table
    assert [h for h in wb["history"] if h not in tables] == [
        {k: pytest.approx(v) for k, v in row.items()} for row in rows]
    assert len(tables) == 1 and tables[0]["completions._type"] == "table-file", tables
    assert tables[0]["completions.nrows"] == 2
    failed_run = read_offline_run(offline_runs(jobs["32,ladder16"])[0])
    assert failed_run["exit_code"] == 1 and "FileNotFoundError" in failed_run["summary"]["error"]

    # re-run after fixing the missing input: the finished jobs are skipped, the failed one runs again
    (tmp_path / "prompts_32_ladder16.jsonl").write_text("\n".join(json.dumps(p) for p in prompts))
    before = {k: (d / "summary.json").stat().st_mtime_ns for k, d in jobs.items()}
    r = run_python(args, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-4000:]
    after = {k: (d / "summary.json").stat().st_mtime_ns for k, d in jobs.items()}
    assert {k for k in jobs if after[k] != before[k]} == {"32,ladder16"}
    assert json.loads((jobs["32,ladder16"] / "summary.json").read_text())["status"] == "ok"
    assert r.stdout.count(" skipped ") >= 3
    assert len(offline_runs(jobs["16,ladder8"])) == 1 and len(offline_runs(jobs["32,ladder16"])) == 2


def test_launcher_records_a_dead_process_and_an_exception_and_goes_on(tmp_path):
    (tmp_path / "app.py").write_text(textwrap.dedent(APP))
    (tmp_path / "app.yaml").write_text(APP_CONFIG)
    sweep = tmp_path / "sweep"
    r = run_python(["app.py", "-m", "x=1,2,3,4", f"hydra.sweep.dir={sweep}", "hydra.launcher.parallel_jobs=2"],
                   cwd=tmp_path, timeout=300)
    assert r.returncode == 0, r.stderr[-4000:]
    dead = json.loads((sweep / "1" / "summary.json").read_text())
    assert dead["status"] == "failed" and "ended without a result" in dead["error"], dead
    raised = json.loads((sweep / "2" / "summary.json").read_text())
    assert raised["status"] == "failed" and "RuntimeError: boom" in raised["error"]
    assert not (sweep / "0" / "summary.json").exists()  # this app writes no summaries of its own
    # the sweep went on past both failures: the last job ran and finished ok (the results table's row)
    rows = {m.group(1): m.group(2) for m in re.finditer(r"^  (\d+)\s+(\w+)\s", r.stdout, re.M)}
    assert rows == {"0": "ok", "1": "failed", "2": "failed", "3": "ok"}, r.stdout[-2000:]
    assert "sweep results:" in r.stdout and "sweep: 100%" in r.stderr
