"""Nothing outside the job: a GRPO job makes no DNS lookup or connection (TRL's Hub telemetry is off
in the CLI's processes), and an offline W&B run keeps every file inside its job directory."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]  # the repository (this file is tests/cli/...)
# the switches under test, and CI (TRL sends no telemetry when CI is set: the test must see what a user's run does)
UNSET = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_HUB_DISABLE_TELEMETRY", "DISABLE_TELEMETRY", "CI")


def _strace(tmp_path: Path, args: list[str], env: dict) -> list[str]:
    strace = shutil.which("strace")
    if strace is None:
        pytest.skip("strace is not installed")
    trace = tmp_path / "trace.txt"
    # --seccomp-bpf: only connect() stops the traced processes (a GRPO job stopped at every syscall ran 3x longer)
    argv = [strace, "-f", "--seccomp-bpf", "-qq", "-e", "trace=connect", "-o", str(trace), *args]
    r = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)
    if r.returncode != 0 and "ptrace" in r.stderr:
        pytest.skip(f"strace cannot trace here: {r.stderr.strip()[:200]}")
    assert r.returncode == 0, r.stderr[-3000:]
    return [line for line in trace.read_text().splitlines() if "AF_INET" in line]


def test_a_grpo_job_makes_no_dns_lookup_or_connection(tmp_path):
    pytest.importorskip("trl")
    env = {k: v for k, v in os.environ.items() if k not in UNSET}
    env.update(PYTHONPATH=str(ROOT), OMP_WAIT_POLICY="PASSIVE", TRL_EXPERIMENTAL_SILENCE="1")
    calls = _strace(tmp_path, [sys.executable, "-m", "flexgemma", "experiment=grpo_tiny", "task.steps=1",
                               "task.max_new_tokens=2", f"hydra.run.dir={tmp_path / 'job'}"], env)
    assert calls == []
    assert (tmp_path / "job" / "summary.json").is_file()


OFFLINE_RUN = """
import os, sys
from pathlib import Path
from flexgemma import compose
from flexgemma.run.wandb_logger import WandbRun

out = Path(sys.argv[1])
cfg = compose(["+model=tiny", "logger=wandb_offline"])
before = {k: os.environ.get(k) for k in ("WANDB_DATA_DIR", "WANDB_CACHE_DIR", "WANDB_ARTIFACT_DIR")}
run = WandbRun.start(cfg, out, {"name": "files", "group": "g", "job_type": "bench", "tags": []}, {})
run.log_round({"round": 0, "throughput/total_tok_s": 1.0})
run.log_completions([{"prompt_index": 0, "prompt": "a", "completion": "b", "token_ids": [1, 2]}])
run.finish("ok")
assert before == {k: os.environ.get(k) for k in before}, "the process's W&B directories are restored"
print("RUN_OK")
"""


def test_an_offline_wandb_run_writes_nothing_outside_its_job_dir(tmp_path):
    """The completions table is staged, and wandb-core logs, under <job dir>/wandb, not ~/.local/share/wandb
    or ~/.cache/wandb (a user without WANDB_* variables: HOME is a fresh directory)."""
    pytest.importorskip("wandb")
    home = tmp_path / "home"
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_") and k != "XDG_CACHE_HOME"}
    env.update(HOME=str(home), PYTHONPATH=str(ROOT), WANDB_SILENT="true")
    script = tmp_path / "offline_run.py"
    script.write_text(OFFLINE_RUN)
    r = subprocess.run([sys.executable, str(script), str(tmp_path / "job")], capture_output=True, text=True, env=env,
                       timeout=300)
    assert r.returncode == 0 and "RUN_OK" in r.stdout, r.stderr[-3000:]
    written = [p for p in home.rglob("*") if p.is_file() and "wandb" in str(p)]
    assert written == []
    assert list((tmp_path / "job" / "wandb" / "data").rglob("*"))  # the staged table is there instead
