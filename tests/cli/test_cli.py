"""The main job end to end through the CLI, as a user runs it."""

import json
import os
import subprocess
import sys

from conftest import ROOT


def run_cli(*args, cwd):
    env = {**os.environ, "HYDRA_FULL_ERROR": "1"}
    return subprocess.run([sys.executable, "-m", "flexgemma", *args], cwd=cwd, capture_output=True, text=True,
                          env=env, timeout=300)


def test_main_job_on_default_model(tmp_path):
    r = run_cli(f"hydra.run.dir={tmp_path}/run", "workload.num_prompts=4", "workload.rounds=2",
                "workload.max_new_tokens=8", cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "embedded default 'tiny'" in r.stderr + r.stdout
    assert "output tok/s" in r.stdout
    assert (r.stdout + r.stderr).count("engine: tiny (random") == 1  # one handler: each log record once
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "ok" and summary["model"] == "tiny"
    assert summary["bench/generated_tokens_per_round"] == 4 * 8
    assert summary["throughput/output_tok_s_median"] > 0
    assert summary["determinism/run_to_run"] is True
    assert (tmp_path / "run" / "config_resolved.yaml").exists()
    rounds = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert len(rounds) == 2


def test_invalid_override_exits_with_a_clear_message(tmp_path):
    r = run_cli(f"hydra.run.dir={tmp_path}/run", "kv.page_size=48", cwd=tmp_path)
    assert r.returncode != 0
    assert "kv.page_size=48" in r.stderr + r.stdout


def test_unknown_model_exits_with_choices(tmp_path):
    r = run_cli("+model=gemma9", cwd=tmp_path)
    assert r.returncode == 2 and "unknown model 'gemma9'" in r.stderr and "26b_a4b" in r.stderr


def test_help_is_flexgemmas_page_and_hydras_stays_reachable(tmp_path):
    r = run_cli("--help", cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    page = r.stdout
    assert page.startswith("flexgemma: a fast Gemma-4 generation engine") and "_schema" not in page
    for group in ("model", "quant", "lora", "attn", "kv", "cudagraph", "workload", "task", "logger", "hydra/launcher"):
        assert f"\n  {group} " in page, group
    for preset in sorted(p.stem for p in (ROOT / "conf" / "experiment").glob("*.yaml")):
        line = next(ln for ln in page.splitlines() if ln.startswith(f"  {preset} "))
        assert len(line.split(maxsplit=1)[1]) > 10, line  # each preset has its line
    examples = [ln for ln in page.splitlines() if ln.startswith("  python -m flexgemma")]
    assert len(examples) >= 5 and "tiny*" in page and "bench*" in page
    assert len(page.splitlines()) < 80
    hydra = run_cli("--hydra-help", cwd=tmp_path)
    assert hydra.returncode == 0 and "--multirun" in hydra.stdout
